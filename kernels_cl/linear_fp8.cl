// FP8 (e4m3fn) weights with 128x128 block scales, as DeepSeek-V3's FP8 checkpoints store them:
// W ~= e4m3(W_q[n, k]) * scale_inv[n / 128, k / 128] (the "inv" scale MULTIPLIES).
//
// linear_fp8: y = alpha * x W^T (+ y when accumulating). x: [M, K] f32 rows (stride ldx); W: [N, K]
// bytes; scale: f32 [ceil(N/128), KB = ceil(K/128)]; y: [M, N] f32 (stride ldy). The bytes are
// decoded in registers right before the FMA, so the weights stream at 1 byte per element.
// Tiling as linear.cl: TM x TN tiles of y walking K with 16-wide loads; a work-item (local size 1
// on CPU) owns a block of them; dimension 0 walks column blocks, dimension 1 row blocks.
//
// dequantize_fp8: out[N, K] f32 = e4m3(W) * scale, one work-item per row; with -DOUT_BF16=1 the
// same rounded to bf16 (nearest even), for the bf16-compute GEMM (model.compute_dtype: bf16).
//
// Build options: -DTM=1..4 -DTN=4 -DFP8_DENORM=1|0, -DCOLUMNS_IN_TURN=0|1 -DFP8_NAN_WATCH=0|1
// -DFP8_XS_MAX (fp8_tile.cl), -DOUT_BF16=0|1 (dequantize_fp8),
// -DWG -DRB (linear_fp8_wg, the GPU shape).
//
// At one byte per weight a GEMV's instructions, more than memory, set its time (on the 2-core EPYC
// the one-row GEMV with every weight row in L1 ran only 1.2-1.5x faster than streamed), so the
// loop is the decode (common.cl's e4m3x16_decode_scaled, FP8_DENORM chosen per device) and one
// FMA. The tile's sums and its NaN watch are fp8_tile.cl's, shared with moe.cl's grouped FP8 tile.

#include "tile_shape.cl"
#define FP8_TILE_ROWS_VARY 1  // the last row block of a launch may have fewer rows than TM
#include "fp8_tile.cl"

