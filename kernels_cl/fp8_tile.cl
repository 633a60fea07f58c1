// The dot products of one TM x TN tile of FP8 weights (e4m3fn, 128 x 128 block scales), shared by
// linear_fp8.cl's tile, moe.cl's grouped FP8 tile and mla.cl's up-projection through #include, so
// a row's sums are the same operations whichever launch computes them.
// The including file defines TM, TN and COLUMNS_IN_TURN first (tile_shape.cl), and FP8_DENORM for
// common.cl's decode; FP8_NAN_WATCH, FP8_TILE_ROWS_VARY, FP8_XS_MAX and FP8_BF16_DOT (bf16
// compute's tiles in turn) below.
//
// out[i][j] = x[i] . (W[j] * scale) over K, with K's blocks of 128 each under their scale
// (srow: the scale row of the tile's weight rows; a TN-row tile never straddles two block rows,
// TN divides 128). A block's products are summed unscaled (16 lanes) and join the running sums
// under the block's scale, one FMA per block, as DeepSeek's FP8 GEMMs promote their block sums,
// so that a one-row tile's loop is the decode and one FMA per 16 codes. Before, x was multiplied by
// the scale per 16 codes and the NaN watch below always ran. Without both, in-process A/B on the
// 2-core EPYC: one-row tiles (M = 1, 2, 3; N x K = 2048 x 2048, 7168 x 2048, 512 x 2048,
// 2048 x 512) 1.14-1.47x faster, four-row tiles (M = 8, 64) 0.97-1.00x.
// e4m3x16_decode_scaled leaves a power-of-two factor that FP8_X_SCALE (on x) and FP8_ACC_SCALE
// (on the sums) take back.
//
// Tiles with COLUMNS_IN_TURN (one to four rows) read the columns one after another: one
// sequential stream of weight bytes, as linear.cl's tile_dots (two or four streams side by side,
// even 128 bytes at a time, ran 1.3-2.4x slower on the 2-core EPYC), each weight vector decoded
// once for the tile's rows. Their x rows times FP8_X_SCALE are made once in private memory
// (Fp8TileCache) and read by every tile of the work-item on those rows, so the callers walk a row
// block's tiles together. An output's sum is the same operations whatever the tile's rows, and
// the same as in a four-row tile.
//
// NaN (0x7F / 0xFF: the "fn" variant has no infinities) is not produced by the decode. With
// -DFP8_NAN_WATCH=1 (the default) row_has_nan[j] says whether weight row j holds either byte (the
// running unsigned and signed byte maxima of the row: 0xFF is the unsigned maximum, 0x7F the signed
// one), for the caller to write NaN. The host passes 0 for weights that its load-time scan found
// free of both codes (Weight::fp8_nan_free); row_has_nan is then false.

#ifndef FP8_NAN_WATCH
#define FP8_NAN_WATCH 1
#endif
#ifndef FP8_TILE_ROWS_VARY
#define FP8_TILE_ROWS_VARY 0  // 1: tiles in turn of fewer rows than TM (fp8_tile_dots' rows)
#endif
#if FP8_TILE_ROWS_VARY && COLUMNS_IN_TURN && TM > 4
#error "fp8_tile_dots computes tiles in turn of 1-3 rows and of TM, so TM is at most 4"
#endif
#ifndef FP8_XS_MAX
#define FP8_XS_MAX 4096  // the largest K of tiles in turn (KernelTuning::gemv_stream_k)
#endif

#if FP8_NAN_WATCH
#define FP8_WATCH_DECLARE                          \
  uchar16 umax[TN];                                \
  char16 smax[TN];                                 \
  _Pragma("unroll") for (int j = 0; j < TN; ++j) { \
    umax[j] = (uchar16)(0);                        \
    smax[j] = (char16)(-128);                      \
  }
#define FP8_WATCH(j, b)          \
  umax[j] = max(umax[j], (b));   \
  smax[j] = max(smax[j], as_char16(b));
