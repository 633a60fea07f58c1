// Multi-head latent attention (DeepSeek-V2/V3 MLA) over a paged latent cache.
//
// Cache of one layer: [num_pages + 1][page_size][LKV + DR] ctype elements (common.cl: f32, or bf16
// rounded to nearest even with -DCACHE_TYPE=1, read back widened to f32); the row of a token is
// [ RMSNorm(c_kv) * kv_a_layernorm (LKV) | RoPE(k_pe) (DR) ] (576 wide for V3), the last page is
// the null page that pads lookup tables. One row serves every head: it is K (all of it) and V (its
// first LKV values) in the latent space of the absorbed decode path, and the source of K-nope / V
// (through kv_b_proj) and of the shared roped key in the decompressed prefill path.
//
// Shaped for CPU OpenCL like the other kernels: a work-item owns a contiguous chunk, local size 1,
// 16-wide loads. Build options (per kernel, as needed):
//   -DWKIND=0|1|2   kv_b_proj weight: f32 | bf16 | f8e4m3 with [ceil(n/128), ceil(k/128)] f32 block
//                   multipliers (`weight_scale_inv`), dequantised in registers
//   -DNORM_BF16=0|1 kv_a_layernorm weight dtype
//   -DINTERLEAVED=0|1 RoPE pairs (2i, 2i+1) as DeepSeek's checkpoints, or (i, i + d/2)
//   -DLKV=.. -DDR=.. -DDN=.. -DDV=.. the MLA dimensions (multiples of 16 for LKV/DR, of 8 for DN/DV)

#ifndef WKIND
#define WKIND 0
#endif

// e4m3fn -> f32: e4m3x16_to_f32 / e4m3_to_f32 of common.cl (exact, NaN codes as NaN).

#if WKIND == 1
typedef ushort wtype;
#define LOADW16(i, p) bf16x16_to_f32(vload16((i), (p)))
#define LOADW1(p) bf16_to_f32(*(p))
#elif WKIND == 2
typedef uchar wtype;
#define LOADW16(i, p) e4m3x16_to_f32(vload16((i), (p)))
#define LOADW1(p) e4m3_to_f32(*(p))
#else
typedef float wtype;
#define LOADW16(i, p) vload16((i), (p))
#define LOADW1(p) (*(p))
#endif

// The multiplier of weight element (row, col): its 128x128 block's scale for fp8, else 1.
#if WKIND == 2
#define WSCALE(scales, ld, row, col) ((scales)[((row) >> 7) * (ld) + ((col) >> 7)])
#else
#define WSCALE(scales, ld, row, col) 1.0f
#endif

#if NORM_BF16
#define LOADN(p) bf16_to_f32(*(p))
typedef ushort ntype;
#else
#define LOADN(p) (*(p))
typedef float ntype;
#endif

inline size_t cache_row_index(global const uint* lut, uint pos, uint page_size) {
  return (size_t)lut[pos / page_size] * page_size + pos % page_size;
}

// The DR / 2 pairs' rotation at position pos: c[i], s[i] = cos, sin of pos * inv_freq[i], times
// YaRN's attention factor. One token's heads and key share it: made once per token, where each
// head had taken its own cos and sin. In a perf profile of dsv3-mini's bf16-compute prefill,
// mla_rope_store went from 5.3% of the bf16 GEMM tiles' samples to 0.5%.
inline void rope_angles(uint pos, global const float* inv_freq, float factor, float* c, float* s) {
  for (uint i = 0; i < DR / 2; ++i) {
    const float angle = (float)pos * inv_freq[i];
    c[i] = cos(angle) * factor;
    s[i] = sin(angle) * factor;
  }
}

