// The dot products of one TM x TN tile of f32 / bf16 / f16 weights (tile_dots), shared by
// linear.cl's tiles, moe.cl's grouped tile and mla.cl's up-projection through #include, so a row's
// sums are the same operations whichever launch computes them.
// The including file defines TM, TN and COLUMNS_IN_TURN first (tile_shape.cl).

// The dot products of one TM x TN tile: out[i][j] = sum_k x[i][k] * w[j][k], each
// column's sum in the same order whatever the tile around it, so a fused launch gives the same
// bits as the separate ones. Rows and columns past the edge are clamped by the caller.
// pf_stride (elements; 0: none): while a tile of several rows (TM > 1: batched decode, prefill)
// streams its weight rows, the lines at wr[j] + pf_stride are prefetched (PREFETCH_LINE), i.e. the
// rows of the work-item's next tile. Such a tile computes TM x TN dot products per weight line,
// so it reads the TN rows side by side slower than the hardware prefetcher would run ahead of
// a stream, and each row of 2048 bf16 is one page, where that prefetcher starts over. Measured on
// the 2-core EPYC (bf16 weights, every launch on its own copy, 40 interleaved pairs, medians;
// with prefetcht0 then, which common.cl's PREFETCH_LINE has since replaced by prefetcht1):
// N=16384 K=2048 M=4/8/16/32 2.39/3.41/5.15/8.38 -> 2.14/2.94/4.50/7.56 ms, N=3072 K=2048 M=8
// 0.68 -> 0.59 ms, N=2048 K=8192 M=8 1.41 -> 1.34 ms. One-row tiles side by side gained nothing
// (M=1 K=8192 0.92-0.99 ms either way) and are left without it. One-row tiles in turn prefetch
// for gate/up only (GLU): llama3-1b's decode step at batch 1 (bench_decode_breakdown
// --prefetch-ab, prefetcht1, off/on) ran gate/up 1.19-1.33x and the whole step 1.02-1.08x faster
// in 3 runs, while q/k/v and o_proj, single runs of consecutive rows, were 17-24% slower with it.
#if TM == 1 && COLUMNS_IN_TURN
// The prefetch of a one-row tile in turn at step k of weight row wr (one per 64-byte line).
inline void in_turn_prefetch(global const wtype* wr, uint k, uint pf_stride) {
  if ((k * 16 * sizeof(wtype)) % 64 != 0) return;
#if PREFETCH_X86 && defined(GLU) && GLU
  // Gate/up (GLU) alternates page-long runs of two matrices, which the hardware prefetcher
  // does not follow: there the next tile's lines are prefetched too.
  if (pf_stride) PREFETCH_LINE(wr + pf_stride + k * 16);
#else
#ifdef GEMV_STREAM_PREFETCH
  // The line GEMV_STREAM_PREFETCH bytes ahead in the work-item's run of rows
  // (KernelTuning::gemv_stream_prefetch): on the Xeon with AMX the hardware prefetcher alone
  // left a bf16 decode step 1.19-1.45x slower (kernel_tuning.cpp).
  PREFETCH_LINE((global const uchar*)(wr + k * 16) + GEMV_STREAM_PREFETCH);
#endif
#ifdef STREAM_PREFETCH_L1
  // And, as FP8's stream (fp8_tile.cl), the line STREAM_PREFETCH_L1 bytes ahead into L1
  // (KernelTuning::stream_prefetch_l1).
  PREFETCH_LINE_L1((global const uchar*)(wr + k * 16) + STREAM_PREFETCH_L1);
#endif
#endif
}
#endif

