// The packed bf16-compute GEMM (model.compute_dtype: bf16; CPU shape; linear_bf16.cl's
// linear_bf16_packed), for prefill-sized M: an outer product, where bf16_tile.cl's tiles are dot
// products. Build options: -DPANEL_TM (rows per tile), -DPANEL_NV (vectors of 16 columns per
// tile), -DPANEL_KP (pair steps per panel), -DBF16_DOT=0|1 (the micro-kernel, below),
// -DPAIRS_ALIGNED=0|1 (weight rows on 4-byte boundaries), -DPREFETCH_X86=1 (PanelPrefetch),
// -DPANEL_WF32=1 (the portable micro-kernel's weights widened at the pack, below), and
// -DPANEL_FP8=1 for FP8 weights, dequantized to bf16 as they are packed (with common.cl's
// -DFP8_DENORM and -DFP8_NAN_WATCH).
//
// A work-item owns a column tile of PANEL_NC = 16 PANEL_NV weight rows (output columns) and
// packs them once into a panel in local memory: for each pair step kp (elements 2 kp and
// 2 kp + 1) the tile's PANEL_NC weight pairs as 32-bit words (element 2 kp in the low half),
// word c of step kp at panel[kp * PANEL_NC + c]. Its row tiles (PANEL_TM rows of x, bf16 rows
// read as words) then keep PANEL_TM x PANEL_NV vectors of 16 sums, lane l of vector v the sum of
// column 16 v + l: a step broadcasts each row's pair against the PANEL_NV panel vectors of the
// step. No sum crosses lanes, so a tile ends without a reduction, and a step reads PANEL_NV
// panel vectors and PANEL_TM 4-byte words of x for PANEL_TM x PANEL_NV products, where a dot
// product tile reads a whole 64-byte line per row and per weight row. In-process A/B on the 2-core
// EPYC against bf16_tile.cl's 4 x 6 tiles (M = 512; 4 x 3 here, with GLU 4 x 4): vdpbf16ps
// 1.05x (3072 x 2048), 1.03x (2048 x 2048), 1.07x (2048 x 8192), 1.14x (gate|up with SwiGLU,
// 2 x 8192 x 2048); the portable micro-kernel 1.9x, 1.9x and 2.1x, at 93% of the f32 FMA peak.
// FP8 weights, dequantized as they are packed, against the tiles' private dequantized panels:
// 1.27x (3072 x 2048, 2048 x 2048), 1.32x (2048 x 8192), 1.28x (16384 x 2048), and on dsv3-mini's
// shapes 1.20-1.28x (bf16 weights there 1.06x). At M = 128 1.03-1.05x, at M = 64 and 96 no
// faster (the pack is a memory phase the rows no longer cover), so the host takes it from
// KernelTuning's gemm_bf16_packed_rows rows.
//
// An output's sum is one f32 chain over the pairs in order of k, each pair's odd element first,
// then its even one, each product exact in f32 and each add rounded once: vdpbf16ps's order, so
// the two micro-kernels below agree up to bf16 denormals (which the instruction reads as zero).
// (bf16_tile.cl's sums run in 16 lanes and meet at the end: the two GEMMs round differently, and
// which one a row gets depends on M.) A K of odd length ends with the pair (x[K - 1], 0) against
// (w[K - 1], 0), whose added zero leaves the sum as it is.
//
// Micro-kernels, chosen by the host per device (runtime/ops.cpp), as bf16_tile.cl's:
// -DBF16_DOT=1: vdpbf16ps through clang's per-function target attribute, out of line and without
//   OpenCL builtins; -DBF16_DOT=0: the same sums with f32 FMAs on the bf16 values widened by a
//   shift, any device.
//
// With -DPANEL_XF32=1 (compute_dtype f32 over bf16 weights, which f32 holds exactly) the x rows
// are f32 as they are, not rounded, and the portable micro-kernel adds their products with the
// widened weights in the same order: the f32 product as one chain per output, where linear.cl's
// f32 tiles sum 16 lanes and reduce them. llama3-1b's 512-token prefill at f32 compute ran
// 1.41-1.47x faster so (3 interleaved pairs, 2-core EPYC, Zen 5), its GEMMs at 90-92% of the
// register-only f32 FMA peak (bench_kernels --gemm-bf16).
//
// Panels longer than PANEL_KP pairs are packed and run in chunks of PANEL_KP pairs; between
// chunks a tile's sums wait in memory (partial sums: the same chain, stored and loaded as they
// are).

