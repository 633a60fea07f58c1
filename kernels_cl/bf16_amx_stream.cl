// The bf16-compute GEMM of decode batches (model.compute_dtype: bf16, at most 32 rows) over bf16
// weights with Intel AMX, the weights read where they lie: linear_bf16.cl's linear_bf16_amx_stream.
// With -DX_SPLIT=3 it is compute_dtype f32's too, on the rows' exact bf16 terms (below).
//
// Why: at a decode batch the GEMM is bound by reading the weights once. The packed GEMM
// (bf16_packed.cl) first transposes each column tile's weights into a local panel, AMX's B
// layout, and that pack read the weights at 9-12 GB/s, about half of what the memory gives. Here
// the product is taken the other way round, y^T = W x^T: 16 weight rows of 32 elements, one row
// stride apart, are AMX's A operand exactly as they lie in memory (tileloadd reads them there),
// and the batch's rows are the B operand, packed once per GEMM by round_bf16 (-DOUT_VNNI=1) into
// groups of 16 pair steps x 16 columns (pair words, columns past M zero; AMX_NB such blocks per
// group, batch rows 0-15 and 16-31). Each weight is read once
// by one tile load, with no copy and no transpose.
//
// Sums: C[n][m] of 16 weight rows x 16 batch rows per tile register. A unit of work is AMX_NA
// sources of A (16 weight rows each) against the same B tile: AMX_NA groups of 16 side-by-side
// output columns, or with GLU AMX_NA / 2 groups of gate rows, then the same columns' up rows. Each
// tdpbf16ps adds one group of 16 pair steps to every output, the sums' order over the groups that
// of k; its own rounding within a group (bf16_packed.cl), with the operands' roles exchanged.
// Sources whose 16 rows do not lie one stride apart within one weight (a GEMM's last rows, or
// rows across the boundary of two side-by-side weights), and every unit's last group where K is
// not a multiple of 32, are staged: copied into a private block of 16 x 32 elements, zero past the
// rows and past K, and loaded from there, so no load reads past a weight row it owns.
//
// Build options: -DAMX_NB (tiles of 16 batch rows: 1 or 2, so M up to 32), -DAMX_NA (sources per
// unit: 1, 2 or 4; with GLU even), -DAMX_IN_TURN=1 (a
// unit's sources one after another, each against its own loads of B: 16 weight rows streaming at
// a time instead of 16 AMX_NA), -DGLU=0|1, -DWEIGHT_TYPE=1 (common.cl's fused_row over bf16 rows).

#include "amx.cl"

#ifndef AMX_IN_TURN
#define AMX_IN_TURN 0
#endif
#ifndef AMX_NA
#define AMX_NA 2
#endif
#ifndef AMX_NB
#define AMX_NB 1
#endif
#ifndef X_SPLIT
#define X_SPLIT 1
#endif
#if AMX_NA != 1 && AMX_NA != 2 && AMX_NA != 4
#error "AMX_NA: 1, 2 or 4 sources per unit"
#endif
#if AMX_NB != 1 && AMX_NB != 2
#error "AMX_NB: 1 or 2 tiles of 16 batch rows"
#endif
#if AMX_NA * AMX_NB > 4 && !AMX_IN_TURN
#error "at most 4 C tiles: AMX_NA sources x AMX_NB batch tiles read together"
#endif
#if X_SPLIT > 1 && AMX_NA > 2
#error "X_SPLIT: at most 2 sources per unit (A tiles 4 and 5 held across the terms)"
#endif
#if GLU && AMX_NA == 1
#error "GLU units take a gate and an up source (AMX_NA 2 or 4)"
#endif

