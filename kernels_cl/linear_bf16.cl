// bf16 compute (model.compute_dtype: bf16): the prefill GEMM of bf16 weights with activations
// rounded to bf16 and f32 accumulation, as llama.cpp's bf16 path and AVX-512 BF16's vdpbf16ps do.
//
// round_bf16 rounds f32 activation rows to bf16 (round to nearest even) once per GEMM; linear_bf16
// multiplies them with the bf16 weights: y[m, :N] (+)= alpha * (x[m] [W0; W1; W2]^T (+ bias)),
// the weights' rows side by side as one output (q/k/v; n1, n2 where W1, W2 start), or with GLU
// y[m, n] = silu(x[m] . gate[n]) * (x[m] . up[n]) (gate W0, up W1).
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
// -DBF16_DOT=0: the same sums with f32 FMAs on the bf16 values widened by a shift, any device.
// Build options: -DTM, -DTN (tile), -DGLU=0|1, -DBF16_DOT=0|1, -DPAIRS_ALIGNED=0|1,
// -DWEIGHT_TYPE=1 (common.cl's wtype = ushort, for its fused_row), and -DPREFETCH_X86=1
// (ops::weight_prefetch_option).

#ifndef TM
#define TM 4
#endif
#ifndef TN
#define TN 4
#endif
#ifndef GLU
#define GLU 0
#endif
#ifndef BF16_DOT
#define BF16_DOT 0
#endif

// xb[m, k] = bf16(x[m, k]) for M rows of K (row strides ldx, ldxb in elements); with -DOUT_F32=1
// the rounded values are written back as f32 (xf), for devices that multiply them in the f32
// kernels. Launch: global (ceil(K / 64), M).
kernel void round_bf16(global const float* x, uint x_off, uint ldx,
#if OUT_F32
                       global float* xf,
#else
                       global ushort* xb,
#endif
                       uint ldxb, uint K) {
  const uint m = get_global_id(1);
  const uint k0 = get_global_id(0) * 64;
  const uint k1 = min(k0 + 64, K);
  global const float* xr = x + x_off + (size_t)m * ldx;
  for (uint k = k0; k < k1; ++k) {
    const ushort b = f32_to_bf16_rne(xr[k]);
#if OUT_F32
    xf[(size_t)m * ldxb + k] = bf16_to_f32(b);
#else
    xb[(size_t)m * ldxb + k] = b;
#endif
  }
}

// wf[n, k] = the bf16 weight w[w_off + n * ldw + k] as f32, for rows of K (wf's row stride K):
// bf16 weights widened for an f32 GEMM library (runtime/ops_blas.cpp). Launch: global
// (K rounded up to 64, rows), local (64, 1).
kernel void widen_bf16_rows(global const ushort* w, uint w_off, uint ldw, global float* wf,
                            uint K) {
  const uint n = get_global_id(1), k = get_global_id(0);
  if (k < K) wf[(size_t)n * K + k] = bf16_to_f32(w[w_off + (size_t)n * ldw + k]);
}

#ifdef LINEAR_BF16

typedef short v32s_u __attribute__((__vector_size__(64), __aligned__(2)));
typedef int v16i __attribute__((__vector_size__(64)));
typedef float v16f __attribute__((ext_vector_type(16)));
typedef float v16f_u __attribute__((ext_vector_type(16), __aligned__(4)));

// Where the tile's sum (i, j) sits in the micro-kernels' out array of OUT_PADDED floats (16 per
// vector, the slots past the tile zero): row-major, or with GLU the TM x TN / 2 gate sums first
// and the up sums from GLU_PADDED, so that the epilogue takes both 16 at a time.
#define ROUND16(n) (((n) + 15) / 16 * 16)
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