// Rotates the DR / 2 pairs of x by rope_angles' c, s; in global memory (rope_pairs) or private
// (rope_pairs_private: a key rotated before it is narrowed).
#if INTERLEAVED
#define ROPE_PAIR_INDEX(i, n) const uint i0 = 2 * (i), i1 = 2 * (i) + 1
#else
#define ROPE_PAIR_INDEX(i, n) const uint i0 = (i), i1 = (i) + (n)
#endif
#define DEFINE_ROPE_PAIRS(NAME, SPACE)                                  \
  inline void NAME(SPACE float* x, const float* c, const float* s) {   \
    for (uint i = 0; i < DR / 2; ++i) {                                 \
      ROPE_PAIR_INDEX(i, DR / 2);                                       \
      const float a = x[i0], b = x[i1];                                 \
      x[i0] = a * c[i] - b * s[i];                                      \
      x[i1] = a * s[i] + b * c[i];                                      \
    }                                                                   \
  }
DEFINE_ROPE_PAIRS(rope_pairs, global)
DEFINE_ROPE_PAIRS(rope_pairs_private, private)

// Per new token: RoPE on every head's q_pe (in place in q), and the cache row from the raw
// kv_a_proj_with_mqa output [c_kv (LKV) | k_pe (DR)]: normalised latent, roped key.
// q: head h of token t at q[q_off + t * ldq + h * qk_dim], [nope (qk_dim - DR) | pe (DR)].
kernel void mla_rope_store(global float* q, uint q_off, uint ldq, uint n_heads, uint qk_dim,
                           global const float* kv, uint kv_off, uint ldkv,
                           global const ntype* norm_w, float eps, global const float* inv_freq,
                           float rope_factor, global const uint* token_row,
                           global const uint* token_pos, global const uint* lookup,
                           uint pages_per_row, uint page_size, global ctype* cache) {
  const uint t = get_global_id(0);
  const uint pos = token_pos[t];
  global float* qt = q + q_off + (size_t)t * ldq;
  float c[DR / 2], s[DR / 2];
  rope_angles(pos, inv_freq, rope_factor, c, s);
  for (uint h = 0; h < n_heads; ++h) rope_pairs(qt + h * qk_dim + (qk_dim - DR), c, s);

  global const float* src = kv + kv_off + (size_t)t * ldkv;
  global const uint* lut = lookup + (size_t)token_row[t] * pages_per_row;
  global ctype* row = cache + cache_row_index(lut, pos, page_size) * (LKV + DR);
  float ss = 0.0f;
  for (uint i = 0; i < LKV; ++i) ss = fma(src[i], src[i], ss);
  const float inv = 1.0f / sqrt(ss / (float)LKV + eps);
  for (uint i = 0; i < LKV; ++i) STOREC1((src[i] * inv) * LOADN(norm_w + i), row + i);
#if CACHE_TYPE == 0
  for (uint i = 0; i < DR; ++i) row[LKV + i] = src[LKV + i];
  rope_pairs(row + LKV, c, s);
#else
  // The key rotated in f32, then rounded once as it is stored.
  float pe[DR];
  for (uint i = 0; i < DR; ++i) pe[i] = src[LKV + i];
  rope_pairs_private(pe, c, s);
  for (uint i = 0; i < DR; ++i) STOREC1(pe[i], row + LKV + i);
#endif
}

// ---- decode path: attention in the latent space ------------------------------------------------

