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
// -DCOLUMNS_IN_TURN=0|1 (one-row tiles: see tile_dots); linear_fused_chunked -DTM=8 -DK_CHUNK.
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
  for (uint n0 = n_begin; n0 < n_end; n0 += TN)
    for (uint m0 = m_begin; m0 < m_end; m0 += TM)  // the next tile's rows, while this one's stream
      linear_tile(x, x_off, ldx, w, ldw, bias, has_bias, y, y_off, ldy, M, N, K, alpha, accumulate,
                  m0, n0, m0 == m_begin && n0 + TN < n_end ? TN * ldw : 0);
}

// linear_fused's tile columns n0..: its TN weight rows (with GLU TN / 2 gate rows, then the same
// columns' up rows), those past N clamped.
inline void fused_tile_rows(uint n0, uint N, global const wtype* w0, uint ldw0, uint n1,
                            global const wtype* w1, uint ldw1, uint n2, global const wtype* w2,
                            uint ldw2, global const wtype* wr[TN]) {
#pragma unroll
  for (int j = 0; j < TN; ++j) {
#if GLU
    const uint c = min(n0 + j % (TN / 2), N - 1);
    wr[j] = j < TN / 2 ? w0 + (size_t)c * ldw0 : w1 + (size_t)c * ldw1;
#else
    wr[j] = fused_row(min(n0 + j, N - 1), w0, ldw0, n1, w1, ldw1, n2, w2, ldw2);
#endif
  }
}

// Stores a linear_fused tile at (m0, n0): alpha * out (with GLU silu(gate) * up), added to y when
// accumulating; rows past M and columns past N are not stored.
inline void fused_tile_store(float out[TM][TN], global float* y, uint y_off, uint ldy, uint M,
                             uint N, float alpha, int accumulate, uint m0, uint n0) {
#if GLU
  const uint tile_cols = TN / 2;
  float act[ROUND16(TM * (TN / 2))];
  silu_tile(&out[0][0], TN, TM, TN / 2, act);
#else
  const uint tile_cols = TN;
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
  for (uint m0 = m_begin; m0 < m_end; m0 += TM) {
    global const float* xr[TM];
#pragma unroll
    for (int i = 0; i < TM; ++i) xr[i] = x + x_off + (size_t)min(m0 + i, M - 1) * ldx;
    for (uint n0 = n_begin; n0 < n_end; n0 += tile_cols) {
      global const wtype* wr[TN];
      fused_tile_rows(n0, N, w0, ldw0, n1, w1, ldw1, n2, w2, ldw2, wr);
      float out[TM][TN];
      // The next tile's rows (GLU: the next gate and up rows), while this one's stream.
      tile_dots(xr, wr, K, m0 == m_begin && n0 + tile_cols < n_end ? tile_cols * ldw0 : 0, out);
      fused_tile_store(out, y, y_off, ldy, M, N, alpha, accumulate, m0, n0);
    }
  }
}