#define FP8_WATCH_RESULT(j) (any(umax[j] == (uchar16)(0xFF)) || any(smax[j] == (char16)(0x7F)))
#else
#define FP8_WATCH_DECLARE
#define FP8_WATCH(j, b)
#define FP8_WATCH_RESULT(j) false
#endif

// What a work-item's tiles keep from one tile to the next, in private memory; the callers walk a
// row block's tiles (in turn) or a column tile's row tiles (4-row tiles) together.
// - Tiles in turn: the x rows times FP8_X_SCALE (`row`: which rows, by the first one's address;
//   null: none yet). Other tiles without a panel scale their x vectors as they load them.
// - 4-row tiles with -DFP8_PANEL_K (K rounded up to 16): the column tile's TN weight rows
//   decoded once, times FP8_X_SCALE (`panel_row`: which rows, by the first one's address), with
//   their NaN watch; the tiles then read x as it is. A product x * (d * FP8_X_SCALE) is the same
//   number as (x * FP8_X_SCALE) * d, rounded once, so the sums keep their bits (while |x| < 2^28,
//   as the decode's note says). The decode and the x scaling leave the loop: in-process on the
//   2-core EPYC (bench_fp8, 2048 x 2048) M = 64 and 512 1.11-1.13x faster, M = 32 1.04x, M = 8
//   and 16 0.75-0.9x (too few row tiles to pay for the panel), hence the host's
//   kFp8PanelRowsFrom.
// Tiles in turn of 2 rows or more take their weight rows two at a time, each x vector loaded once
// for both (each column's sums the same operations either way); one-row tiles stay one stream.
// In-process A/B against one weight row at a time on the 2-core Zen 4 EPYC (dsv3-mini fp8's
// decode, bench_deepseek --tuning-ab through a throwaway switch, 7 rounds in turn): f32 compute
// batch 8 1.08x [1.05, 1.09], batch 32 1.04x [0.99, 1.05]; bf16 compute (fp8_in_turn_bf16.cl)
// batch 32 1.05x [1.04, 1.06], batch 8 1.03x [1.01, 1.05]. Pairs from one row: f32 batch 8 1.07x
// (no better), batch 1 1.01x [0.97, 1.08]; bf16 batch 1 0.98x [0.97, 0.99].
#define FP8_PAIRS_FROM_ROWS 2
#if COLUMNS_IN_TURN && TN % 2
#error "tiles in turn take their weight rows in pairs: TN even"
#endif
#if FP8_BF16_DOT && (!COLUMNS_IN_TURN || !FP8_DENORM)
#error "FP8_BF16_DOT: tiles in turn with the short decode (FP8_DENORM=1) only"
#endif

typedef struct {
#if COLUMNS_IN_TURN && FP8_BF16_DOT
  ushort16 xb[TM][FP8_XS_MAX / 16];  // the x rows times FP8_X_SCALE, rounded to bf16
  uint rows;
#elif COLUMNS_IN_TURN
  float16 x[TM][FP8_XS_MAX / 16];
  uint rows;  // how many of x's rows are made
#endif
  global const float* row;
#ifdef FP8_PANEL_K
  float16 w[TN][FP8_PANEL_K / 16];
  global const uchar* panel_row;
  bool panel_nan[TN];
#endif
} Fp8TileCache;

#if COLUMNS_IN_TURN && FP8_BF16_DOT
// bf16 compute's tiles in turn (-DFP8_BF16_DOT=1; where the host has vdpbf16ps, ops::linear_fp8's
// and the grouped experts' tiles at any row count): the sums of
// fp8_in_turn_sums below over the x rows rounded to bf16 (times FP8_X_SCALE, nearest even), 32
// products per vdpbf16ps. Each 32 codes widen to bf16 words
// (common.cl's e4m3x32_bf16_words): the code times 2^-120 as e4m3x16_decode_scaled's f32 words,
// which FP8_ACC_SCALE takes back. The codes are exact in bf16, but vdpbf16ps reads denormal
// inputs as zero: subnormal codes (below
// 2^-6 in e4m3's units; the host takes this path for weights with at most
// kFp8DenormMaxSubnormalShare of them) count as 0. A block's products join the running sums under
// its scale as in the f32 tiles. Per 32 codes the decode is 3 instructions instead of 6 and each
// row's products 1 instead of 2.
typedef int fp8_v16i __attribute__((__vector_size__(64)));
typedef float fp8_v16f __attribute__((ext_vector_type(16)));
#define FP8_BF16_TARGET __attribute__((target("avx512bf16,avx512f,avx512bw,avx512vl")))
// 32 lanes of two 16-lane halves, in order.
#define FP8_BF16_JOIN(a, b)                                                                       \
  ((fp8_v16i)__builtin_shufflevector((a), (b), 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, \
                                     15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, \
                                     30, 31))