// Query absorption: qf[t, h] = [ q_nope[t, h] . W_uk[h] (LKV) | q_pe[t, h] (DR) ], where
// W_uk[h] = kv_b_proj rows h*(DN+DV) .. h*(DN+DV)+DN-1 (each LKV long). A work-item owns ABS_TM
// tokens (-DABS_TM=1..4) and ABS_CHUNK columns of one head (-DABS_CHUNK: LKV for one token, 128
// or 64 for more, so that the sums stay in registers) and streams the DN weight rows of that chunk
// once, adding each weight vector times every token's q_nope[d] to the tokens' sums. One token's
// work-item reads the head's rows front to back; its LKV sums outgrow the registers and live in
// L1, which cost less than reading the rows in pieces.
// An fp8 block's scale multiplies the q value rather than each weight vector (one product per row
// and 128 columns, where there had been one per 16 weights), and weights free of NaN codes
// (-DKV_B_NAN_FREE=1, the load-time scan) take common.cl's short decode with its power-of-two
// factors; with NaN codes the exact decode carries them into the sums.
// Work-items had taken 64 columns of one token (or of four): a one-token step read each row in
// 64-byte pieces, one cache miss per row, and a step of 2-3 tokens read the weights once per
// token. On the 2-core EPYC (dsv3-mini's kv_b_proj, 24 launches in a row over 24 copies, processes
// interleaved with the earlier kernels): 1 token fp8 0.15-0.22 -> 0.12-0.13 ms, bf16 0.12-0.14 ->
// 0.10-0.12 ms; 2-3 tokens fp8 0.27-0.32 -> 0.15-0.20 ms, bf16 0.17-0.24 -> 0.17-0.18 ms; 4 and 8
// tokens, which keep 64 columns, about even (0.16-0.27 ms either way).
#ifndef ABS_TM
#define ABS_TM 1
#endif
#ifndef ABS_CHUNK
#define ABS_CHUNK LKV
#endif
#if WKIND == 2 && KV_B_NAN_FREE
#define ABS_LOADW16(i, p) e4m3x16_decode_scaled(vload16((i), (p)))
#define ABS_X_SCALE FP8_X_SCALE
#define ABS_ACC_SCALE FP8_ACC_SCALE
#else
#define ABS_LOADW16(i, p) LOADW16((i), (p))
#define ABS_X_SCALE 1.0f
#define ABS_ACC_SCALE 1.0f
#endif
#define ABS_BLOCKS ((ABS_CHUNK + 127) / 128)
kernel void mla_absorb_q(global const float* q, uint q_off, uint ldq, global const wtype* w,
                         global const float* wscale, uint ld_scale, uint T, uint n_heads,
                         global float* qf) {
  const uint n_chunks = (LKV + ABS_CHUNK - 1) / ABS_CHUNK;
  const uint h = get_global_id(0) / n_chunks;
  const uint c0 = (get_global_id(0) % n_chunks) * ABS_CHUNK;
  const uint nv = min((uint)ABS_CHUNK, (uint)LKV - c0) / 16;
  const uint t0 = get_global_id(1) * ABS_TM;
  const uint qk = DN + DR;
  float16 acc[ABS_TM][ABS_CHUNK / 16];
#pragma unroll
  for (int i = 0; i < ABS_TM; ++i)
#pragma unroll
    for (int v = 0; v < ABS_CHUNK / 16; ++v) acc[i][v] = (float16)(0.0f);
  global const float* qr[ABS_TM];
#pragma unroll
  for (int i = 0; i < ABS_TM; ++i)
    qr[i] = q + q_off + (size_t)min(t0 + i, T - 1) * ldq + h * qk;
  for (uint d = 0; d < DN; ++d) {
    const uint r = h * (DN + DV) + d;
    global const wtype* wr = w + (size_t)r * LKV + c0;
    // Each token's q_nope[d] times the scale of each 128-column block.
    float qd[ABS_TM][ABS_BLOCKS];
#pragma unroll
    for (int b = 0; b < ABS_BLOCKS; ++b) {
      const float s = WSCALE(wscale, ld_scale, r, min(c0 + 128 * b, (uint)LKV - 1)) * ABS_X_SCALE;
#pragma unroll
      for (int i = 0; i < ABS_TM; ++i) qd[i][b] = qr[i][d] * s;
    }
#pragma unroll
    for (int v = 0; v < ABS_CHUNK / 16; ++v) {
      if ((uint)v < nv) {  // a guard, not a break: the loop stays unrolled
        const float16 wv = ABS_LOADW16(v, wr);
#pragma unroll
        for (int i = 0; i < ABS_TM; ++i) acc[i][v] = fma((float16)(qd[i][v / 8]), wv, acc[i][v]);
      }
    }
  }
  for (int i = 0; i < ABS_TM; ++i) {
    if (t0 + i >= T) break;
    global float* o = qf + ((size_t)(t0 + i) * n_heads + h) * (LKV + DR);
    for (uint v = 0; v < nv; ++v) vstore16(acc[i][v] * ABS_ACC_SCALE, 0, o + c0 + 16 * v);
    if (c0 == 0)
      for (uint j = 0; j < DR; ++j) o[LKV + j] = qr[i][DN + j];
  }
}

