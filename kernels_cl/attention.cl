// Causal attention of the new tokens over each row's paged KV cache (cached tokens and this
// step's, which rope.cl's rope_store_kv or mla.cl's mla_rope_store wrote first). Prefill and
// decode rows mix freely: a token at position p attends to positions 0..p of its row. Three
// kernels: the CPU shape's tiles (paged_attention_tiles, every step), and the GPU shape's split-K
// (paged_attention_wg, decode) and tiled prefill (paged_attention_prefill_wg). The cache layout
// is rope.cl's; MLA's decompressed prefill and absorbed decode use the same kernels with their
// own strides.

// The arguments of both prefill kernels (paged_attention_tiles, paged_attention_prefill_wg), which
// the host sets alike (ops::paged_attention_prefill): q (from q_off, strides per token and head),
// the cache and where a position's key and value sit in it, MLA's decompressed rows (kv; unread
// for MHA), the step's tokens and page tables, and out (strides per token and head).
#define PAGED_PREFILL_PARAMS                                                                   \
  global const float *q, uint q_off, uint q_ldt, uint q_ldh, global const ctype *cache,        \
      ulong page_stride, uint slot_stride, uint k_off, uint v_off, uint kv_head_stride,        \
      uint heads_per_kv, global const float *kv, uint ldkv, uint kv_head_ld,                   \
      global const uint *ctx_start, global const uint *token_row, global const uint *token_pos, \
      global const uint *lookup, uint pages_per_row, uint page_size, uint n_tokens, float scale, \
      global float *out, uint o_ldt, uint o_ldh

#ifdef AT_TQ
// ---- The CPU shape: a work-item per (AT_TQ consecutive tokens, AT_GH query heads of one KV head)
// The arguments and both layouts are paged_attention_prefill_wg's (below): MHA's cache, and MLA's
// decompressed prefill with -DAT_NOPE=DN (K-nope and V from kv, the roped key from the cache; one
// head per work-item). The work-item walks its tokens' positions in blocks of 16. Each block's 16
// keys are loaded once and transposed in registers (common.cl's transpose16x16) into kt, whose
// row d holds dimension d of the 16 keys: a query row's 16 scores are then one vector, a chain of
// FMAs over d of the query's element d (broadcast) and kt's row d, with no sum across lanes
// (where a key at a time takes 16-lane partial sums and their reduction), and one transposed
// block serves all AT_TQ x AT_GH query rows. The online softmax moves all rows at once
// (common.cl's softmax_rows16: the rows' maxima, factors and sums as vectors); the values are
// added position by position into each row's accumulators, AT_PG rows' at a time in registers.
// Against one work-item per (token, up to 4 heads) with the scores one key at a time, in-process
// on the 2-core EPYC (Zen 5), 9 pairs: llama3-1b's attention over a 512-token prefill 2.0x,
// dsv3-mini's MLA prefill attention 2.1x, a 100-token prefill of 4 rows 1.6x; decode at 4096
// positions 1.2x, 32 rows at 1024 positions 0.99x.
//
// A token's operations, and their order, do not depend on the tokens beside it: the tokens of
// another row run apart (runs of equal rows), a run of one token (decode) takes a copy of the
// code for one token, and the blocks and positions past a token's own (those of later tokens of
// its run) give it weights of exactly 0, a rescaling by exactly 1. So a token's output has the
// same bits in any step, whichever tokens share its tile.
// Build options: -DAT_TQ, -DAT_GH; -DAT_DK, -DAT_DV (key and value widths); -DAT_NOPE (0 for MHA,
// else MLA's K-nope width); each part of the key and the value a multiple of 8 wide; -DCACHE_TYPE.
// Launch: global (ceil(T / AT_TQ), n_heads / AT_GH), local (1, 1).
#ifndef AT_NOPE
#define AT_NOPE 0
#endif
#define AT_KC (AT_DK - AT_NOPE)         // key dimensions read from the cache
#define AT_RA ROUND16(AT_NOPE)          // kt's rows: K-nope's (padded to 16), then the cache's
#define AT_KR (AT_RA + ROUND16(AT_KC))
#define AT_VV ((AT_DV + 15) / 16)       // a value row's vectors
#define AT_R (AT_TQ * AT_GH)            // query rows (token, head), token-major: at most 16
#if AT_R > 16
#error "attention.cl's tiles hold at most 16 query rows (softmax_rows16)"
#endif
// Query rows whose value accumulators are held in registers together (16 vectors).
#define AT_PG (AT_VV >= 16 ? 1 : 16 / AT_VV)

#ifndef AT_BF16
#define AT_BF16 0
#endif
#if AT_BF16
// -DAT_BF16=1 (model.compute_dtype: bf16 where the host has vdpbf16ps; ops::attention_bf16):
// the scores and the weighted values as bf16 dot products, as bf16 flash attention takes them.
// The queries times scale, the keys, the values and the softmax weights are rounded to bf16
// (nearest even: an f32 cache's elements by vcvtne2ps2bf16, whose denormal inputs become zero as
// vdpbf16ps would read them; a bf16 cache's as they are; fp8 codes exactly); the running maxima,
// the factors and the sums stay f32 (softmax_rows16). Each vdpbf16ps adds two products per lane
// in f32: a score's pair is dimensions 2w, 2w + 1 (a query's pair word broadcast against kp[w],
// the block's keys transposed as pair words: lane j = key j's), a value's is positions 2p,
// 2p + 1 (a weight pair broadcast against vp, two value rows interleaved: lane l = dimension l of
// both). Half the multiply-adds and half the key transposes of the f32 tiles. A token's
// operations still do not depend on the tokens beside it: both copies of at_run call the same
// sums (one function per row count), and the second position of a pair past the block's last is
// the last position again with weight 0. The sums are out-of-line functions with clang's
// per-function target attribute on plain vector types, as bf16_packed.cl's micro-kernel.
// MLA's decompressed prefill (-DAT_NOPE) takes it too: K-nope and V from its f32 rows. Against the
// f32 tiles on the 2-core Zen 4 EPYC (bench_step_breakdown): llama3-1b's attention over a
// 512-token prefill 1.25x (one run of each build); the same build switched in turn, 2 pairs: over
// 2048 tokens 1.27-1.32x, decode at 4096 cached positions 1.2-1.4x; dsv3-mini's MLA prefill over
// 512 tokens 1.3-1.45x.
#define AT_PA (ROUND32(AT_NOPE) / 2)        // a key's pair words of K-nope (MLA), then
#define AT_PK (AT_PA + ROUND32(AT_KC) / 2)  // the cache's (zeros past each part)
typedef int at_v16i __attribute__((__vector_size__(64)));
typedef float at_v16f __attribute__((ext_vector_type(16)));
#define AT_BF16_TARGET \
  __attribute__((target("avx512bf16,avx512f,avx512bw,avx512vl"))) __attribute__((noinline))