inline void tile_dots(global const float* xr_in[TM], global const wtype* wr_in[TN],
                      uint K, uint pf_stride, float out[TM][TN]) {
  // The row pointers as locals: the prefetch is a volatile asm statement, which the compiler
  // must assume writes memory, so pointers read through the caller's arrays were loaded again
  // after every prefetch (8 loads per step of a 4 x 4 tile). llama3-1b's batch-8 decode steps
  // (bench_llama --tuning-ab, in turn in one process, two runs of 7 and 9 rounds) 1.03x and
  // 1.04x faster; batch 1 and the prefill unchanged (0.99-1.00x).
  global const float* xr[TM];
  global const wtype* wr[TN];
#pragma unroll
  for (int i = 0; i < TM; ++i) xr[i] = xr_in[i];
#pragma unroll
  for (int j = 0; j < TN; ++j) wr[j] = wr_in[j];
#if TM == 1 && COLUMNS_IN_TURN && GEMV_ROW_PAIRS && TN % 2 == 0
  // One row (decode), the columns two at a time (KernelTuning::gemv_row_pairs): each column's sum
  // is the same FMAs in the same order as below, but two independent chains are in flight, where
  // one chain (an FMA's latency per 16 weights) had bounded the stream. Both rows prefetch as one
  // row does.
#pragma unroll
  for (int j = 0; j < TN; j += 2) {
    float16 acc0 = (float16)(0.0f), acc1 = (float16)(0.0f);
    for (uint k = 0; k < K / 16; ++k) {
      const float16 xv = vload16(k, xr[0]);
      acc0 = fma(xv, LOADW16(k, wr[j]), acc0);
      acc1 = fma(xv, LOADW16(k, wr[j + 1]), acc1);
      in_turn_prefetch(wr[j], k, pf_stride);
      in_turn_prefetch(wr[j + 1], k, pf_stride);
    }
    out[0][j] = hsum16(acc0);
    out[0][j + 1] = hsum16(acc1);
  }
#elif TM == 1 && COLUMNS_IN_TURN
  // One row (decode): the columns one after another, so the work-item reads its weight rows as
  // one sequential run of addresses, which a CPU core streams faster than runs side by side. Each
  // column's sum is the same as in the tile below. The host picks it while the x row fits in L1
  // beside the stream (KernelTuning::gemv_stream_k): past that the tile's reuse of x wins.
#pragma unroll
  for (int j = 0; j < TN; ++j) {
    float16 acc = (float16)(0.0f);
    for (uint k = 0; k < K / 16; ++k) {
      acc = fma(vload16(k, xr[0]), LOADW16(k, wr[j]), acc);
      in_turn_prefetch(wr[j], k, pf_stride);
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
#if PREFETCH_X86 && TM > 1
    // One prefetch per 64-byte line: every 64 / (16 * sizeof(wtype)) steps.
    if (pf_stride && (k * 16 * sizeof(wtype)) % 64 == 0) {
#pragma unroll
      for (int j = 0; j < TN; ++j) PREFETCH_LINE(wr[j] + pf_stride + k * 16);
    }
#endif
#pragma unroll
    for (int i = 0; i < TM; ++i) {
      const float16 xv = vload16(k, xr[i]);
#pragma unroll
      for (int j = 0; j < TN; ++j) acc[i][j] = fma(xv, wv[j], acc[i][j]);
    }
  }

#if TM * TN >= 8
  // 16 sums at a time (common.cl's hsum16_x16, hsum16's bits), row-major; from 8 sums on it takes
  // fewer instructions than hsum16 one by one. With silu_tile's copy unrolled, the 512-row f32
  // compute GEMMs ran 1.00-1.01x (q/k/v, o, down) and 1.03x (gate|up with SwiGLU) faster, and
  // batches of 1 and 8 alike (in-process A/B, 11-25 pairs, on the 2-core EPYC).
  float16 flat[ROUND16(TM * TN)];
#pragma unroll
  for (int p = 0; p < ROUND16(TM * TN); ++p)
    flat[p] = p < TM * TN ? acc[p / TN][p % TN] : (float16)(0.0f);
#pragma unroll
  for (int p = 0; p < TM * TN; p += 16) {
    float sums[16];
    vstore16(hsum16_x16(flat + p), 0, sums);
#pragma unroll
    for (int q = 0; q < 16 && p + q < TM * TN; ++q) out[(p + q) / TN][(p + q) % TN] = sums[q];
  }
#else
#pragma unroll
  for (int i = 0; i < TM; ++i)
#pragma unroll
    for (int j = 0; j < TN; ++j) out[i][j] = hsum16(acc[i][j]);
#endif
#endif
  for (uint k = K / 16 * 16; k < K; ++k) {
#pragma unroll
    for (int i = 0; i < TM; ++i) {
      const float xk = xr[i][k];
#pragma unroll
      for (int j = 0; j < TN; ++j) out[i][j] = fma(xk, LOADW1(wr[j] + k), out[i][j]);
    }
  }
}