// Causal attention of each new token over its row's cache rows 0..pos: score = scale * qf . row
// (LKV + DR wide), value = row[:LKV]. A work-item owns a token and DEC_G of its heads (-DDEC_G;
// heads past n_heads repeat the last one and are not stored): every head reads the same rows (one
// latent KV head), so each row's vectors are loaded once for the work-item's heads, as
// attention.cl's GQA heads share theirs. Blocks of 16 positions with an online softmax: a head's
// 16 scores come out as one vector (common.cl's hsum16_x16) and their weights as one vector exp
// (softmax_block16); the values are summed a column vector at a time over the block's rows, each
// head's sums in registers.
// A work-item per (token, head) had read every row once per head, with a scalar exp per score.
// On the 2-core EPYC (dsv3-mini's 16 heads, 8 per work-item; 6 layers' caches in turn, processes
// interleaved with the earlier kernel): 1 token at context 128 0.12-0.13 -> 0.07-0.08 ms, at 1024
// 1.09-1.17 -> 0.48-0.68 ms (bf16 cache 0.56-0.95 -> 0.23-0.44 ms); 8 tokens at 128 0.77-1.19 ->
// 0.70-0.74 ms, at 1024 6.2-6.5 -> 3.0-3.1 ms.
#define ATT_BLOCK 16
#ifndef DEC_G
#define DEC_G 1
#endif
#define DEC_QV ((LKV + DR) / 16)
#define DEC_VV (LKV / 16)
kernel void mla_decode_attention(global const float* qf, global const ctype* cache,
                                 global const uint* token_row, global const uint* token_pos,
                                 global const uint* lookup, uint pages_per_row, uint page_size,
                                 uint n_heads, float scale, global float* out) {
  const uint t = get_global_id(0);
  const uint h0 = get_global_id(1) * DEC_G;
  const uint last = token_pos[t];
  global const uint* lut = lookup + (size_t)token_row[t] * pages_per_row;
  float16 qv[DEC_G][DEC_QV], acc[DEC_G][DEC_VV];
  float m[DEC_G], l[DEC_G];
#pragma unroll
  for (int g = 0; g < DEC_G; ++g) {
    global const float* qp = qf + ((size_t)t * n_heads + min(h0 + g, n_heads - 1)) * (LKV + DR);
    for (int i = 0; i < DEC_QV; ++i) qv[g][i] = vload16(i, qp) * scale;
    for (int i = 0; i < DEC_VV; ++i) acc[g][i] = (float16)(0.0f);
    m[g] = -INFINITY;
    l[g] = 0.0f;
  }
  for (uint p0 = 0; p0 <= last; p0 += ATT_BLOCK) {
    const uint n = min((uint)ATT_BLOCK, last + 1 - p0);
    // The block's rows; past n the last one again (scored, then masked).
    global const ctype* row[ATT_BLOCK];
    for (uint j = 0; j < ATT_BLOCK; ++j)
      row[j] = cache + cache_row_index(lut, p0 + min(j, n - 1), page_size) * (LKV + DR);
    float16 dots[DEC_G][ATT_BLOCK];
    for (uint j = 0; j < ATT_BLOCK; ++j) {
#if PREFETCH_X86
      // The row two positions on into L1 while this one is scored. The scores had waited on the
      // rows' loads (most of the kernel's samples in a perf profile; a work-item scored a row in
      // about the same time from DRAM as from L3), and prefetching into L2 (prefetcht1, one block
      // ahead or two rows) gained nothing. On the 2-core EPYC, dsv3-mini's shape with 8 heads per
      // work-item (6 layers' caches in turn, in-process, ahead / not): context 1024 1.08-1.51x,
      // 4096 1.21-1.37x (1 to 3 rows ahead alike), 128 even.
      if (p0 + j + 2 <= last) {
        global const uchar* ahead = (global const uchar*)(
            cache + cache_row_index(lut, p0 + j + 2, page_size) * (LKV + DR));
        for (uint c = 0; c < (LKV + DR) * sizeof(ctype); c += 64) PREFETCH_LINE_L1(ahead + c);
      }
#endif
      // Two accumulators per head halve the FMA dependency chain (36 vectors long for V3).
      float16 d0[DEC_G], d1[DEC_G];
#pragma unroll
      for (int g = 0; g < DEC_G; ++g) d0[g] = d1[g] = (float16)(0.0f);
      for (int i = 0; i + 1 < DEC_QV; i += 2) {
        const float16 r0 = LOADC16(i, row[j]), r1 = LOADC16(i + 1, row[j]);
#pragma unroll
        for (int g = 0; g < DEC_G; ++g) {
          d0[g] = fma(qv[g][i], r0, d0[g]);
          d1[g] = fma(qv[g][i + 1], r1, d1[g]);
        }
      }
      if (DEC_QV % 2) {
        const float16 r = LOADC16(DEC_QV - 1, row[j]);
#pragma unroll
        for (int g = 0; g < DEC_G; ++g) d0[g] = fma(qv[g][DEC_QV - 1], r, d0[g]);
      }
#pragma unroll
      for (int g = 0; g < DEC_G; ++g) dots[g][j] = d0[g] + d1[g];
    }
    float w[DEC_G][ATT_BLOCK], corr[DEC_G];
#pragma unroll
    for (int g = 0; g < DEC_G; ++g) {
      float16 e;
      corr[g] = softmax_block16(hsum16_x16(dots[g]), n, &m[g], &l[g], &e);
      vstore16(e, 0, w[g]);
    }
    for (int i = 0; i < DEC_VV; ++i) {
      float16 a[DEC_G];
#pragma unroll
      for (int g = 0; g < DEC_G; ++g) a[g] = acc[g][i] * corr[g];
      for (uint j = 0; j < n; ++j) {
        const float16 r = LOADC16(i, row[j]);
#pragma unroll
        for (int g = 0; g < DEC_G; ++g) a[g] = fma((float16)(w[g][j]), r, a[g]);
      }
#pragma unroll
      for (int g = 0; g < DEC_G; ++g) acc[g][i] = a[g];
    }
  }
#pragma unroll
  for (int g = 0; g < DEC_G; ++g) {
    if (h0 + g < n_heads) {
      global float* o = out + ((size_t)t * n_heads + h0 + g) * LKV;
      const float inv_l = 1.0f / l[g];
      for (int i = 0; i < DEC_VV; ++i) vstore16(acc[g][i] * inv_l, i, o);
    }
  }
}

