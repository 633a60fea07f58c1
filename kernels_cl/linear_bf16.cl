// bf16 compute (model.compute_dtype: bf16): the prefill GEMM of bf16 weights with activations
// rounded to bf16 and f32 accumulation, as llama.cpp's bf16 path and AVX-512 BF16's vdpbf16ps do.
//
// round_bf16 rounds f32 activation rows to bf16 (round to nearest even) once per GEMM; linear_bf16
// multiplies them with the bf16 weights: y[m, :N] (+)= alpha * (x[m] [W0; W1; W2]^T (+ bias)),
// the weights' rows side by side as one output (q/k/v; n1, n2 where W1, W2 start), or with GLU
// y[m, n] = silu(x[m] . gate[n]) * (x[m] . up[n]) (gate W0, up W1).
//
// The tile's sums: bf16_tile.cl's micro-kernels (vdpbf16ps or portable FMAs), which moe.cl's
// grouped experts share. Build options: -DTM, -DTN (tile), -DGLU=0|1, -DBF16_DOT=0|1,
// -DPAIRS_ALIGNED=0|1 (bf16_tile.cl), -DWEIGHT_TYPE=1 (common.cl's wtype = ushort, for its
// fused_row), -DPREFETCH_X86=1 (ops::weight_prefetch_option), and for FP8 weights
// -DFP8_BF16_PANEL=1 with bf16_tile.cl's panel options.

#ifndef TM
#define TM 4
#endif
#ifndef TN
#define TN 4
#endif
#ifndef GLU
#define GLU 0
#endif
#ifndef BF16_AMX
#define BF16_AMX 0
#endif
#ifndef BF16_DOT
#define BF16_DOT 0
#endif

#ifndef X_SPLIT
#define X_SPLIT 1
#endif
#if X_SPLIT != 1 && X_SPLIT != 3
#error "X_SPLIT: 1 (bf16(x)) or 3 (x as three bf16 terms)"
#endif
#if X_SPLIT != 1 && OUT_F32
#error "X_SPLIT: the terms are bf16 rows (OUT_F32 writes one rounded f32 row)"
#endif

// x as X_SPLIT bf16 terms: one, bf16(x) rounded to nearest even; or three whose sum is x exactly
// (compute_dtype f32 with AMX, -DX_SPLIT=3): each term the truncation of what the ones before it
// leave. f32's 24-bit significand is three bf16 significands of 8 bits, each remainder is exact
// in f32, so a bf16 weight times the three terms gives the f32 product in three exact parts.
// Truncation, not rounding: a rounded first term can overflow to infinity near FLT_MAX. Values
// below 2^-110 or so lose their last terms to AMX's flush of bf16 denormals; a value that is not
// finite is its first term alone.
inline void bf16_terms(float x, ushort term[X_SPLIT]) {
#if X_SPLIT == 1
  term[0] = f32_to_bf16_rne(x);
#else
  if (!isfinite(x)) {
    term[0] = f32_to_bf16_rne(x);
    term[1] = term[2] = 0;
    return;
  }
  float rest = x;
  for (int t = 0; t < 3; ++t) {
    term[t] = (ushort)(as_uint(rest) >> 16);
    rest -= bf16_to_f32(term[t]);
  }
#endif
}

