// The dot products of one TM x TN tile of f32 / bf16 / f16 weights (tile_dots), shared by
// linear.cl's tiles and moe.cl's grouped tile through #include, so a row's sums are the same
// operations whichever launch computes them. The including file defines TM, TN, NORM and
// COLUMNS_IN_TURN first (NORM and COLUMNS_IN_TURN default to 0 here).

#ifndef NORM
#define NORM 0
#endif
#ifndef COLUMNS_IN_TURN
#define COLUMNS_IN_TURN 0
#endif

// The dot products of one TM x TN tile: out[i][j] = sum_k x[i][k] (* g[k]) * w[j][k], each
// column's sum in the same order whatever the tile around it, so a fused launch gives the same
// bits as the separate ones. Rows and columns past the edge are clamped by the caller.
inline void tile_dots(global const float* xr[TM], global const wtype* wr[TN],
                      global const ntype* g, uint K, float out[TM][TN]) {
#if TM == 1 && COLUMNS_IN_TURN
  // One row (decode): the columns one after another, so the work-item reads its weight rows as
  // one sequential run of addresses, which a CPU core streams faster than runs side by side. Each
  // column's sum is the same as in the tile below. The host picks it while the x row fits in L1
  // beside the stream (KernelTuning::gemv_stream_k): past that the tile's reuse of x wins.
#pragma unroll
  for (int j = 0; j < TN; ++j) {
    float16 acc = (float16)(0.0f);
    for (uint k = 0; k < K / 16; ++k) {
#if NORM
      acc = fma(vload16(k, xr[0]) * LOADN16(k, g), LOADW16(k, wr[j]), acc);
#else
      acc = fma(vload16(k, xr[0]), LOADW16(k, wr[j]), acc);
#endif
    }
    out[0][j] = hsum16(acc);
  }
#else
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
#if NORM
    const float16 gv = LOADN16(k, g);
#endif
#pragma unroll
    for (int i = 0; i < TM; ++i) {
#if NORM
      const float16 xv = vload16(k, xr[i]) * gv;
#else
      const float16 xv = vload16(k, xr[i]);
#endif
#pragma unroll
      for (int j = 0; j < TN; ++j) acc[i][j] = fma(xv, wv[j], acc[i][j]);
    }
  }

#pragma unroll
  for (int i = 0; i < TM; ++i)
#pragma unroll
    for (int j = 0; j < TN; ++j) out[i][j] = hsum16(acc[i][j]);
#endif
  for (uint k = K / 16 * 16; k < K; ++k) {
#pragma unroll
    for (int i = 0; i < TM; ++i) {
#if NORM
      const float xk = xr[i][k] * LOADN1(g + k);
#else
      const float xk = xr[i][k];
#endif
#pragma unroll
      for (int j = 0; j < TN; ++j) out[i][j] = fma(xk, LOADW1(wr[j] + k), out[i][j]);
    }
  }
}