// out[OUT_INDEX(i, j)] = the sum over the first K32 * 32 elements of xr[i] . wr[j].
#if BF16_DOT
__attribute__((target("avx512bf16,avx512f,avx512bw,avx512vl"))) __attribute__((noinline))
void tile_dots_bf16(global const ushort* const* xr, global const ushort* const* wr, uint K32,
                    global const ushort* const* pf, float* out) {
  v16f acc[TM][TN];
#pragma unroll
  for (int i = 0; i < TM; ++i)
#pragma unroll
    for (int j = 0; j < TN; ++j) acc[i][j] = (v16f)(0.0f);
  for (uint k = 0; k < K32; ++k) {
    v16i wv[TN];
#pragma unroll
    for (int j = 0; j < TN; ++j) wv[j] = (v16i)(*(global const v32s_u*)(wr[j] + (size_t)k * 32));
    PREFETCH_NEXT_ROWS(pf, k);
#pragma unroll
    for (int i = 0; i < TM; ++i) {
      const v16i xv = (v16i)(*(global const v32s_u*)(xr[i] + (size_t)k * 32));
#pragma unroll
      for (int j = 0; j < TN; ++j) acc[i][j] = __builtin_ia32_dpbf16ps_512(acc[i][j], xv, wv[j]);
    }
  }
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
inline void bf16x32_pairs(global const ushort* p, float16* even, float16* odd) {
#if PAIRS_ALIGNED
  const uint16 u = vload16(0, (global const uint*)p);
  *even = as_float16(u << 16);
  *odd = as_float16(u & 0xffff0000u);
#else
  const ushort16 a = vload16(0, p), b = vload16(1, p);
  *even = as_float16(convert_uint16((ushort16)(a.even, b.even)) << 16);
  *odd = as_float16(convert_uint16((ushort16)(a.odd, b.odd)) << 16);
#endif
}

void tile_dots_bf16(global const ushort* const* xr, global const ushort* const* wr, uint K32,
                    global const ushort* const* pf, float* out) {
  float16 acc[TM][TN];
#pragma unroll
  for (int i = 0; i < TM; ++i)
#pragma unroll
    for (int j = 0; j < TN; ++j) acc[i][j] = (float16)(0.0f);
  for (uint k = 0; k < K32; ++k) {
    float16 w_even[TN], w_odd[TN];
#pragma unroll
    for (int j = 0; j < TN; ++j) bf16x32_pairs(wr[j] + (size_t)k * 32, &w_even[j], &w_odd[j]);
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

// The TN weight rows of the column tile from n0: side by side (fused_row), or with GLU the
// tile's TN / 2 gate rows, then the same columns' up rows. Columns past N take the last row
// (computed on, not stored).
inline void tile_weight_rows(uint n0, uint N, global const ushort* w0, uint ldw0, uint n1,
                             global const ushort* w1, uint ldw1, uint n2,
                             global const ushort* w2, uint ldw2, global const ushort* wr[TN]) {
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

// xb: [M, K] bf16 rows (row stride ldxb, a multiple of 32 keeps the loads aligned). One
// work-item owns n_tiles column tiles x m_rows rows, column tile outer (its weight rows stay in
// cache while the rows stream). Launch: global (row blocks, column blocks), local 1. Row blocks
// are the first dimension because PoCL's CPU driver hands each thread runs of consecutive
// work-groups, first dimension fastest: so the row blocks of one column block run one after
// another and find its weight rows in cache. With column blocks first, a 512-token prefill read
// every weight from memory once per 64-row block.
kernel void linear_bf16(global const ushort* xb, uint ldxb,
                        global const ushort* w0, uint w0_off, uint ldw0, uint n1,
                        global const ushort* w1, uint w1_off, uint ldw1, uint n2,
                        global const ushort* w2, uint w2_off, uint ldw2,
                        global const ushort* bias, uint b_off, int has_bias,
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
  const uint K32 = K / 32;
  global const ushort* next[TN];
  tile_weight_rows(n_begin, N, w0, ldw0, n1, w1, ldw1, n2, w2, ldw2, next);
  for (uint n0 = n_begin; n0 < n_end; n0 += tile_cols) {
    global const ushort* wr[TN];
#pragma unroll
    for (int j = 0; j < TN; ++j) wr[j] = next[j];
    const bool has_next = n0 + tile_cols < n_end;
    if (has_next) tile_weight_rows(n0 + tile_cols, N, w0, ldw0, n1, w1, ldw1, n2, w2, ldw2, next);
    for (uint m0 = m_begin; m0 < m_end; m0 += TM) {
      // Rows and columns past the edge compute on a valid row (clamped) and are not stored.
      global const ushort* xr[TM];
#pragma unroll
      for (int i = 0; i < TM; ++i) xr[i] = xb + (size_t)min(m0 + i, M - 1) * ldxb;
      float out[OUT_PADDED];
      tile_dots_bf16(xr, wr, K32, has_next && m0 + TM >= m_end ? next : 0, out);
      for (uint k = K32 * 32; k < K; ++k) {
#pragma unroll
        for (int i = 0; i < TM; ++i) {
          const float xk = bf16_to_f32(xr[i][k]);
#pragma unroll
          for (int j = 0; j < TN; ++j)
            out[OUT_INDEX(i, j)] = fma(xk, bf16_to_f32(wr[j][k]), out[OUT_INDEX(i, j)]);
        }
      }
#if GLU
      // silu(gate) * up, 16 at a time (silu_mul's expression), from the two halves of out.
      float act[GLU_PADDED];
#pragma unroll
      for (int c = 0; c < GLU_PADDED; c += 16) {
        const float16 g = vload16(0, out + c);
        vstore16(g / (1.0f + exp(-g)) * vload16(0, out + GLU_PADDED + c), 0, act + c);
      }
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
