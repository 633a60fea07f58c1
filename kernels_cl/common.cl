// Prepended to every kernels_cl/ program: weight loaders shared by the kernels.

// bf16 -> f32 is a 16-bit shift: bf16 is the top half of an IEEE f32.
inline float bf16_to_f32(ushort b) { return as_float(((uint)b) << 16); }
inline float8 bf16x8_to_f32(ushort8 b) { return as_float8(convert_uint8(b) << 16); }
inline float16 bf16x16_to_f32(ushort16 b) { return as_float16(convert_uint16(b) << 16); }

// 16 outputs of one row into yr[0 .. 16) (yr: the row's column n), those below column N only:
// (s + the bf16 bias[n ..] where has_bias) * alpha, y's values added where accumulating. The
// epilogue of bf16_packed.cl's and bf16_amx_stream.cl's GEMMs, one set of operations for both.
inline void store_row16(global float* yr, float16 s, uint n, uint N, global const ushort* bias,
                        int has_bias, float alpha, int accumulate) {
  if (n + 16 <= N) {
    if (has_bias) s += bf16x16_to_f32(vload16(0, bias + n));
    s *= alpha;
    vstore16(accumulate ? vload16(0, yr) + s : s, 0, yr);
    return;
  }
  float o[16];
  vstore16(s, 0, o);
  for (uint l = 0; n + l < N; ++l) {
    float e = o[l];
    if (has_bias) e += bf16_to_f32(bias[n + l]);
    e *= alpha;
    yr[l] = accumulate ? yr[l] + e : e;
  }
}
// f32 -> bf16, round to nearest, ties to even, as torch's cast does; NaN stays a quiet NaN.
inline ushort f32_to_bf16_rne(float f) {
  const uint u = as_uint(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (ushort)((u >> 16) | 0x40u);
  return (ushort)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
// The rounding alone (the bits of f32 u to bf16 bits), for values known not to be NaN.
inline uint16 f32x16_round_bf16_bits(uint16 u) { return (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16; }
inline ushort16 f32x16_to_bf16_rne(float16 f) {
  const uint16 u = as_uint16(f);
  const uint16 nan = (u >> 16) | 0x40u;
  return convert_ushort16(select(f32x16_round_bf16_bits(u), nan, (u & 0x7FFFFFFFu) > 0x7F800000u));
}
// 32 bf16 values (a: elements 0-15, b: 16-31) as 16 pair words, vdpbf16ps's operand: their bytes
// as they are (little endian: element 2 q is the low half of word q). (Through .even / .odd
// swizzles this had compiled to a word insert per element.)
inline uint16 bf16_pair_words(ushort16 a, ushort16 b) {
  return (uint16)(as_uint8(a), as_uint8(b));
}

// The sum of 16 lanes, pairwise (halves, then quarters ...): every kernel that reduces a vector
// accumulator uses this one order, so their results agree bit for bit.
inline float hsum16(float16 v) {
  const float8 a = v.lo + v.hi;
  const float4 b = a.lo + a.hi;
  const float2 c = b.lo + b.hi;
  return c.x + c.y;
}

// n rounded up to a multiple of 16: arrays filled or read 16 floats at a time.
#define ROUND16(n) (((n) + 15) / 16 * 16)
// And to a multiple of 32 (attention.cl's bf16 pair words, 32 elements a vector).
#define ROUND32(n) (((n) + 31) / 32 * 32)

// Chunk i (16 floats) of a row of D floats at p, read by LOAD8 / LOAD16 (vload8 / vload16 or a
// cache's LOADC8 / LOADC16); with D % 16 == 8 the last chunk's upper half is zeros, whose products
// are exact zeros (the attention kernels' rows of D a multiple of 8).
#define CHUNK16(i, p, D, LOAD8, LOAD16) \
  ((D) % 16 && (i) == (D) / 16 ? (float16)(LOAD8(2 * (i), p), (float8)(0.0f)) : LOAD16(i, p))

#ifdef __clang__
// The tree's four rounds, each combining two shuffles of a and b by OP (+ or fmax).
// Halves: lanes 0-7 a's 8 partial results, 8-15 b's.
#define X16_HALVES(a, b, OP)                                                                  \
  OP(__builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23),   \
     __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31))
// Quarters: 4 lanes per vector, a's two, then b's two.
#define X16_QUARTERS(a, b, OP)                                                                \
  OP(__builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27), \
     __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31))
