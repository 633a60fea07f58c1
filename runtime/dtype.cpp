#include "runtime/dtype.h"

#include <cmath>

namespace clshard {

namespace {
struct DTypeRow {
  DType t;
  const char* name;
  size_t size;
};
constexpr DTypeRow kTypes[] = {
    {DType::F64, "F64", 8},         {DType::F32, "F32", 4},         {DType::F16, "F16", 2},
    {DType::BF16, "BF16", 2},       {DType::F8_E4M3, "F8_E4M3", 1}, {DType::F8_E5M2, "F8_E5M2", 1},
    {DType::I64, "I64", 8},         {DType::I32, "I32", 4},         {DType::I16, "I16", 2},
    {DType::I8, "I8", 1},           {DType::U8, "U8", 1},           {DType::Bool, "BOOL", 1},
};
}  // namespace

size_t dtype_size(DType t) {
  for (const auto& r : kTypes)
    if (r.t == t) return r.size;
  return 0;
}

const char* dtype_name(DType t) {
  for (const auto& r : kTypes)
    if (r.t == t) return r.name;
  return "?";
}

std::optional<DType> dtype_from_name(std::string_view name) {
  for (const auto& r : kTypes)
    if (name == r.name) return r.t;
  return std::nullopt;
}

float f16_to_f32(uint16_t h) {
  const int sign = (h >> 15) & 1, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
  float v;
  if (exp == 0) v = std::ldexp(float(mant), -24);
  else if (exp == 31) v = mant ? NAN : INFINITY;
  else v = std::ldexp(float(mant | 0x400), exp - 25);
  return sign ? -v : v;
}

uint16_t f32_to_f16(float f) {
#if defined(__FLT16_MAX__)  // the compiler has _Float16 (GCC 12; clang 14 lacks it on x86)
  const _Float16 h = static_cast<_Float16>(f);
  uint16_t bits;
  std::memcpy(&bits, &h, 2);
  return bits;
#else
  // Round to nearest even, as the conversion above does.
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint16_t sign = uint16_t((x >> 16) & 0x8000);
  const uint32_t abs = x & 0x7fffffff;
  if (abs > 0x7f800000) return uint16_t(sign | 0x7e00);  // NaN
  if (abs >= 0x477ff000) return uint16_t(sign | 0x7c00);  // rounds past 65504: infinity
  if (abs < 0x38800000) {  // below 2^-14: a subnormal half (or zero)
    const float scaled = std::fabs(f) * 16777216.0f;  // in units of 2^-24, exact
    return uint16_t(sign | uint16_t(std::nearbyint(scaled)));
  }
  const uint32_t mant = abs & 0x7fffff, exp = (abs >> 23) - 112;
  uint32_t h = (exp << 10) | (mant >> 13);
  const uint32_t rest = mant & 0x1fff;
  if (rest > 0x1000 || (rest == 0x1000 && (h & 1))) ++h;
  return uint16_t(sign | h);
#endif
}

}  // namespace clshard