// The value pairs' interleave: lanes 0-15 of a 32-word vector (position 2p's dimensions) with
// lanes 16-31 (position 2p + 1's), word l of position 2p low.
#define AT_INTERLEAVE(b)                                                                      \
  as_uint16(__builtin_shufflevector(b, b, 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, \
                                    23, 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, \
                                    15, 31))

// ---- f32 rows (an f32 cache; MLA's decompressed K-nope and V): two 16-float chunks become 32
// bf16 in one vcvtne2ps2bf16 ----
typedef float at_f16u __attribute__((ext_vector_type(16), aligned(4)));
typedef float at_f8u __attribute__((ext_vector_type(8), aligned(4)));
typedef short at_v32s __attribute__((__vector_size__(64)));
// Chunk c (16 floats) of a row of D floats at p: zeros past D.
#define AT_F32_CHUNK(p, c, D)                                                \
  ((c) * 16 >= (D) ? (at_v16f)(0.0f)                                        \
   : (D) % 16 && (c) == (D) / 16                                            \
       ? (at_v16f)(*(global const at_f8u*)((p) + 16 * (c)), (float8)(0.0f)) \
       : (at_v16f)(*(global const at_f16u*)((p) + 16 * (c))))
// 32 bf16 words: lo's 16 values, then hi's.
#define AT_CVT2(lo, hi) ((at_v32s)__builtin_ia32_cvtne2ps2bf16_512((hi), (lo)))
// Row p's pair words of dimensions 32 g .. of W (zeros past W), and dimensions 16 i .. of the
// values of rows p0 and p1 interleaved (lane l: p0's in the low half, p1's in the high one).
#define AT_F32_WORDS(p, g, W) \
  as_uint16(AT_CVT2(AT_F32_CHUNK(p, 2 * (g), W), AT_F32_CHUNK(p, 2 * (g) + 1, W)))
#define AT_F32_PAIR(p0, p1, i) \
  AT_INTERLEAVE(AT_CVT2(AT_F32_CHUNK(p0, i, AT_DV), AT_F32_CHUNK(p1, i, AT_DV)))

// The two loaders of a block, one per source (f32 rows above, the bf16 and fp8 caches below: the
// loops the same, the qualifiers and the loads not):
// NAME(base, at, kp): the pair words of dimensions [0, W) of the 16 rows at base + at[j]
// (elements of T), transposed: kp[w] lane j = row j's pair word w (WORDS above).
#define AT_KEY_PAIRS(QUAL, NAME, T, W, WORDS)                                           \
  QUAL void NAME(global const T* base, const size_t* at, uint16* kp) {                  \
    _Pragma("unroll") for (int g = 0; g < ROUND32(W) / 32; ++g) {                      \
      uint16 r[16];                                                                    \
      _Pragma("unroll") for (int j = 0; j < 16; ++j) r[j] = WORDS(base + at[j], g, W); \
      transpose16x16(r);                                                               \
      _Pragma("unroll") for (int i = 0; i < 16; ++i) kp[16 * g + i] = r[i];            \
    }                                                                                  \
  }
// NAME(base, at, np, vp): np value pairs, vp[p * AT_VV + i] dimensions 16 i .. of the rows at
// base + at[2p] and base + at[2p + 1] (PAIR above).
#define AT_VALUE_PAIRS(QUAL, NAME, T, PAIR)                                     \
  QUAL void NAME(global const T* base, const size_t* at, uint np, uint16* vp) { \
    for (uint p = 0; p < np; ++p)                                               \
      _Pragma("unroll") for (int i = 0; i < AT_VV; ++i) vp[p * AT_VV + i] =     \
          PAIR(base + at[2 * p], base + at[2 * p + 1], i);                      \
  }
AT_VALUE_PAIRS(AT_BF16_TARGET, at_value_pairs_f32, float, AT_F32_PAIR)
#if AT_NOPE
AT_KEY_PAIRS(AT_BF16_TARGET, at_key_pairs_nope, float, AT_NOPE, AT_F32_WORDS)
#endif
#if CACHE_TYPE == 0
AT_KEY_PAIRS(AT_BF16_TARGET, at_key_pairs_cache, float, AT_KC, AT_F32_WORDS)
#else
// ---- bf16 and fp8 caches: a bf16 cache's bits as they are, fp8 codes widened (exact in bf16) ----
#if CACHE_TYPE == 1
#define LOADB16(i, p) vload16((i), (p))
#define LOADB8(i, p) vload8((i), (p))
#else
#define LOADB16(i, p) f32x16_to_bf16_rne(LOADC16((i), (p)))
#define LOADB8(i, p) f32x16_to_bf16_rne((float16)(LOADC8((i), (p)), (float8)(0.0f))).lo
#endif
// Chunk i of a row of D as bf16 bits: zeros past D.
#define BCHUNK16(i, p, D)                                                       \
  ((i) * 16 >= (D) ? (ushort16)(0)                                              \
   : (D) % 16 && (i) == (D) / 16 ? (ushort16)(LOADB8(2 * (i), p), (ushort8)(0)) \
                                 : LOADB16(i, p))
#define AT_CACHE_WORDS(p, g, W) \
  bf16_pair_words(BCHUNK16(2 * (g), p, W), BCHUNK16(2 * (g) + 1, p, W))
