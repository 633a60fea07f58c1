// What both shapes of the sampler share: kernels_cl/sampling.cl (one work-item per row, the CPU
// shape) and kernels_cl/sampling_wg.cl (one work-group per row, the GPU shape) pull this file in
// with #include (runtime/program_cache.cpp), so each program compiles only its own kernels.
//
// The summation order, fixed so both shapes draw the same tokens bit for bit: a row is cut into
// 512-token segments of 32 16-token chunks. A segment's mass is its chunks added as float16
// vectors in id order (token j of every chunk in lane j, from 0), then hsum16 over the 16 lanes
// (segment_mass); a row's mass is its segment masses added in id order. On the CPU shape that is a
// vector accumulator per segment; on the GPU shape 16 lanes each sum one column of the segment
// (neighbouring lanes read neighbouring tokens) and meet in a local-memory tree in hsum16's
// order. The inverse-CDF walk goes through the same segment masses, then chunk by chunk (hsum16
// each) and token by token inside the segment that crosses the draw.

#define CHUNK 16

// Per-row parameters, filled by runtime/engine/sampling.cpp (SamplingRowArgs there; 4-byte fields
// only so the layout is the same on both sides).
typedef struct {
  float inv_temperature;  // 1 / max(T, 1e-6)
  uint top_k;             // 0: no top-k filter
  float top_p;            // 1: no nucleus filter
  float min_p;            // keep w >= min_p (w of the best token is 1)
  uint seed_lo;
  uint seed_hi;
  uint greedy;            // temperature 0 or top_k 1
  uint pad;
} SamplingRowArgs;

// Floats of `work` per row: the kept masses, and before them the radix top-k's scratch (candidate
// keys and chunk maxima). runtime/engine/sampling.cpp allocates rows * work_stride.
inline size_t work_stride(uint vocab) { return (size_t)vocab + (vocab + CHUNK - 1) / CHUNK; }

constant uint16 kLane = (uint16)(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);

// Philox4x32-10 (Salmon et al., Random123): a counter-based generator, so a row's draws depend
// only on its seed and the round number.
inline uint4 philox4x32_10(uint4 ctr, uint2 key) {
  for (int i = 0; i < 10; ++i) {
    const uint lo0 = 0xD2511F53u * ctr.x, hi0 = mul_hi(0xD2511F53u, ctr.x);
    const uint lo1 = 0xCD9E8D57u * ctr.z, hi1 = mul_hi(0xCD9E8D57u, ctr.z);
    ctr = (uint4)(hi1 ^ ctr.y ^ key.x, lo1, hi0 ^ ctr.w ^ key.y, lo0);
    key += (uint2)(0x9E3779B9u, 0xBB67AE85u);
  }
  return ctr;
}

// Uniform in [0, 1) with 24 random bits (every value exact in float).
inline float uniform_draw(uint2 seed, uint round) {
  return (float)(philox4x32_10((uint4)(round, 0u, 0u, 0u), seed).x >> 8) * 0x1.0p-24f;
}

// Monotone float -> uint map: a < b as floats (with -0 < +0) iff key(a) < key(b).
inline uint16 order_keys(float16 x) {
  const uint16 u = as_uint16(x);
  return u ^ (((uint16)0u - (u >> 31)) | 0x80000000u);
}
inline uint order_key(float x) {
  const uint u = as_uint(x);
  return u ^ ((0u - (u >> 31)) | 0x80000000u);
}

// The n (1..16) tokens from i; missing lanes read -inf (never allowed).
inline float16 load_logits(global const float* row, uint i, uint n) {
  if (n == CHUNK) return vload16(0, row + i);
  float t[CHUNK];
  for (uint j = 0; j < CHUNK; ++j) t[j] = j < n ? row[i + j] : -INFINITY;
  return vload16(0, t);
}

inline float16 load_work(global const float* w, uint i, uint n) {
  if (n == CHUNK) return vload16(0, w + i);
  float t[CHUNK];
  for (uint j = 0; j < CHUNK; ++j) t[j] = j < n ? w[i + j] : 0.0f;
  return vload16(0, t);
}

inline void store_work(global float* w, uint i, uint n, float16 v) {
  if (n == CHUNK) {
    vstore16(v, 0, w + i);
    return;
  }
  float t[CHUNK];
  vstore16(v, 0, t);
  for (uint j = 0; j < n; ++j) w[i + j] = t[j];
}