// One function per row count R (fp8_in_turn_bf16.cl, included with FP8_BF16_ROWS = R), each
// summing R rows: a 1-row tile then costs one vdpbf16ps per 32 codes, not TM.
#define FP8_BF16_CAT(a, b) a##b
#define FP8_BF16_SUMS(r) FP8_BF16_CAT(fp8_in_turn_sums_bf16_, r)
#define FP8_BF16_ROWS TM
#include "fp8_in_turn_bf16.cl"
#undef FP8_BF16_ROWS
#if FP8_TILE_ROWS_VARY
#if TM > 1
#define FP8_BF16_ROWS 1
#include "fp8_in_turn_bf16.cl"
#undef FP8_BF16_ROWS
#endif
#if TM > 2
#define FP8_BF16_ROWS 2
#include "fp8_in_turn_bf16.cl"
#undef FP8_BF16_ROWS
#endif
#if TM > 3
#define FP8_BF16_ROWS 3
#include "fp8_in_turn_bf16.cl"
#undef FP8_BF16_ROWS
#endif
#endif
#elif COLUMNS_IN_TURN
// The sums of a tile in turn over its first R rows into out (its other rows 0), and the NaN
// watch of its weight rows; each column's row sums are reduced as the column ends, so that only
// R accumulators (2 R with the weight rows in pairs) stay live. R is a constant where
// fp8_tile_dots calls this, always inlined, so that the loops over rows unroll as over TM
// (called, with R a variable, the grouped experts had run 3x slower), and a tile of fewer rows
// than TM decodes each weight vector once for the rows it has and does no FMA for the others.
// Static, so that no external copy is compiled with R a variable: its unroll pragmas failed there,
// and PoCL's compiler printed "N warnings generated." to stderr at every build of the file.
static __attribute__((always_inline)) inline void fp8_in_turn_sums(
    const int R, const Fp8TileCache* sx, global const uchar* wr[TN], global const float* srow,
    uint K16, float out[TM][TN], bool row_has_nan[TN]) {
  FP8_WATCH_DECLARE
  // Whole blocks, then the partial last one (K % 128) with its V_TAIL vectors: the weight and x
  // pointers step a block at a time, so a whole block is loads, decodes and FMAs at constant
  // offsets with no per-vector index arithmetic.
  const uint KB_FULL = K16 / VECS_PER_BLOCK, V_TAIL = K16 - KB_FULL * VECS_PER_BLOCK;
  // Weight rows two at a time (C) from FP8_PAIRS_FROM_ROWS rows.
  const int C = R >= FP8_PAIRS_FROM_ROWS ? 2 : 1;
  // One vector of the weight rows' block: 16 codes of each decoded and summed into every x row's
  // block sums.
#define FP8_IN_TURN_VECTOR(u)                                           \
  {                                                                     \
    float16 wv[2];                                                      \
    _Pragma("unroll") for (int c = 0; c < C; ++c) {                     \
      const uchar16 b = vload16((u), wb[c]);                            \
      FP8_WATCH(j + c, b)                                               \
      wv[c] = e4m3x16_decode_scaled(b);                                 \
    }                                                                   \
    _Pragma("unroll") for (int i = 0; i < R; ++i) {                     \
      const float16 xv = xb[i][(u)];                                    \
      _Pragma("unroll") for (int c = 0; c < C; ++c) blk[c][i] =         \
          fma(xv, wv[c], blk[c][i]);                                    \
    }                                                                   \
  }
#pragma unroll
  for (int j = 0; j < TN; j += C) {
    global const uchar* wb[2];
    const float16* xb[TM];
    float16 acc[2][TM];
#pragma unroll
    for (int c = 0; c < C; ++c) wb[c] = wr[j + c];
#pragma unroll
    for (int i = 0; i < R; ++i) {
      xb[i] = sx->x[i];
#pragma unroll
      for (int c = 0; c < C; ++c) acc[c][i] = (float16)(0.0f);
    }
    for (uint kb = 0; kb < KB_FULL + (V_TAIL ? 1 : 0); ++kb) {
      float16 blk[2][TM];
#pragma unroll
      for (int c = 0; c < C; ++c)
#pragma unroll
        for (int i = 0; i < R; ++i) blk[c][i] = (float16)(0.0f);
      if (kb < KB_FULL) {
#pragma unroll
        for (int c = 0; c < C; ++c) {
#ifdef STREAM_PREFETCH
          // The block's two lines STREAM_PREFETCH bytes ahead (ops::columns_in_turn_option):
          // with the hardware prefetcher alone, a block's first load held most of the tile's
          // profile samples, and a thread of the kernel read 12-14 GB/s where a native loop of
          // the same instructions read 22 (bench_fp8, M = 1, 7168 x 2048, one PoCL thread); 8 KiB
          // ahead, 23-27. STREAM_PREFETCH_L1: the same lines nearer, into L1
          // (stream_prefetch_l1).
          PREFETCH_LINE(wb[c] + STREAM_PREFETCH);
          PREFETCH_LINE(wb[c] + STREAM_PREFETCH + 64);
#endif
#ifdef STREAM_PREFETCH_L1
          PREFETCH_LINE_L1(wb[c] + STREAM_PREFETCH_L1);
          PREFETCH_LINE_L1(wb[c] + STREAM_PREFETCH_L1 + 64);
#endif
        }
#pragma unroll
        for (uint u = 0; u < VECS_PER_BLOCK; ++u) FP8_IN_TURN_VECTOR(u)
      } else {
        for (uint u = 0; u < V_TAIL; ++u) FP8_IN_TURN_VECTOR(u)
      }
      const float16 s = (float16)(srow[kb]);
#pragma unroll
      for (int i = 0; i < R; ++i) {
#pragma unroll
        for (int c = 0; c < C; ++c) acc[c][i] = fma(blk[c][i], s, acc[c][i]);
        xb[i] += VECS_PER_BLOCK;
      }
#pragma unroll
      for (int c = 0; c < C; ++c) wb[c] += QBLOCK;
    }
#pragma unroll
    for (int c = 0; c < C; ++c)
#pragma unroll
      for (int i = 0; i < TM; ++i)
        out[i][j + c] = i < R ? hsum16(acc[c][i]) * FP8_ACC_SCALE : 0.0f;
  }
#undef FP8_IN_TURN_VECTOR
#pragma unroll
  for (int j = 0; j < TN; ++j) row_has_nan[j] = FP8_WATCH_RESULT(j);
}
#endif

