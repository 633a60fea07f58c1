// The bf16 sums of a tile in turn over its first FP8_BF16_ROWS rows (fp8_tile.cl's
// FP8_BF16_DOT path): FP8_BF16_SUMS(R), that is fp8_in_turn_sums_bf16_R for R = FP8_BF16_ROWS, defined each time fp8_tile.cl
// includes this file with another R. out[i * TN + j] for rows i < R, and the NaN watch of the
// weight rows.
//
// Whole blocks only (fp8_tile_dots sums the partial last one in f32). R is a literal in each copy:
// the row count as a variable, or as a constant through an always-inline helper as
// fp8_in_turn_sums takes it, made the 4-row loop 1.3-1.4x slower, and a branch for the partial
// block 1.2-1.3x (bench_fp8, 8 x 2048 x 2048).
FP8_BF16_TARGET __attribute__((noinline)) void FP8_BF16_SUMS(FP8_BF16_ROWS)(
    const Fp8TileCache* sx, global const uchar* const* wr_in, global const float* srow, uint K16,
    float* out, bool* row_has_nan) {
  global const uchar* wr[TN];
#pragma unroll
  for (int j = 0; j < TN; ++j) wr[j] = wr_in[j];
  FP8_WATCH_DECLARE
  const uint KB_FULL = K16 / VECS_PER_BLOCK;
  // Vectors u and u + 1 of row j's block into every x row's sums.
#define FP8_BF16_STEP(u, b0, b1)                                                           \
  {                                                                                        \
    FP8_WATCH(j, b0)                                                                       \
    FP8_WATCH(j, b1)                                                                       \
    const fp8_v16i wv = FP8_BF16_JOIN(e4m3x16_bf16_words(b0), e4m3x16_bf16_words(b1));    \
    _Pragma("unroll") for (int i = 0; i < FP8_BF16_ROWS; ++i) blk[i] =                    \
        __builtin_ia32_dpbf16ps_512(                                                       \
            blk[i], FP8_BF16_JOIN(sx->xb[i][x0 + (u)], sx->xb[i][x0 + (u) + 1]), wv);      \
  }
#pragma unroll
  for (int j = 0; j < TN; ++j) {
    global const uchar* wb = wr[j];
    fp8_v16f acc[FP8_BF16_ROWS];
#pragma unroll
    for (int i = 0; i < FP8_BF16_ROWS; ++i) acc[i] = (fp8_v16f)(0.0f);
    for (uint kb = 0; kb < KB_FULL; ++kb) {
      const uint x0 = kb * VECS_PER_BLOCK;
      fp8_v16f blk[FP8_BF16_ROWS];
#pragma unroll
      for (int i = 0; i < FP8_BF16_ROWS; ++i) blk[i] = (fp8_v16f)(0.0f);
#ifdef STREAM_PREFETCH
      PREFETCH_LINE(wb + STREAM_PREFETCH);
      PREFETCH_LINE(wb + STREAM_PREFETCH + 64);
#endif
#pragma unroll
      for (uint u = 0; u < VECS_PER_BLOCK; u += 2)
        FP8_BF16_STEP(u, vload16(u, wb), vload16(u + 1, wb))
      const fp8_v16f s = (fp8_v16f)(srow[kb]);
#pragma unroll
      for (int i = 0; i < FP8_BF16_ROWS; ++i) acc[i] = fma(blk[i], s, acc[i]);
      wb += QBLOCK;
    }
#pragma unroll
    for (int i = 0; i < FP8_BF16_ROWS; ++i) out[i * TN + j] = hsum16(acc[i]) * FP8_ACC_SCALE;
  }
#undef FP8_BF16_STEP
#pragma unroll
  for (int j = 0; j < TN; ++j) row_has_nan[j] = FP8_WATCH_RESULT(j);
}