// xb[m, k] = bf16(x[row(m), k]) for M rows of K (row strides ldx, ldxb in elements), row(m) =
// x_rows[m] when indirect (the tokens of the grouped experts' rows, in plan order), else m; with
// -DOUT_F32=1 the rounded values are written back as f32 (xf), for devices that multiply them in
// the f32 kernels, or with -DOUT_VNNI=1 as AMX's B operand (below; global (ceil(K / 64), 16 or
// 32)). With -DX_SPLIT=3 (not with OUT_F32) each row becomes its three bf16 terms (bf16_terms):
// rows 3 m + t of xb hold row m's term t, and in the B operand each group of 32 elements becomes
// three groups in a row, one per term.
// Launch: global (ceil(K / 64), M).
kernel void round_bf16(global const float* x, uint x_off, uint ldx, global const uint* x_rows,
                       int indirect,
#if OUT_F32
                       global float* xf,
#else
                       global ushort* xb,
#endif
                       uint ldxb, uint K) {
  const uint m = get_global_id(1);
  const uint k0 = get_global_id(0) * 64;
  const uint k1 = min(k0 + 64, K);
  ushort term[X_SPLIT];
#if OUT_VNNI
  // The rows as AMX's B operand (bf16_amx_stream.cl), nb = ceil(M / 16) blocks of 16 rows per
  // group of 32 elements and term: element k of row m's term t in word (((k / 32) * X_SPLIT + t)
  // * nb + m / 16) * 256 + (k / 2 % 16) * 16 + m % 16, the low half for k even; rows m from M (to
  // the launch's 16 nb) and elements from K to the next 32 zero. ldxb is M here.
  const uint M = ldxb, mr = min(m, M - 1), nb = (M + 15) / 16;
  global const float* xr = x + x_off + (size_t)(indirect ? x_rows[mr] : mr) * ldx;
  for (uint k = k0; k < min(k0 + 64, (K + 31) / 32 * 32); ++k) {
    bf16_terms(m < M && k < K ? xr[k] : 0.0f, term);
    for (int t = 0; t < X_SPLIT; ++t)
      xb[(((((k / 32) * X_SPLIT + t) * nb + m / 16) * 256 + k / 2 % 16 * 16 + m % 16) << 1) +
         (k & 1)] = term[t];
  }
#else
  global const float* xr = x + x_off + (size_t)(indirect ? x_rows[m] : m) * ldx;
  for (uint k = k0; k < k1; ++k) {
    bf16_terms(xr[k], term);
#if OUT_F32
    xf[(size_t)m * ldxb + k] = bf16_to_f32(term[0]);
#else
    for (int t = 0; t < X_SPLIT; ++t) xb[(size_t)(X_SPLIT * m + t) * ldxb + k] = term[t];
#endif
  }
#if !OUT_F32
  // Zeros from K to the next 32 elements: AMX's packed GEMM reads whole 32-element groups, and
  // a zero there adds nothing to its sums (bf16_packed.cl).
  if (k1 == K)
    for (int t = 0; t < X_SPLIT; ++t)
      for (uint k = K; k < (K + 31) / 32 * 32; ++k) xb[(size_t)(X_SPLIT * m + t) * ldxb + k] = 0;
#endif
#endif  // OUT_VNNI
}

// wf[n, k] = the bf16 weight w[w_off + n * ldw + k] as f32, for rows of K (wf's row stride K):
// bf16 weights widened for an f32 GEMM library (runtime/ops_blas.cpp). Launch: global
// (K rounded up to 64, rows), local (64, 1).
kernel void widen_bf16_rows(global const ushort* w, uint w_off, uint ldw, global float* wf,
                            uint K) {
  const uint n = get_global_id(1), k = get_global_id(0);
  if (k < K) wf[(size_t)n * K + k] = bf16_to_f32(w[w_off + (size_t)n * ldw + k]);
}

#if defined(LINEAR_BF16) || defined(LINEAR_BF16_PACKED)
// Weight row j of a tile of `rows` weight rows whose first output column is n0: the rows side by
// side (fused_row), or with GLU the tile's rows / 2 gate rows, then the same columns' up rows.
// Columns past N take the last row (computed on, not stored). Both GEMMs' tiles take their rows so.
inline global const ushort* gemm_weight_row(uint j, uint rows, uint n0, uint N,
                                            global const ushort* w0, uint ldw0, uint n1,
                                            global const ushort* w1, uint ldw1, uint n2,
                                            global const ushort* w2, uint ldw2) {
#if GLU
  const uint c = min(n0 + j % (rows / 2), N - 1);
  return j < rows / 2 ? w0 + (size_t)c * ldw0 : w1 + (size_t)c * ldw1;
#else
  return fused_row(min(n0 + j, N - 1), w0, ldw0, n1, w1, ldw1, n2, w2, ldw2);
#endif
}
#endif