// C[s][b] += A[s] B[b] over `groups` groups of 16 pair steps for the sources s < n_a and the
// AMX_NB tiles of batch rows b (tile registers: C s * AMX_NB + b of 0-3, A 4 and 5 in turn, B 6
// and 7): a[s] the address of source s's first element of its first row, lda[s] its row stride in
// bytes, xp the packed rows' first group (AMX_NB KB a group). sums: the n_a x AMX_NB tiles of 16
// x 16 floats in that order, read as the starting sums unless from_zero, written at the end.
// (A software prefetch of each row 1 or 4 groups ahead was no faster: llama3-1b's batch-8 step
// 1.00-1.13x without, in-process A/B.)
__attribute__((target("amx-tile,amx-bf16"))) __attribute__((noinline))
void amx_stream_sums(const ulong* a, const ulong* lda, uint n_a, ulong xp, uint groups,
                     int from_zero, float* sums) {
  AmxTileConfig cfg;
  amx_config_clear(&cfg);
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  __builtin_ia32_tile_loadconfig(&cfg);
  // C tile c belongs to source c / AMX_NB.
#define AMX_STREAM_START(c)                                \
  if ((c) < n_a * AMX_NB) {                                \
    if (from_zero)                                         \
      __builtin_ia32_tilezero(c);                          \
    else                                                   \
      __builtin_ia32_tileloadd64(c, sums + 256 * (c), 64); \
  }
  AMX_STREAM_START(0)
  AMX_STREAM_START(1)
  AMX_STREAM_START(2)
  AMX_STREAM_START(3)
#undef AMX_STREAM_START
  for (uint g = 0; g < groups; ++g) {
#if X_SPLIT > 1
    // The sources' A tiles once (at most 2: registers 4 and 5), then the B tiles of the rows'
    // X_SPLIT terms in turn against them.
    const ulong xg = xp + 1024ul * AMX_NB * X_SPLIT * g;
    __builtin_ia32_tileloadd64(4, (const void*)(a[0] + 64ul * g), lda[0]);
    if (n_a > 1) __builtin_ia32_tileloadd64(5, (const void*)(a[1] + 64ul * g), lda[1]);
    for (uint t = 0; t < X_SPLIT; ++t) {
#if AMX_NB == 2
      __builtin_ia32_tileloadd64(6, (const void*)(xg + 2048ul * t), 64);
      __builtin_ia32_tileloadd64(7, (const void*)(xg + 2048ul * t + 1024), 64);
      __builtin_ia32_tdpbf16ps(0, 4, 6);
      __builtin_ia32_tdpbf16ps(1, 4, 7);
      if (n_a > 1) {
        __builtin_ia32_tdpbf16ps(2, 5, 6);
        __builtin_ia32_tdpbf16ps(3, 5, 7);
      }
#else
      __builtin_ia32_tileloadd64(6, (const void*)(xg + 1024ul * t), 64);
      __builtin_ia32_tdpbf16ps(0, 4, 6);
      if (n_a > 1) __builtin_ia32_tdpbf16ps(1, 5, 6);
#endif
    }
#else
    __builtin_ia32_tileloadd64(6, (const void*)(xp + 1024ul * AMX_NB * g), 64);
#if AMX_NB == 2
    __builtin_ia32_tileloadd64(7, (const void*)(xp + 1024ul * (2 * g + 1)), 64);
#define AMX_STREAM_STEP(s)                                                             \
  if ((s) < n_a) {                                                                     \
    __builtin_ia32_tileloadd64(4 + ((s) & 1), (const void*)(a[s] + 64ul * g), lda[s]); \
    __builtin_ia32_tdpbf16ps(2 * (s), 4 + ((s) & 1), 6);                               \
    __builtin_ia32_tdpbf16ps(2 * (s) + 1, 4 + ((s) & 1), 7);                           \
  }
    AMX_STREAM_STEP(0)
    AMX_STREAM_STEP(1)
#else
#define AMX_STREAM_STEP(s)                                                             \
  if ((s) < n_a) {                                                                     \
    __builtin_ia32_tileloadd64(4 + ((s) & 1), (const void*)(a[s] + 64ul * g), lda[s]); \
    __builtin_ia32_tdpbf16ps(s, 4 + ((s) & 1), 6);                                     \
  }
    AMX_STREAM_STEP(0)
    AMX_STREAM_STEP(1)
    AMX_STREAM_STEP(2)
    AMX_STREAM_STEP(3)
#endif
#endif  // X_SPLIT
#undef AMX_STREAM_STEP
  }
#define AMX_STREAM_STORE(c) \
  if ((c) < n_a * AMX_NB) __builtin_ia32_tilestored64(c, sums + 256 * (c), 64);
  AMX_STREAM_STORE(0)
  AMX_STREAM_STORE(1)
  AMX_STREAM_STORE(2)
  AMX_STREAM_STORE(3)
#undef AMX_STREAM_STORE
  __builtin_ia32_tilerelease();
}

// A unit's source s: its 16 weight rows (row[r], null past the GEMM's rows) and whether they lie
// one stride apart within one weight (direct: tileloadd reads them where they are).
typedef struct {
  global const ushort* row[16];
  uint stride;  // elements
  int direct;
} AmxSource;

