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
// dimension 1 row blocks. Build options: -DTM=1|4 -DTN=4 -DWEIGHT_TYPE=0|1|2 (f32, bf16, f16; see common.cl).

#ifndef TM
#define TM 1
#endif
#ifndef TN
#define TN 4
#endif


// One TM x TN tile at (m0, n0).
inline void linear_tile(global const float* x, uint x_off, uint ldx, global const wtype* w,
                        uint ldw, global const wtype* bias, int has_bias, global float* y, uint y_off,
                        uint ldy, uint M, uint N, uint K, float alpha, int accumulate, uint m0,
                        uint n0) {
  // Rows and columns past the edge compute on a valid row (clamped) and are not stored.
  global const float* xr[TM];
  global const wtype* wr[TN];
#pragma unroll
  for (int i = 0; i < TM; ++i) xr[i] = x + x_off + (size_t)min(m0 + i, M - 1) * ldx;
#pragma unroll
  for (int j = 0; j < TN; ++j) wr[j] = w + (size_t)min(n0 + j, N - 1) * ldw;

  float16 acc[TM][TN];
#pragma unroll
  for (int i = 0; i < TM; ++i)
#pragma unroll
    for (int j = 0; j < TN; ++j) acc[i][j] = (float16)(0.0f);

  const uint K16 = K / 16;
  for (uint k = 0; k < K16; ++k) {
    float16 wv[TN];
#pragma unroll
    for (int j = 0; j < TN; ++j) wv[j] = LOADW16(k, wr[j]);
#pragma unroll
    for (int i = 0; i < TM; ++i) {
      const float16 xv = vload16(k, xr[i]);
#pragma unroll
      for (int j = 0; j < TN; ++j) acc[i][j] = fma(xv, wv[j], acc[i][j]);
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
      out[i][j] = s2.x + s2.y;
    }
  for (uint k = K16 * 16; k < K; ++k) {
#pragma unroll
    for (int i = 0; i < TM; ++i)
#pragma unroll
      for (int j = 0; j < TN; ++j) out[i][j] = fma(xr[i][k], LOADW1(wr[j] + k), out[i][j]);
  }

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
    for (uint m0 = m_begin; m0 < m_end; m0 += TM)
      linear_tile(x, x_off, ldx, w, ldw, bias, has_bias, y, y_off, ldy, M, N, K, alpha, accumulate,
                  m0, n0);
}