#ifdef LINEAR_BF16

#include "bf16_tile.cl"

// The TN weight rows of the column tile from n0 (gemm_weight_row).
inline void tile_weight_rows(uint n0, uint N, global const ushort* w0, uint ldw0, uint n1,
                             global const ushort* w1, uint ldw1, uint n2,
                             global const ushort* w2, uint ldw2, global const ushort* wr[TN]) {
#pragma unroll
  for (int j = 0; j < TN; ++j)
    wr[j] = gemm_weight_row(j, TN, n0, N, w0, ldw0, n1, w1, ldw1, n2, w2, ldw2);
}

#if FP8_BF16_PANEL
typedef uchar w0_t;  // FP8 codes, with block scales s0 (KB per 128-row block): one weight, no GLU
#else
typedef ushort w0_t;
#endif

// xb: [M, K] bf16 rows (row stride ldxb, a multiple of 32 keeps the loads aligned). One
// work-item owns n_tiles column tiles x m_rows rows, column tile outer (its weight rows stay in
// cache while the rows stream). Launch: global (row blocks, column blocks), local 1. Row blocks
// are the first dimension because PoCL's CPU driver hands each thread runs of consecutive
// work-groups, first dimension fastest: so the row blocks of one column block run one after
// another and find its weight rows in cache. With column blocks first, a 512-token prefill read
// every weight from memory once per 64-row block.
// With FP8_BF16_PANEL (w0 FP8, its scales s0) each column tile's rows are dequantized into the
// work-item's panel (bf16_tile.cl) once, for its row tiles.
kernel void linear_bf16(global const ushort* xb, uint ldxb,
                        global const w0_t* w0, uint w0_off, uint ldw0, uint n1,
                        global const ushort* w1, uint w1_off, uint ldw1, uint n2,
                        global const ushort* w2, uint w2_off, uint ldw2,
                        global const ushort* bias, uint b_off, int has_bias,
                        global const float* s0, uint KB,
                        global float* y, uint y_off, uint ldy, uint M, uint N, uint K,
                        float alpha, int accumulate, uint n_tiles, uint m_rows) {
#if GLU
  const uint tile_cols = TN / 2;  // TN / 2 gate rows, then the same TN / 2 columns' up rows
#else
  const uint tile_cols = TN;
#endif
  const uint n_begin = get_global_id(1) * n_tiles * tile_cols;
  const uint n_end = min(n_begin + n_tiles * tile_cols, N);
  const uint m_begin = get_global_id(0) * m_rows;
  const uint m_end = min(m_begin + m_rows, M);
  w0 += w0_off;
  w1 += w1_off;
  w2 += w2_off;
#if FP8_BF16_PANEL
  ushort panel[TN][BF16_PANEL_K] __attribute__((aligned(64)));  // rows: whole 32-byte vectors
  private const ushort* wr[TN];
#pragma unroll
  for (int j = 0; j < TN; ++j) wr[j] = panel[j];
  global const ushort* const* next = 0;  // no prefetch: the panel is made before the tiles
  const bool has_next = false;
  for (uint n0 = n_begin; n0 < n_end; n0 += tile_cols) {
    global const uchar* codes[TN];
    global const float* sr[TN];
#pragma unroll
    for (int j = 0; j < TN; ++j) {
      const uint n = min(n0 + j, N - 1);
      codes[j] = w0 + (size_t)n * ldw0;
      sr[j] = fp8_scale_row(s0, n, KB);
    }
    fp8_panel(codes, sr, K, panel);
#else
  global const ushort* next[TN];
  const uint pf_end = prefetch_end(n_end, N, get_global_size(0));  // row blocks: dimension 0
  tile_weight_rows(n_begin, N, w0, ldw0, n1, w1, ldw1, n2, w2, ldw2, next);
  for (uint n0 = n_begin; n0 < n_end; n0 += tile_cols) {
    global const ushort* wr[TN];
#pragma unroll
    for (int j = 0; j < TN; ++j) wr[j] = next[j];
    const bool has_next = n0 + tile_cols < pf_end;
    if (has_next) tile_weight_rows(n0 + tile_cols, N, w0, ldw0, n1, w1, ldw1, n2, w2, ldw2, next);
#endif
    for (uint m0 = m_begin; m0 < m_end; m0 += TM) {
      // Rows and columns past the edge compute on a valid row (clamped) and are not stored.
      global const ushort* xr[TM];
#pragma unroll
      for (int i = 0; i < TM; ++i) xr[i] = xb + (size_t)min(m0 + i, M - 1) * ldxb;
      float out[OUT_PADDED];
      tile_sums_bf16(xr, wr, K, has_next && m0 + TM >= m_end ? next : 0, out);
#if GLU
      float act[GLU_PADDED];
      glu_act(out, act);
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
          float v = act[i * tile_cols + j];
#else
          float v = out[OUT_INDEX(i, j)];
          if (has_bias) v += bf16_to_f32(bias[b_off + n]);
#endif
          v *= alpha;
          yr[n] = accumulate ? yr[n] + v : v;
        }
      }
    }
  }
}