// Pairs: quarter q holds lanes x, y of vector q of a's four, then of vector q of b's four.
#define X16_PAIRS(a, b, OP)                                                                   \
  OP(__builtin_shufflevector(a, b, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29), \
     __builtin_shufflevector(a, b, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31))
// Last: x with y of vector p (a holds 0-7: p % 4's quarter, the first pair for p < 4; b 8-15).
#define X16_LAST(a, b, OP)                                                                    \
  OP(__builtin_shufflevector(a, b, 0, 4, 8, 12, 2, 6, 10, 14, 16, 20, 24, 28, 18, 22, 26, 30), \
     __builtin_shufflevector(a, b, 1, 5, 9, 13, 3, 7, 11, 15, 17, 21, 25, 29, 19, 23, 27, 31))
#define X16_ADD(x, y) ((x) + (y))
#define X16_REDUCE(a, OP)                                                            \
  float16 h[8], q[4], p[2];                                                          \
  _Pragma("unroll") for (int i = 0; i < 8; ++i) h[i] =                               \
      X16_HALVES(a[2 * i], a[2 * i + 1], OP);                                        \
  _Pragma("unroll") for (int i = 0; i < 4; ++i) q[i] =                               \
      X16_QUARTERS(h[2 * i], h[2 * i + 1], OP);                                      \
  _Pragma("unroll") for (int i = 0; i < 2; ++i) p[i] = X16_PAIRS(q[2 * i], q[2 * i + 1], OP); \
  return X16_LAST(p[0], p[1], OP)
// hsum16 of 16 vectors at once: lane p of the result is hsum16(a[p]), the same bits. Each step
// adds the same two lanes of each vector as hsum16 does (halves, quarters, pairs, then x + y),
// with the vectors packed side by side so that one vector add serves 2, 4, 8 and then 16 of them
// (float addition commutes). Where the compiler has no __builtin_shufflevector, hsum16 one by one.
// 16 sums take about 45 instructions so, against about 130 one by one (linear_bf16.cl's tiles,
// mla.cl's decode scores; attention.cl's tiles sum their softmax weights so).
inline float16 hsum16_x16(const float16* a) { X16_REDUCE(a, X16_ADD); }
// The same tree by fmax: lane p is the largest of a[p]'s lanes (attention.cl's tiles: 16 query
// rows' maxima over a block of scores).
inline float16 hmax16_x16(const float16* a) { X16_REDUCE(a, fmax); }

// 16 x 16 words transposed: r[c] lane q becomes r[q] lane c (bf16_packed.cl's panels of weight
// pairs, attention.cl's blocks of keys). The usual four rounds, each of 16 two-source shuffles
// that x86 has as single instructions (unpack of 32-bit and 64-bit elements within 128-bit lanes,
// then 128-bit lane shuffles): 64 in all (__builtin_shufflevector with constant indices, which
// the backend lowers to those single instructions; OpenCL's shuffle2 went through PoCL's library
// as a general permute of a mask loaded from memory). Without clang, element by element.
__attribute__((always_inline)) inline void transpose16x16(uint16 r[16]) {
  uint16 t[16], u[16];
  // Rows 2k, 2k + 1 interleaved per 32-bit element, then rows of each group of 4 per 64-bit
  // element: u[4 g + q]'s 128-bit lane L holds column 4 L + q of rows 4 g .. 4 g + 3.
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    t[2 * k] = __builtin_shufflevector(r[2 * k], r[2 * k + 1], 0, 16, 1, 17, 4, 20, 5, 21, 8, 24,
                                       9, 25, 12, 28, 13, 29);
    t[2 * k + 1] = __builtin_shufflevector(r[2 * k], r[2 * k + 1], 2, 18, 3, 19, 6, 22, 7, 23, 10,
                                           26, 11, 27, 14, 30, 15, 31);
  }