#define PANEL_NC (16 * PANEL_NV)
// With -DPANEL_WF32=1 (the portable micro-kernel only) the panel holds each step's weights widened
// to f32, the odd (high) halves' PANEL_NC floats and then the even ones': the pack widens them
// once for all the tile's rows, where the steps would each widen them again (a shift and a mask
// per vector, which on Intel's cores share the two ports of the FMAs). The panel takes twice the
// local memory; the host builds it where KernelTuning's gemm_bf16_packed_wf32 asks and it fits.
#ifndef PANEL_WF32
#define PANEL_WF32 0
#endif
#if PANEL_WF32 && (BF16_DOT || BF16_AMX)
#error "-DPANEL_WF32=1: widened panels are the portable micro-kernel's (-DBF16_DOT=0 -DBF16_AMX=0)"
#endif
#define PANEL_STEP_WORDS (PANEL_NC * (PANEL_WF32 ? 2 : 1))

// The x rows: bf16, rounded once and read as pair words (compute_dtype bf16), or with
// -DPANEL_XF32=1 the f32 rows as they are (compute_dtype f32 over bf16 weights, whose values f32
// holds exactly: the portable micro-kernel's f32 FMAs on the unrounded rows).
#if PANEL_XF32
#if BF16_DOT
#error "f32 rows take the portable micro-kernel (-DBF16_DOT=0)"
#endif
typedef float panel_x_t;
typedef float panel_xr_t;  // an element
#else
typedef ushort panel_x_t;
typedef int panel_xr_t;  // a pair word
#endif

// The pair words kp0 .. kp0 + 15 of a weight row: panel_row_words where they lie within the row
// (2 kp0 + 32 <= K), panel_row_tail where the row ends among them (words past it zero). A bf16
// row is read as words where every row starts on a 4-byte boundary (-DPAIRS_ALIGNED=1), else as
// ushorts (a GPU would fault on the misaligned word; PoCL reads either); an FP8 row (srow: its
// block scales) is dequantized to bf16 (common.cl's e4m3x16_dequant_bf16, the bits that
// dequantize_fp8_bf16 gives).
#if PANEL_FP8
typedef uchar panel_w_t;
inline uint16 panel_row_words(global const uchar* row, global const float* srow, uint kp0) {
  return bf16_pair_words(e4m3x16_dequant_bf16(row, srow, kp0 / 8),
                         e4m3x16_dequant_bf16(row, srow, kp0 / 8 + 1));
}
inline uint16 panel_row_tail(global const uchar* row, global const float* srow, uint kp0,
                             uint K) {
  uint w[16];
  for (int q = 0; q < 16; ++q) {
    const uint k = 2 * (kp0 + q);
    w[q] = (k < K ? (uint)e4m3_dequant_bf16(row, srow, k) : 0u) |
           (k + 1 < K ? (uint)e4m3_dequant_bf16(row, srow, k + 1) << 16 : 0u);
  }
  return vload16(0, w);
}
#else
typedef ushort panel_w_t;
typedef uint panel_u16_u __attribute__((ext_vector_type(16), aligned(4)));
inline uint16 panel_row_words(global const ushort* row, global const float* srow, uint kp0) {
#if PAIRS_ALIGNED
  return *(global const panel_u16_u*)((global const uint*)row + kp0);
#else
  return bf16_pair_words(vload16(0, row + 2 * kp0), vload16(1, row + 2 * kp0));
#endif
}
inline uint16 panel_row_tail(global const ushort* row, global const float* srow, uint kp0,
                             uint K) {
  uint w[16];
  for (int q = 0; q < 16; ++q) {
    const uint k = 2 * (kp0 + q);
    w[q] = (k < K ? (uint)row[k] : 0u) | (k + 1 < K ? (uint)row[k + 1] << 16 : 0u);
  }
  return vload16(0, w);
}
#endif

