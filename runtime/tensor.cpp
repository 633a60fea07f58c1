#include "runtime/tensor.h"

#include "runtime/device.h"
#include "runtime/safetensors.h"

namespace clshard {

Weight to_device(Device& dev, const TensorView& view) {
  Weight w;
  w.mem = dev.wrap_host(view.data, view.bytes);
  w.dtype = view.dtype;
  w.shape = view.shape;
  w.name = view.name;
  return w;
}

Weight to_device_f32(Device& dev, const std::vector<float>& values, std::vector<int64_t> shape,
                     std::string name) {
  Weight w;
  w.mem = dev.alloc(values.size() * sizeof(float), CL_MEM_READ_ONLY);
  dev.write(w.mem, values.data(), values.size() * sizeof(float));
  w.dtype = DType::F32;
  w.shape = std::move(shape);
  w.name = std::move(name);
  return w;
}

}  // namespace clshard