// Lanes (-1) whose token may be sampled: inside the row, allowed by the bitmask (bit set), and
// with a logit that is neither NaN nor -inf. i is a multiple of 16.
inline int16 allowed_lanes(float16 l, global const uint* mask_row, uint i, uint n) {
  uint bits = n == CHUNK ? 0xFFFFu : ((1u << n) - 1u);
  if (mask_row) bits &= mask_row[i >> 5] >> (i & 31u);
  const int16 bit_set = as_int16(((uint16)bits >> kLane) & 1u);
  return (bit_set != 0) & (l > (float16)(-INFINITY));
}

// Logits are clamped so +inf behaves as the largest float (its tokens share the mass).
inline float16 clamped(float16 l) { return fmin(l, (float16)FLT_MAX); }

// Lanes ranked at or above the boundary token (bkey, bid): key > bkey, or key == bkey and
// id <= bid.
inline int16 at_or_above(uint16 key, uint16 id, uint bkey, uint bid) {
  return (key > bkey) | ((key == bkey) & (id <= bid));
}
// Lanes ranked strictly above token (pkey, pid).
inline int16 strictly_above(uint16 key, uint16 id, uint pkey, uint pid) {
  return (key > pkey) | ((key == pkey) & (id < pid));
}

// The lanes set in `lanes` (-1/0 per lane) as bits of a uint, so scalar code visits only those
// (lowest_lane + clear) instead of testing all 16.
inline uint lane_bits(int16 lanes) {
  const uint16 b = as_uint16(lanes) & ((uint16)1u << kLane);
  const uint8 a = b.lo | b.hi;
  const uint4 c = a.lo | a.hi;
  const uint2 d = c.lo | c.hi;
  return d.x | d.y;
}
inline uint lowest_lane(uint bits) { return 31u - clz(bits & (0u - bits)); }

// The scans for the best tokens (the top-k boundary, the top logprobs) chunk by chunk: the order
// keys of the chunk at i (n tokens) in *key, and the bits of its lanes that are allowed with a key
// above `above`.
inline uint chunk_keys_above(global const float* row, global const uint* mask_row, uint i, uint n,
                             uint above, uint16* key) {
  const float16 l = load_logits(row, i, n);
  *key = order_keys(clamped(l));
  return lane_bits(allowed_lanes(l, mask_row, i, n) & (*key > above));
}

// A token's rank among the best: key << 32 | ~id, so a larger rank is a better token and equal
// keys go to the lower id; no two tokens share one.
inline ulong token_rank(uint key, uint id) { return ((ulong)key << 32) | (ulong)(~id); }

// The lanes `cand` of the chunk at i (keys `key`) into top[0, *size), the best rank first and at
// most top_n of them; once the list is full, *worst_key is its last entry's key (a chunk's lanes
// at or below it cannot enter).
inline void top_ranks_insert(uint cand, uint16 key, uint i, ulong* top, uint* size, uint top_n,
                             uint* worst_key) {
  uint kt[CHUNK];
  vstore16(key, 0, kt);
  for (; cand; cand &= cand - 1) {
    const uint j = lowest_lane(cand);
    const ulong rank = token_rank(kt[j], i + j);
    if (*size == top_n && rank <= top[*size - 1]) continue;
    uint pos = *size < top_n ? (*size)++ : *size - 1;
    while (pos > 0 && top[pos - 1] < rank) {
      top[pos] = top[pos - 1];
      --pos;
    }
    top[pos] = rank;
    if (*size == top_n) *worst_key = (uint)(top[*size - 1] >> 32);
  }
}

// Per row that asks, filled by runtime/engine/sampling.cpp (LogprobRowArgs there).
typedef struct {
  uint row;              // logits (and bitmask) row
  int token;             // the sampled token
  uint top_n;            // 0..MAX_TOP_LOGPROBS
  float inv_temperature; // 1 for the raw distribution
  uint use_mask;         // restrict to the bitmask row's allowed tokens
  uint pad0, pad1, pad2;
} LogprobRowArgs;

// ---- the fixed summation order ------------------------------------------------------------------

#define SEGMENT 512                    // tokens per segment
#define SEGMENT_CHUNKS (SEGMENT / CHUNK)  // 32

// The kept masses of the chunk at i (a multiple of 16, < vocab); with `restricted`, only the
// tokens ranked strictly above (pkey, pid) keep theirs.
inline float16 chunk_mass(global const float* work, global const float* row, uint vocab, uint i,
                          int restricted, uint pkey, uint pid) {
  const uint n = min((uint)CHUNK, vocab - i);
  float16 w = load_work(work, i, n);
  if (restricted) {
    const uint16 key = order_keys(clamped(load_logits(row, i, n)));
    w = select((float16)0.0f, w, strictly_above(key, (uint16)i + kLane, pkey, pid));
  }
  return w;
}

