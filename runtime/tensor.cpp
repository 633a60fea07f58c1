#include "runtime/tensor.h"

#include <cstring>
#include <stdexcept>

#include "runtime/device.h"
#include "runtime/safetensors.h"

namespace clshard {

uint32_t mem_start_alignment(const cl::Mem& mem) {
  void* host = nullptr;
  size_t origin = 0;
  cl::check(clGetMemObjectInfo(mem.get(), CL_MEM_HOST_PTR, sizeof(host), &host, nullptr),
            "clGetMemObjectInfo (CL_MEM_HOST_PTR)");
  cl::check(clGetMemObjectInfo(mem.get(), CL_MEM_OFFSET, sizeof(origin), &origin, nullptr),
            "clGetMemObjectInfo (CL_MEM_OFFSET)");
  const uintptr_t start_bits = reinterpret_cast<uintptr_t>(host) | origin | kMaxStartAlign;
  return uint32_t(start_bits & (~start_bits + 1));  // the lowest set bit
}

Weight to_device(Device& dev, const TensorView& view) {
  Weight w;
  w.mem = dev.wrap_host(view.data, view.bytes);
  w.start_align = mem_start_alignment(w.mem);
  w.dtype = view.dtype;
  w.shape = view.shape;
  w.name = view.name;
  return w;
}

Weight to_device_rows(Device& dev, const TensorView& view, int64_t r0, int64_t r1) {
  const int64_t row = view.shape.size() > 1 ? view.shape[1] : 1;
  const size_t es = dtype_size(view.dtype);
  if (r0 < 0 || r1 > view.shape.at(0) || r0 >= r1)
    throw std::out_of_range(view.name + ": rows [" + std::to_string(r0) + ", " +
                            std::to_string(r1) + ") outside " + std::to_string(view.shape[0]));
  Weight w;
  w.mem = dev.wrap_host(view.data + size_t(r0) * row * es, size_t(r1 - r0) * row * es);
  w.start_align = mem_start_alignment(w.mem);
  w.dtype = view.dtype;
  w.shape = view.shape;
  w.shape[0] = r1 - r0;
  w.name = view.name + "[" + std::to_string(r0) + ":" + std::to_string(r1) + "]";
  return w;
}

Weight to_device_columns(Device& dev, const TensorView& view, int64_t c0, int64_t c1) {
  if (view.shape.size() != 2 || c0 < 0 || c1 > view.shape[1] || c0 >= c1)
    throw std::out_of_range(view.name + ": columns [" + std::to_string(c0) + ", " +
                            std::to_string(c1) + ") of a tensor of shape rank " +
                            std::to_string(view.shape.size()));
  const int64_t N = view.shape[0], K = view.shape[1];
  const size_t es = dtype_size(view.dtype);
  Weight w;
  w.dtype = view.dtype;
  w.shape = {N, c1 - c0};
  w.name = view.name + "[:, " + std::to_string(c0) + ":" + std::to_string(c1) + "]";
  if (dev.info().host_unified_memory) {
    w.mem = dev.wrap_host(view.data, view.bytes);
    w.start_align = mem_start_alignment(w.mem);
    w.offset = size_t(c0);
    w.ld = K;
    return w;
  }
  std::vector<uint8_t> slice(size_t(N) * size_t(c1 - c0) * es);
  for (int64_t n = 0; n < N; ++n)
    std::memcpy(slice.data() + size_t(n) * (c1 - c0) * es, view.data + (size_t(n) * K + c0) * es,
                size_t(c1 - c0) * es);
  w.mem = dev.alloc(slice.size(), CL_MEM_READ_ONLY);
  w.start_align = mem_start_alignment(w.mem);
  dev.write(w.mem, slice.data(), slice.size());
  return w;
}

Weight to_device_f32(Device& dev, const std::vector<float>& values, std::vector<int64_t> shape,
                     std::string name) {
  Weight w;
  w.mem = dev.alloc(values.size() * sizeof(float), CL_MEM_READ_ONLY);
  w.start_align = mem_start_alignment(w.mem);
  dev.write(w.mem, values.data(), values.size() * sizeof(float));
  w.dtype = DType::F32;
  w.shape = std::move(shape);
  w.name = std::move(name);
  return w;
}

}  // namespace clshard