#define AT_CACHE_PAIR(p0, p1, i) \
  (convert_uint16(BCHUNK16(i, p0, AT_DV)) | (convert_uint16(BCHUNK16(i, p1, AT_DV)) << 16))
AT_KEY_PAIRS(inline, at_key_pairs_cache, ctype, AT_KC, AT_CACHE_WORDS)
AT_VALUE_PAIRS(inline, at_value_pairs_cache, ctype, AT_CACHE_PAIR)
#endif

// Scores s[r] (lane j: key j) of ROWS query rows (qp: AT_PK pair words per row) against the
// block's key pairs kp: one chain per row over the pair words in order.
#define AT_BF16_SCORES(NAME, ROWS)                                                          \
  AT_BF16_TARGET void NAME(const uint* qp, const uint16* kp, float16* s) {                  \
    at_v16f a[ROWS];                                                                        \
    _Pragma("unroll") for (int r = 0; r < ROWS; ++r) a[r] = (at_v16f)(0.0f);                \
    for (int w = 0; w < AT_PK; ++w) {                                                       \
      const at_v16i k = (at_v16i)kp[w];                                                     \
      _Pragma("unroll") for (int r = 0; r < ROWS; ++r) a[r] =                               \
          __builtin_ia32_dpbf16ps_512(a[r], (at_v16i)((int16)((int)qp[r * AT_PK + w])), k); \
    }                                                                                       \
    _Pragma("unroll") for (int r = 0; r < ROWS; ++r) s[r] = a[r];                           \
  }
// The np position pairs' values (vp) weighted by each row's weight pairs (wp: 8 words per row)
// into the ROWS rows' accumulators acc (AT_VV vectors per row), first scaled by the rows'
// factors corr; AT_PG rows' accumulators at a time in registers, as the f32 tiles.
#define AT_BF16_VALUES(NAME, ROWS)                                                           \
  AT_BF16_TARGET void NAME(const uint* wp, const uint16* vp, float16* acc, const float* corr, \
                           uint np) {                                                        \
    _Pragma("unroll") for (int g0 = 0; g0 < ROWS; g0 += AT_PG) {                             \
      at_v16f a[AT_PG][AT_VV];                                                               \
      _Pragma("unroll") for (int k = 0; k < AT_PG; ++k) if (g0 + k < ROWS)                   \
          _Pragma("unroll") for (int i = 0; i < AT_VV; ++i) a[k][i] =                        \
              acc[(g0 + k) * AT_VV + i] * corr[g0 + k];                                      \
      for (uint p = 0; p < np; ++p) {                                                        \
        at_v16i v[AT_VV];                                                                    \
        _Pragma("unroll") for (int i = 0; i < AT_VV; ++i) v[i] = (at_v16i)vp[p * AT_VV + i]; \
        _Pragma("unroll") for (int k = 0; k < AT_PG; ++k) if (g0 + k < ROWS) {               \
          const at_v16i w = (at_v16i)((int16)((int)wp[(g0 + k) * 8 + p]));                   \
          _Pragma("unroll") for (int i = 0; i < AT_VV; ++i) a[k][i] =                        \
              __builtin_ia32_dpbf16ps_512(a[k][i], w, v[i]);                                 \
        }                                                                                    \
      }                                                                                      \
      _Pragma("unroll") for (int k = 0; k < AT_PG; ++k) if (g0 + k < ROWS)                   \
          _Pragma("unroll") for (int i = 0; i < AT_VV; ++i) acc[(g0 + k) * AT_VV + i] =      \
              a[k][i];                                                                       \
    }                                                                                        \
  }
// One copy per row count: a run of one token (AT_GH rows) and of AT_TQ tokens (AT_R).
AT_BF16_SCORES(at_scores_bf16_one, AT_GH)
AT_BF16_SCORES(at_scores_bf16_all, AT_R)
AT_BF16_VALUES(at_values_bf16_one, AT_GH)
AT_BF16_VALUES(at_values_bf16_all, AT_R)
#endif

// Dimensions [0, W) of the 16 keys at base + at[j], transposed: kt[d] lane j = key j's element
// d (rows past W up to a multiple of 16 are zeros).
#define AT_KEYS_T(kt, base, at, W, LOAD8, LOAD16)                                         \
  _Pragma("unroll") for (int c_ = 0; c_ < ((W) + 15) / 16; ++c_) {                      \
    uint16 r_[16];                                                                       \
    _Pragma("unroll") for (int j_ = 0; j_ < 16; ++j_)                                    \
        r_[j_] = as_uint16(CHUNK16(c_, (base) + (at)[j_], (W), LOAD8, LOAD16));          \
    transpose16x16(r_);                                                                  \
    _Pragma("unroll") for (int i_ = 0; i_ < 16; ++i_) (kt)[16 * c_ + i_] =               \
        as_float16(r_[i_]);                                                              \
  }