// rows: how many of the tile's TM rows the caller stores; out's other rows are 0. Tiles in turn
// with FP8_TILE_ROWS_VARY compute only those rows; other tiles form every row's block sums,
// those past `rows` on repeated x rows.
inline void fp8_tile_dots(global const float* xr[TM], global const uchar* wr[TN],
                          global const float* srow, uint KB, uint K, uint rows, Fp8TileCache* sx,
                          float out[TM][TN], bool row_has_nan[TN]) {
  const uint K16 = K / 16;
#if COLUMNS_IN_TURN && FP8_BF16_DOT
  if (sx->row != xr[0] || sx->rows < rows) {
#pragma unroll
    for (int i = 0; i < TM; ++i)
      for (uint v = 0; v < K16; ++v)
        sx->xb[i][v] =
            i < rows ? f32x16_to_bf16_rne(vload16(v, xr[i]) * FP8_X_SCALE) : (ushort16)(0);
    sx->row = xr[0];
    sx->rows = rows;
  }
  {
    float flat[TM * TN];
#if TM > 1 && FP8_TILE_ROWS_VARY
    if (rows == 1)
      FP8_BF16_SUMS(1)(sx, wr, srow, K16, flat, row_has_nan);
#if TM > 2
    else if (rows == 2)
      FP8_BF16_SUMS(2)(sx, wr, srow, K16, flat, row_has_nan);
#endif
#if TM > 3
    else if (rows == 3)
      FP8_BF16_SUMS(3)(sx, wr, srow, K16, flat, row_has_nan);
#endif
    else
#endif
      FP8_BF16_SUMS(TM)(sx, wr, srow, K16, flat, row_has_nan);
    // Rows past `rows` are 0 from here on (no caller stores them).
#pragma unroll
    for (int i = 0; i < TM; ++i)
#pragma unroll
      for (int j = 0; j < TN; ++j) out[i][j] = i < rows ? flat[i * TN + j] : 0.0f;
  }
#elif COLUMNS_IN_TURN
  if (sx->row != xr[0] || sx->rows < rows) {
#pragma unroll
    for (int i = 0; i < TM; ++i)
      if (i < rows)
        for (uint v = 0; v < K16; ++v) sx->x[i][v] = vload16(v, xr[i]) * FP8_X_SCALE;
    sx->row = xr[0];
    sx->rows = rows;
  }
#if TM > 1 && FP8_TILE_ROWS_VARY
  if (rows == 1)
    fp8_in_turn_sums(1, sx, wr, srow, K16, out, row_has_nan);
#if TM > 2
  else if (rows == 2)
    fp8_in_turn_sums(2, sx, wr, srow, K16, out, row_has_nan);
#endif
#if TM > 3
  else if (rows == 3)
    fp8_in_turn_sums(3, sx, wr, srow, K16, out, row_has_nan);
#endif
  else
#endif
    fp8_in_turn_sums(TM, sx, wr, srow, K16, out, row_has_nan);
#else
  float16 acc[TM][TN];
#pragma unroll
  for (int i = 0; i < TM; ++i)
#pragma unroll
    for (int j = 0; j < TN; ++j) acc[i][j] = (float16)(0.0f);
  FP8_WATCH_DECLARE
#ifdef FP8_PANEL_K
  if (sx->panel_row != wr[0]) {
#pragma unroll
    for (int j = 0; j < TN; ++j)
      for (uint v = 0; v < K16; ++v) {
        const uchar16 b = vload16(v, wr[j]);
        FP8_WATCH(j, b)
        sx->w[j][v] = e4m3x16_decode_scaled(b) * FP8_X_SCALE;
      }
#pragma unroll
    for (int j = 0; j < TN; ++j) sx->panel_nan[j] = FP8_WATCH_RESULT(j);
    sx->panel_row = wr[0];
  }
#endif
  for (uint kb = 0; kb < KB; ++kb) {
    float16 blk[TM][TN];
#pragma unroll
    for (int i = 0; i < TM; ++i)
#pragma unroll
      for (int j = 0; j < TN; ++j) blk[i][j] = (float16)(0.0f);
    const uint v_end = min((kb + 1) * VECS_PER_BLOCK, K16);
    for (uint v = kb * VECS_PER_BLOCK; v < v_end; ++v) {
      float16 wv[TN];
#pragma unroll
      for (int j = 0; j < TN; ++j) {
#ifdef FP8_PANEL_K
        wv[j] = sx->w[j][v];
#else
        const uchar16 b = vload16(v, wr[j]);
        FP8_WATCH(j, b)
        wv[j] = e4m3x16_decode_scaled(b);
#endif
      }
#pragma unroll
      for (int i = 0; i < TM; ++i) {
#ifdef FP8_PANEL_K
        const float16 xv = vload16(v, xr[i]);
#else
        const float16 xv = vload16(v, xr[i]) * FP8_X_SCALE;
#endif
#pragma unroll
        for (int j = 0; j < TN; ++j) blk[i][j] = fma(xv, wv[j], blk[i][j]);
      }
    }
    const float16 s = (float16)(srow[kb]);
#pragma unroll
    for (int i = 0; i < TM; ++i)
#pragma unroll
      for (int j = 0; j < TN; ++j) acc[i][j] = fma(blk[i][j], s, acc[i][j]);
  }
  // Rows past `rows` are 0 from here on (no caller stores them).
#pragma unroll
  for (int i = 0; i < TM; ++i)
#pragma unroll
    for (int j = 0; j < TN; ++j) out[i][j] = i < rows ? hsum16(acc[i][j]) * FP8_ACC_SCALE : 0.0f;
#endif
  // The K % 16 tail lies inside the last K block (128 is a multiple of 16); its decode is exact
  // and NaN-aware on its own. The bf16 sums take whole blocks only: their tail is the partial
  // last block (K % 128), in f32 on x unrounded (a branch for it in the bf16 loop had made the
  // whole blocks' loop 1.2-1.3x slower).
#if COLUMNS_IN_TURN && FP8_BF16_DOT
  const uint k_tail = K / QBLOCK * QBLOCK;
#else
  const uint k_tail = K16 * 16;
#endif
  if (k_tail < K) {
    const float s_last = srow[KB - 1];
    for (uint k = k_tail; k < K; ++k) {
#pragma unroll
      for (int i = 0; i < TM; ++i) {
        if (i < rows) {
          const float xs = xr[i][k] * s_last;
#pragma unroll
          for (int j = 0; j < TN; ++j) out[i][j] = fma(xs, e4m3_to_f32(wr[j][k]), out[i][j]);
        }
      }
    }
  }
#if !COLUMNS_IN_TURN
#pragma unroll
  for (int j = 0; j < TN; ++j)
#ifdef FP8_PANEL_K
    row_has_nan[j] = sx->panel_nan[j];
#else
    row_has_nan[j] = FP8_WATCH_RESULT(j);
#endif
#endif
}