// Packs pair steps [kp_begin, kp_end) of the tile's PANEL_NC weight rows (rows[c]; FP8: their
// block-scale rows srows[c]) into panel[(kp - kp_begin) * PANEL_NC + c] (with PANEL_WF32 each
// step's odd then even halves, PANEL_STEP_WORDS apart): 16 rows x 16 steps at a time, transposed
// in registers, so that each step's 16 words are one vector store.
// perf record of llama3-1b's 512-token prefill at bf16 compute (2-core Zen 5, 2026-12-06) put
// 8.5-10% of each packed GEMM's samples here, nearly all on the 16 row loads. Two prefetches were
// tried and left out, as neither made the GEMMs faster (old and new builds in turn):
// - PanelPrefetch's lines issued in the last row tiles instead of the first: this function's
//   share fell to 3-4% and the sums' grew by as much; the prefill (bench_llama, 3 pairs) 191.7 /
//   194.2 / 189.1 tok/s against 189.4 / 199.1 / 191.5;
// - the 16 rows prefetched 4 blocks ahead here: the five GEMMs of bench_kernels --gemm-bf16
//   (their GFLOP/s summed) 0.89x and 0.98x into L1, 1.01x and 1.01x into L2 (one GEMM of one
//   build moved by up to 16% between rounds).
inline void pack_panel(global const panel_w_t* const* rows, global const float* const* srows,
                       uint K, uint kp_begin, uint kp_end, local uint* panel) {
  for (int g = 0; g < PANEL_NV; ++g)
    for (uint kp0 = kp_begin; kp0 < kp_end; kp0 += 16) {
      uint16 r[16];
      if (2 * kp0 + 32 <= K) {
#pragma unroll
        for (int c = 0; c < 16; ++c)
          r[c] = panel_row_words(rows[16 * g + c], srows[16 * g + c], kp0);
      } else {
        for (int c = 0; c < 16; ++c)
          r[c] = panel_row_tail(rows[16 * g + c], srows[16 * g + c], kp0, K);
      }
      transpose16x16(r);
      local uint* dst = panel + (size_t)(kp0 - kp_begin) * PANEL_STEP_WORDS + 16 * g;
#if BF16_AMX
      const uint steps = 16;  // whole groups: words past K are zero (panel_row_tail)
#else
      const uint steps = min(16u, kp_end - kp0);
#endif
#if PANEL_WF32
      for (uint q = 0; q < steps; ++q) {
        *(local uint16*)(dst + (size_t)q * PANEL_STEP_WORDS) = r[q] & 0xffff0000u;
        *(local uint16*)(dst + (size_t)q * PANEL_STEP_WORDS + PANEL_NC) = r[q] << 16;
      }
#else
      for (uint q = 0; q < steps; ++q) *(local uint16*)(dst + (size_t)q * PANEL_NC) = r[q];
#endif
    }
}

// The weights of the work-item that packs next (its column tile's rows): two byte ranges of
// half_lines 64-byte lines each (with GLU its gate rows and its up rows, else the two halves of
// its rows). While a tile's sums run, panel_tile_sums prefetches one line per step (common.cl's
// PREFETCH_LINE, -DPREFETCH_X86=1; lines `line` .. line + steps - 1 of the two ranges in turn),
// so that the pack, which otherwise waits on memory with no work beside it, finds them in cache.
typedef struct {
  global const uchar* base[2];
  uint half_lines, line;
} PanelPrefetch;
#define PANEL_PREFETCH(pf, l)                                                       \
  {                                                                                 \
    const uint l_ = (l), h_ = (pf)->half_lines;                                     \
    PREFETCH_LINE(l_ < h_ ? (pf)->base[0] + (size_t)l_ * 64                         \
                          : (pf)->base[1] + (size_t)(l_ - h_) * 64);                \
  }
// Of a call's steps, how many prefetch a line (none without pf or past its lines).
inline uint panel_prefetches(const PanelPrefetch* pf, uint steps) {
  if (!pf || pf->line >= 2 * pf->half_lines) return 0;
  return min(steps, 2 * pf->half_lines - pf->line);
}