// One run of tokens t .. t + nt - 1 of one row, NQ (1 or AT_TQ) query tokens wide: slots past
// nt repeat the run's last token, computed and not kept. Loops run to the constant AT_R and skip
// the rows past NQ * AT_GH, so that both copies keep their rows' vectors in registers.
__attribute__((always_inline)) inline void at_run(
    const uint NQ, uint t, uint nt, uint h0, global const float* q, uint q_off, uint q_ldt,
    uint q_ldh, global const ctype* cache, ulong page_stride, uint slot_stride, uint k_off,
    uint v_off, uint kv_head_stride, uint heads_per_kv, global const float* kv, uint ldkv,
    uint kv_head_ld, global const uint* ctx_start, global const uint* token_row,
    global const uint* token_pos, global const uint* lookup, uint pages_per_row, uint page_size,
    float scale, global float* out, uint o_ldt, uint o_ldh) {
  const uint rows = NQ * AT_GH;
  const uint row = token_row[t];
  global const uint* lut = lookup + (size_t)row * pages_per_row;
  global const ctype* keys = cache + k_off + (h0 / heads_per_kv) * kv_head_stride;
#if AT_NOPE
  global const float* kv_rows = kv + (size_t)ctx_start[row] * ldkv + (size_t)h0 * kv_head_ld;
#else
  global const ctype* values = cache + v_off + (h0 / heads_per_kv) * kv_head_stride;
#endif
  int pos[AT_TQ];
  uint last = 0;
#pragma unroll
  for (uint i = 0; i < AT_TQ; ++i)
    if (i < NQ) {
      pos[i] = (int)token_pos[t + min(i, nt - 1)];
      last = max(last, (uint)pos[i]);
    }
#if AT_BF16
  uint qp[AT_R * AT_PK];  // the queries times scale as bf16 pair words, in kp's rows
#else
  float qs[AT_R][AT_KR];  // the queries times scale, in kt's rows
#endif
  float16 acc[AT_R][AT_VV];
  float16 m = (float16)(-INFINITY), l = (float16)(0.0f);  // lane r: row r's
#pragma unroll
  for (uint r = 0; r < AT_R; ++r) {
    if (r >= rows) continue;
    global const float* qr = q + q_off + (size_t)(t + min(r / AT_GH, nt - 1)) * q_ldt +
                             (size_t)(h0 + r % AT_GH) * q_ldh;
#if AT_BF16
    // Chunk c of the part of W at p times scale, rounded (zeros past W).
#define AT_QB(c, p, W) \
  ((c) * 16 >= (W) ? (ushort16)(0) : f32x16_to_bf16_rne(CHUNK16(c, p, W, vload8, vload16) * scale))
#if AT_NOPE
    for (int g = 0; g < AT_PA / 16; ++g)
      vstore16(bf16_pair_words(AT_QB(2 * g, qr, AT_NOPE), AT_QB(2 * g + 1, qr, AT_NOPE)), g,
               qp + r * AT_PK);
#endif
    for (int g = 0; g < (AT_PK - AT_PA) / 16; ++g)
      vstore16(bf16_pair_words(AT_QB(2 * g, qr + AT_NOPE, AT_KC),
                               AT_QB(2 * g + 1, qr + AT_NOPE, AT_KC)),
               g, qp + r * AT_PK + AT_PA);
#undef AT_QB
#else
#if AT_NOPE
    for (int c = 0; c < AT_RA / 16; ++c)
      vstore16(CHUNK16(c, qr, AT_NOPE, vload8, vload16) * scale, c, qs[r]);
#endif
    for (int c = 0; c < ROUND16(AT_KC) / 16; ++c)
      vstore16(CHUNK16(c, qr + AT_NOPE, AT_KC, vload8, vload16) * scale, c, qs[r] + AT_RA);
#endif
#pragma unroll
    for (int i = 0; i < AT_VV; ++i) acc[r][i] = (float16)(0.0f);
  }
  const int16 lane = (int16)(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (uint p0 = 0; p0 <= last; p0 += 16) {
    const uint n = min(16u, last + 1 - p0);
    // The block's slots from one division: its positions are consecutive, so a slot moves to the
    // next page only where the offset within the page reaches page_size. Past n the last
    // position again (its scores are masked, its values weighted 0).
    size_t at[16];
    {
      uint page = p0 / page_size, off = p0 % page_size;
      for (uint j = 0; j < 16; ++j) {
        at[j] = (size_t)lut[page] * page_stride + (size_t)off * slot_stride;
        if (j + 1 < n && ++off == page_size) {
          off = 0;
          ++page;
        }
      }
    }
#if PREFETCH_X86 && !AT_NOPE
    // The next block's keys and values into L1 while this block is summed: a work-item reads one
    // KV head's rows, 4 lines of every slot's kv_row (2 KB in llama3-1b), and waited on them.
    // llama3-1b's decode attention alone (16 layers' caches in turn, in-process, 2-core EPYC,
    // ahead / not, 5 runs): context 4096 1.09-1.20x, 2048 0.98-1.10x, 1024 0.95-1.09x, 128
    // even; into L2 about the same. Runs of several tokens (prefill) leave it out: their blocks
    // are summed for 16 rows, long enough for the loads, and the 512-token prefill's attention
    // at llama3-1b's shapes ran 1.03x, 1.05x and 1.05x faster without it (Zen 4, in-process, in
    // turn, 9-11 rounds).
    if (NQ == 1 && p0 + 16 <= last) {
      uint page = (p0 + 16) / page_size, off = (p0 + 16) % page_size;
      const uint ahead = min(16u, last + 1 - (p0 + 16));
      for (uint j = 0; j < ahead; ++j) {
        const size_t a = (size_t)lut[page] * page_stride + (size_t)off * slot_stride;
        global const uchar* kp = (global const uchar*)(keys + a);
        global const uchar* vp = (global const uchar*)(values + a);
        for (uint c = 0; c < AT_KC * sizeof(ctype); c += 64) PREFETCH_LINE_L1(kp + c);
        for (uint c = 0; c < AT_DV * sizeof(ctype); c += 64) PREFETCH_LINE_L1(vp + c);
        if (++off == page_size) {
          off = 0;
          ++page;
        }
      }
    }
#endif
#if AT_NOPE
    size_t nope_at[16];
    for (uint j = 0; j < 16; ++j) nope_at[j] = (size_t)(p0 + min(j, n - 1)) * ldkv;
#endif
#if AT_BF16
    // The keys and the value pairs (past n the last position again, with weight 0).
    const uint np = (n + 1) / 2;
    uint16 kp[AT_PK], vp[8 * AT_VV];
#if AT_NOPE
    at_key_pairs_nope(kv_rows, nope_at, kp);
#endif
    at_key_pairs_cache(keys, at, kp + AT_PA);
#if AT_NOPE
    at_value_pairs_f32(kv_rows + AT_NOPE, nope_at, np, vp);
#elif CACHE_TYPE == 0
    at_value_pairs_f32(values, at, np, vp);
#else
    at_value_pairs_cache(values, at, np, vp);
#endif
    float16 s[16];
    if (NQ == 1)
      at_scores_bf16_one(qp, kp, s);
    else
      at_scores_bf16_all(qp, kp, s);
#pragma unroll
    for (uint r = 0; r < AT_R; ++r)
      if (r < rows)
        s[r] = select(s[r], (float16)(-INFINITY), lane > (int16)(pos[r / AT_GH] - (int)p0));
    float corr[16];
    vstore16(softmax_rows16(s, rows, &m, &l), 0, corr);
    uint wp[AT_R * 8];
#pragma unroll
    for (uint r = 0; r < AT_R; ++r)
      if (r < rows) vstore8(as_uint8(f32x16_to_bf16_rne(s[r])), r, wp);
    if (NQ == 1)
      at_values_bf16_one(wp, vp, &acc[0][0], corr, np);
    else
      at_values_bf16_all(wp, vp, &acc[0][0], corr, np);
#else
    float16 kt[AT_KR];
#if AT_NOPE
    AT_KEYS_T(kt, kv_rows, nope_at, AT_NOPE, vload8, vload16);
#endif
    AT_KEYS_T(kt + AT_RA, keys, at, AT_KC, LOADC8, LOADC16);
    // Scores: row r's one chain over d, each row on its own (no row reads another's).
    float16 s[16];
#pragma unroll
    for (uint r = 0; r < AT_R; ++r) s[r] = (float16)(0.0f);
    for (uint d = 0; d < AT_NOPE; ++d) {
      const float16 k = kt[d];
#pragma unroll
      for (uint r = 0; r < AT_R; ++r)
        if (r < rows) s[r] = fma((float16)(qs[r][d]), k, s[r]);
    }
    for (uint d = AT_RA; d < AT_RA + AT_KC; ++d) {
      const float16 k = kt[d];
#pragma unroll
      for (uint r = 0; r < AT_R; ++r)
        if (r < rows) s[r] = fma((float16)(qs[r][d]), k, s[r]);
    }
    // Causal: row r counts the positions up to its token's own.
#pragma unroll
    for (uint r = 0; r < AT_R; ++r)
      if (r < rows)
        s[r] = select(s[r], (float16)(-INFINITY), lane > (int16)(pos[r / AT_GH] - (int)p0));
    float corr[16], w[AT_R][16];
    vstore16(softmax_rows16(s, rows, &m, &l), 0, corr);
#pragma unroll
    for (uint r = 0; r < AT_R; ++r)
      if (r < rows) vstore16(s[r], 0, w[r]);
    // Values: AT_PG rows' accumulators at a time in registers, each position's value row read
    // once per group.
#pragma unroll
    for (uint g0 = 0; g0 < AT_R; g0 += AT_PG) {
      if (g0 >= rows) continue;
      float16 a[AT_PG][AT_VV];
#pragma unroll
      for (uint k = 0; k < AT_PG; ++k)
        if (g0 + k < rows)
#pragma unroll
          for (int i = 0; i < AT_VV; ++i) a[k][i] = acc[g0 + k][i] * corr[g0 + k];
      for (uint j = 0; j < n; ++j) {
        float16 v[AT_VV];
#if AT_NOPE
        global const float* vp = kv_rows + (size_t)(p0 + j) * ldkv + AT_NOPE;
#pragma unroll
        for (int i = 0; i < AT_VV; ++i) v[i] = CHUNK16(i, vp, AT_DV, vload8, vload16);
#else
        global const ctype* vp = values + at[j];
#pragma unroll
        for (int i = 0; i < AT_VV; ++i) v[i] = CHUNK16(i, vp, AT_DV, LOADC8, LOADC16);
#endif
#pragma unroll
        for (uint k = 0; k < AT_PG; ++k)
          if (g0 + k < rows)
#pragma unroll
            for (int i = 0; i < AT_VV; ++i) a[k][i] = fma((float16)(w[g0 + k][j]), v[i], a[k][i]);
      }
#pragma unroll
      for (uint k = 0; k < AT_PG; ++k)
        if (g0 + k < rows)
#pragma unroll
          for (int i = 0; i < AT_VV; ++i) acc[g0 + k][i] = a[k][i];
    }
#endif
  }
  float inv_l[16];
  vstore16(1.0f / l, 0, inv_l);
  for (uint r = 0; r < nt * AT_GH; ++r) {
    global float* o = out + (size_t)(t + r / AT_GH) * o_ldt + (size_t)(h0 + r % AT_GH) * o_ldh;
#pragma unroll
    for (int i = 0; i < AT_VV; ++i) {
#if AT_DV % 16
      if (i == AT_VV - 1) {
        vstore8((acc[r][i] * inv_l[r]).lo, 2 * i, o);
        continue;
      }
#endif
      vstore16(acc[r][i] * inv_l[r], i, o);
    }
  }
}

kernel void paged_attention_tiles(PAGED_PREFILL_PARAMS) {
  const uint t0 = get_global_id(0) * AT_TQ, h0 = get_global_id(1) * AT_GH;
  const uint nq = min((uint)AT_TQ, n_tokens - t0);
#if PREFETCH_X86
  // The next tile's queries (the work-item the same thread likely runs next), into L2: the
  // first reads of a tile's queries had been a tenth of the kernel's profile; 1.03-1.04x.
  for (uint i = 0; i < AT_TQ; ++i)
    for (uint g = 0; g < AT_GH; ++g) {
      global const float* qp =
          q + q_off + (size_t)(t0 + AT_TQ + i) * q_ldt + (size_t)(h0 + g) * q_ldh;
      for (uint c = 0; c < AT_DK; c += 16) PREFETCH_LINE(qp + c);
    }
#endif
  for (uint run = 0; run < nq;) {
    uint end = run + 1;
    while (end < nq && token_row[t0 + end] == token_row[t0 + run]) ++end;
    if (end - run == 1)
      at_run(1, t0 + run, 1, h0, q, q_off, q_ldt, q_ldh, cache, page_stride, slot_stride, k_off,
             v_off, kv_head_stride, heads_per_kv, kv, ldkv, kv_head_ld, ctx_start, token_row,
             token_pos, lookup, pages_per_row, page_size, scale, out, o_ldt, o_ldh);
    else
      at_run(AT_TQ, t0 + run, end - run, h0, q, q_off, q_ldt, q_ldh, cache, page_stride,
             slot_stride, k_off, v_off, kv_head_stride, heads_per_kv, kv, ldkv, kv_head_ld,
             ctx_start, token_row, token_pos, lookup, pages_per_row, page_size, scale, out, o_ldt,
             o_ldh);
    run = end;
  }
}
#endif  // AT_TQ

#ifdef ATT_WG
// ---- The GPU shape: split-K attention over the pages, then a reduction of the splits ----
// Shared by the MHA cache above and MLA's absorbed decode (mla.cl's cache rows), which differ only
// in where a position's key and value sit: paged_slot(...) + k_off (+ v_off), and the KV head's
// kv_head_stride. Build options:
//   -DATT_WG    lanes per work-group (a power of two)
//   -DDK, -DDV  key (score) and value widths; -DV_IN_K=1: the value is the key's first DV floats
//   -DG         query heads per work-group (they share one KV head: GQA's group, MLA's all heads)
//   -DTILE      positions per local-memory tile
//   -DCACHE_TYPE the cache's element type (common.cl), widened to f32 as the tiles load
// A work-group owns (split, head group, token): the positions [split * split_len, ...) up to the
// token's own (causal). Per tile it loads the keys (and values) once into local memory with
// neighbouring lanes on neighbouring floats, computes the G x TILE scores, moves the online
// softmax (common.cl) and accumulates the values, a lane owning value columns lane, lane + ATT_WG,
// ... With one split it writes the normalised output; with more, unnormalised partials (acc, max,
// sum) that attention_merge_splits combines. Launch: global (n_splits * ATT_WG, n_heads / G, T),
// local (ATT_WG, 1, 1).
#ifndef V_IN_K
#define V_IN_K 0
#endif
#define DPL ((DV + ATT_WG - 1) / ATT_WG)  // value columns per lane
#define KSTRIDE (DK + 1)  // a padded local key row: lanes reading one column of many rows spread banks
kernel __attribute__((reqd_work_group_size(ATT_WG, 1, 1)))
void paged_attention_wg(global const float* q, uint q_ldt, uint q_ldh, global const ctype* cache,
                        ulong page_stride, uint slot_stride, uint k_off, uint v_off,
                        uint kv_head_stride, uint heads_per_kv, global const uint* token_row,
                        global const uint* token_pos, global const uint* lookup,
                        uint pages_per_row, uint page_size, uint n_heads, float scale,
                        uint split_len, uint n_splits, global float* out, uint o_ldt, uint o_ldh,
                        global float* part, global float* part_ml) {
  local float kt[TILE * KSTRIDE];
#if !V_IN_K
  local float vt[TILE * DV];
#define VT(j, d) vt[(j) * DV + (d)]
#else
#define VT(j, d) kt[(j) * KSTRIDE + (d)]
#endif
  local float pr[G * TILE];  // scores, then their exp(s - m)
  local float m_run[G], l_run[G], corr[G];  // per head; lane g < G keeps head g's
  const uint lane = get_local_id(0);
  const uint split = get_group_id(0), h0 = get_group_id(1) * G, t = get_group_id(2);
  const uint last = token_pos[t];
  const uint p_begin = split * split_len;
  if (p_begin > last) return;  // past this token's context: the whole group leaves
  const uint p_end = min(last + 1, p_begin + split_len);
  global const uint* lut = lookup + (size_t)token_row[t] * pages_per_row;
  const uint head_off = (h0 / heads_per_kv) * kv_head_stride;
  float acc[G][DPL];
#pragma unroll
  for (int g = 0; g < G; ++g)
#pragma unroll
    for (int i = 0; i < DPL; ++i) acc[g][i] = 0.0f;
  if (lane < G) {
    m_run[lane] = -INFINITY;
    l_run[lane] = 0.0f;
  }
  for (uint p0 = p_begin; p0 < p_end; p0 += TILE) {
    const uint n = min((uint)TILE, p_end - p0);
    for (uint idx = lane; idx < TILE * DK; idx += ATT_WG) {
      const uint j = idx / DK, d = idx % DK;
      kt[j * KSTRIDE + d] =
          j < n ? LOADC1(cache + paged_slot(lut, p0 + j, page_size, page_stride, slot_stride) +
                         k_off + head_off + d)
                : 0.0f;
    }
#if !V_IN_K
    for (uint idx = lane; idx < TILE * DV; idx += ATT_WG) {
      const uint j = idx / DV, d = idx % DV;
      vt[idx] = j < n ? LOADC1(cache + paged_slot(lut, p0 + j, page_size, page_stride, slot_stride) +
                               v_off + head_off + d)
                      : 0.0f;
    }
#endif
    barrier(CLK_LOCAL_MEM_FENCE);
    for (uint idx = lane; idx < G * TILE; idx += ATT_WG) {
      const uint g = idx / TILE, j = idx % TILE;
      float s = -INFINITY;
      if (j < n) {
        global const float* qp = q + (size_t)t * q_ldt + (size_t)(h0 + g) * q_ldh;
        local const float* kr = kt + j * KSTRIDE;
        float d0 = 0.0f, d1 = 0.0f;  // two chains: half the FMA latency per score
        uint d = 0;
        for (; d + 1 < DK; d += 2) {
          d0 = fma(qp[d], kr[d], d0);
          d1 = fma(qp[d + 1], kr[d + 1], d1);
        }
        if (d < DK) d0 = fma(qp[d], kr[d], d0);
        s = (d0 + d1) * scale;
      }
      pr[idx] = s;
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    if (lane < G) softmax_tile_max(pr + lane * TILE, n, m_run + lane, corr + lane);
    barrier(CLK_LOCAL_MEM_FENCE);
    for (uint idx = lane; idx < G * TILE; idx += ATT_WG)
      pr[idx] = idx % TILE < n ? softmax_exp(pr[idx] - m_run[idx / TILE]) : 0.0f;
    barrier(CLK_LOCAL_MEM_FENCE);
    if (lane < G) {
      float sum = 0.0f;
      for (uint j = 0; j < n; ++j) sum += pr[lane * TILE + j];
      l_run[lane] = l_run[lane] * corr[lane] + sum;
    }
#pragma unroll
    for (int g = 0; g < G; ++g) {
      const float c = corr[g];
#pragma unroll
      for (int i = 0; i < DPL; ++i) {
        const uint d = lane + i * ATT_WG;
        if (d < DV) {
          float a = acc[g][i] * c;
          for (uint j = 0; j < n; ++j) a = fma(pr[g * TILE + j], VT(j, d), a);
          acc[g][i] = a;
        }
      }
    }
    barrier(CLK_LOCAL_MEM_FENCE);  // the tiles are overwritten next
  }
#pragma unroll
  for (int g = 0; g < G; ++g) {
    const uint h = h0 + g;
    if (n_splits == 1) {
      global float* o = out + (size_t)t * o_ldt + (size_t)h * o_ldh;
      const float inv_l = 1.0f / l_run[g];
#pragma unroll
      for (int i = 0; i < DPL; ++i)
        if (lane + i * ATT_WG < DV) o[lane + i * ATT_WG] = acc[g][i] * inv_l;
    } else {
      const size_t slot = ((size_t)t * n_heads + h) * n_splits + split;
      global float* pa = part + slot * DV;
#pragma unroll
      for (int i = 0; i < DPL; ++i)
        if (lane + i * ATT_WG < DV) pa[lane + i * ATT_WG] = acc[g][i];
      if (lane == 0) {
        part_ml[2 * slot] = m_run[g];
        part_ml[2 * slot + 1] = l_run[g];
      }
    }
  }
#undef VT
}

// The splits of paged_attention_wg combined: with M the largest of their maxima, out =
// sum_s acc_s exp(m_s - M) / sum_s l_s exp(m_s - M), over the splits that hold positions of the
// token. Launch: global (ATT_WG, n_heads, T), local (ATT_WG, 1, 1).
kernel __attribute__((reqd_work_group_size(ATT_WG, 1, 1)))
void attention_merge_splits(global const float* part, global const float* part_ml,
                            global const uint* token_pos, uint split_len, uint n_splits,
                            uint n_heads, global float* out, uint o_ldt, uint o_ldh) {
  const uint lane = get_local_id(0), h = get_group_id(1), t = get_group_id(2);
  const uint used = min(n_splits, token_pos[t] / split_len + 1);
  const size_t base = ((size_t)t * n_heads + h) * n_splits;
  float m = -INFINITY;
  for (uint s = 0; s < used; ++s) m = fmax(m, part_ml[2 * (base + s)]);
  float l = 0.0f;
  for (uint s = 0; s < used; ++s) l += part_ml[2 * (base + s) + 1] * softmax_rescale(part_ml[2 * (base + s)], m);
  const float inv_l = 1.0f / l;
  global float* o = out + (size_t)t * o_ldt + (size_t)h * o_ldh;
  for (uint d = lane; d < DV; d += ATT_WG) {
    float a = 0.0f;
    for (uint s = 0; s < used; ++s)
      a = fma(part[(base + s) * DV + d], softmax_rescale(part_ml[2 * (base + s)], m), a);
    o[d] = a * inv_l;
  }
}
#endif  // ATT_WG

#ifdef PF_WG
// ---- The GPU shape for prefill: a work-group per (tile of query tokens, group of query heads) --
// Flash-attention style: the group stages its queries once in local memory, then walks the KV
// positions of their row in tiles, each key and value tile loaded once into local memory (lanes on
// neighbouring floats of a row) and used by every query of the group, with the online softmax of
// common.cl. Nothing of size context is stored and no split-K pass follows, so it suits steps
// whose rows bring many new tokens (the ops route by the step's longest row).
// The tokens of one row are consecutive in a step; a tile that straddles rows runs once per run
// of equal rows (each run with its own page table), so any token order stays correct.
// Two layouts: MHA's cache (rope.cl: key and value of position p for query head h at
// paged_slot(p) + k_off (+ v_off) + (h / heads_per_kv) * kv_head_stride), and MLA's decompressed
// prefill (-DPF_NOPE=DN): key = [K-nope (DN floats) | the shared roped key (from the cache row at
// k_off)], value = the DV floats after K-nope, K-nope and value from kv[ctx_start[row] + p] at
// h * kv_head_ld (mla.cl's prefill buffer; one head per group). Build options:
//   -DPF_WG  lanes per work-group           -DPF_DK, -DPF_DV  key and value widths (even)
//   -DPF_QT  query tokens per tile          -DPF_GH  query heads per group (sharing a KV head)
//   -DPF_KT  KV positions per tile          -DPF_NOPE  0 (MHA) or MLA's DN
//   -DCACHE_TYPE the cache's element type (common.cl), widened to f32 as the tiles load
// Launch: global (ceil(T / PF_QT) * PF_WG, n_heads / PF_GH, 1), local (PF_WG, 1, 1).
#ifndef PF_NOPE
#define PF_NOPE 0
#endif
#if PF_NOPE && PF_GH != 1
#error "MLA's prefill layout has a key per head: one head per work-group"
#endif
#define PF_R (PF_QT * PF_GH)                               // query rows: (token, head) pairs
#define PF_EPL ((PF_R * PF_DV + PF_WG - 1) / PF_WG)        // output elements per lane
#define PF_KS (PF_DK + 1)  // a padded local row: lanes reading one column of many rows spread banks
kernel __attribute__((reqd_work_group_size(PF_WG, 1, 1)))
void paged_attention_prefill_wg(PAGED_PREFILL_PARAMS) {
  local float qs[PF_R * PF_KS];   // the queries, row r = token (r / PF_GH), head h0 + r % PF_GH
  local float kt[PF_KT * PF_KS];
  local float vt[PF_KT * PF_DV];
  local float pr[PF_R * PF_KT];   // scores, then their exp(s - m)
  local float m_run[PF_R], l_run[PF_R], corr[PF_R];
  local int qpos[PF_QT];          // each token's position while its run is processed, else -1
  const uint lane = get_local_id(0);
  const uint t0 = get_group_id(0) * PF_QT, h0 = get_group_id(1) * PF_GH;
  const uint nq = min((uint)PF_QT, n_tokens - t0);
  const uint head_off = (h0 / heads_per_kv) * kv_head_stride;
  for (uint run = 0; run < nq;) {
    // The run [run, run_end) of tokens of one row; every lane reads the same values.
    const uint row = token_row[t0 + run];
    uint run_end = run + 1, last = token_pos[t0 + run];
    while (run_end < nq && token_row[t0 + run_end] == row) last = max(last, token_pos[t0 + run_end++]);
    global const uint* lut = lookup + (size_t)row * pages_per_row;
#if PF_NOPE
    global const float* kv_rows = kv + (size_t)ctx_start[row] * ldkv + (size_t)h0 * kv_head_ld;
#endif
    for (uint i = lane; i < PF_QT; i += PF_WG)
      qpos[i] = i >= run && i < run_end ? (int)token_pos[t0 + i] : -1;
    for (uint idx = lane; idx < PF_R * PF_DK; idx += PF_WG) {
      const uint r = idx / PF_DK, d = idx % PF_DK, tok = r / PF_GH;
      qs[r * PF_KS + d] = tok >= run && tok < run_end
                              ? q[q_off + (size_t)(t0 + tok) * q_ldt + (size_t)(h0 + r % PF_GH) * q_ldh + d]
                              : 0.0f;
    }
    for (uint r = lane; r < PF_R; r += PF_WG) {
      m_run[r] = -INFINITY;
      l_run[r] = 0.0f;
    }
    float acc[PF_EPL];
#pragma unroll
    for (int i = 0; i < PF_EPL; ++i) acc[i] = 0.0f;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (uint p0 = 0; p0 <= last; p0 += PF_KT) {
      const uint n = min((uint)PF_KT, last + 1 - p0);
      for (uint idx = lane; idx < PF_KT * PF_DK; idx += PF_WG) {
        const uint j = idx / PF_DK, d = idx % PF_DK;
        float x = 0.0f;
        if (j < n) {
#if PF_NOPE
          x = d < PF_NOPE ? kv_rows[(size_t)(p0 + j) * ldkv + d]
                          : LOADC1(cache + paged_slot(lut, p0 + j, page_size, page_stride,
                                                      slot_stride) + k_off + (d - PF_NOPE));
#else
          x = LOADC1(cache + paged_slot(lut, p0 + j, page_size, page_stride, slot_stride) + k_off +
                     head_off + d);
#endif
        }
        kt[j * PF_KS + d] = x;
      }
      for (uint idx = lane; idx < PF_KT * PF_DV; idx += PF_WG) {
        const uint j = idx / PF_DV, d = idx % PF_DV;
        float x = 0.0f;
        if (j < n) {
#if PF_NOPE
          x = kv_rows[(size_t)(p0 + j) * ldkv + PF_NOPE + d];
#else
          x = LOADC1(cache + paged_slot(lut, p0 + j, page_size, page_stride, slot_stride) + v_off +
                     head_off + d);
#endif
        }
        vt[idx] = x;
      }
      barrier(CLK_LOCAL_MEM_FENCE);
      for (uint idx = lane; idx < PF_R * PF_KT; idx += PF_WG) {
        const uint r = idx / PF_KT, j = idx % PF_KT;
        float s = -INFINITY;
        if ((int)(p0 + j) <= qpos[r / PF_GH]) {  // causal; positions past the run's last too
          local const float* qr = qs + r * PF_KS;
          local const float* kr = kt + j * PF_KS;
          float d0 = 0.0f, d1 = 0.0f;  // two chains: half the FMA latency per score
          for (uint d = 0; d < PF_DK; d += 2) {
            d0 = fma(qr[d], kr[d], d0);
            d1 = fma(qr[d + 1], kr[d + 1], d1);
          }
          s = (d0 + d1) * scale;
        }
        pr[idx] = s;
      }
      barrier(CLK_LOCAL_MEM_FENCE);
      for (uint r = lane; r < PF_R; r += PF_WG)
        softmax_tile_max(pr + r * PF_KT, n, m_run + r, corr + r);
      barrier(CLK_LOCAL_MEM_FENCE);
      for (uint idx = lane; idx < PF_R * PF_KT; idx += PF_WG)
        pr[idx] = pr[idx] == -INFINITY ? 0.0f : softmax_exp(pr[idx] - m_run[idx / PF_KT]);
      barrier(CLK_LOCAL_MEM_FENCE);
      for (uint r = lane; r < PF_R; r += PF_WG) {
        float sum = 0.0f;
        for (uint j = 0; j < n; ++j) sum += pr[r * PF_KT + j];
        l_run[r] = l_run[r] * corr[r] + sum;
      }
      // Not needed by the memory model (the value loop below reads none of l_run), but PoCL's
      // work-group loops lost this update without it (the sums came out zero).
      barrier(CLK_LOCAL_MEM_FENCE);
#pragma unroll
      for (int i = 0; i < PF_EPL; ++i) {
        const uint e = lane + i * PF_WG;
        if (e < PF_R * PF_DV) {
          const uint r = e / PF_DV, d = e % PF_DV;
          float a = acc[i] * corr[r];
          for (uint j = 0; j < n; ++j) a = fma(pr[r * PF_KT + j], vt[j * PF_DV + d], a);
          acc[i] = a;
        }
      }
      barrier(CLK_LOCAL_MEM_FENCE);  // the tiles (and l_run) are rewritten next
    }
#pragma unroll
    for (int i = 0; i < PF_EPL; ++i) {
      const uint e = lane + i * PF_WG;
      if (e < PF_R * PF_DV) {
        const uint r = e / PF_DV, d = e % PF_DV, tok = r / PF_GH;
        if (tok >= run && tok < run_end)
          out[(size_t)(t0 + tok) * o_ldt + (size_t)(h0 + r % PF_GH) * o_ldh + d] = acc[i] / l_run[r];
      }
    }
    barrier(CLK_LOCAL_MEM_FENCE);  // qpos, qs and the softmax state are rewritten by the next run
    run = run_end;
  }
}
#endif  // PF_WG
