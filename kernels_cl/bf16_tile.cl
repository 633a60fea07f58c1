// The bf16-compute tile's sums (model.compute_dtype: bf16), shared by linear_bf16.cl's GEMM and
// moe.cl's grouped experts through #include, so a row's sums are the same operations whichever
// launch computes them. The including file defines TM, TN, GLU and BF16_DOT first.
//
// The tile (TM rows x TN weight rows) is a dot product along K in 16 lanes of f32 partial sums:
// lane l of step s takes the bf16 pairs (2l, 2l + 1) of the 32 elements at 32 s. The pair is
// added odd element first, then even, each product exact in f32 and each add rounded once:
// vdpbf16ps's order, so the two micro-kernels below agree up to bf16 denormals (which the
// instruction reads as zero). The lanes' sums meet in hsum16's order; K % 32 elements are added
// last, one at a time.
//
// Micro-kernels, chosen by the host per device (runtime/ops.cpp):
// -DBF16_DOT=1: vdpbf16ps through clang's per-function target attribute, for PoCL on a host CPU
//   that reports avx512_bf16 (the instruction faults elsewhere). PoCL compiles for a CPU name
//   without the feature and rejects -m options; the attribute is what reaches it. The function must
//   stay out of line (inlining into the kernel drops the attribute) and use no OpenCL builtins
//   (the vload builtins are rejected inside it), so it loads through unaligned vector types.
// -DBF16_DOT=0: the same sums with f32 FMAs on the bf16 values widened by a shift, any device;
//   -DPAIRS_ALIGNED=1 where every row starts on a 4-byte boundary.
// The weight rows are global memory, or with -DFP8_BF16_PANEL=1 a work-item's private panel of
// rows it dequantized itself from FP8 (below; 4-byte aligned).
#if FP8_BF16_PANEL
#define BF16_W_SPACE private
#else
#define BF16_W_SPACE global
#endif

typedef short v32s_u __attribute__((__vector_size__(64), __aligned__(2)));
typedef int v16i __attribute__((__vector_size__(64)));
typedef float v16f __attribute__((ext_vector_type(16)));
typedef float v16f_u __attribute__((ext_vector_type(16), __aligned__(4)));

// Where the tile's sum (i, j) sits in the micro-kernels' out array of OUT_PADDED floats (16 per
// vector, the slots past the tile zero): row-major, or with GLU the TM x TN / 2 gate sums first
// and the up sums from GLU_PADDED, so that the epilogue takes both 16 at a time.
#if GLU
#define GLU_PADDED ROUND16(TM * (TN / 2))
#define OUT_PADDED (2 * GLU_PADDED)
#define OUT_INDEX(i, j) \
  ((j) < TN / 2 ? (i) * (TN / 2) + (j) : GLU_PADDED + (i) * (TN / 2) + (j) - TN / 2)
#else
#define OUT_PADDED ROUND16(TM * TN)
#define OUT_INDEX(i, j) ((i) * TN + (j))
#endif

// While a work-item's last row tile of a column tile runs (its weight rows then come from cache,
// read by the tiles before it), the lines of the next column tile's weight rows are prefetched
// (pf: their TN row pointers; null for none): a step reads one 64-byte line of each row, so one
// prefetch per row and step. Only with -DPREFETCH_X86=1 (common.cl's PREFETCH_LINE).
#if PREFETCH_X86
#define PREFETCH_NEXT_ROWS(pf, k)                                            \
  if (pf) {                                                                  \
    _Pragma("unroll") for (int j = 0; j < TN; ++j) PREFETCH_LINE((pf)[j] + (size_t)(k) * 32); \
  }
#else
#define PREFETCH_NEXT_ROWS(pf, k)
#endif

// The micro-kernels' row pointers (xr_in, wr_in, pf_in: the caller's arrays) as locals xr, wr
// and pf: the prefetch is a volatile asm statement, after which pointers read through the
// caller's arrays were loaded again (as in linear_tile.cl's tile_dots). llama3-1b's batch-8 decode
// at bf16 compute (the 8 x 4 vdpbf16ps tile; bench_llama --tuning-ab, in turn in one process)
// 1.035x [0.947, 1.053] and 1.020x [0.958, 1.078] faster in two runs of 7 and 9 rounds.
#define BF16_TILE_ROWS_AS_LOCALS                                  \
  global const ushort* xr[TM];                                    \
  BF16_W_SPACE const ushort* wr[TN];                              \
  global const ushort* pf_rows[TN];                               \
  global const ushort* const* pf = pf_in ? pf_rows : 0;           \
  _Pragma("unroll") for (int i = 0; i < TM; ++i) xr[i] = xr_in[i]; \
  _Pragma("unroll") for (int j = 0; j < TN; ++j) {                \
    wr[j] = wr_in[j];                                             \
    pf_rows[j] = pf_in ? pf_in[j] : 0;                            \
  }