// The tile's sums over the panel's steps [0, steps): xr[i] are the tile's x rows from the panel's
// first step (pair words, or with PANEL_XF32 f32 elements). sums: PANEL_TM x PANEL_NC floats (row-major, 64-byte aligned),
// read as the starting sums unless from_zero. odd_tail: the last step is a K of odd length's
// lone element: its x word keeps only the low half.
#if BF16_AMX
// -DBF16_AMX=1 (PANEL_TM 16, PANEL_NV at most 5): Intel AMX's tdpbf16ps through the same
// per-function target attribute. A tile register holds 16 rows of 64 bytes: the tile's 16 x rows
// over 16 pair steps (tile 5, A), 16 pair steps of one panel vector's 16 columns (tiles 6 and 7 in
// turn, B: the panel's layout as it is), and each vector's 16 x 16 sums (tiles 0 .. PANEL_NV - 1,
// C). tdpbf16ps adds 16 steps' products to each output in f32, but not rounded as the chain of
// the micro-kernels above (measured against host emulations: neither vdpbf16ps's order nor an
// exact sum per group matched every output), so its bits are its own; each output's do not depend
// on the other rows of its tile (test_gemm_bf16). It reads whole groups of 16 steps: the panel is packed to a multiple of 16 steps
// with zero words past K, and the rounded x rows hold zeros from K to the next multiple of 32
// elements (round_bf16), so a group past the last step adds products of zero, and an odd K's
// last pair needs no mask (amx.cl: the tile configuration).
// With -DX_SPLIT=3 (compute_dtype f32) the x rows are the f32 rows' three bf16 terms
// (linear_bf16.cl's bf16_terms, rows X_SPLIT m + t): each group runs the panel's B tiles against
// the three terms' A tiles in turn, so each output adds the weights' exact products with the f32
// rows, in f32.
#include "amx.cl"

#ifndef X_SPLIT
#define X_SPLIT 1
#endif

#if PANEL_NV == 1
#define AMX_EACH_C(OP) OP(0)
#elif PANEL_NV == 2
#define AMX_EACH_C(OP) OP(0) OP(1)
#elif PANEL_NV == 3
#define AMX_EACH_C(OP) OP(0) OP(1) OP(2)
#elif PANEL_NV == 4
#define AMX_EACH_C(OP) OP(0) OP(1) OP(2) OP(3)
#elif PANEL_NV == 5
#define AMX_EACH_C(OP) OP(0) OP(1) OP(2) OP(3) OP(4)
#else
#error "AMX tiles: PANEL_NV from 1 to 5"
#endif

// The sums of `rows` x rows (x: the first one's word at the panel's first step, ldx bytes
// apart) over the panel's steps [0, steps): as panel_tile_sums, with the pointers as addresses
// (the builtins take unqualified ones; PoCL's CPU device has one address space).
__attribute__((target("amx-tile,amx-bf16"))) __attribute__((noinline))
void panel_tile_sums_amx(ulong x, ulong ldx, uint rows, ulong panel, uint steps, int from_zero,
                         float* sums, const PanelPrefetch* pf) {
  AmxTileConfig cfg;
  amx_config_clear(&cfg);
  for (int t = 0; t < PANEL_NV; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = rows;
  }
  cfg.colsb[5] = 64;
  cfg.rows[5] = rows;
  cfg.colsb[6] = cfg.colsb[7] = 64;
  cfg.rows[6] = cfg.rows[7] = 16;
  __builtin_ia32_tile_loadconfig(&cfg);
  const ulong ld_sums = PANEL_NC * 4;
#define AMX_START(v)                                                         \
  if (from_zero)                                                             \
    __builtin_ia32_tilezero(v);                                              \
  else                                                                       \
    __builtin_ia32_tileloadd64(v, sums + 16 * (v), ld_sums);
  AMX_EACH_C(AMX_START)
#undef AMX_START
  const uint groups = (steps + 15) / 16;
  const uint n_pf = panel_prefetches(pf, steps);
  for (uint g = 0; g < groups; ++g) {
    for (uint l = 16 * g; l < min(16 * g + 16, n_pf); ++l) PANEL_PREFETCH(pf, pf->line + l)
    const ulong b = panel + (ulong)g * 16 * PANEL_NC * 4;
#define AMX_STEP(v)                                                                          \
  __builtin_ia32_tileloadd64(6 + ((v) & 1), (const void*)(b + 64 * (v)), (ulong)PANEL_NC * 4); \
  __builtin_ia32_tdpbf16ps(v, 5, 6 + ((v) & 1));
    // With X_SPLIT terms, the rows of term t lie t / X_SPLIT of ldx after term 0's (round_bf16).
    for (uint t = 0; t < X_SPLIT; ++t) {
      __builtin_ia32_tileloadd64(5, (const void*)(x + ldx / X_SPLIT * t + 64ul * g), ldx);
      AMX_EACH_C(AMX_STEP)
    }
#undef AMX_STEP
  }
#define AMX_STORE(v) __builtin_ia32_tilestored64(v, sums + 16 * (v), ld_sums);
  AMX_EACH_C(AMX_STORE)
#undef AMX_STORE
  __builtin_ia32_tilerelease();
}
#endif

