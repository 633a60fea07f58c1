// FP8 activation fake-quantization, as MAX and DeepSeek's reference code run FP8 checkpoints:
// per token (row) and per block of 128 columns, s = clamp(amax, 1e-4, 1200) / 448 and
// y = e4m3fn(x / s) * s, rounding to the nearest e4m3 value (ties to even), saturating at 448.
// One work-item per (row, 128-column block); act_quant_fp8_wg is the GPU shape.

// x rounded to the nearest e4m3fn value: 3 mantissa bits, exponents down to -6 (then subnormal
// steps of 2^-9), largest finite 448.
inline float round_to_e4m3(float x) {
  const float a = fabs(x);
  if (a >= 448.0f) return copysign(448.0f, x);
  if (a == 0.0f) return x;
  int e;
  frexp(a, &e);                      // a = m * 2^e, m in [0.5, 1)
  const int exp2 = max(e - 1, -6);   // the binade of a, clamped to the smallest normal one
  const float quantum = ldexp(1.0f, exp2 - 3);
  return copysign(rint(a / quantum) * quantum, x);
}

kernel void act_quant_fp8(global const float* x, uint x_off, uint ldx, global float* y, uint K) {
  const uint row = get_global_id(1);
  const uint k0 = get_global_id(0) * 128;
  const uint k1 = min(k0 + 128, K);
  global const float* xr = x + x_off + (size_t)row * ldx;
  global float* yr = y + (size_t)row * K;
  float amax = 0.0f;
  for (uint k = k0; k < k1; ++k) amax = fmax(amax, fabs(xr[k]));
  const float s = clamp(amax, 1e-4f, 1200.0f) / 448.0f;
  for (uint k = k0; k < k1; ++k) yr[k] = round_to_e4m3(xr[k] / s) * s;
}

// The GPU shape: a work-group of 128 lanes per (row, 128-column block), a lane per column, the
// block's amax by a tree in local memory. A maximum is exact in any order, and the tree starts
// from 0 as the CPU shape's loop does (fmax passes over NaN), so s and every output equal
// act_quant_fp8's bit for bit. Launch: global (ceil(K / 128) * 128, M), local (128, 1).
kernel __attribute__((reqd_work_group_size(128, 1, 1)))
void act_quant_fp8_wg(global const float* x, uint x_off, uint ldx, global float* y, uint K) {
  local float amax[128];
  const uint lane = get_local_id(0), row = get_group_id(1), k = get_global_id(0);
  const float v = k < K ? x[x_off + (size_t)row * ldx + k] : 0.0f;
  amax[lane] = fmax(0.0f, fabs(v));
  barrier(CLK_LOCAL_MEM_FENCE);
  for (uint stride = 64; stride > 0; stride >>= 1) {
    if (lane < stride) amax[lane] = fmax(amax[lane], amax[lane + stride]);
    barrier(CLK_LOCAL_MEM_FENCE);
  }
  const float s = clamp(amax[0], 1e-4f, 1200.0f) / 448.0f;
  if (k < K) y[(size_t)row * K + k] = round_to_e4m3(v / s) * s;
}