#ifdef RB
// The GPU shape's sums over one FP8 weight row for RB rows of x, one lane's share of them
// (linear_fp8.cl's linear_fp8_wg and moe.cl's grouped FP8 launch both call this, so a row's value
// is the same in either): lane `lane` of `wg` takes the 4 bytes at 4 lane, 4 (lane + wg), ... and
// then the K % 4 tail's columns lane, lane + wg, ...; each byte decoded exactly (e4m3_to_f32:
// a NaN code is NaN and poisons the sums) times its K block's scale (srow: the row's scales).
inline void fp8_lane_dots(global const float* xr[RB], global const uchar* wr,
                          global const float* srow, uint K, uint lane, uint wg, float acc[RB]) {
  for (int r = 0; r < RB; ++r) acc[r] = 0.0f;
  const uint K4 = K / 4;
  for (uint q = lane; q < K4; q += wg) {
    const uchar4 b = vload4(q, wr);
    const float s = srow[q * 4 / QBLOCK];  // QBLOCK is a multiple of 4: one block per 4 bytes
    const float4 wv = (float4)(e4m3_to_f32(b.x), e4m3_to_f32(b.y), e4m3_to_f32(b.z),
                               e4m3_to_f32(b.w)) * s;
    for (int r = 0; r < RB; ++r) {
      const float4 xv = vload4(q, xr[r]);
      acc[r] = fma(xv.x, wv.x, fma(xv.y, wv.y, fma(xv.z, wv.z, fma(xv.w, wv.w, acc[r]))));
    }
  }
  for (uint k = K4 * 4 + lane; k < K; k += wg) {
    const float wv = e4m3_to_f32(wr[k]) * srow[k / QBLOCK];
    for (int r = 0; r < RB; ++r) acc[r] = fma(xr[r][k], wv, acc[r]);
  }
}
#endif
