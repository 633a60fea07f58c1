// The bf16 sums of a tile in turn over its first FP8_BF16_ROWS rows (fp8_tile.cl's FP8_BF16_DOT
// path): FP8_BF16_SUMS(R), i.e. fp8_in_turn_sums_bf16_R for R = FP8_BF16_ROWS, defined each time
// fp8_tile.cl includes this file with another R. out[i * TN + j] for rows i < R, and the NaN watch
// of the weight rows.
//
// Whole blocks only (fp8_tile_dots sums the partial last one in f32). R is a literal in each copy:
// the row count as a variable, or as a constant through an always-inline helper as
// fp8_in_turn_sums takes it, made the 4-row loop 1.3-1.4x slower, and a branch for the partial
// block 1.2-1.3x (bench_fp8, 8 x 2048 x 2048).
//
// Weight rows two at a time (FP8_BF16_COLS) from fp8_tile.cl's FP8_PAIRS_FROM_ROWS rows: the
// 4-row loop is bound by its loads and shuffles more than by its vdpbf16ps.
#if FP8_BF16_ROWS >= FP8_PAIRS_FROM_ROWS
#define FP8_BF16_COLS 2
#if TN % 2
#error "FP8_BF16_COLS 2: TN even"
#endif
#else
#define FP8_BF16_COLS 1
#endif
FP8_BF16_TARGET __attribute__((noinline)) void FP8_BF16_SUMS(FP8_BF16_ROWS)(
    const Fp8TileCache* sx, global const uchar* const* wr_in, global const float* srow, uint K16,
    float* out, bool* row_has_nan) {
  global const uchar* wr[TN];
#pragma unroll
  for (int j = 0; j < TN; ++j) wr[j] = wr_in[j];
  FP8_WATCH_DECLARE
  const uint KB_FULL = K16 / VECS_PER_BLOCK;
#pragma unroll
  for (int j = 0; j < TN; j += FP8_BF16_COLS) {
    global const uchar* wb[FP8_BF16_COLS];
    fp8_v16f acc[FP8_BF16_COLS][FP8_BF16_ROWS];
#pragma unroll
    for (int c = 0; c < FP8_BF16_COLS; ++c) {
      wb[c] = wr[j + c];
#pragma unroll
      for (int i = 0; i < FP8_BF16_ROWS; ++i) acc[c][i] = (fp8_v16f)(0.0f);
    }
    for (uint kb = 0; kb < KB_FULL; ++kb) {
      const uint x0 = kb * VECS_PER_BLOCK;
      fp8_v16f blk[FP8_BF16_COLS][FP8_BF16_ROWS];
#pragma unroll
      for (int c = 0; c < FP8_BF16_COLS; ++c) {
#pragma unroll
        for (int i = 0; i < FP8_BF16_ROWS; ++i) blk[c][i] = (fp8_v16f)(0.0f);
#ifdef STREAM_PREFETCH
        PREFETCH_LINE(wb[c] + STREAM_PREFETCH);
        PREFETCH_LINE(wb[c] + STREAM_PREFETCH + 64);
#endif
      }
      // Vectors u and u + 1 of the weight rows' block (32 codes each) into every x row's sums.
#pragma unroll
      for (uint u = 0; u < VECS_PER_BLOCK; u += 2) {
        fp8_v16i wv[FP8_BF16_COLS];
#pragma unroll
        for (int c = 0; c < FP8_BF16_COLS; ++c) {
          const uchar16 b0 = vload16(u, wb[c]), b1 = vload16(u + 1, wb[c]);
          FP8_WATCH(j + c, b0)
          FP8_WATCH(j + c, b1)
          wv[c] = (fp8_v16i)e4m3x32_bf16_words(b0, b1);
        }
#pragma unroll
        for (int i = 0; i < FP8_BF16_ROWS; ++i) {
          const fp8_v16i xv = FP8_BF16_JOIN(sx->xb[i][x0 + u], sx->xb[i][x0 + u + 1]);
#pragma unroll
          for (int c = 0; c < FP8_BF16_COLS; ++c)
            blk[c][i] = __builtin_ia32_dpbf16ps_512(blk[c][i], xv, wv[c]);
        }
      }
      const fp8_v16f s = (fp8_v16f)(srow[kb]);
#pragma unroll
      for (int c = 0; c < FP8_BF16_COLS; ++c) {
#pragma unroll
        for (int i = 0; i < FP8_BF16_ROWS; ++i) acc[c][i] = fma(blk[c][i], s, acc[c][i]);
        wb[c] += QBLOCK;
      }
    }
#pragma unroll
    for (int c = 0; c < FP8_BF16_COLS; ++c)
#pragma unroll
      for (int i = 0; i < FP8_BF16_ROWS; ++i)
        out[i * TN + j + c] = hsum16(acc[c][i]) * FP8_ACC_SCALE;
  }
#pragma unroll
  for (int j = 0; j < TN; ++j) row_has_nan[j] = FP8_WATCH_RESULT(j);
}
#undef FP8_BF16_COLS
