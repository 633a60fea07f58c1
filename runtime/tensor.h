// Weights on a device: a buffer, its element type and its shape. Activations are plain f32 buffers
// whose shapes the forward pass knows.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "runtime/cl.h"
#include "runtime/dtype.h"

namespace clshard {

class Device;
struct TensorView;

struct Weight {
  cl::Mem mem;
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  std::string name;

  int64_t dim(size_t i) const { return shape.at(i); }
  explicit operator bool() const { return bool(mem); }
};

// Puts a checkpoint tensor on a device: wraps the mapped file on host-memory devices (no copy),
// uploads it on discrete ones.
Weight to_device(Device& dev, const TensorView& view);
// An f32 weight from host values (converted copies: clamped qkv, test inputs).
Weight to_device_f32(Device& dev, const std::vector<float>& values, std::vector<int64_t> shape,
                     std::string name);

}  // namespace clshard
