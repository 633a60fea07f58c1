// FP8 (e4m3fn) weights with 128x128 block scales, as DeepSeek-V3's FP8 checkpoints store them:
// W ~= e4m3(W_q[n, k]) * scale_inv[n / 128, k / 128] (the "inv" scale MULTIPLIES).
//
// linear_fp8: y = alpha * x W^T (+ y when accumulating). x: [M, K] f32 rows (stride ldx); W: [N, K]
// bytes; scale: f32 [ceil(N/128), KB = ceil(K/128)]; y: [M, N] f32 (stride ldy). The bytes are
// decoded in registers right before the FMA, so the weights stream at 1 byte per element.
// Tiling as linear.cl: one work-item owns a TM x TN tile of y (local size 1 on CPU) and walks K
// with 16-wide loads; dimension 0 walks N, dimension 1 walks M.
//
// dequantize_fp8: out[N, K] f32 = e4m3(W) * scale, one work-item per row.
//
// Build options: -DTM=1|4 -DTN=4 -DFP8_DENORM=1|0.
//
// At one byte per weight a GEMV is bound by the decode, not by memory, so the decode is a handful
// of instructions and the constant factors it leaves go into the block scale instead:
//
// FP8_DENORM=1 (devices with f32 denormals, CL_FP_DENORM): sign-extend the byte to int, shift the
//   7 magnitude bits under the f32 exponent (<< 20) and keep sign | magnitude (the extended sign
//   also lands in bits 27-30, masked off). That f32 is exactly e4m3 * 2^-120 (biases 127 vs 7);
//   the exponent-0 codes (e4m3 subnormals) become f32 denormals, still exact. 2^120 would overflow
//   the scale side, so it is split: x * scale * 2^100 feeds the FMA, and the sums, which then hold
//   y * 2^-20, are multiplied by 2^20 after the loop. All of it is power-of-two scaling, exact
//   while |x * scale| < 2^28 and each product stays above 2^-106. 3 instructions per 16 weights.
// FP8_DENORM=0 (devices that flush denormals): the same 7 bits under an f16's exponent (<< 7) are a
//   half equal to e4m3 * 2^-8 (biases 15 vs 7), subnormals included, widened by vload_half (F16C's
//   vcvtph2ps on x86; core OpenCL, no cl_khr_fp16 needed); x * scale * 2^8 feeds the FMA.
//
// NaN (0x7F / 0xFF, the "fn" variant has no infinities) is not produced by either decode: each
// work-item keeps the running unsigned and signed byte maxima of every weight row it reads (0xFF
// is the unsigned maximum, 0x7F the signed one) and writes NaN for a row that holds either.

#ifndef TM
#define TM 1
#endif
#ifndef TN
#define TN 4
#endif
#ifndef FP8_DENORM
#define FP8_DENORM 1
#endif

// Block edge of the scales. A TN-row tile never straddles two block rows: TN divides 128.
#define QBLOCK 128
#define VECS_PER_BLOCK (QBLOCK / 16)

#if FP8_DENORM
// e4m3 * 2^-120, as f32 bits.
inline float16 e4m3x16_decode_scaled(uchar16 b) {
  return as_float16((convert_int16(as_char16(b)) << 20) & (int16)(int)0x87F00000);
}
#define DECODE_UNSCALE 0x1p120f
#define X_SCALE 0x1p100f  // with ACC_SCALE: X_SCALE * ACC_SCALE = DECODE_UNSCALE
#define ACC_SCALE 0x1p20f
#else
// e4m3 * 2^-8, as a half widened to f32.
inline float16 e4m3x16_decode_scaled(uchar16 b) {
  const short16 h = (convert_short16(as_char16(b)) << 7) & (short16)(short)0xBF80;
  return vload_half16(0, (const private half*)&h);
}
#define DECODE_UNSCALE 0x1p8f
#define X_SCALE 0x1p8f
#define ACC_SCALE 1.0f
#endif

inline int16 e4m3x16_is_nan(uchar16 b) {
  return convert_int16((b & (uchar16)0x7F) == (uchar16)0x7F);
}

// The exact value, NaN included: for dequantize_fp8.
inline float16 e4m3x16_to_f32(uchar16 b) {
  return select(e4m3x16_decode_scaled(b) * DECODE_UNSCALE, (float16)NAN, e4m3x16_is_nan(b));
}

// Scalar form for the K % 16 tail, on integers: normal codes move the 7 magnitude bits under f32's
// exponent (<< 20) and add the bias difference 127 - 7 = 120; exponent field 0 is mantissa * 2^-9
// in float arithmetic, never an f32 denormal.
inline float e4m3_to_f32(uchar b) {
  const uint u = b;
  const uint mag = u & 0x7Fu;
  float v = mag < 8u ? (float)mag * 0x1p-9f : as_float((mag << 20) + (120u << 23));
  if (mag == 0x7Fu) v = NAN;
  return as_float(as_uint(v) | ((u & 0x80u) << 24));
}