#pragma unroll
  for (int g = 0; g < 4; ++g)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint16 a = t[4 * g + h], b = t[4 * g + 2 + h];
      u[4 * g + 2 * h] = __builtin_shufflevector(a, b, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25,
                                                 12, 13, 28, 29);
      u[4 * g + 2 * h + 1] = __builtin_shufflevector(a, b, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26,
                                                     27, 14, 15, 30, 31);
    }
  // Column 4 L + q = (u[q], u[4 + q], u[8 + q], u[12 + q])'s lane L: two rounds of lane shuffles
  // (even lanes 0, 2 of both sources; odd lanes 1, 3).
#define T16_EVEN128(a, b) \
  __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27)
#define T16_ODD128(a, b) \
  __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31)
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const uint16 a = T16_EVEN128(u[q], u[4 + q]), b = T16_EVEN128(u[8 + q], u[12 + q]);
    const uint16 c = T16_ODD128(u[q], u[4 + q]), d = T16_ODD128(u[8 + q], u[12 + q]);
    r[q] = T16_EVEN128(a, b);
    r[8 + q] = T16_ODD128(a, b);
    r[4 + q] = T16_EVEN128(c, d);
    r[12 + q] = T16_ODD128(c, d);
  }
#undef T16_EVEN128
#undef T16_ODD128
}
#else
inline void transpose16x16(uint16 r[16]) {
  uint t[16][16];
  for (int c = 0; c < 16; ++c) vstore16(r[c], 0, t[c]);
  for (int q = 0; q < 16; ++q)
    r[q] = (uint16)(t[0][q], t[1][q], t[2][q], t[3][q], t[4][q], t[5][q], t[6][q], t[7][q],
                    t[8][q], t[9][q], t[10][q], t[11][q], t[12][q], t[13][q], t[14][q], t[15][q]);
}
inline float16 hsum16_x16(const float16* a) {
  float s[16];
  for (int i = 0; i < 16; ++i) s[i] = hsum16(a[i]);
  return vload16(0, s);
}
inline float16 hmax16_x16(const float16* a) {
  float s[16];
  for (int i = 0; i < 16; ++i) {
    const float8 h = fmax(a[i].lo, a[i].hi);
    const float4 q = fmax(h.lo, h.hi);
    s[i] = fmax(fmax(q.x, q.y), fmax(q.z, q.w));
  }
  return vload16(0, s);
}
#endif

// The end of a GPU-shaped row sum: the lanes' partial sums of `rows` rows (partial: rows x wg
// floats in local memory, row r at r * wg, every lane's written) are added into slot 0 of each
// row by a tree, halves, then quarters, ..., with a barrier before and after each step; the
// whole work-group must reach it. Every work-group GEMV (linear_wg, linear_fused_wg,
// linear_fp8_wg and the grouped experts) ends this way, so their rows agree bit for bit.
inline void wg_tree_sum(local float* partial, uint rows, uint wg, uint lane) {
  barrier(CLK_LOCAL_MEM_FENCE);
  for (uint stride = wg / 2; stride > 0; stride >>= 1) {
    if (lane < stride)
      for (uint r = 0; r < rows; ++r) partial[r * wg + lane] += partial[r * wg + lane + stride];
    barrier(CLK_LOCAL_MEM_FENCE);
  }
}

// A hint that the 64-byte line at p will be read soon, into L2 (x86 prefetcht1): the tiles that
// prefetch their next tile's weight rows hold their own rows and x rows in L1, where prefetcht0
// would put the lines (the likely reason it did less). llama3-1b decode at batch 8 (bench_decode_breakdown --prefetch-ab, step off/on):
// f32 GEMMs 1.093 with prefetcht0 against 1.172 with prefetcht1, the same run. Built with
// -DPREFETCH_X86=1 only for PoCL's CPU device on an x86 host (ops::weight_prefetch_option):
// OpenCL C's prefetch() compiles to nothing there, and clang's __builtin_prefetch takes no
// global pointer in OpenCL C 1.2. A prefetch never faults, so a line past a buffer's end is
// harmless.
// PREFETCH_LINE_L1: the same hint into L1 (prefetcht0), for a line wanted within a few hundred
// cycles whose wait the hardware prefetchers leave exposed (mla.cl's decode rows, attention.cl's
// next block of keys and values).
#if PREFETCH_X86
#define PREFETCH_LINE(p) __asm__ volatile("prefetcht1 (%0)" ::"r"(p))
#define PREFETCH_LINE_L1(p) __asm__ volatile("prefetcht0 (%0)" ::"r"(p))
#else
#define PREFETCH_LINE(p)
#define PREFETCH_LINE_L1(p)
#endif