#ifdef K_CHUNK
// linear_fused for a batch of up to TM = 8 rows (batched decode; the host builds it with -DTM=8,
// -DTN=4 and -DK_CHUNK, KernelTuning::batch_chunk_k). A work-item's column tiles walk K together
// in chunks of K_CHUNK elements, and each tile runs its two 4-row halves over a chunk one after
// the other: the weights' chunk streams from memory once for the whole batch and is read again
// from L1 (4-row tiles over the whole K read every weight row once per row tile, the second time
// mostly from L2 or memory), and the rows' chunk (8 x 512 floats: 16 KB) stays in L1 across the
// tiles. A tile's lane sums wait in private memory between chunks; each lane still adds its
// products in k's order, and tile_reduce and tile_tail finish them, so the bits are
// linear_fused's. While a tile streams a chunk, the lines of the next tile's chunk (the last tile:
// the first tile's next chunk) are prefetched: a chunk's run of a row is short (1 KB of bf16 at
// 512), and without it the tiles waited on the weight loads (0.72-0.94x the 4-row tiles).
// On the 2-core EPYC (bf16 weights streamed from memory, in-process A/B against the 4-row tiles,
// 5 rounds, the same bits), M = 8: 2048 x 2048, 3072 x 2048, 2048 x 8192, 16384 x 2048 and the
// GLU launch 2 x 8192 x 2048 1.12-1.33x (medians of two runs; 1.09-1.25x at 1024); M = 5
// 1.08-1.24x. One pass of 8 x 3 tiles (24 sums in registers) at 1024 ran 1.13-1.37x, but GLU
// needs an even TN and 8 x 4's 32 sums spill (GLU 1.03x).
// Launch: global (column blocks); n_tiles column tiles per work-item, at most CHUNK_TILES.
#define K_CHUNK16 (K_CHUNK / 16)
#define CHUNK_TILES 16
#define PASS_M 4
kernel void linear_fused_chunked(global const float* x, uint x_off, uint ldx,
                                 global const wtype* w0, uint w0_off, uint ldw0, uint n1,
                                 global const wtype* w1, uint w1_off, uint ldw1, uint n2,
                                 global const wtype* w2, uint w2_off, uint ldw2,
                                 global float* y, uint y_off, uint ldy, uint M, uint N, uint K,
                                 float alpha, int accumulate, uint n_tiles) {
#if GLU
  const uint tile_cols = TN / 2;
#else
  const uint tile_cols = TN;
#endif
  const uint n_begin = get_global_id(0) * n_tiles * tile_cols;
  const uint n_end = min(n_begin + n_tiles * tile_cols, N);
  const uint tiles = min((n_end - n_begin + tile_cols - 1) / tile_cols, (uint)CHUNK_TILES);
  w0 += w0_off;
  w1 += w1_off;
  w2 += w2_off;
  global const float* xr[TM];
#pragma unroll
  for (int i = 0; i < TM; ++i) xr[i] = x + x_off + (size_t)min((uint)i, M - 1) * ldx;
  float16 sums[CHUNK_TILES][TM][TN];
  for (uint t = 0; t < tiles; ++t)
#pragma unroll
    for (int i = 0; i < TM; ++i)
#pragma unroll
      for (int j = 0; j < TN; ++j) sums[t][i][j] = (float16)(0.0f);
  const uint K16 = K / 16;
  for (uint k0 = 0; k0 < K16; k0 += K_CHUNK16) {
    const uint k1 = min(k0 + K_CHUNK16, K16);
    for (uint t = 0; t < tiles; ++t) {
      global const wtype* wr[TN];
      global const wtype* pf[TN];
      fused_tile_rows(n_begin + t * tile_cols, N, w0, ldw0, n1, w1, ldw1, n2, w2, ldw2, wr);
      const bool last = t + 1 == tiles;
      fused_tile_rows(last ? n_begin : n_begin + (t + 1) * tile_cols, N, w0, ldw0, n1, w1, ldw1,
                      n2, w2, ldw2, pf);
      const uint pf_k = last ? K_CHUNK : 0;
      for (uint p = 0; p < TM; p += PASS_M) {
        float16 acc[PASS_M][TN];
#pragma unroll
        for (int i = 0; i < PASS_M; ++i)
#pragma unroll
          for (int j = 0; j < TN; ++j) acc[i][j] = sums[t][p + i][j];
        for (uint k = k0; k < k1; ++k) {
          float16 wv[TN];
#pragma unroll
          for (int j = 0; j < TN; ++j) wv[j] = LOADW16(k, wr[j]);
#if PREFETCH_X86
          if (p == 0 && (k * 16 * sizeof(wtype)) % 64 == 0) {
#pragma unroll
            for (int j = 0; j < TN; ++j) PREFETCH_LINE(pf[j] + pf_k + k * 16);
          }
#endif
#pragma unroll
          for (int i = 0; i < PASS_M; ++i) {
            const float16 xv = vload16(k, xr[p + i]);
#pragma unroll
            for (int j = 0; j < TN; ++j) acc[i][j] = fma(xv, wv[j], acc[i][j]);
          }
        }
#pragma unroll
        for (int i = 0; i < PASS_M; ++i)
#pragma unroll
          for (int j = 0; j < TN; ++j) sums[t][p + i][j] = acc[i][j];
      }
    }
  }
  for (uint t = 0; t < tiles; ++t) {
    const uint n0 = n_begin + t * tile_cols;
    global const wtype* wr[TN];
    fused_tile_rows(n0, N, w0, ldw0, n1, w1, ldw1, n2, w2, ldw2, wr);
    float out[TM][TN];
    tile_reduce(sums[t], out);
    tile_tail(xr, wr, K, out);
    fused_tile_store(out, y, y_off, ldy, M, N, alpha, accumulate, 0, n0);
  }
}
#endif