#if X_SPLIT > 1 && !BF16_AMX
#error "X_SPLIT: the three terms run on AMX's tiles (-DBF16_AMX=1)"
#endif

#if BF16_DOT
typedef int panel_v16i __attribute__((__vector_size__(64)));
typedef float panel_v16f __attribute__((ext_vector_type(16)));

__attribute__((target("avx512bf16,avx512f,avx512bw,avx512vl"))) __attribute__((noinline))
void panel_tile_sums(global const panel_xr_t* const* xr, local const uint* panel, uint steps,
                     int odd_tail, int from_zero, float* sums, const PanelPrefetch* pf) {
  panel_v16f acc[PANEL_TM][PANEL_NV];
#pragma unroll
  for (int i = 0; i < PANEL_TM; ++i)
#pragma unroll
    for (int v = 0; v < PANEL_NV; ++v)
      acc[i][v] = from_zero ? (panel_v16f)(0.0f) : *(panel_v16f*)(sums + (i * PANEL_NV + v) * 16);
  // One step: PANEL_NV panel vectors against each row's pair word (masked by keep).
#define PANEL_DOT_STEP(kp, keep)                                                        \
  {                                                                                     \
    panel_v16i w[PANEL_NV];                                                             \
    _Pragma("unroll") for (int v = 0; v < PANEL_NV; ++v) w[v] =                         \
        *(local const panel_v16i*)(panel + (size_t)(kp) * PANEL_NC + 16 * v);           \
    _Pragma("unroll") for (int i = 0; i < PANEL_TM; ++i) {                              \
      const panel_v16i xb = (panel_v16i)((int16)(xr[i][kp] & (keep)));                  \
      _Pragma("unroll") for (int v = 0; v < PANEL_NV; ++v) acc[i][v] =                  \
          __builtin_ia32_dpbf16ps_512(acc[i][v], xb, w[v]);                             \
    }                                                                                   \
  }
  const uint full = steps - (odd_tail ? 1 : 0), n_pf = panel_prefetches(pf, full);
  for (uint kp = 0; kp < n_pf; ++kp) {
    PANEL_PREFETCH(pf, pf->line + kp)
    PANEL_DOT_STEP(kp, -1)
  }
  for (uint kp = n_pf; kp < full; ++kp) PANEL_DOT_STEP(kp, -1)
  if (odd_tail) PANEL_DOT_STEP(full, 0xFFFF)
#undef PANEL_DOT_STEP
#pragma unroll
  for (int i = 0; i < PANEL_TM; ++i)
#pragma unroll
    for (int v = 0; v < PANEL_NV; ++v) *(panel_v16f*)(sums + (i * PANEL_NV + v) * 16) = acc[i][v];
}
#else
// The same chain with f32 FMAs on the bf16 halves widened by a shift: odd (high half) first.
// With f32 rows, their elements 2 kp + 1 and 2 kp (the odd tail's missing one read as 0).
void panel_tile_sums(global const panel_xr_t* const* xr, local const uint* panel, uint steps,
                     int odd_tail, int from_zero, float* sums, const PanelPrefetch* pf) {
  float16 acc[PANEL_TM][PANEL_NV];
#pragma unroll
  for (int i = 0; i < PANEL_TM; ++i)
#pragma unroll
    for (int v = 0; v < PANEL_NV; ++v)
      acc[i][v] = from_zero ? (float16)(0.0f) : vload16(i * PANEL_NV + v, sums);
#if PANEL_XF32
#define PANEL_X_PAIR(row, kp, keep)                                                        \
  const float16 x_even = (float16)((row)[2 * (kp)]);                                       \
  const float16 x_odd = (float16)((keep) == 0xFFFFu ? 0.0f : (row)[2 * (kp) + 1]);
#else
#define PANEL_X_PAIR(row, kp, keep)                                                        \
  const uint u = (uint)(row)[kp] & (keep);                                                 \
  const float16 x_even = (float16)(as_float(u << 16));                                     \
  const float16 x_odd = (float16)(as_float(u & 0xffff0000u));
#endif
#if PANEL_WF32
#define PANEL_W_PAIR(kp, v)                                                                \
  w_odd[v] = as_float16(vload16(0, panel + (size_t)(kp) * PANEL_STEP_WORDS + 16 * (v)));   \
  w_even[v] =                                                                              \
      as_float16(vload16(0, panel + (size_t)(kp) * PANEL_STEP_WORDS + PANEL_NC + 16 * (v)));
#else
#define PANEL_W_PAIR(kp, v)                                                                \
  const uint16 u = vload16(0, panel + (size_t)(kp) * PANEL_NC + 16 * (v));                 \
  w_even[v] = as_float16(u << 16);                                                         \
  w_odd[v] = as_float16(u & 0xffff0000u);
#endif
#define PANEL_FMA_STEP(kp, keep)                                                           \
  {                                                                                        \
    float16 w_even[PANEL_NV], w_odd[PANEL_NV];                                             \
    _Pragma("unroll") for (int v = 0; v < PANEL_NV; ++v) {                                 \
      PANEL_W_PAIR(kp, v)                                                                  \
    }                                                                                      \
    _Pragma("unroll") for (int i = 0; i < PANEL_TM; ++i) {                                 \
      PANEL_X_PAIR(xr[i], kp, keep)                                                        \
      _Pragma("unroll") for (int v = 0; v < PANEL_NV; ++v) {                               \
        acc[i][v] = fma(x_odd, w_odd[v], acc[i][v]);                                       \
        acc[i][v] = fma(x_even, w_even[v], acc[i][v]);                                     \
      }                                                                                    \
    }                                                                                      \
  }
  const uint full = steps - (odd_tail ? 1 : 0), n_pf = panel_prefetches(pf, full);
  for (uint kp = 0; kp < n_pf; ++kp) {
    PANEL_PREFETCH(pf, pf->line + kp)
    PANEL_FMA_STEP(kp, 0xFFFFFFFFu)
  }
  for (uint kp = n_pf; kp < full; ++kp) PANEL_FMA_STEP(kp, 0xFFFFFFFFu)
  if (odd_tail) PANEL_FMA_STEP(full, 0xFFFFu)
#undef PANEL_FMA_STEP
#undef PANEL_W_PAIR
#undef PANEL_X_PAIR
#pragma unroll
  for (int i = 0; i < PANEL_TM; ++i)
#pragma unroll
    for (int v = 0; v < PANEL_NV; ++v) vstore16(acc[i][v], i * PANEL_NV + v, sums);
}
#endif
#ifndef PANEL_ROWS
#define PANEL_ROWS 0
#endif