// Up to which output column a GEMM work-item's tiles, each prefetching the next tile's weight
// rows, prefetch (the column tiles from n_end on being the next work-item's): its own end, or
// with one row block (decode batches) the weight's end N, so that its last tile prefetches the
// next work-item's first. PoCL's CPU driver hands a thread runs of consecutive work-groups, so
// that work-item is most likely the thread's next, and only a run's first tile starts cold.
// llama3-1b's decode step (bench_llama --tuning-ab, Zen 4 EPYC, 2026-11-30, 30-36 rounds in
// turn, split by the read pass after each: fast rounds at 44-61 GB/s, slow ones at 27-36), with
// against without: batch 8 at bf16 compute 1.07x / 1.08x / 1.06x fast and 1.03x / 1.04x / 1.04x
// slow (three runs), at f32 compute 1.10x in both; batch 1 within the noise (bf16 compute 1.19x
// fast and 0.99x slow in one run, 0.97x and 0.98x in another; f32 1.03x and 1.00x); dsv3-mini
// bf16 at bf16 compute, whose few GEMVs that prefetch are about 5% of its step, 1.00x slow and
// 0.85x in 5 fast rounds (noise of that size: the rounds ranged 0.76-1.03x), fp8 0.99x.
inline uint prefetch_end(uint n_end, uint N, uint row_blocks) {
  return row_blocks == 1 ? N : n_end;
}

// The weight element type of kernels built with -DWEIGHT_TYPE=0|1|2 (f32 | bf16 | f16): wtype,
// and loaders that widen to f32 in registers (a weight is never converted in memory).
#ifdef WEIGHT_TYPE
#if WEIGHT_TYPE == 1
typedef ushort wtype;
#define LOADW16(i, p) bf16x16_to_f32(vload16((i), (p)))
#define LOADW1(p) bf16_to_f32(*(p))
#elif WEIGHT_TYPE == 2
typedef half wtype;  // loaded with vload_half, which needs no cl_khr_fp16
#define LOADW16(i, p) vload_half16((i), (p))
#define LOADW1(p) vload_half(0, (p))
#else
typedef float wtype;
#define LOADW16(i, p) vload16((i), (p))
#define LOADW1(p) (*(p))
#endif

// Output column n of a launch over up to three weights side by side (linear_fused's q/k/v, both
// kernel shapes): its weight row. Columns [0, n1) are rows of w0, [n1, n2) of w1, [n2, N) of w2.
inline global const wtype* fused_row(uint n, global const wtype* w0, uint ldw0, uint n1,
                                     global const wtype* w1, uint ldw1, uint n2,
                                     global const wtype* w2, uint ldw2) {
  if (n < n1) return w0 + (size_t)n * ldw0;
  if (n < n2) return w1 + (size_t)(n - n1) * ldw1;
  return w2 + (size_t)(n - n2) * ldw2;
}
#endif

// SiLU of a GLU tile's gate sums, 16 at a time: act[i * cols + j] = silu(a), a = sums[i * ld + j]
// for i < rows, j < cols; act holds ROUND16(rows * cols) floats. One float16 exp where a scalar
// exp per output had cost 5-7% of a prefill (the tile kernels' epilogues). silu(a) =
// a / (1 + exp(-a)), as silu_mul computes it.
inline void silu_tile(const float* sums, uint ld, uint rows, uint cols, float* act) {
  const uint n = rows * cols;
#pragma unroll  // constant indices: not a gather from computed ones
  for (uint c = 0; c < ROUND16(n); ++c)
    act[c] = c < n ? sums[c / cols * ld + c % cols] : 0.0f;
  for (uint c = 0; c < ROUND16(n); c += 16) {
    const float16 a = vload16(0, act + c);
    vstore16(a / (1.0f + exp(-a)), 0, act + c);
  }
}

