// The host side of the narrow KV caches (kv_cache.dtype bf16 | fp8; common.cl's CACHE_TYPE): the
// code a cache stores for an f32 value, the value a code stands for, and the code at element i of
// a cache read back as bytes. bf16: nearest even. fp8: e4m3fn nearest even, saturating at 448 (the
// rounding make-model's FP8 presets use), no scale.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "models/deepseek_v3/presets.h"
#include "runtime/dtype.h"
#include "runtime/ops_moe.h"

namespace clshard::test {

inline uint32_t cache_code(DType dt, float x) {
  return dt == DType::BF16 ? f32_to_bf16(x) : deepseek_v3::f32_to_e4m3(x);
}
inline float cache_value(DType dt, uint32_t code) {
  return dt == DType::BF16 ? bf16_to_f32(uint16_t(code)) : reference::e4m3_to_f32(uint8_t(code));
}
// What a narrow cache holds for x.
inline float cached(DType dt, float x) { return cache_value(dt, cache_code(dt, x)); }
inline uint32_t stored_code(DType dt, const std::vector<uint8_t>& bytes, size_t i) {
  if (dt == DType::F8_E4M3) return bytes[i];
  uint16_t v;
  std::memcpy(&v, bytes.data() + 2 * i, 2);
  return v;
}

}  // namespace clshard::test