// out[OUT_INDEX(i, j)] = the sum over the first K32 * 32 elements of xr[i] . wr[j].
#if BF16_DOT
__attribute__((target("avx512bf16,avx512f,avx512bw,avx512vl"))) __attribute__((noinline))
void tile_dots_bf16(global const ushort* const* xr_in, BF16_W_SPACE const ushort* const* wr_in,
                    uint K32, global const ushort* const* pf_in, float* out) {
  BF16_TILE_ROWS_AS_LOCALS
  v16f acc[TM][TN];
#if TM == 1 && COLUMNS_IN_TURN
  // One row (decode, K up to gemv_stream_k): the weight rows one after another, one sequential
  // stream, as linear_tile.cl's one-row tiles; each column's chain is the one below. With GLU the
  // next tile's rows are prefetched as it goes (gate and up alternate runs of two matrices, which
  // the hardware prefetcher does not follow).
#pragma unroll
  for (int j = 0; j < TN; ++j) {
    v16f a = (v16f)(0.0f);
    for (uint k = 0; k < K32; ++k) {
      const v16i xv = (v16i)(*(global const v32s_u*)(xr[0] + (size_t)k * 32));
      a = __builtin_ia32_dpbf16ps_512(
          a, xv, (v16i)(*(BF16_W_SPACE const v32s_u*)(wr[j] + (size_t)k * 32)));
#if PREFETCH_X86 && GLU
      if (pf) PREFETCH_LINE(pf[j] + (size_t)k * 32);
#endif
    }
    acc[0][j] = a;
  }
#else
#pragma unroll
  for (int i = 0; i < TM; ++i)
#pragma unroll
    for (int j = 0; j < TN; ++j) acc[i][j] = (v16f)(0.0f);
  for (uint k = 0; k < K32; ++k) {
    v16i wv[TN];
#pragma unroll
    for (int j = 0; j < TN; ++j)
      wv[j] = (v16i)(*(BF16_W_SPACE const v32s_u*)(wr[j] + (size_t)k * 32));
    PREFETCH_NEXT_ROWS(pf, k);
#pragma unroll
    for (int i = 0; i < TM; ++i) {
      const v16i xv = (v16i)(*(global const v32s_u*)(xr[i] + (size_t)k * 32));
#pragma unroll
      for (int j = 0; j < TN; ++j) acc[i][j] = __builtin_ia32_dpbf16ps_512(acc[i][j], xv, wv[j]);
    }
  }
#endif
  // The sums in OUT_INDEX's order, 16 per vector (common.cl's hsum16_x16; the slots past the
  // tile's add zeros). A 4 x 6 tile's code after its loop went from 200 instructions to about 80;
  // with the GLU epilogue's sums 16 at a time (linear_bf16 below), the 512-row GEMMs ran
  // 1.05-1.09x (gate|up with SwiGLU), 1.01 (q/k/v), 1.02 (o) and 1.02x (down) faster than with
  // hsum16 one by one (in-process A/B on the 2-core EPYC, 15 pairs each).
  v16f flat[OUT_PADDED];
#pragma unroll
  for (int p = 0; p < OUT_PADDED; ++p) flat[p] = (v16f)(0.0f);
#pragma unroll
  for (int i = 0; i < TM; ++i)
#pragma unroll
    for (int j = 0; j < TN; ++j) flat[OUT_INDEX(i, j)] = acc[i][j];
#pragma unroll
  for (int p = 0; p < OUT_PADDED; p += 16) *(v16f_u*)(out + p) = hsum16_x16(flat + p);
}
#else
// The 32 bf16 values at p as f32: lane l of *even gets element 2l, of *odd element 2l + 1. With
// -DPAIRS_ALIGNED=1 (the host's promise that every row starts on a 4-byte boundary: even row
// strides and offsets) as 16 4-byte words, else as ushorts: a weight row of odd K starts on a
// 2-byte boundary only, and GPUs fault on a misaligned 4-byte load (NVIDIA's OpenCL reports
// CL_OUT_OF_RESOURCES). The words measured ~20% faster on PoCL (AVX-512, no avx512_bf16 path).
inline void bf16_word_pairs(uint16 u, float16* even, float16* odd) {
  *even = as_float16(u << 16);
  *odd = as_float16(u & 0xffff0000u);
}
inline void bf16x32_pairs(global const ushort* p, float16* even, float16* odd) {
#if PAIRS_ALIGNED
  bf16_word_pairs(vload16(0, (global const uint*)p), even, odd);
#else
  const ushort16 a = vload16(0, p), b = vload16(1, p);
  *even = as_float16(convert_uint16((ushort16)(a.even, b.even)) << 16);
  *odd = as_float16(convert_uint16((ushort16)(a.odd, b.odd)) << 16);
#endif
}
// The weight rows' loads: a private panel's rows are aligned, so always words.
#if FP8_BF16_PANEL
inline void bf16x32_weight_pairs(private const ushort* p, float16* even, float16* odd) {
  bf16_word_pairs(vload16(0, (private const uint*)p), even, odd);
}
#else
#define bf16x32_weight_pairs bf16x32_pairs
#endif