// Per-head linear with rows taken from a slice of each head's block of kv_b_proj:
//   y[t, h*N + n] = sum_k x[t, h*LKV + k] * W[h*(DN+DV) + row0 + n, k],  k < LKV
// (the output up-projection W_uv of the decode path: row0 = DN, N = DV). Per head a GEMM of
// linear.cl's tiles: linear_tile.cl's tile_dots, fp8_tile.cl's fp8_tile_dots for fp8 (the same
// operations as ops::linear's and ops::linear_fp8's tiles). A work-item owns n_tiles TN-row tiles
// of one head (a tile never crosses a 128-row block: DN, DV and N are multiples of 8) for m_rows
// tokens, as linear.cl's work-items do. Build options -DTM -DTN -DCOLUMNS_IN_TURN (chosen as
// ops::linear chooses them, and for fp8 one tile in turn of up to 3 tokens as ops::linear_fp8's)
// and for fp8 fp8_tile.cl's. Where there had been 512
// work-items a launch, each reading its 4 rows side by side (2 KB of fp8), on the 2-core EPYC (as
// mla_absorb_q's figures): 1 token fp8 0.18-0.19 -> 0.08 ms, bf16 0.16-0.17 -> 0.10-0.11 ms;
// 2-3 tokens fp8 0.33-0.48 -> 0.10-0.11 ms, bf16 0.24-0.38 -> 0.13-0.19 ms; 4-8 tokens fp8
// 0.24-0.37 -> 0.15-0.24 ms, bf16 about even (0.22-0.30 ms).
#include "tile_shape.cl"
#if WKIND == 2
#include "fp8_tile.cl"
#else
#include "linear_tile.cl"
#endif
kernel void mla_head_linear(global const float* x, global const wtype* w,
                            global const float* wscale, uint ld_scale, uint row0, uint N,
                            uint n_heads, uint M, global float* y, uint y_off, uint ldy,
                            uint n_tiles, uint m_rows) {
  const uint col_blocks = ((N + TN - 1) / TN + n_tiles - 1) / n_tiles;
  const uint h = get_global_id(0) / col_blocks;
  const uint n_begin = (get_global_id(0) % col_blocks) * n_tiles * TN;
  const uint n_end = min(n_begin + n_tiles * TN, N);
  const uint m_begin = get_global_id(1) * m_rows, m_end = min(m_begin + m_rows, M);
#if WKIND == 2
  Fp8TileCache sx;
  sx.row = 0;
#endif
#if COLUMNS_IN_TURN
  for (uint m0 = m_begin; m0 < m_end; m0 += TM)
    for (uint n0 = n_begin; n0 < n_end; n0 += TN) {
#else
  for (uint n0 = n_begin; n0 < n_end; n0 += TN)
    for (uint m0 = m_begin; m0 < m_end; m0 += TM) {
#endif
      global const float* xr[TM];
      global const wtype* wr[TN];
#pragma unroll
      for (int i = 0; i < TM; ++i) xr[i] = x + ((size_t)min(m0 + i, M - 1) * n_heads + h) * LKV;
      const uint r0 = h * (DN + DV) + row0;
#pragma unroll
      for (int j = 0; j < TN; ++j) wr[j] = w + (size_t)(r0 + min(n0 + j, N - 1)) * LKV;
      float out[TM][TN];
#if WKIND == 2
      bool row_has_nan[TN];
      fp8_tile_dots(xr, wr, fp8_scale_row(wscale, r0 + n0, ld_scale), ld_scale, LKV, TM, &sx,
                    out, row_has_nan);
#else
      tile_dots(xr, wr, LKV, 0, out);
#endif
#pragma unroll
      for (int i = 0; i < TM; ++i) {
        if (m0 + i >= M) break;
        global float* yr = y + y_off + (size_t)(m0 + i) * ldy + h * N;
#pragma unroll
        for (int j = 0; j < TN; ++j) {
          if (n0 + j >= N) break;
#if WKIND == 2
          yr[n0 + j] = row_has_nan[j] ? NAN : out[i][j];
#else
          yr[n0 + j] = out[i][j];
#endif
        }
      }
    }
}

// ---- prefill path: decompressed K and V ---------------------------------------------------------

// Copies the latent part of cache rows into a contiguous buffer: out[i] = cache row src_rows[i].
kernel void mla_gather_latent(global const ctype* cache, global const uint* src_rows,
                              global float* out) {
  const uint i = get_global_id(0);
  global const ctype* src = cache + (size_t)src_rows[i] * (LKV + DR);
  global float* dst = out + (size_t)i * LKV;
  for (uint k = 0; k < LKV / 16; ++k) vstore16(LOADC16(k, src), k, dst);
}

// The attention over the decompressed keys and values is attention.cl's (paged_attention_tiles on
// the CPU shape, paged_attention_prefill_wg on the GPU shape; ops::paged_attention_prefill).

#ifdef MLA_WG
// ---- The GPU shape (-DMLA_WG lanes, a power of two): work-groups whose neighbouring lanes touch
// neighbouring floats. The same arithmetic per element as the kernels above, except that sums
// over a row meet in a tree (common.cl's wg_sum) rather than in one chain. -DMLA_TM: tokens per
// work-group of the two per-head GEMMs.
#ifndef MLA_TM
#define MLA_TM 1
#endif

// mla_gather_latent: a work-group per buffer row. Launch: global (L * MLA_WG), local (MLA_WG).
kernel __attribute__((reqd_work_group_size(MLA_WG, 1, 1)))
void mla_gather_latent_wg(global const ctype* cache, global const uint* src_rows,
                          global float* out) {
  const uint i = get_group_id(0), lane = get_local_id(0);
  global const ctype* src = cache + (size_t)src_rows[i] * (LKV + DR);
  global float* dst = out + (size_t)i * LKV;
  for (uint k = lane; k < LKV; k += MLA_WG) dst[k] = LOADC1(src + k);
}

// mla_rope_store: a work-group per new token. The lanes rotate the (head, pair)s of q_pe, reduce
// the latent's sum of squares, then store the normalised latent and the roped key (a lane rotates
// a pair in registers and stores it, rounded once for a narrow cache).
// Launch: global (T * MLA_WG), local (MLA_WG).
kernel __attribute__((reqd_work_group_size(MLA_WG, 1, 1)))
void mla_rope_store_wg(global float* q, uint q_off, uint ldq, uint n_heads, uint qk_dim,
                       global const float* kv, uint kv_off, uint ldkv,
                       global const ntype* norm_w, float eps, global const float* inv_freq,
                       float rope_factor, global const uint* token_row,
                       global const uint* token_pos, global const uint* lookup,
                       uint pages_per_row, uint page_size, global ctype* cache) {
  local float scratch[MLA_WG];
  const uint t = get_group_id(0), lane = get_local_id(0);
  const uint pos = token_pos[t];
  global float* qt = q + q_off + (size_t)t * ldq;
  const uint n_pairs = DR / 2;
  for (uint idx = lane; idx < n_heads * n_pairs; idx += MLA_WG) {
    const uint h = idx / n_pairs, i = idx % n_pairs;
    const float angle = (float)pos * inv_freq[i];
    const float c = cos(angle) * rope_factor, s = sin(angle) * rope_factor;
    ROPE_PAIR_INDEX(i, n_pairs);
    global float* x = qt + h * qk_dim + (qk_dim - DR);
    const float a = x[i0], b = x[i1];
    x[i0] = a * c - b * s;
    x[i1] = a * s + b * c;
  }
  global const float* src = kv + kv_off + (size_t)t * ldkv;
  global const uint* lut = lookup + (size_t)token_row[t] * pages_per_row;
  global ctype* row = cache + cache_row_index(lut, pos, page_size) * (LKV + DR);
  float ss = 0.0f;
  for (uint i = lane; i < LKV; i += MLA_WG) ss = fma(src[i], src[i], ss);
  ss = wg_sum(ss, scratch);
  const float inv = 1.0f / sqrt(ss / (float)LKV + eps);
  for (uint i = lane; i < LKV; i += MLA_WG) STOREC1((src[i] * inv) * LOADN(norm_w + i), row + i);
  for (uint i = lane; i < n_pairs; i += MLA_WG) {
    const float angle = (float)pos * inv_freq[i];
    const float c = cos(angle) * rope_factor, s = sin(angle) * rope_factor;
    ROPE_PAIR_INDEX(i, n_pairs);
    const float a = src[LKV + i0], b = src[LKV + i1];
    STOREC1(a * c - b * s, row + LKV + i0);
    STOREC1(a * s + b * c, row + LKV + i1);
  }
}

// mla_absorb_q: a work-group per (head, MLA_WG latent columns, MLA_TM tokens); lane l owns column
// c0 + l, so each weight row d is read by neighbouring lanes, and the tokens' q_nope values sit
// in local memory for all lanes. Launch: global (n_heads * ceil(LKV / MLA_WG) * MLA_WG,
// ceil(T / MLA_TM)), local (MLA_WG, 1).
kernel __attribute__((reqd_work_group_size(MLA_WG, 1, 1)))
void mla_absorb_q_wg(global const float* q, uint q_off, uint ldq, global const wtype* w,
                     global const float* wscale, uint ld_scale, uint T, uint n_heads,
                     global float* qf) {
  local float qn[MLA_TM * DN];
  const uint n_chunks = (LKV + MLA_WG - 1) / MLA_WG;
  const uint h = get_group_id(0) / n_chunks, lane = get_local_id(0);
  const uint c = (get_group_id(0) % n_chunks) * MLA_WG + lane;
  const uint t0 = get_group_id(1) * MLA_TM;
  const uint nt = min((uint)MLA_TM, T - t0);
  const uint qk = DN + DR;
  for (uint idx = lane; idx < MLA_TM * DN; idx += MLA_WG) {
    const uint i = idx / DN, d = idx % DN;
    qn[idx] = i < nt ? q[q_off + (size_t)(t0 + i) * ldq + h * qk + d] : 0.0f;
  }
  barrier(CLK_LOCAL_MEM_FENCE);
  float acc[MLA_TM];
#pragma unroll
  for (int i = 0; i < MLA_TM; ++i) acc[i] = 0.0f;
  if (c < LKV) {
    for (uint d = 0; d < DN; ++d) {
      const uint r = h * (DN + DV) + d;
      const float wv = LOADW1(w + (size_t)r * LKV + c) * WSCALE(wscale, ld_scale, r, c);
#pragma unroll
      for (int i = 0; i < MLA_TM; ++i) acc[i] = fma(qn[i * DN + d], wv, acc[i]);
    }
  }
  for (uint i = 0; i < nt; ++i) {
    global float* o = qf + ((size_t)(t0 + i) * n_heads + h) * (LKV + DR);
    if (c < LKV) o[c] = acc[i];
    if (get_group_id(0) % n_chunks == 0)
      for (uint j = lane; j < DR; j += MLA_WG) o[LKV + j] = q[q_off + (size_t)(t0 + i) * ldq + h * qk + DN + j];
  }
}

// mla_head_linear: a work-group per (head, output row n, MLA_TM tokens); the lanes split k (a
// weight row read by neighbouring lanes) and the partial sums meet in a tree.
// Launch: global (n_heads * N * MLA_WG, ceil(M / MLA_TM)), local (MLA_WG, 1).
kernel __attribute__((reqd_work_group_size(MLA_WG, 1, 1)))
void mla_head_linear_wg(global const float* x, global const wtype* w,
                        global const float* wscale, uint ld_scale, uint row0, uint N,
                        uint n_heads, uint M, global float* y, uint y_off, uint ldy) {
  local float scratch[MLA_WG];
  const uint h = get_group_id(0) / N, n = get_group_id(0) % N, lane = get_local_id(0);
  const uint m0 = get_group_id(1) * MLA_TM;
  const uint r = h * (DN + DV) + row0 + n;
  global const wtype* wr = w + (size_t)r * LKV;
  float acc[MLA_TM];
#pragma unroll
  for (int i = 0; i < MLA_TM; ++i) acc[i] = 0.0f;
  for (uint k = lane; k < LKV; k += MLA_WG) {
    const float wv = LOADW1(wr + k) * WSCALE(wscale, ld_scale, r, k);
#pragma unroll
    for (int i = 0; i < MLA_TM; ++i)
      if (m0 + i < M) acc[i] = fma(x[((size_t)(m0 + i) * n_heads + h) * LKV + k], wv, acc[i]);
  }
#pragma unroll
  for (int i = 0; i < MLA_TM; ++i) {
    const float s = wg_sum(acc[i], scratch);
    if (lane == 0 && m0 + i < M) y[y_off + (size_t)(m0 + i) * ldy + h * N + n] = s;
  }
}
#endif  // MLA_WG