#endif  // LINEAR_BF16

#ifdef LINEAR_BF16_AMX_STREAM

#include "bf16_amx_stream.cl"

// linear_bf16's product for decode batches (M <= 32) over bf16 weights with AMX, the weights read
// where they lie (bf16_amx_stream.cl): xp the rows packed by round_bf16 -DOUT_VNNI=1. A unit is
// AMX_NA groups of 16 output columns side by side (fused_row's), or with GLU AMX_NA / 2 groups
// of gate rows and the same columns' up rows; a work-item runs units_per_item units in turn.
// Launch: global (work-items), local 1.
kernel void linear_bf16_amx_stream(global const uint* xp, global const ushort* w0, uint w0_off,
                                   uint ldw0, uint n1, global const ushort* w1, uint w1_off,
                                   uint ldw1, uint n2, global const ushort* w2, uint w2_off,
                                   uint ldw2, global const ushort* bias, uint b_off, int has_bias,
                                   global float* y, uint y_off, uint ldy, uint M, uint N, uint K,
                                   float alpha, int accumulate, uint units_per_item) {
  w0 += w0_off;
  w1 += w1_off;
  w2 += w2_off;
  const uint unit_cols = GLU ? 8 * AMX_NA : 16 * AMX_NA;
  const uint units = (N + unit_cols - 1) / unit_cols;
  const uint u0 = get_global_id(0) * units_per_item, u1 = min(units, u0 + units_per_item);
  float sums[AMX_NA * AMX_NB * 256] __attribute__((aligned(64)));
  for (uint u = u0; u < u1; ++u) {
    const uint n0 = u * unit_cols;
    AmxSource src[AMX_NA];
    // Without GLU the sources past N are left out; with it each gate source has its up source.
    uint n_a = AMX_NA;
    for (uint s = 0; s < AMX_NA; ++s)
      src[s] = amx_source(s, n0, N, w0, ldw0, n1, w1, ldw1, n2, w2, ldw2);
#if !GLU
    n_a = min((uint)AMX_NA, (N - n0 + 15) / 16);
#endif
    amx_unit_sums(src, n_a, xp, K, sums);
    amx_unit_store(sums, n0, N, M, bias + b_off, has_bias, y + y_off, ldy, alpha, accumulate);
  }
}

#endif  // LINEAR_BF16_AMX_STREAM

#ifdef LINEAR_BF16_PACKED

#include "bf16_packed.cl"

