// y = alpha * x W^T (+ bias) (+ y when accumulating): the linear layers of every model.
// x: [M, K] f32 rows (row stride ldx); W: [N, K] as Hugging Face stores nn.Linear weights, f32 or
// bf16 or f16 (widened inside the loop: never a converted copy in memory), starting at
// element w_off with row stride ldw (a column slice of a bigger weight for tensor parallelism);
// y: [M, N] f32 (row stride ldy). Accumulating into y is how residual adds happen (h += o_proj(attn)).
//
// Shaped for CPU OpenCL: the inner tile is TM x TN outputs, walking K with 16-wide vector loads.
// One work-item (local size 1) owns a block of n_tiles column tiles x m_rows rows and loops over
// its tiles itself: PoCL pays about a microsecond per work-group, so a work-item per tile would
// spend more time scheduling than computing. The column tile is the outer loop, so its TN weight
// rows stay in L1 while the block's x rows stream from L2. Dimension 0 walks column blocks,
// dimension 1 row blocks. Build options: -DTM=1|4 -DTN=2|4 -DWEIGHT_TYPE=0|1|2 (f32, bf16, f16; see common.cl),
// -DCOLUMNS_IN_TURN=0|1 (one-row tiles: see tile_dots).
//
// linear_fused is the same tile with what decode runs around a GEMV folded in: up to three
// weights side by side as one output (q/k/v), the SwiGLU of gate and up in the epilogue (-DGLU=1),
// and the residual add (accumulate), already in linear. The RMSNorm before them is a launch of its
// own (ops::linear_fused).

#include "tile_shape.cl"
#ifndef GLU
#define GLU 0
#endif
#include "linear_tile.cl"

// One TM x TN tile at (m0, n0).
inline void linear_tile(global const float* x, uint x_off, uint ldx, global const wtype* w,
                        uint ldw, global const wtype* bias, int has_bias, global float* y, uint y_off,
                        uint ldy, uint M, uint N, uint K, float alpha, int accumulate, uint m0,
                        uint n0, uint pf_stride) {
  // Rows and columns past the edge compute on a valid row (clamped) and are not stored.
  global const float* xr[TM];
  global const wtype* wr[TN];
#pragma unroll
  for (int i = 0; i < TM; ++i) xr[i] = x + x_off + (size_t)min(m0 + i, M - 1) * ldx;
#pragma unroll
  for (int j = 0; j < TN; ++j) wr[j] = w + (size_t)min(n0 + j, N - 1) * ldw;
  float out[TM][TN];
  tile_dots(xr, wr, K, pf_stride, out);

#pragma unroll
  for (int i = 0; i < TM; ++i) {
    if (m0 + i >= M) break;
    global float* yr = y + y_off + (size_t)(m0 + i) * ldy;
#pragma unroll
    for (int j = 0; j < TN; ++j) {
      const uint n = n0 + j;
      if (n >= N) break;
      float v = out[i][j];
      if (has_bias) v += LOADW1(bias + n);
      v *= alpha;
      yr[n] = accumulate ? yr[n] + v : v;
    }
  }
}

kernel void linear(global const float* x, uint x_off, uint ldx,
                   global const wtype* w_base, uint w_off, uint ldw,
                   global const wtype* bias_base, uint b_off, int has_bias,
                   global float* y, uint y_off, uint ldy,
                   uint M, uint N, uint K, float alpha, int accumulate,
                   uint n_tiles, uint m_rows) {
  const uint n_begin = get_global_id(0) * n_tiles * TN;
  const uint n_end = min(n_begin + n_tiles * TN, N);
  const uint m_begin = get_global_id(1) * m_rows;
  const uint m_end = min(m_begin + m_rows, M);
  global const wtype* w = w_base + w_off;
  global const wtype* bias = bias_base + b_off;
  const uint pf_end = prefetch_end(n_end, N, get_global_size(1));  // row blocks: dimension 1
  for (uint n0 = n_begin; n0 < n_end; n0 += TN)
    for (uint m0 = m_begin; m0 < m_end; m0 += TM)  // the next tile's rows, while this one's stream
      linear_tile(x, x_off, ldx, w, ldw, bias, has_bias, y, y_off, ldy, M, N, K, alpha, accumulate,
                  m0, n0, m0 == m_begin && n0 + TN < pf_end ? TN * ldw : 0);
}

// y[m, :N] (+)= alpha * (x[m] [W0; W1; W2]^T), or with GLU y[m, n] = silu(x[m] . gate[n]) *
// (x[m] . up[n]) for n < N. Launch as linear: dimension 0 walks blocks of n_tiles column tiles
// (each tile TN output columns, TN / 2 with GLU), dimension 1 blocks of m_rows rows.
kernel void linear_fused(global const float* x, uint x_off, uint ldx,
                         global const wtype* w0, uint w0_off, uint ldw0, uint n1,
                         global const wtype* w1, uint w1_off, uint ldw1, uint n2,
                         global const wtype* w2, uint w2_off, uint ldw2,
                         global float* y, uint y_off, uint ldy, uint M, uint N, uint K,
                         float alpha, int accumulate, uint n_tiles, uint m_rows) {
#if GLU
  const uint tile_cols = TN / 2;  // TN dot products per row: TN / 2 gate, TN / 2 up
#else
  const uint tile_cols = TN;
#endif
  const uint n_begin = get_global_id(0) * n_tiles * tile_cols;
  const uint n_end = min(n_begin + n_tiles * tile_cols, N);
  const uint m_begin = get_global_id(1) * m_rows;
  const uint m_end = min(m_begin + m_rows, M);
  w0 += w0_off;
  w1 += w1_off;
  w2 += w2_off;
  const uint pf_end = prefetch_end(n_end, N, get_global_size(1));  // row blocks: dimension 1
  for (uint m0 = m_begin; m0 < m_end; m0 += TM) {
    global const float* xr[TM];
#pragma unroll
    for (int i = 0; i < TM; ++i) xr[i] = x + x_off + (size_t)min(m0 + i, M - 1) * ldx;
    for (uint n0 = n_begin; n0 < n_end; n0 += tile_cols) {
      global const wtype* wr[TN];
#pragma unroll
      for (int j = 0; j < TN; ++j) {
#if GLU
        const uint c = min(n0 + j % tile_cols, N - 1);
        wr[j] = j < tile_cols ? w0 + (size_t)c * ldw0 : w1 + (size_t)c * ldw1;
#else
        wr[j] = fused_row(min(n0 + j, N - 1), w0, ldw0, n1, w1, ldw1, n2, w2, ldw2);
#endif
      }
      float out[TM][TN];
      // The next tile's rows (GLU: the next gate and up rows), while this one's stream.
      tile_dots(xr, wr, K, m0 == m_begin && n0 + tile_cols < pf_end ? tile_cols * ldw0 : 0, out);
#if GLU
      float act[ROUND16(TM * (TN / 2))];
      silu_tile(&out[0][0], TN, TM, TN / 2, act);
#endif
#pragma unroll
      for (int i = 0; i < TM; ++i) {
        if (m0 + i >= M) break;
        global float* yr = y + y_off + (size_t)(m0 + i) * ldy;
#pragma unroll
        for (int j = 0; j < tile_cols; ++j) {
          const uint n = n0 + j;
          if (n >= N) break;
#if GLU
          float v = act[i * tile_cols + j] * out[i][j + tile_cols];
#else
          float v = out[i][j];
#endif
          v *= alpha;
          yr[n] = accumulate ? yr[n] + v : v;
        }
      }
    }
  }
}