// Source s of the unit whose first output column is n0 (module comment).
inline AmxSource amx_source(uint s, uint n0, uint N, global const ushort* w0, uint ldw0, uint n1,
                            global const ushort* w1, uint ldw1, uint n2,
                            global const ushort* w2, uint ldw2) {
  AmxSource src;
#if GLU
  const uint first = n0 + 16 * (s % (AMX_NA / 2));
  global const ushort* w = s < AMX_NA / 2 ? w0 : w1;
  const uint ldw = s < AMX_NA / 2 ? ldw0 : ldw1;
  for (int r = 0; r < 16; ++r) src.row[r] = first + r < N ? w + (size_t)(first + r) * ldw : 0;
  src.stride = ldw;
  src.direct = first + 16 <= N;
#else
  const uint first = n0 + 16 * s;
  for (int r = 0; r < 16; ++r)
    src.row[r] = first + r < N ? fused_row(first + r, w0, ldw0, n1, w1, ldw1, n2, w2, ldw2) : 0;
  // One weight: the 16 rows fall below n1, or within [n1, n2), or from n2.
  const uint last = first + 15;
  src.stride = first < n1 ? ldw0 : first < n2 ? ldw1 : ldw2;
  src.direct = last < N && (last < n1 || (first >= n1 && (last < n2 || first >= n2)));
#endif
  return src;
}

// Copies elements [k0, k0 + 32) of the source's rows into stage (16 rows of 32), zero past K and
// for absent rows.
inline void amx_stage(const AmxSource* src, uint k0, uint K, ushort* stage) {
  for (int r = 0; r < 16; ++r)
    for (uint q = 0; q < 32; ++q)
      stage[32 * r + q] = src->row[r] && k0 + q < K ? src->row[r][k0 + q] : (ushort)0;
}

// The unit's sums over all of K: the full groups straight from memory where every source is
// direct, the rest (every group of a unit with a staged source; the last group where K is not a
// multiple of 32) one staged group at a time.
inline void amx_unit_sums(const AmxSource* src, uint n_a, global const uint* xp, uint K,
                          float* sums) {
  const uint groups = (K + 31) / 32;
  int direct = 1;
  for (uint s = 0; s < n_a; ++s) direct &= src[s].direct;
  uint done = 0;
  if (direct && K >= 32) {
    ulong a[AMX_NA], lda[AMX_NA];
    for (uint s = 0; s < n_a; ++s) {
      a[s] = (ulong)src[s].row[0];
      lda[s] = (ulong)src[s].stride * 2;
    }
    done = K / 32;
#if AMX_IN_TURN
    for (uint s = 0; s < n_a; ++s)
      amx_stream_sums(a + s, lda + s, 1, (ulong)xp, done, 1, sums + 256 * AMX_NB * s);
#else
    amx_stream_sums(a, lda, n_a, (ulong)xp, done, 1, sums);
#endif
  }
  ushort stage[AMX_NA][512] __attribute__((aligned(64)));
  for (uint g = done; g < groups; ++g) {
    ulong a[AMX_NA], lda[AMX_NA];
    for (uint s = 0; s < n_a; ++s) {
      amx_stage(&src[s], 32 * g, K, stage[s]);
      a[s] = (ulong)stage[s];
      lda[s] = 64;
    }
#if AMX_IN_TURN
    for (uint s = 0; s < n_a; ++s)
      amx_stream_sums(a + s, lda + s, 1, (ulong)(xp + 256 * AMX_NB * X_SPLIT * g), 1, g == 0,
                      sums + 256 * AMX_NB * s);
#else
    amx_stream_sums(a, lda, n_a, (ulong)(xp + 256 * AMX_NB * X_SPLIT * g), 1, g == 0, sums);
#endif
  }
}

// The unit's outputs into y[m, n0 ..] for m < M, columns below N: with GLU silu(gate) * up
// (bf16_packed.cl's panel_store expression, so a row gets the bits either GEMM gives it), else
// the sum plus the bias; then alpha, and y's value added where accumulating.
inline void amx_unit_store(const float* sums, uint n0, uint N, uint M, global const ushort* bias,
                           int has_bias, global float* y, uint ldy, float alpha, int accumulate) {
#if GLU
  const int out_groups = AMX_NA / 2;
#else
  const int out_groups = AMX_NA;
#endif
  for (int j = 0; j < out_groups; ++j) {
    const uint n = n0 + 16 * j;
    if (n >= N) break;
    for (uint b = 0; b < AMX_NB && 16 * b < M; ++b) {
      // Row r of tile (j, b) is column n + r: transposed, t[i] holds batch row 16 b + i's 16
      // columns.
      const float* tile = sums + 256 * (AMX_NB * j + b);
      uint16 t[16];
      for (int r = 0; r < 16; ++r) {
#if GLU
        const float16 g = vload16(r, tile);
        const float16 s = g / (1.0f + exp(-g)) * vload16(r, tile + 256 * AMX_NB * (AMX_NA / 2));
#else
        const float16 s = vload16(r, tile);
#endif
        t[r] = as_uint16(s);
      }
      transpose16x16(t);
      for (uint i = 0; i < 16 && 16 * b + i < M; ++i) {
        global float* yr = y + (size_t)(16 * b + i) * ldy + n;
        store_row16(yr, as_float16(t[i]), n, N, bias, !GLU && has_bias, alpha, accumulate);
      }
    }
  }
}