void tile_dots_bf16(global const ushort* const* xr_in, BF16_W_SPACE const ushort* const* wr_in,
                    uint K32, global const ushort* const* pf_in, float* out) {
  BF16_TILE_ROWS_AS_LOCALS
  float16 acc[TM][TN];
#pragma unroll
  for (int i = 0; i < TM; ++i)
#pragma unroll
    for (int j = 0; j < TN; ++j) acc[i][j] = (float16)(0.0f);
  for (uint k = 0; k < K32; ++k) {
    float16 w_even[TN], w_odd[TN];
#pragma unroll
    for (int j = 0; j < TN; ++j)
      bf16x32_weight_pairs(wr[j] + (size_t)k * 32, &w_even[j], &w_odd[j]);
    PREFETCH_NEXT_ROWS(pf, k);
#pragma unroll
    for (int i = 0; i < TM; ++i) {
      float16 x_even, x_odd;
      bf16x32_pairs(xr[i] + (size_t)k * 32, &x_even, &x_odd);
#pragma unroll
      for (int j = 0; j < TN; ++j) {
        acc[i][j] = fma(x_odd, w_odd[j], acc[i][j]);
        acc[i][j] = fma(x_even, w_even[j], acc[i][j]);
      }
    }
  }
#pragma unroll
  for (int p = 0; p < OUT_PADDED; ++p) out[p] = 0.0f;
#pragma unroll
  for (int i = 0; i < TM; ++i)
#pragma unroll
    for (int j = 0; j < TN; ++j) out[OUT_INDEX(i, j)] = hsum16(acc[i][j]);
}
#endif

// out[OUT_INDEX(i, j)] = xr[i] . wr[j] over K: the micro-kernel's whole 32-element steps, then
// the K % 32 elements one at a time.
inline void tile_sums_bf16(global const ushort* xr[TM], BF16_W_SPACE const ushort* wr[TN], uint K,
                           global const ushort* const* pf, float* out) {
  const uint K32 = K / 32;
  tile_dots_bf16(xr, wr, K32, pf, out);
  for (uint k = K32 * 32; k < K; ++k) {
#pragma unroll
    for (int i = 0; i < TM; ++i) {
      const float xk = bf16_to_f32(xr[i][k]);
#pragma unroll
      for (int j = 0; j < TN; ++j)
        out[OUT_INDEX(i, j)] = fma(xk, bf16_to_f32(wr[j][k]), out[OUT_INDEX(i, j)]);
    }
  }
}

#if GLU
// The GLU epilogue: act[i * TN / 2 + j] = silu(gate sum) * (up sum) of the tile's sums (out in
// OUT_INDEX's order), 16 at a time: silu_mul's expression, with exp on 16 lanes.
inline void glu_act(const float* out, float* act) {
#pragma unroll
  for (int c = 0; c < GLU_PADDED; c += 16) {
    const float16 g = vload16(0, out + c);
    vstore16(g / (1.0f + exp(-g)) * vload16(0, out + GLU_PADDED + c), 0, act + c);
  }
}
#endif

#if FP8_BF16_PANEL
// FP8 weights under bf16 compute (moe.cl's grouped experts, linear_bf16.cl's FP8 GEMM): a
// work-item dequantizes a column tile's TN weight rows to bf16 once (code x block scale in f32,
// nearest even: dequantize_fp8's bf16 output, as DeepSeek's weight_dequant feeds its bf16 GEMMs)
// into a private panel of rows of BF16_PANEL_K (K rounded up to 16), which the tile's row tiles
// then read (common.cl's e4m3x16_dequant_bf16). Build options: -DBF16_PANEL_K, -DFP8_DENORM and
// -DFP8_NAN_WATCH (common.cl, fp8_tile.cl).

// The panel: the column tile's TN rows of K codes (wr, their scale rows sr) dequantized to bf16.
inline void fp8_panel(global const uchar* wr[TN], global const float* sr[TN], uint K,
                      ushort panel[TN][BF16_PANEL_K]) {
  const uint K16 = K / 16;
  for (int j = 0; j < TN; ++j) {
    // One 32-byte store per 16 (vstore16 to private memory became 16 two-byte stores).
    for (uint v = 0; v < K16; ++v)
      *(private ushort16*)(panel[j] + 16 * v) = e4m3x16_dequant_bf16(wr[j], sr[j], v);
    for (uint k = K16 * 16; k < K; ++k) panel[j][k] = e4m3_dequant_bf16(wr[j], sr[j], k);
  }
}
#endif