// The tile's sums into y[m0 .., n0 ..] (rows below m_end, columns below N): with GLU
// silu(gate) * up of the gate vectors v < PANEL_NV / 2 and the up vectors v + PANEL_NV / 2 (the
// same columns), glu_act's expression; else the sum plus the bias. Then alpha, and y's value
// added where accumulating.
inline void panel_store(const float* sums, uint m0, uint m_end, uint n0, uint N,
                        global const ushort* bias, int has_bias, global float* y, uint ldy,
                        float alpha, int accumulate) {
#if GLU
  const int out_vectors = PANEL_NV / 2;
#else
  const int out_vectors = PANEL_NV;
#endif
  for (int i = 0; i < PANEL_TM; ++i) {
    if (m0 + i >= m_end) break;
    global float* yr = y + (size_t)(m0 + i) * ldy;
#pragma unroll
    for (int v = 0; v < out_vectors; ++v) {
      const uint n = n0 + 16 * v;
      if (n >= N) break;
#if GLU
      const float16 g = vload16(i * PANEL_NV + v, sums);
      float16 s = g / (1.0f + exp(-g)) * vload16(i * PANEL_NV + v + PANEL_NV / 2, sums);
#else
      float16 s = vload16(i * PANEL_NV + v, sums);
#endif
      store_row16(yr + n, s, n, N, bias, !GLU && has_bias, alpha, accumulate);
    }
  }
}

