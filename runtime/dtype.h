// Element types of checkpoint tensors and how big they are.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <string_view>

namespace clshard {

enum class DType { F64, F32, F16, BF16, F8_E4M3, F8_E5M2, I64, I32, I16, I8, U8, Bool };

size_t dtype_size(DType t);
// The safetensors spelling: "F32", "BF16", "F8_E4M3", ...
const char* dtype_name(DType t);
std::optional<DType> dtype_from_name(std::string_view name);

// What the linear layers multiply in (model.compute_dtype): f32 activations, or activations rounded
// to bf16 with f32 sums (runtime/ops.h says where).
enum class ComputeDType { F32, BF16 };
inline const char* compute_dtype_name(ComputeDType c) {
  return c == ComputeDType::BF16 ? "bf16" : "f32";
}

inline float bf16_to_f32(uint16_t b) {
  uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
// Round to nearest even, as torch does when casting f32 to bf16.
inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // keep NaN a NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}
float f16_to_f32(uint16_t h);
uint16_t f32_to_f16(float f);  // round to nearest even

}  // namespace clshard