// e4m3fn (FP8: 1 sign, 4 exponent bits bias 7, 3 mantissa bits, subnormals, no infinities,
// 0x7F / 0xFF NaN) -> f32, written once for every kernel that reads FP8 weights.
// Exact: normal codes move the 7 magnitude bits under f32's exponent (<< 20) and add the bias
// difference 127 - 7 = 120; exponent field 0 is mantissa * 2^-9 in float arithmetic, never an f32
// denormal, so it holds on devices that flush denormals.
inline float e4m3_to_f32(uchar b) {
  const uint u = b;
  const uint mag = u & 0x7Fu;
  float v = mag < 8u ? (float)mag * 0x1p-9f : as_float((mag << 20) + (120u << 23));
  if (mag == 0x7Fu) v = NAN;
  return as_float(as_uint(v) | ((u & 0x80u) << 24));
}
inline int16 e4m3x16_is_nan(uchar16 b) {
  return convert_int16((b & (uchar16)0x7F) == (uchar16)0x7F);
}
inline float16 e4m3x16_to_f32(uchar16 b) {
  const uint16 u = convert_uint16(b);
  const uint16 mag = u & 0x7Fu;
  const float16 normal = as_float16((mag << 20) + (120u << 23));
  const float16 sub = convert_float16(mag) * 0x1p-9f;
  const float16 v = as_float16(as_uint16(select(normal, sub, mag < (uint16)8u)) | ((u & 0x80u) << 24));
  return select(v, (float16)NAN, e4m3x16_is_nan(b));
}

// DeepSeek-V3's FP8 weights carry one f32 scale per QBLOCK x QBLOCK block of codes. A weight row's
// codes dequantized, each times its block's scale in f32 (srow: the row's block scales): the 16
// from column 16 v, or the one at column k. Written once for the dequantize kernels
// (linear_fp8.cl) and moe.cl's bf16 panels, so both give the same values.
#define QBLOCK 128
#define VECS_PER_BLOCK (QBLOCK / 16)
inline float16 e4m3x16_dequant(global const uchar* row, global const float* srow, uint v) {
  return e4m3x16_to_f32(vload16(v, row)) * srow[v / VECS_PER_BLOCK];
}
inline float e4m3_dequant(global const uchar* row, global const float* srow, uint k) {
  return e4m3_to_f32(row[k]) * srow[k / QBLOCK];
}
// The block scales of weight row n (KB blocks a row): the scale row of n's block of rows.
inline global const float* fp8_scale_row(global const float* scales, uint n, uint KB) {
  return scales + (size_t)(n / QBLOCK) * KB;
}

// The KV caches' element type, -DCACHE_TYPE=0|1|2 (f32 | bf16 | fp8; kv_cache.dtype): ctype, a
// loader that widens to f32 and a store that narrows. bf16 stores round to nearest, ties to even,
// as torch's cast does (NaN stays a quiet NaN). fp8 is e4m3fn with no scale (vLLM's fp8 cache
// without calibrated scales): nearest even, saturating at +-448 as torch's saturating cast does,
// NaN kept. Loads are exact.
#ifndef CACHE_TYPE
#define CACHE_TYPE 0
#endif
#if CACHE_TYPE == 1
typedef ushort ctype;
#define LOADC1(p) bf16_to_f32(*(p))
#define LOADC8(i, p) bf16x8_to_f32(vload8((i), (p)))
#define LOADC16(i, p) bf16x16_to_f32(vload16((i), (p)))
#define STOREC1(v, p) (*(p) = f32_to_bf16_rne(v))
#elif CACHE_TYPE == 2
typedef uchar ctype;
inline uchar f32_to_e4m3_sat(float f) {
  const uint u = as_uint(f), a = u & 0x7FFFFFFFu;
  const uchar sign = (uchar)((u >> 24) & 0x80u);
  if (a > 0x7F800000u) return sign | (uchar)0x7F;  // NaN
  if (a >= 0x43E00000u) return sign | (uchar)0x7E;  // 448 and beyond (infinity too): saturate
  // Below 2^-6 the codes are multiples of 2^-9 (8 of them is code 8 = 2^-6, the smallest normal).
  if (a < 0x3C800000u) return sign | (uchar)convert_int_rte(as_float(a) * 512.0f);
  // The f32 exponent and the top 3 mantissa bits, rounded to nearest even at bit 20 (a carry
  // moves into the exponent), rebased from bias 127 to 7.
  return sign | (uchar)(((a + 0x7FFFFu + ((a >> 20) & 1u)) >> 20) - (120u << 3));
}
#define LOADC1(p) e4m3_to_f32(*(p))
#define LOADC8(i, p) e4m3x16_to_f32((uchar16)(vload8((i), (p)), (uchar8)(0))).lo
#define LOADC16(i, p) e4m3x16_to_f32(vload16((i), (p)))
#define STOREC1(v, p) (*(p) = f32_to_e4m3_sat(v))
#else
typedef float ctype;
#define LOADC1(p) (*(p))
#define LOADC8(i, p) vload8((i), (p))
#define LOADC16(i, p) vload16((i), (p))
#define STOREC1(v, p) (*(p) = (v))
#endif