kernel void linear_fp8(global const float* x, uint x_off, uint ldx,
                       global const uchar* w, global const float* scale, uint KB,
                       global float* y, uint y_off, uint ldy,
                       uint M, uint N, uint K, float alpha, int accumulate) {
  const uint n0 = get_global_id(0) * TN;
  const uint m0 = get_global_id(1) * TM;
  // Rows and columns past the edge compute on a valid row (clamped) and are not stored. The
  // clamped rows stay inside n0's group of TN, so every row of the tile shares one scale row.
  global const float* xr[TM];
  global const uchar* wr[TN];
#pragma unroll
  for (int i = 0; i < TM; ++i) xr[i] = x + x_off + (size_t)min(m0 + i, M - 1) * ldx;
#pragma unroll
  for (int j = 0; j < TN; ++j) wr[j] = w + (size_t)min(n0 + j, N - 1) * K;
  global const float* srow = scale + (size_t)(n0 / QBLOCK) * KB;

  float16 acc[TM][TN];
#pragma unroll
  for (int i = 0; i < TM; ++i)
#pragma unroll
    for (int j = 0; j < TN; ++j) acc[i][j] = (float16)(0.0f);
  uchar16 umax[TN];  // NaN watch, see the top
  char16 smax[TN];
#pragma unroll
  for (int j = 0; j < TN; ++j) {
    umax[j] = (uchar16)(0);
    smax[j] = (char16)(-128);
  }

  // The block scale is shared by the whole tile within one K block, so it multiplies the TM x
  // vectors (TM multiplies per 16 columns) instead of the TN decoded weight vectors.
  const uint K16 = K / 16;
  for (uint kb = 0; kb < KB; ++kb) {
    const float s = srow[kb] * X_SCALE;
    const uint v_end = min((kb + 1) * VECS_PER_BLOCK, K16);
    for (uint v = kb * VECS_PER_BLOCK; v < v_end; ++v) {
      float16 wv[TN];
#pragma unroll
      for (int j = 0; j < TN; ++j) {
        const uchar16 b = vload16(v, wr[j]);
        umax[j] = max(umax[j], b);
        smax[j] = max(smax[j], as_char16(b));
        wv[j] = e4m3x16_decode_scaled(b);
      }
#pragma unroll
      for (int i = 0; i < TM; ++i) {
        const float16 xv = vload16(v, xr[i]) * s;
#pragma unroll
        for (int j = 0; j < TN; ++j) acc[i][j] = fma(xv, wv[j], acc[i][j]);
      }
    }
  }

  float out[TM][TN];
#pragma unroll
  for (int i = 0; i < TM; ++i)
#pragma unroll
    for (int j = 0; j < TN; ++j) {
      const float16 a = acc[i][j];
      const float8 s8 = a.lo + a.hi;
      const float4 s4 = s8.lo + s8.hi;
      const float2 s2 = s4.lo + s4.hi;
      out[i][j] = (s2.x + s2.y) * ACC_SCALE;
    }
  // The K % 16 tail lies inside the last K block (128 is a multiple of 16); its decode is exact and
  // NaN-aware on its own.
  if (K16 * 16 < K) {
    const float s_last = srow[KB - 1];
    for (uint k = K16 * 16; k < K; ++k) {
#pragma unroll
      for (int i = 0; i < TM; ++i) {
        const float xs = xr[i][k] * s_last;
#pragma unroll
        for (int j = 0; j < TN; ++j) out[i][j] = fma(xs, e4m3_to_f32(wr[j][k]), out[i][j]);
      }
    }
  }

  bool row_has_nan[TN];
#pragma unroll
  for (int j = 0; j < TN; ++j)
    row_has_nan[j] = any(umax[j] == (uchar16)(0xFF)) || any(smax[j] == (char16)(0x7F));

#pragma unroll
  for (int i = 0; i < TM; ++i) {
    if (m0 + i >= M) break;
    global float* yr = y + y_off + (size_t)(m0 + i) * ldy;
#pragma unroll
    for (int j = 0; j < TN; ++j) {
      const uint n = n0 + j;
      if (n >= N) break;
      const float v = row_has_nan[j] ? NAN : out[i][j] * alpha;
      yr[n] = accumulate ? yr[n] + v : v;
    }
  }
}

kernel void dequantize_fp8(global const uchar* w, global const float* scale, uint KB,
                           global float* out, uint N, uint K) {
  const uint n = get_global_id(0);
  global const uchar* wr = w + (size_t)n * K;
  global const float* srow = scale + (size_t)(n / QBLOCK) * KB;
  global float* o = out + (size_t)n * K;
  const uint K16 = K / 16;
  for (uint v = 0; v < K16; ++v)
    vstore16(e4m3x16_to_f32(vload16(v, wr)) * srow[v / VECS_PER_BLOCK], v, o);
  for (uint k = K16 * 16; k < K; ++k) o[k] = e4m3_to_f32(wr[k]) * srow[k / QBLOCK];
}