// The mass of the segment at s0 (a multiple of SEGMENT).
inline float segment_mass(global const float* work, global const float* row, uint vocab, uint s0,
                          int restricted, uint pkey, uint pid) {
  float16 acc = 0.0f;
  for (uint i = s0; i < min(vocab, s0 + SEGMENT); i += CHUNK)
    acc += chunk_mass(work, row, vocab, i, restricted, pkey, pid);
  return hsum16(acc);
}

// One chunk of walk_segment: w holds the kept masses of tokens i .. i + n - 1 and cum the running
// mass before them. When the chunk's sum takes cum past r, the walk goes token by token to the one
// that does and returns 1; otherwise cum takes the chunk's sum. pick follows the last token with
// mass.
inline int walk_chunk(float16 w, uint i, uint n, float r, float* cum, uint* pick) {
  const float s = hsum16(w);
  if (!(s > 0.0f)) return 0;
  float wt[CHUNK];
  vstore16(w, 0, wt);
  if (*cum + s > r) {
    for (uint j = 0; j < n; ++j) {
      if (wt[j] > 0.0f) {
        *pick = i + j;
        *cum += wt[j];
        if (*cum > r) break;
      }
    }
    return 1;
  }
  for (uint j = 0; j < n; ++j)
    if (wt[j] > 0.0f) *pick = i + j;
  *cum += s;
  return 0;
}

// Inside the segment at s0, with `cum` the mass of the segments before it: the first token whose
// running mass exceeds r, the running mass going chunk by chunk, then token by token in the chunk
// that crosses r. When none does (rounding: the chunks' running sum need not reach the segment's
// tree sum), the segment's last token with mass. r = INFINITY asks for that last token.
inline uint walk_segment(global const float* work, global const float* row, uint vocab, uint s0,
                         float cum, float r, int restricted, uint pkey, uint pid) {
  uint pick = s0;
  const uint end = min(vocab, s0 + SEGMENT);
  for (uint i = s0; i < end; i += CHUNK)
    if (walk_chunk(chunk_mass(work, row, vocab, i, restricted, pkey, pid), i,
                   min((uint)CHUNK, vocab - i), r, &cum, &pick))
      break;
  return pick;
}

// One segment of walk_segments: segment k has mass s and cum is the mass before it. Returns 1 when
// it takes the running mass past r; otherwise cum takes s. last follows the last segment with
// mass.
inline int segment_crosses(float s, uint k, float r, float* cum, uint* last) {
  if (s > 0.0f) *last = k;
  if (*cum + s > r) return 1;
  *cum += s;
  return 0;
}

// The inverse-CDF draw given the row's segment masses (seg[k] for the segment at k * SEGMENT):
// the first segment whose running mass exceeds r is walked; rounding can leave r at or above the
// total, and the last token with mass is taken then.
inline uint walk_segments(global const float* work, global const float* row, uint vocab,
                          const global float* seg, float r, int restricted, uint pkey, uint pid) {
  const uint n_seg = (vocab + SEGMENT - 1) / SEGMENT;
  float cum = 0.0f;
  uint last = 0;
  for (uint k = 0; k < n_seg; ++k)
    if (segment_crosses(seg[k], k, r, &cum, &last))
      return walk_segment(work, row, vocab, k * SEGMENT, cum, r, restricted, pkey, pid);
  return walk_segment(work, row, vocab, last * SEGMENT, 0.0f, INFINITY, restricted, pkey, pid);
}

// A row's mass: its segment masses in id order.
inline float sum_segments(const global float* seg, uint vocab) {
  const uint n_seg = (vocab + SEGMENT - 1) / SEGMENT;
  float total = 0.0f;
  for (uint k = 0; k < n_seg; ++k) total += seg[k];
  return total;
}

// Segments of a row (the GPU shape keeps their masses in the tail of `work`: work_stride leaves
// ceil(vocab / 16) floats there).
inline uint segment_count(uint vocab) { return (vocab + SEGMENT - 1) / SEGMENT; }

// exp(l * inv_t - m) of the allowed tokens of the chunk at i, 0 for the others (log Z of
// row_logprobs, and relaxed acceptance's mass, in both shapes).
inline float16 logprob_chunk_mass(global const float* row, global const uint* mask_row, uint vocab,
                                  uint i, float inv_t, float m) {
  const uint n = min((uint)CHUNK, vocab - i);
  const float16 l = load_logits(row, i, n);
  return select((float16)0.0f, exp(clamped(l) * inv_t - m), allowed_lanes(l, mask_row, i, n));
}

// *z += v with Kahan compensation: a row's segment masses are added so (a plain float sum of 250
// segments at a 128k vocabulary would lose ~1e-5).
inline void kahan_add(float* z, float* comp, float v) {
  const float y = v - *comp;
  const float t = *z + y;
  *comp = (t - *z) - y;
  *z = t;
}

