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

Fp8CodeScan scan_fp8_codes(const uint8_t* codes, size_t n) {
  // Eight codes per word, no carry crossing into the next code in any of the adds:
  // - a code's low 7 bits plus one carry into bit 7 only at 0x7F: a NaN code of either sign;
  // - its exponent bits (0x78) plus 0x78 set bit 7 unless they are 0, its mantissa bits (0x07)
  //   plus 7 set bit 3 unless they are 0: subnormal where the first stays clear and the second not.
  constexpr uint64_t kLow7 = 0x7F7F7F7F7F7F7F7Full, kOne = 0x0101010101010101ull,
                     kHigh = 0x8080808080808080ull, kExp = 0x7878787878787878ull,
                     kMant = 0x0707070707070707ull, kBit3 = 0x0808080808080808ull;
  // The subnormal marks (bit 7 of a byte) are counted per byte lane, 255 words at most, before the
  // eight lanes are added: a popcount per word had been libgcc's __popcountdi2 call (the build
  // targets no popcnt instruction), half of the load of an FP8 checkpoint's scan; 2.1x faster
  // over 1 GiB here (4.7 against 2.2 GB/s, one thread).
  uint64_t marks = 0, subnormal = 0;
  size_t i = 0;
  while (i + 8 <= n) {
    uint64_t lanes = 0;
    for (int w = 0; w < 255 && i + 8 <= n; ++w, i += 8) {
      uint64_t word;
      std::memcpy(&word, codes + i, 8);
      marks |= ((word & kLow7) + kOne) & kHigh;
      const uint64_t exp_zero = ~((word & kExp) + kExp) & kHigh;
      const uint64_t mant_set = (((word & kMant) + kMant) & kBit3) << 4;
      lanes += (exp_zero & mant_set) >> 7;
    }
    const uint64_t pairs = (lanes & 0x00FF00FF00FF00FFull) + ((lanes >> 8) & 0x00FF00FF00FF00FFull);
    subnormal += (pairs * 0x0001000100010001ull) >> 48;
  }
  for (; i < n; ++i) {
    marks |= (codes[i] & 0x7F) == 0x7F;
    subnormal += (codes[i] & 0x78) == 0 && (codes[i] & 0x07) != 0;
  }
  return {marks == 0, subnormal};
}

bool fp8_nan_free(const uint8_t* codes, size_t n) { return scan_fp8_codes(codes, n).nan_free; }

namespace {
// The scan of a weight's FP8 codes where it is built (to_device*): its rows `rows` of `row_bytes`
// from `data` with stride `stride`.
void scan_fp8(Weight& w, const uint8_t* data, size_t rows, size_t row_bytes, size_t stride) {
  if (w.dtype != DType::F8_E4M3) return;
  bool free = true;
  uint64_t subnormal = 0;
  for (size_t r = 0; r < rows; ++r) {
    const Fp8CodeScan scan = scan_fp8_codes(data + r * stride, row_bytes);
    free = free && scan.nan_free;
    subnormal += scan.subnormal;
  }
  w.fp8_nan_free = free;
  w.fp8_subnormal_share =
      rows * row_bytes != 0 ? float(double(subnormal) / double(rows * row_bytes)) : 0;
}
}  // namespace

Weight to_device(Device& dev, const TensorView& view) {
  Weight w;
  w.mem = dev.wrap_host(view.data, view.bytes);
  w.start_align = mem_start_alignment(w.mem);
  w.dtype = view.dtype;
  scan_fp8(w, view.data, 1, view.bytes, 0);
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
  scan_fp8(w, view.data + size_t(r0) * row * es, 1, size_t(r1 - r0) * row * es, 0);
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
  scan_fp8(w, view.data + size_t(c0) * es, size_t(N), size_t(c1 - c0) * es, size_t(K) * es);
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