// The GEMV decode: a handful of instructions per 16 codes that leave a power-of-two factor for the
// caller to take back (x * FP8_X_SCALE feeds the FMA, the sums are multiplied by FP8_ACC_SCALE;
// fp8_tile.cl). Chosen per device with -DFP8_DENORM (runtime/ops_moe.cpp):
// FP8_DENORM=1 (devices with f32 denormals): sign-extend the byte, shift the 7 magnitude bits under
//   the f32 exponent (<< 20) and keep sign | magnitude: exactly e4m3 * 2^-120 (subnormal codes
//   become f32 denormals, still exact). 2^120 is split as 2^100 on x and 2^20 on the sums: exact
//   while |x| < 2^28 and each product x * e4m3 stays above 2^-106.
// FP8_DENORM=0: the same 7 bits under an f16's exponent (<< 7) are a half equal to e4m3 * 2^-8,
//   widened by vload_half (F16C's vcvtph2ps on x86; core OpenCL, no cl_khr_fp16 needed).
// NaN codes decode to finite values here: callers that must propagate them watch the raw bytes.
#ifndef FP8_DENORM
#define FP8_DENORM 1
#endif
#if FP8_DENORM
inline float16 e4m3x16_decode_scaled(uchar16 b) {
  return as_float16((convert_int16(as_char16(b)) << 20) & (int16)(int)0x87F00000);
}
#define FP8_X_SCALE 0x1p100f
#define FP8_ACC_SCALE 0x1p20f
#else
inline float16 e4m3x16_decode_scaled(uchar16 b) {
  const short16 h = (convert_short16(as_char16(b)) << 7) & (short16)(short)0xBF80;
  return vload_half16(0, (const private half*)&h);
}
#define FP8_X_SCALE 0x1p8f
#define FP8_ACC_SCALE 1.0f
#endif

#if FP8_BF16_DOT
// 32 e4m3 codes (b0, then b1) as bf16 words: (sign-extended code << 4) & 0x87F0 puts e4m3's
// exponent and mantissa under bf16's exponent, the code times 2^-120 as the FP8_DENORM=1
// decode's f32 words, exactly (subnormal codes become bf16 denormals). For fp8_tile.cl's bf16
// sums (vdpbf16ps; PoCL's CPU device only, hence clang's 32-lane vectors): 32 lanes at once
// sign-extend 32 loaded bytes in one instruction, where two 16-lane halves took two and a join;
// dsv3-mini fp8's decode at bf16 compute on the Zen 4 EPYC (bench_deepseek --tuning-ab through a
// throwaway switch, 7 rounds in turn) batch 32 1.06x [1.01, 1.08], batch 8 1.03x [1.01, 1.06],
// batch 1 1.02x [0.99, 1.03] (9 rounds).
typedef char e4m3x32_codes __attribute__((ext_vector_type(32)));
typedef short e4m3x32_words __attribute__((ext_vector_type(32)));
__attribute__((always_inline)) inline e4m3x32_words e4m3x32_bf16_words(uchar16 b0, uchar16 b1) {
  const e4m3x32_codes c = __builtin_shufflevector(as_char16(b0), as_char16(b1), 0, 1, 2, 3, 4,
                                                  5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17,
                                                  18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29,
                                                  30, 31);
  return (__builtin_convertvector(c, e4m3x32_words) << (e4m3x32_words)(4)) &
         (e4m3x32_words)((short)0x87F0);
}
#endif

