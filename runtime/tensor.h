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
  // Where the weight starts in `mem` and its row stride, in elements: a slice of a bigger tensor
  // (tensor parallelism) is a view, not a copy, where the device reads host memory.
  size_t offset = 0;
  int64_t ld = 0;  // 0: rows are contiguous (shape.back())
  // The byte alignment of where `mem` starts on the device (mem_start_alignment), recorded where
  // the weight is built (to_device*): a buffer's start never moves, so the GPU shape's launches
  // need not ask OpenCL for it each time. 0: not recorded (a weight built by hand), asked at the
  // launch.
  uint32_t start_align = 0;
  // F8_E4M3 only: the load-time scan found no NaN code (0x7F, 0xFF) in the bytes `mem` covers
  // (fp8_nan_free), so the FP8 tiles need not watch for them (kernels_cl/fp8_tile.cl). False where
  // unknown (a weight built by hand): the tiles watch.
  bool fp8_nan_free = false;
  // F8_E4M3 only: the share of the codes the load-time scan found subnormal (exponent bits 0,
  // mantissa not), which pick the e4m3 decode on CPUs (ops::fp8_decode_option). 0 where unknown.
  float fp8_subnormal_share = 0.0f;

  int64_t dim(size_t i) const { return shape.at(i); }
  int64_t row_stride() const { return ld ? ld : shape.back(); }
  explicit operator bool() const { return bool(mem); }
};

// The byte alignment of where `mem` starts on the device: the largest power of two, up to
// kMaxStartAlign, dividing both the host pointer it wraps (a mapped checkpoint; none for a device
// allocation) and its origin in a parent buffer (a sub-buffer). Asks OpenCL (two
// clGetMemObjectInfo calls). 64 bytes is the widest OpenCL vector (16 floats), so "starts on an
// n-byte boundary" for any vector load is `alignment % n == 0`.
constexpr uint32_t kMaxStartAlign = 64;
uint32_t mem_start_alignment(const cl::Mem& mem);

// Whether n e4m3fn codes hold no NaN (0x7F or 0xFF). Reads them all (about memory speed).
bool fp8_nan_free(const uint8_t* codes, size_t n);
// The same pass, also counting the subnormal codes (0x01-0x07, 0x81-0x87).
struct Fp8CodeScan {
  bool nan_free = true;
  uint64_t subnormal = 0;
};
Fp8CodeScan scan_fp8_codes(const uint8_t* codes, size_t n);

// Puts a checkpoint tensor on a device: wraps the mapped file on host-memory devices (no copy),
// uploads it on discrete ones. F8_E4M3 tensors are scanned for NaN codes (Weight::fp8_nan_free).
Weight to_device(Device& dev, const TensorView& view);
// Rows [r0, r1) of a 2-D (or 1-D: elements) tensor: contiguous, so a view of the mapping.
Weight to_device_rows(Device& dev, const TensorView& view, int64_t r0, int64_t r1);
// Columns [c0, c1) of a 2-D tensor: a strided view over the whole tensor where the device reads
// host memory, a gathered copy of just the slice where it does not.
Weight to_device_columns(Device& dev, const TensorView& view, int64_t c0, int64_t c1);
// An f32 weight from host values (converted copies: clamped qkv, test inputs).
Weight to_device_f32(Device& dev, const std::vector<float>& values, std::vector<int64_t> shape,
                     std::string name);

}  // namespace clshard