// linear_bf16's product in bf16_packed.cl's form, for prefill-sized M. A work-item owns one
// column tile (PANEL_NC weight rows side by side, fused_row's; with GLU the gate rows of
// PANEL_NC / 2 columns, then their up rows) and rows [m_begin, m_begin + m_rows). It packs the
// tile's panel PANEL_KP pair steps at a time and runs its row tiles over each chunk; with more
// than one chunk (the host then builds with -DPANEL_ROWS, at least m_rows) the rows' partial sums
// wait in local memory between chunks. FP8 weights (-DPANEL_FP8=1: w0 with its block scales s0,
// KB a row; one weight, no GLU) are dequantized to bf16 as they are packed. xb: the rounded rows
// (bf16), or with -DPANEL_XF32=1 the f32 rows (bf16 weights only), from element xb_off.
// Launch: global (column tiles, row blocks), local 1.
kernel void linear_bf16_packed(global const panel_x_t* xb, uint xb_off, uint ldxb,
                               global const panel_w_t* w0, uint w0_off, uint ldw0, uint n1,
                               global const ushort* w1, uint w1_off, uint ldw1, uint n2,
                               global const ushort* w2, uint w2_off, uint ldw2,
                               global const ushort* bias, uint b_off, int has_bias,
                               global const float* s0, uint KB, global float* y, uint y_off,
                               uint ldy, uint M, uint N, uint K, float alpha, int accumulate,
                               uint m_rows) {
  PACKED_LOCALS
#if GLU
  const uint tile_cols = PANEL_NC / 2;
#else
  const uint tile_cols = PANEL_NC;
#endif
  const uint n0 = get_global_id(0) * tile_cols;
  const uint m_begin = get_global_id(1) * m_rows, m_end = min(M, m_begin + m_rows);
  w0 += w0_off;
  w1 += w1_off;
  w2 += w2_off;
  // The tile's weight rows (columns past N take the last: computed on, not stored).
  global const panel_w_t* rows[PANEL_NC];
  global const float* srows[PANEL_NC];
  for (int c = 0; c < PANEL_NC; ++c) {
#if PANEL_FP8
    const uint n = min(n0 + c, N - 1);
    rows[c] = w0 + (size_t)n * ldw0;
    srows[c] = fp8_scale_row(s0, n, KB);
#else
    rows[c] = gemm_weight_row(c, PANEL_NC, n0, N, w0, ldw0, n1, w1, ldw1, n2, w2, ldw2);
    srows[c] = s0;  // unread: bf16 rows have no scales
#endif
  }
  const uint steps = (K + 1) / 2;  // pair steps; with K odd the last holds one element
  // The next work-item's weights (the next column tile), prefetched while this one's rows run
  // when the panel takes one chunk (bf16_packed.cl's PanelPrefetch).
  PanelPrefetch next;
  const bool has_next = steps <= PANEL_KP && n0 + tile_cols < N;
  if (has_next) {
    const uint n_next = n0 + tile_cols, n_half = min(N - n_next, tile_cols / (GLU ? 1 : 2));
#if PANEL_FP8
    next.base[0] = (global const uchar*)(w0 + (size_t)n_next * ldw0);
    next.base[1] = next.base[0] + (size_t)n_half * ldw0;
#elif GLU
    next.base[0] = (global const uchar*)(w0 + (size_t)n_next * ldw0);
    next.base[1] = (global const uchar*)(w1 + (size_t)n_next * ldw1);
#else
    next.base[0] = (global const uchar*)fused_row(n_next, w0, ldw0, n1, w1, ldw1, n2, w2, ldw2);
    next.base[1] = (global const uchar*)fused_row(min(n_next + n_half, N - 1), w0, ldw0, n1, w1,
                                                  ldw1, n2, w2, ldw2);
#endif
    next.half_lines = n_half * K * sizeof(panel_w_t) / 64;
    next.line = 0;
  }
  packed_column_tile(xb + xb_off, ldxb, rows, srows, K, m_begin, m_end, n0, N,
                     has_next ? &next : 0, packed_panel, PACKED_PARTIAL, bias + b_off, has_bias,
                     y + y_off, ldy, alpha, accumulate);
}

#endif  // LINEAR_BF16_PACKED