// An FP8 weight row's codes dequantized to bf16 for the bf16-compute GEMMs (bf16_tile.cl's private
// panels, bf16_packed.cl's packed ones): code x block scale in f32, nearest even (dequantize_fp8's
// bf16 output, as DeepSeek's weight_dequant feeds its bf16 GEMMs); the 16 from column 16 v, or the
// one at column k. Weights the load-time scan found free of NaN codes (-DFP8_NAN_WATCH=0) take the
// short decode above, exact up to a power of two that the first product takes back exactly, and a
// rounding without NaN: the same bits as e4m3x16_dequant's, rounded, in about half the
// instructions (the panels had cost 0.7x the experts' GEMM time in a profile of dsv3-mini's
// 512-token prefill).
inline ushort16 e4m3x16_dequant_bf16(global const uchar* row, global const float* srow, uint v) {
#if defined(FP8_NAN_WATCH) && !FP8_NAN_WATCH
  const float16 d = e4m3x16_decode_scaled(vload16(v, row)) * (FP8_X_SCALE * FP8_ACC_SCALE) *
                    srow[v / VECS_PER_BLOCK];
  return convert_ushort16(f32x16_round_bf16_bits(as_uint16(d)));
#else
  return f32x16_to_bf16_rne(e4m3x16_dequant(row, srow, v));
#endif
}
inline ushort e4m3_dequant_bf16(global const uchar* row, global const float* srow, uint k) {
  return f32_to_bf16_rne(e4m3_dequant(row, srow, k));
}

// ---- The GPU shape's shared pieces (work-group reductions, online softmax, page lookup) ----

// The sum and the max over the lanes of a work-group (dimension 0; its size a power of two) of
// one value per lane, through `scratch` (local, one float per lane); every lane gets the result.
// Every lane of the group must call (barriers). A tree in local memory: portable to any
// OpenCL 1.2 device, where subgroup operations are not.
inline float wg_sum(float v, local float* scratch) {
  const uint lane = get_local_id(0);
  scratch[lane] = v;
  barrier(CLK_LOCAL_MEM_FENCE);
  for (uint s = get_local_size(0) / 2; s > 0; s >>= 1) {
    if (lane < s) scratch[lane] += scratch[lane + s];
    barrier(CLK_LOCAL_MEM_FENCE);
  }
  const float r = scratch[0];
  barrier(CLK_LOCAL_MEM_FENCE);  // scratch is free again for the next call
  return r;
}
inline float wg_max(float v, local float* scratch) {
  const uint lane = get_local_id(0);
  scratch[lane] = v;
  barrier(CLK_LOCAL_MEM_FENCE);
  for (uint s = get_local_size(0) / 2; s > 0; s >>= 1) {
    if (lane < s) scratch[lane] = fmax(scratch[lane], scratch[lane + s]);
    barrier(CLK_LOCAL_MEM_FENCE);
  }
  const float r = scratch[0];
  barrier(CLK_LOCAL_MEM_FENCE);
  return r;
}

// A softmax's weight exp(d) of d = s - m <= 0, or 0 where exp(d) would be an f32 denormal (d <
// -87; exp(-87) is just above FLT_MIN, and exp never sees a lower argument; -inf gives 0, NaN NaN).
// On x86 CPUs without flush-to-zero, a denormal costs a microcode assist in exp and in each FMA
// that takes it: a decode attention over 4096 positions whose scores spread with a standard
// deviation of 16-36 ran 2-3x slower on the Xeon here. What is dropped is less than 2^-126 of a
// sum that holds 1 (the max's own weight).
#define SOFTMAX_EXP_FLOOR (-87.0f)
inline float softmax_exp(float d) {
  return d < SOFTMAX_EXP_FLOOR ? 0.0f : exp(d < SOFTMAX_EXP_FLOOR ? SOFTMAX_EXP_FLOOR : d);
}
inline float16 softmax_exp16(float16 d) {
  const int16 low = d < (float16)(SOFTMAX_EXP_FLOOR);
  return select(exp(select(d, (float16)(SOFTMAX_EXP_FLOOR), low)), (float16)(0.0f), low);
}