// The sum of exp(l * inv_t - m) over a row's allowed tokens in the order above (a 512-token
// segment as float16 chunk sums, then hsum16; the segments added in id order with kahan_add): the
// CPU shape's; sampling_wg.cl's wg_row_mass gives the same bits.
inline float row_mass(global const float* row, global const uint* mask_row, uint vocab, float inv_t,
                      float m) {
  float z = 0.0f, comp = 0.0f;
  for (uint s0 = 0; s0 < vocab; s0 += SEGMENT) {
    float16 acc = 0.0f;
    for (uint i = s0; i < min(vocab, s0 + SEGMENT); i += CHUNK)
      acc += logprob_chunk_mass(row, mask_row, vocab, i, inv_t, m);
    kahan_add(&z, &comp, hsum16(acc));
  }
  return z;
}

// ---- speculative-decoding acceptance (runtime/engine/acceptance.h has the rule and its proof) ---

// Per request, filled by runtime/acceptance.cpp (AcceptRowArgs there).
typedef struct {
  SamplingRowArgs sampling;  // the seed is the one of the first verified position
  uint logit_offset;         // first verification row in `logits` (and `bitmask`)
  uint draft_offset;         // first draft in `drafts`
  uint num_drafts;           // verification rows = num_drafts + 1
  uint thinking;             // relaxed acceptance for the drafts
} AcceptRowArgs;

// Position i of request a (both shapes' acceptance kernels): its logits row and bitmask row (null
// without a bitmask), its draft (-1 past the drafts), and the arguments a strict position draws
// with, the first position's seed + i.
inline global const float* accept_logits_row(global const float* logits, uint vocab,
                                             const AcceptRowArgs a, uint i) {
  return logits + ((size_t)a.logit_offset + i) * vocab;
}
inline global const uint* accept_mask_row(global const uint* bitmask, uint bitmask_words,
                                          const AcceptRowArgs a, uint i) {
  return bitmask ? bitmask + ((size_t)a.logit_offset + i) * bitmask_words : 0;
}
inline int accept_draft(const AcceptRowArgs a, global const int* drafts, uint i) {
  return i < a.num_drafts ? drafts[a.draft_offset + i] : -1;
}
inline SamplingRowArgs accept_position_args(const AcceptRowArgs a, uint i) {
  const ulong seed = (((ulong)a.sampling.seed_hi << 32) | a.sampling.seed_lo) + i;
  SamplingRowArgs p = a.sampling;
  p.seed_lo = (uint)seed;
  p.seed_hi = (uint)(seed >> 32);
  return p;
}

// MAX's relaxed acceptance of draft d: with P = softmax of the untempered allowed logits, d is
// accepted iff it is allowed, fewer than top_k allowed tokens rank above it and
// P(d) >= P(top-1) - delta. `argmax` is the row's best allowed token. The pieces are shared by
// both shapes: whether d may be accepted at all, the allowed tokens ranked above d in one chunk,
// and the rule given the count above d and the row's mass (row_mass with inv_t 1 and m the
// largest logit: P(top-1) = 1 / mass).
inline bool relaxed_draft_allowed(global const float* row, global const uint* mask_row, uint d) {
  return (!mask_row || ((mask_row[d >> 5] >> (d & 31u)) & 1u)) && row[d] > -INFINITY;
}
inline uint relaxed_chunk_above(global const float* row, global const uint* mask_row, uint vocab,
                                uint i, uint d) {
  const uint n = min((uint)CHUNK, vocab - i);
  const float16 l = load_logits(row, i, n);
  const int16 ok = allowed_lanes(l, mask_row, i, n);
  return popcount(lane_bits(ok & strictly_above(order_keys(clamped(l)), (uint16)i + kLane,
                                                order_key(fmin(row[d], FLT_MAX)), d)));
}
inline bool relaxed_rule(float dl, float max_logit, float mass, uint n_above, uint top_k,
                         float delta) {
  return n_above < top_k && exp(dl - max_logit) / mass >= 1.0f / mass - delta;
}
inline bool relaxed_accepts(global const float* row, global const uint* mask_row, uint vocab,
                            uint d, uint argmax, uint top_k, float delta) {
  if (!relaxed_draft_allowed(row, mask_row, d)) return false;
  const float max_logit = fmin(row[argmax], FLT_MAX);
  uint n_above = 0;
  for (uint i = 0; i < vocab; i += CHUNK) n_above += relaxed_chunk_above(row, mask_row, vocab, i, d);
  return relaxed_rule(fmin(row[d], FLT_MAX), max_logit,
                      row_mass(row, mask_row, vocab, 1.0f, max_logit), n_above, top_k, delta);
}