// One TM x TN tile at (m0, n0).
inline void linear_fp8_tile(global const float* x, uint x_off, uint ldx, global const uchar* w,
                            global const float* scale, uint KB, global float* y, uint y_off,
                            uint ldy, uint M, uint N, uint K, float alpha, int accumulate,
                            uint m0, uint n0, Fp8TileCache* sx) {
  // Rows and columns past the edge compute on a valid row (clamped) and are not stored. The
  // clamped rows stay inside n0's group of TN, so every row of the tile shares one scale row.
  global const float* xr[TM];
  global const uchar* wr[TN];
#pragma unroll
  for (int i = 0; i < TM; ++i) xr[i] = x + x_off + (size_t)min(m0 + i, M - 1) * ldx;
#pragma unroll
  for (int j = 0; j < TN; ++j) wr[j] = w + (size_t)min(n0 + j, N - 1) * K;
  global const float* srow = fp8_scale_row(scale, n0, KB);
  float out[TM][TN];
  bool row_has_nan[TN];
  fp8_tile_dots(xr, wr, srow, KB, K, min((uint)TM, M - m0), sx, out, row_has_nan);

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

// A work-item owns n_tiles column tiles x m_rows rows and loops over its tiles: PoCL pays about a
// microsecond per work-group, which at one byte per weight is as long as streaming a few
// 2048-wide rows. Column tile outer, so its TN weight rows stay in L1 while the rows use them;
// tiles in turn (up to 4 rows each; the host's kFp8InTurnTileRows) take the row blocks outer
// instead, so that the scaled x copy (fp8_tile.cl) is made once per row block.
// Two weights side by side (ops::linear_fp8_pair): y's columns [0, n1) are x w^T, [n1, N)
// x w1^T, n1 a multiple of TN so that no tile straddles them; each tile is linear_fp8_tile on its
// own weight and scales, the same operations as a launch of that weight alone. One weight: w1 = w,
// scale1 = scale, n1 = N.
kernel void linear_fp8(global const float* x, uint x_off, uint ldx,
                       global const uchar* w, global const float* scale, uint KB,
                       global float* y, uint y_off, uint ldy,
                       uint M, uint N, uint K, float alpha, int accumulate,
                       uint n_tiles, uint m_rows,
                       global const uchar* w1, global const float* scale1, uint n1) {
  const uint n_begin = get_global_id(0) * n_tiles * TN;
  const uint n_end = min(n_begin + n_tiles * TN, N);
  const uint m_begin = get_global_id(1) * m_rows;
  const uint m_end = min(m_begin + m_rows, M);
  Fp8TileCache sx;
  sx.row = 0;
#ifdef FP8_PANEL_K
  sx.panel_row = 0;
#endif
#if COLUMNS_IN_TURN
  for (uint m0 = m_begin; m0 < m_end; m0 += TM)
    for (uint n0 = n_begin; n0 < n_end; n0 += TN)
#else
  for (uint n0 = n_begin; n0 < n_end; n0 += TN)
    for (uint m0 = m_begin; m0 < m_end; m0 += TM)
#endif
      if (n0 < n1)
        linear_fp8_tile(x, x_off, ldx, w, scale, KB, y, y_off, ldy, M, n1, K, alpha, accumulate,
                        m0, n0, &sx);
      else
        linear_fp8_tile(x, x_off, ldx, w1, scale1, KB, y, y_off + n1, ldy, M, N - n1, K, alpha,
                        accumulate, m0, n0 - n1, &sx);
}

#ifdef WG
#include "wg_rows.cl"
// The GPU shape of linear_fp8 (linear_wg.cl's layout for one byte per weight): a work-group of WG
// lanes owns one output feature n for up to RB rows; each lane sums its share of the row
// (fp8_tile.cl's fp8_lane_dots: a 32-lane warp reads 128 consecutive bytes, every byte decoded
// exactly, so NaN codes poison their feature through the sums), and the lanes' partial sums meet
// in local memory and are stored as linear_wg's (wg_rows.cl). Build options: -DWG (a power of
// two), -DRB.
// Launch: global (N * WG, ceil(M / RB)), local (WG, 1).
kernel __attribute__((reqd_work_group_size(WG, 1, 1)))
void linear_fp8_wg(global const float* x, uint x_off, uint ldx,
                   global const uchar* w, global const float* scale, uint KB,
                   global float* y, uint y_off, uint ldy,
                   uint M, uint N, uint K, float alpha, int accumulate) {
  local float partial[RB * WG];
  const uint lane = get_local_id(0);
  const uint n = get_group_id(0);
  const uint m0 = get_group_id(1) * RB;
  global const float* xr[RB];
  wg_x_rows(x, x_off, ldx, m0, M, xr);  // fp8_lane_dots sums every row; those past M not stored
  float acc[RB];
  fp8_lane_dots(xr, w + (size_t)n * K, fp8_scale_row(scale, n, KB), K, lane, WG, acc);
  float v;
  if (wg_row_sum(partial, acc, WG, lane, m0, M, &v))
    wg_store(y, y_off, ldy, m0 + lane, n, v, alpha, accumulate);
}
#endif

// Launch: global (N).
#if OUT_BF16
#define DEQ_OUT ushort
#define DEQ_STORE16(v) f32x16_to_bf16_rne(v)
#define DEQ_STORE(v) f32_to_bf16_rne(v)
#else
#define DEQ_OUT float
#define DEQ_STORE16(v) (v)
#define DEQ_STORE(v) (v)
#endif
kernel void dequantize_fp8(global const uchar* w, global const float* scale, uint KB,
                           global DEQ_OUT* out, uint N, uint K) {
  const uint n = get_global_id(0);
  global const uchar* wr = w + (size_t)n * K;
  global const float* srow = fp8_scale_row(scale, n, KB);
  global DEQ_OUT* o = out + (size_t)n * K;
  const uint K16 = K / 16;
  for (uint v = 0; v < K16; ++v)
    vstore16(DEQ_STORE16(e4m3x16_dequant(wr, srow, v)), v, o);
  for (uint k = K16 * 16; k < K; ++k) o[k] = DEQ_STORE(e4m3_dequant(wr, srow, k));
}

// The GPU shape: a work-item per 16 columns of a row (the last one takes the K % 16 tail), so
// neighbouring lanes read neighbouring bytes. The same decode and product per element: the same
// bits as dequantize_fp8. Launch: global (ceil(K / 16) rounded up to the work-group, N).
kernel void dequantize_fp8_wg(global const uchar* w, global const float* scale, uint KB,
                              global DEQ_OUT* out, uint N, uint K) {
  const uint v = get_global_id(0), n = get_global_id(1);
  const uint K16 = K / 16;
  global const uchar* wr = w + (size_t)n * K;
  global const float* srow = fp8_scale_row(scale, n, KB);
  global DEQ_OUT* o = out + (size_t)n * K;
  if (v < K16) {
    vstore16(DEQ_STORE16(e4m3x16_dequant(wr, srow, v)), v, o);
  } else if (v == K16) {
    for (uint k = K16 * 16; k < K; ++k) o[k] = DEQ_STORE(e4m3_dequant(wr, srow, k));
  }
}