// Online softmax: a running max m and sum l of exp(s - m) over the scores seen so far. A block
// of scores with max block_max moves m to m_new = max(m, block_max); what was summed under the old
// max (l and the value accumulators) is multiplied by the returned factor exp(m - m_new). Zero
// while nothing was seen (m = -inf), never NaN. Weights and factors through softmax_exp.
inline float softmax_rescale(float m, float m_new) {
  return m == -INFINITY ? 0.0f : softmax_exp(m - m_new);
}

// The online softmax's step over a block of up to 16 scores held in one vector (the CPU shape's
// MLA decode, mla.cl): lanes n and past are masked out, the running max *m and sum *l move on,
// *w gets the block's weights exp(s - m_new) (0 past n), and the returned softmax_rescale factor
// is what the caller multiplies its value accumulators by.
inline float softmax_block16(float16 s, uint n, float* m, float* l, float16* w) {
  const int16 lane = (int16)(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  s = select(s, (float16)(-INFINITY), lane >= (int16)(n));
  const float8 m8 = fmax(s.lo, s.hi);
  const float4 m4 = fmax(m8.lo, m8.hi);
  const float m_new = fmax(*m, fmax(fmax(m4.x, m4.y), fmax(m4.z, m4.w)));
  const float corr = softmax_rescale(*m, m_new);
  *w = softmax_exp16(s - m_new);
  *l = *l * corr + hsum16(*w);
  *m = m_new;
  return corr;
}

// The same step for up to 16 query rows at once (attention.cl's tiles): s[r] lane j is row r's
// score of position j of the block (-INFINITY where it does not count; rows past `rows` are
// ignored), lane r of *m and *l row r's running max and sum. s[r] becomes row r's weights
// exp(s - m_new), and lane r of the result is row r's factor for what it has summed so far. The
// maxima, the factors and the sums of the 16 rows are one vector each (hmax16_x16, one vector
// exp, hsum16_x16): what one row at a time takes as 16 scalar exps and 32 reductions. `rows` is
// a constant where it is called, so rows past it compute nothing.
__attribute__((always_inline)) inline float16 softmax_rows16(float16* s, const uint rows,
                                                            float16* m, float16* l) {
#pragma unroll
  for (uint r = rows; r < 16; ++r) s[r] = (float16)(0.0f);
  const float16 m_new = fmax(*m, hmax16_x16(s));
  const float16 corr =
      select(softmax_exp16(*m - m_new), (float16)(0.0f), *m == (float16)(-INFINITY));
  float mn[16];
  vstore16(m_new, 0, mn);
#pragma unroll
  for (uint r = 0; r < 16; ++r)
    if (r < rows) s[r] = softmax_exp16(s[r] - mn[r]);
  *l = *l * corr + hsum16_x16(s);
  *m = m_new;
  return corr;
}

// One row's step of the online softmax over a tile of n scores in local memory: the running max
// *m moves to max(*m, the tile's max), *corr gets softmax_rescale's factor for what was summed.
inline void softmax_tile_max(local const float* scores, uint n, local float* m, local float* corr) {
  float tile_max = -INFINITY;
  for (uint j = 0; j < n; ++j) tile_max = fmax(tile_max, scores[j]);
  const float m_new = fmax(*m, tile_max);
  *corr = softmax_rescale(*m, m_new);
  *m = m_new;
}

// The paged caches: position p of a row lives in page lut[p / page_size] (the row's page table),
// slot p % page_size. The float offset of that slot in a cache whose pages are page_stride floats
// apart and whose slots slot_stride apart (MHA: [page][K, V][slot][kv heads][head dim]; MLA:
// [page][slot][latent | rope]).
inline size_t paged_slot(global const uint* lut, uint p, uint page_size, size_t page_stride,
                         uint slot_stride) {
  return (size_t)lut[p / page_size] * page_stride + (size_t)(p % page_size) * slot_stride;
}