// The packed GEMM's local memory, declared at a kernel's scope (where OpenCL C allows local
// variables): packed_panel (whole groups of 16 steps: AMX reads the last one whole) and, with
// PANEL_ROWS, the rows' partial sums between chunks, which PACKED_PARTIAL names (0 without).
#if PANEL_ROWS
#define PACKED_LOCALS                                                                        \
  local uint packed_panel[(PANEL_KP + 15) / 16 * 16 * PANEL_STEP_WORDS] __attribute__((aligned(64))); \
  local float packed_partial[PANEL_ROWS * PANEL_NC] __attribute__((aligned(64)));
#define PACKED_PARTIAL packed_partial
#else
#define PACKED_LOCALS \
  local uint packed_panel[(PANEL_KP + 15) / 16 * 16 * PANEL_STEP_WORDS] __attribute__((aligned(64)));
#define PACKED_PARTIAL 0
#endif

// One work-item's column tile of the packed GEMM over rows [m_begin, m_end) of xb (row stride
// ldxb; the rounded bf16 rows, or with PANEL_XF32 the f32 ones): packs the tile's weight rows
// (rows[c], FP8: with their block-scale rows srows[c]) PANEL_KP pair steps at a time into panel,
// and runs its row tiles over each chunk; with more than one chunk (built with -DPANEL_ROWS, at
// least m_end - m_begin) the rows' partial sums wait in `partial` between chunks. The outputs go
// to y's rows m_begin .. m_end - 1, columns n0 .. (panel_store). next: the weights to prefetch
// while the rows run (null for none). linear_bf16.cl's dense GEMM and moe.cl's grouped experts
// run their tiles through it, so a row gets the same sums in either.
inline void packed_column_tile(global const panel_x_t* xb, uint ldxb,
                               global const panel_w_t* const* rows,
                               global const float* const* srows, uint K, uint m_begin, uint m_end,
                               uint n0, uint N, PanelPrefetch* next, local uint* panel,
                               local float* partial, global const ushort* bias, int has_bias,
                               global float* y, uint ldy, float alpha, int accumulate) {
  const uint steps = (K + 1) / 2;  // pair steps; with K odd the last holds one element
  float sums[PANEL_TM * PANEL_NC] __attribute__((aligned(64)));
  for (uint kc = 0; kc < steps; kc += PANEL_KP) {
    const uint kc_end = min(steps, kc + PANEL_KP);
    const bool first = kc == 0, last = kc_end == steps;
    pack_panel(rows, srows, K, kc, kc_end, panel);
    for (uint m0 = m_begin; m0 < m_end; m0 += PANEL_TM) {
#if PANEL_ROWS
      local float* part = partial + (size_t)(m0 - m_begin) * PANEL_NC;
      if (!first)
        for (int q = 0; q < PANEL_TM * PANEL_NV; ++q) vstore16(vload16(q, part), q, sums);
#endif
#if BF16_AMX
      // The tile's rows as they lie (a last tile of fewer rows configures fewer).
      panel_tile_sums_amx((ulong)((global const uint*)(xb + (size_t)m0 * ldxb) + kc),
                          (ulong)ldxb * sizeof(panel_x_t), min((uint)PANEL_TM, m_end - m0),
                          (ulong)panel, kc_end - kc, first, sums, next);
#else
      // Rows past the edge compute on the last row (clamped) and are not stored.
      global const panel_xr_t* xr[PANEL_TM];
#pragma unroll
      for (int i = 0; i < PANEL_TM; ++i) {
        global const panel_x_t* row = xb + (size_t)min(m0 + i, m_end - 1) * ldxb;
#if PANEL_XF32
        xr[i] = row + 2 * kc;
#else
        xr[i] = (global const int*)row + kc;
#endif
      }
      panel_tile_sums(xr, panel, kc_end - kc, last && (K & 1), first, sums, next);
#endif
      if (next) next->line += kc_end - kc;
#if PANEL_ROWS
      if (!last) {
        for (int q = 0; q < PANEL_TM * PANEL_NV; ++q) vstore16(vload16(q, sums), q, part);
        continue;
      }
#endif
      panel_store(sums, m0, m_end, n0, N, bias, has_bias, y, ldy, alpha, accumulate);
    }
  }
}
