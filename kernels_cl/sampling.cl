// Batched token sampling, one work-item per logits row (sample_rows), and speculative-decoding
// acceptance, one work-item per request drawing with the same row code (accept_rows).
// runtime/engine/sampling.h and runtime/engine/acceptance.h have the semantics and the host references that
// mirror this file's arithmetic.
//
// A row is scanned in chunks of 16 tokens with float16 loads: on PoCL's CPU device a work-item
// that owns a contiguous range and uses wide loads runs at memory speed, while GPU-style
// work-groups run several times slower. Per row:
//   1. max pass: allowed-token count and argmax (highest order key, ties to the lowest id);
//      greedy rows stop here.
//   2. top-k boundary: a bounded min-heap in private memory when k <= TOPK_HEAP_MAX (one pass;
//      most groups of 64 tokens are rejected by vector compares against the heap's worst key),
//      else a radix select on the order keys above a lower bound taken from the chunk maxima.
//   3. mass pass: w = exp((l - max) / T) for the kept tokens (allowed, in the top-k, w >= min_p),
//      0 for the rest, stored in `work` so later passes do not recompute exp.
//   4. draw: inverse-CDF walk in id order over w, summed in sampling_common.cl's fixed order (the
//      GPU shape, sampling_wg.cl, sums the same way and draws the same tokens). With top_p < 1
//      the draw is a rejection loop (no sort, no threshold search): draw j from the current set S; j is in the nucleus iff the
//      mass of the tokens ranked above it is < top_p * Z; if not, S shrinks to the tokens ranked
//      above j (which still hold the whole nucleus) and a fresh uniform is drawn. Conditioned on
//      acceptance every round samples w restricted to the nucleus, so the result has exactly the
//      nucleus distribution, and each round accepts with probability >= top_p.
//
// Token order ("rank"): by order key of the logit (descending), ties to the lower id. The order key
// maps a float to a uint that sorts the same way, so ranks compare exactly on every device.

#ifndef TOPK_HEAP_MAX
#define TOPK_HEAP_MAX 256
#endif

#include "sampling_common.cl"

// ---- top-k boundaries: the k-th best allowed token as (key, id) ---------------------------------

inline void heap_sift_up(ulong* h, uint pos) {
  while (pos > 0) {
    const uint parent = (pos - 1) / 2;
    if (h[parent] <= h[pos]) break;
    const ulong t = h[parent];
    h[parent] = h[pos];
    h[pos] = t;
    pos = parent;
  }
}

inline void heap_sift_down(ulong* h, uint n) {
  uint pos = 0;
  for (;;) {
    const uint l = 2 * pos + 1, r = l + 1;
    uint m = pos;
    if (l < n && h[l] < h[m]) m = l;
    if (r < n && h[r] < h[m]) m = r;
    if (m == pos) break;
    const ulong t = h[m];
    h[m] = h[pos];
    h[pos] = t;
    pos = m;
  }
}

#define GROUP (4 * CHUNK)

// Whether any allowed token of [g, g + GROUP) has a key in [lo, hi]. Passes that look for a few
// tokens test a group with this first: one branch per 64 tokens instead of one per 16 made such a
// pass about a third cheaper on PoCL.
inline bool group_has_key_in(global const float* row, global const uint* mask_row, uint vocab,
                             uint g, uint lo, uint hi) {
  int16 hit = 0;
  const uint end = min(vocab, g + GROUP);
  for (uint i = g; i < end; i += CHUNK) {
    const uint n = min((uint)CHUNK, vocab - i);
    const float16 l = load_logits(row, i, n);
    const uint16 key = order_keys(clamped(l));
    hit |= allowed_lanes(l, mask_row, i, n) & (key >= lo) & (key <= hi);
  }
  return any(hit);
}

// A min-heap of the k best ranks (token_rank) seen so far: ids arriving in ascending order, a later
// token with the root's key never displaces it.
inline uint2 topk_boundary_heap(global const float* row, global const uint* mask_row, uint vocab,
                                uint k) {
  ulong heap[TOPK_HEAP_MAX];
  uint size = 0;
  uint root_key = 0;  // 0 while filling: every allowed key is larger
  for (uint g = 0; g < vocab; g += GROUP) {
    if (!group_has_key_in(row, mask_row, vocab, g, root_key + 1, 0xFFFFFFFFu)) continue;
    for (uint i = g; i < min(vocab, g + GROUP); i += CHUNK) {
      uint16 key;
      uint cand = chunk_keys_above(row, mask_row, i, min((uint)CHUNK, vocab - i), root_key, &key);
      if (!cand) continue;
      uint kt[CHUNK];
      vstore16(key, 0, kt);
      for (; cand; cand &= cand - 1) {
        const uint j = lowest_lane(cand);
        const ulong rank = token_rank(kt[j], i + j);
        if (size < k) {
          heap[size] = rank;
          heap_sift_up(heap, size);
          if (++size == k) root_key = (uint)(heap[0] >> 32);
        } else if (rank > heap[0]) {
          heap[0] = rank;
          heap_sift_down(heap, size);
          root_key = (uint)(heap[0] >> 32);
        }
      }
    }
  }
  return (uint2)((uint)(heap[0] >> 32), ~(uint)heap[0]);
}

// The n (1..16) keys from i; missing lanes read 0 (below every floor, as disallowed tokens).
inline uint16 load_keys(global const uint* keys, uint i, uint n) {
  if (n == CHUNK) return vload16(0, keys + i);
  uint t[CHUNK];
  for (uint j = 0; j < CHUNK; ++j) t[j] = j < n ? keys[i + j] : 0u;
  return vload16(0, t);
}

inline uint hmax16(uint16 v) {
  const uint8 a = max(v.lo, v.hi);
  const uint4 b = max(a.lo, a.hi);
  const uint2 c = max(b.lo, b.hi);
  return max(c.x, c.y);
}

// Radix select, 8 bits a level from the top, of the k-th largest of keys[0, n) counting only
// keys >= key_floor (at least k of them). Returns (prefix, prefix_mask, above) after `levels`
// levels or as soon as the k-th key is alone in its bucket: the k-th key has bits `prefix` under
// `prefix_mask`, and `above` counted keys lie above every key with that prefix.
inline uint4 radix_select(global const uint* keys, uint n, uint k, uint key_floor, int levels) {
  uint prefix = 0, prefix_mask = 0, above = 0;
  for (int level = 0; level < levels; ++level) {
    const int shift = 24 - 8 * level;
    uint hist[256];
    for (uint b = 0; b < 256; ++b) hist[b] = 0;
    for (uint i = 0; i < n; i += CHUNK) {
      const uint16 key = load_keys(keys, i, min((uint)CHUNK, n - i));
      uint match = lane_bits((key >= key_floor) & ((key & prefix_mask) == prefix));
      if (!match) continue;
      uint kt[CHUNK];
      vstore16(key, 0, kt);
      for (; match; match &= match - 1) ++hist[(kt[lowest_lane(match)] >> shift) & 255u];
    }
    uint b = 256;
    while (b-- > 1 && above + hist[b] < k) above += hist[b];
    prefix |= b << shift;
    prefix_mask |= 255u << shift;
    if (hist[b] == 1) break;
  }
  return (uint4)(prefix, prefix_mask, above, 0u);
}

// Top-k boundary for k above the heap's capacity (and below the allowed count). `scratch` holds
// vocab + ceil(vocab / 16) uints. The k-th largest chunk maximum is a lower bound of the k-th
// largest key (the k best chunks each hold a key at least that large), so after a cheap select
// over the V/16 chunk maxima only the keys above that bound, compacted into a short list, go
// through the radix select; a last pass over the row finds the boundary among equal keys.
inline uint2 topk_boundary_radix(global const float* row, global const uint* mask_row, uint vocab,
                                 uint k, global uint* scratch) {
  global uint* chunk_max = scratch + vocab;
  const uint n_chunks = (vocab + CHUNK - 1) / CHUNK;
  uint filled_chunks = 0;
  for (uint i = 0, c = 0; i < vocab; i += CHUNK, ++c) {
    const uint n = min((uint)CHUNK, vocab - i);
    const float16 l = load_logits(row, i, n);
    chunk_max[c] =
        hmax16(select((uint16)0u, order_keys(clamped(l)), allowed_lanes(l, mask_row, i, n)));
    filled_chunks += chunk_max[c] != 0u;
  }
  uint key_floor = 1u;  // every allowed key is >= 1
  if (filled_chunks >= k) {
    // Two levels give the top 16 bits of the bound, which is bound enough.
    key_floor = max(1u, radix_select(chunk_max, n_chunks, k, 1u, 2).x);
  }

  // The allowed keys >= key_floor, in id order, into scratch[0, count).
  uint count = 0;
  for (uint g = 0; g < vocab; g += GROUP) {
    if (!group_has_key_in(row, mask_row, vocab, g, key_floor, 0xFFFFFFFFu)) continue;
    for (uint i = g; i < min(vocab, g + GROUP); i += CHUNK) {
      const uint n = min((uint)CHUNK, vocab - i);
      const float16 l = load_logits(row, i, n);
      const uint16 key = order_keys(clamped(l));
      uint keep = lane_bits(allowed_lanes(l, mask_row, i, n) & (key >= key_floor));
      if (!keep) continue;
      uint kt[CHUNK];
      vstore16(key, 0, kt);
      for (; keep; keep &= keep - 1) scratch[count++] = kt[lowest_lane(keep)];
    }
  }
  const uint4 sel = radix_select(scratch, count, k, key_floor, 4);

  // The boundary is the (k - above)-th token, in id order, among the allowed keys >= key_floor
  // with the prefix (equal keys, or the single token left).
  const uint lo = max(key_floor, sel.x), hi = sel.x | ~sel.y;
  uint need = k - sel.z;
  for (uint g = 0; g < vocab; g += GROUP) {
    if (!group_has_key_in(row, mask_row, vocab, g, lo, hi)) continue;
    for (uint i = g; i < min(vocab, g + GROUP); i += CHUNK) {
      const uint n = min((uint)CHUNK, vocab - i);
      const float16 l = load_logits(row, i, n);
      const uint16 key = order_keys(clamped(l));
      uint match = lane_bits(allowed_lanes(l, mask_row, i, n) & (key >= lo) & (key <= hi));
      if (!match) continue;
      uint kt[CHUNK];
      vstore16(key, 0, kt);
      for (; match; match &= match - 1) {
        const uint j = lowest_lane(match);
        if (--need == 0) return (uint2)(kt[j], i + j);
      }
    }
  }
  return (uint2)(0u, 0xFFFFFFFFu);  // unreachable when k < allowed tokens
}

// ---- drawing ------------------------------------------------------------------------------------

// The masses of the row's segments (sampling_common.cl), restricted to the tokens ranked strictly
// above (pkey, pid) when `restricted`, into seg[0, segment_count(vocab)).
inline void store_segment_masses(global const float* work, global const float* row, uint vocab,
                                 int restricted, uint pkey, uint pid, global float* seg) {
  for (uint k = 0; k < segment_count(vocab); ++k)
    seg[k] = segment_mass(work, row, vocab, k * SEGMENT, restricted, pkey, pid);
}

// ---- one row ------------------------------------------------------------------------------------

// The argmax of the allowed tokens (highest order key, ties to the lowest id), and their count in
// *n_allowed (0: nothing allowed, the result is then meaningless). Each lane keeps its first best
// (strict >), so across lanes the lowest id wins among equal keys.
inline uint row_argmax(global const float* row, global const uint* mask_row, uint vocab,
                       uint* n_allowed) {
  uint16 best_key = 0u, best_id = 0xFFFFFFFFu;
  int16 allowed_count = 0;
  for (uint i = 0; i < vocab; i += CHUNK) {
    const uint n = min((uint)CHUNK, vocab - i);
    const float16 l = load_logits(row, i, n);
    const int16 ok = allowed_lanes(l, mask_row, i, n);
    const uint16 key = order_keys(clamped(l));
    const int16 better = ok & (key > best_key);
    best_key = select(best_key, key, better);
    best_id = select(best_id, (uint16)i + kLane, better);
    allowed_count -= ok;
  }
  uint bk[CHUNK], bi[CHUNK];
  int ac[CHUNK];
  vstore16(best_key, 0, bk);
  vstore16(best_id, 0, bi);
  vstore16(allowed_count, 0, ac);
  uint max_key = 0, argmax = 0xFFFFFFFFu, count = 0;
  for (uint j = 0; j < CHUNK; ++j) {
    count += (uint)ac[j];
    if (bk[j] > max_key || (bk[j] == max_key && bi[j] < argmax)) {
      max_key = bk[j];
      argmax = bi[j];
    }
  }
  *n_allowed = count;
  return argmax;
}

// The token a row draws with parameters p (seed included); -1 when the row allows no token at all.
// `work_row` is the row's scratch of work_stride(vocab) floats; greedy rows never touch it.
inline int sample_row(global const float* row, global const uint* mask_row, uint vocab,
                      const SamplingRowArgs p, global float* work_row) {
  // 1. Allowed count and argmax.
  uint n_allowed;
  const uint argmax = row_argmax(row, mask_row, vocab, &n_allowed);
  if (n_allowed == 0) return -1;
  if (p.greedy) return (int)argmax;
  const float max_logit = fmin(row[argmax], FLT_MAX);

  // 2. Top-k boundary; (0, ~0) keeps every allowed token (all keys are above 0).
  uint2 boundary = (uint2)(0u, 0xFFFFFFFFu);
  if (p.top_k > 0 && p.top_k < n_allowed)
    boundary = p.top_k <= TOPK_HEAP_MAX
                   ? topk_boundary_heap(row, mask_row, vocab, p.top_k)
                   : topk_boundary_radix(row, mask_row, vocab, p.top_k, (global uint*)work_row);

  // 3. Kept mass (overwrites the radix select's scratch); segment masses into the tail.
  global float* seg = work_row + vocab;
  for (uint s0 = 0; s0 < vocab; s0 += SEGMENT) {
    float16 acc = 0.0f;
    for (uint i = s0; i < min(vocab, s0 + SEGMENT); i += CHUNK) {
      const uint n = min((uint)CHUNK, vocab - i);
      const float16 l = load_logits(row, i, n);
      const uint16 key = order_keys(clamped(l));
      float16 w = exp((clamped(l) - max_logit) * p.inv_temperature);
      const int16 keep = allowed_lanes(l, mask_row, i, n) &
                         at_or_above(key, (uint16)i + kLane, boundary.x, boundary.y) &
                         (w >= p.min_p);
      w = select((float16)0.0f, w, keep);
      store_work(work_row, i, n, w);
      acc += w;
    }
    seg[s0 / SEGMENT] = hsum16(acc);
  }
  const float total = sum_segments(seg, vocab);

  // 4. Draw. In the nucleus loop `seg` always holds the masses of the current set S: after a
  // rejection, the masses above j just summed are those of the next round's set.
  const uint2 seed = (uint2)(p.seed_lo, p.seed_hi);
  if (p.top_p >= 1.0f)
    return (int)walk_segments(work_row, row, vocab, seg, uniform_draw(seed, 0) * total, 0, 0, 0);
  const float target = p.top_p * total;
  float set_mass = total;
  int restricted = 0;
  uint pkey = 0, pid = 0;
  for (uint round = 0;; ++round) {
    const float u = uniform_draw(seed, round);
    const uint j = walk_segments(work_row, row, vocab, seg, u * set_mass, restricted, pkey, pid);
    const uint jkey = order_key(fmin(row[j], FLT_MAX));
    store_segment_masses(work_row, row, vocab, 1, jkey, j, seg);
    const float above = sum_segments(seg, vocab);
    // The best token has nothing above it, so the loop ends; every rejection removes j and all
    // tokens ranked below it.
    if (above < target) return (int)j;
    restricted = 1;
    pkey = jkey;
    pid = j;
    set_mass = above;
  }
}

// One token per row. out[r] = -1 when the row allows no token at all.
kernel void sample_rows(global const float* logits, uint rows, uint vocab,
                        global const SamplingRowArgs* args, global const uint* bitmask,
                        uint bitmask_words, global float* work, global int* out) {
  const uint r = get_global_id(0);
  if (r >= rows) return;
  global const float* row = logits + (size_t)r * vocab;
  global const uint* mask_row = bitmask ? bitmask + (size_t)r * bitmask_words : 0;
  out[r] = sample_row(row, mask_row, vocab, args[r], work + (size_t)r * work_stride(vocab));
}

// ---- speculative-decoding acceptance (runtime/engine/acceptance.h has the rule and its proof) ---

// AcceptRowArgs and relaxed acceptance's pieces are sampling_common.cl's (the GPU shape's
// accept_rows_wg shares them).

// One work-item per request: verifies its drafts in order and stops at the first rejection.
// out[b] = (drafts accepted, next token); the next token is -1 when the row it comes from allows
// no token at all.
kernel void accept_rows(global const float* logits, uint batch, uint vocab,
                        global const AcceptRowArgs* args, global const int* drafts,
                        global const uint* bitmask, uint bitmask_words, uint relaxed_top_k,
                        float relaxed_delta, global float* work, global int2* out) {
  const uint b = get_global_id(0);
  if (b >= batch) return;
  const AcceptRowArgs a = args[b];
  global float* work_row = work + (size_t)b * work_stride(vocab);
  for (uint i = 0;; ++i) {
    global const float* row = accept_logits_row(logits, vocab, a, i);
    global const uint* mask_row = accept_mask_row(bitmask, bitmask_words, a, i);
    const int draft = accept_draft(a, drafts, i);
    if (draft >= 0 && a.thinking) {
      uint n_allowed;
      const uint argmax = row_argmax(row, mask_row, vocab, &n_allowed);
      if (n_allowed == 0) {
        out[b] = (int2)((int)i, -1);
        return;
      }
      if (relaxed_accepts(row, mask_row, vocab, (uint)draft, argmax, relaxed_top_k,
                          relaxed_delta))
        continue;
      out[b] = (int2)((int)i, (int)argmax);
      return;
    }
    // Strict: the token plain sampling draws here; the draft is accepted iff it is that token.
    const SamplingRowArgs p = accept_position_args(a, i);
    const int t = sample_row(row, mask_row, vocab, p, work_row);
    if (draft < 0 || t != draft) {
      out[b] = (int2)((int)i, t);
      return;
    }
  }
}

// ---- penalties (runtime/engine/sampling.h has the rules) ----------------------------------------

// A request's token counts live in one word per vocabulary entry of its slot in `counts`: the low
// 31 bits count the times it was generated, PROMPT_BIT says it occurs in the prompt.
#define PROMPT_BIT 0x80000000u

// Per penalised row, filled by runtime/engine/sampling.cpp (PenaltyRowArgs there).
typedef struct {
  float frequency;   // OpenAI: logit -= frequency * generated count
  float presence;    // OpenAI: logit -= presence * (generated count > 0)
  float repetition;  // HF, over prompt and generated tokens: l > 0 ? l / r : l * r
  uint row;          // logits row
  uint slot;         // counts slot of the request
  uint extra_offset; // tokens not yet in the counts (earlier drafts of a verified run)
  uint extra_count;
  uint pad;
} PenaltyRowArgs;

// The one place the penalty math is written (vLLM's order: repetition first, then frequency and
// presence). `generated` and `seen` (generated or in the prompt; -1/0 per lane) per token.
inline float16 penalised(float16 l, uint16 generated, int16 seen, const PenaltyRowArgs p) {
  const float16 rep = select(l * p.repetition, l / p.repetition, l > (float16)0.0f);
  l = select(l, rep, seen);
  return l - p.frequency * convert_float16(generated) -
         select((float16)0.0f, (float16)p.presence, generated > (uint16)0u);
}

// Work-item (j, block): penalised row j over tokens [block * PENALTY_BLOCK, +PENALTY_BLOCK),
// read from `src` and written to `dst` (the same buffer for in place). Rows with an all-neutral
// PenaltyRowArgs copy through unchanged (the out-of-place case).
kernel void apply_penalties(global const float* src, global float* dst, uint vocab,
                            global const PenaltyRowArgs* args, global const uint* counts,
                            global const int* extra_tokens) {
  const PenaltyRowArgs p = args[get_global_id(0)];
  const uint begin = (uint)get_global_id(1) * PENALTY_BLOCK;
  if (begin >= vocab) return;
  const uint end = min(vocab, begin + PENALTY_BLOCK);
  global const float* in = src + (size_t)p.row * vocab;
  global float* out = dst + (size_t)p.row * vocab;
  global const uint* cnt = counts + (size_t)p.slot * vocab;
  for (uint i = begin; i < end; i += CHUNK) {
    const uint n = min((uint)CHUNK, end - i);
    float16 l;
    uint16 c;
    if (n == CHUNK) {
      l = vload16(0, in + i);
      c = vload16(0, cnt + i);
    } else {
      float lt[CHUNK];
      uint ct[CHUNK];
      for (uint j = 0; j < CHUNK; ++j) {
        lt[j] = j < n ? in[i + j] : 0.0f;
        ct[j] = j < n ? cnt[i + j] : 0u;
      }
      l = vload16(0, lt);
      c = vload16(0, ct);
    }
    uint16 generated = c & ~PROMPT_BIT;
    const uint16 id = (uint16)i + kLane;
    for (uint e = 0; e < p.extra_count; ++e)
      generated -= as_uint16(id == (uint16)(uint)extra_tokens[p.extra_offset + e]);
    const float16 r = penalised(l, generated, (c != (uint16)0u) | (generated != (uint16)0u), p);
    if (n == CHUNK) {
      vstore16(r, 0, out + i);
    } else {
      float rt[CHUNK];
      vstore16(r, 0, rt);
      for (uint j = 0; j < n; ++j) out[i + j] = rt[j];
    }
  }
}

// counts[slot * vocab + token] += 1 for each committed (slot, token); a step can commit the same
// token of a slot twice (speculative runs), hence the atomics.
kernel void penalty_counts_add(global uint* counts, uint vocab, global const uint2* slot_token,
                               uint n) {
  const uint j = get_global_id(0);
  if (j >= n) return;
  atomic_inc(counts + (size_t)slot_token[j].x * vocab + slot_token[j].y);
}

// Marks a new request's prompt tokens in its (zeroed) slot.
kernel void penalty_counts_prompt(global uint* counts, uint vocab, uint slot,
                                  global const int* tokens, uint n) {
  const uint j = get_global_id(0);
  if (j >= n) return;
  atomic_or(counts + (size_t)slot * vocab + (uint)tokens[j], PROMPT_BIT);
}

// ---- log-probabilities --------------------------------------------------------------------------

// Row j, at out + j * (2 + 2 * MAX_TOP_LOGPROBS): log p(token), the number of top entries (as
// uint bits; top_n or fewer when fewer tokens are allowed), then (id bits, log p) pairs, best
// first (logit descending, ties to the lower id). p = softmax(l * inv_t) over the allowed tokens
// (finite or +inf logits, bitmask bit set when use_mask). A token outside that set gets -inf.
kernel void row_logprobs(global const float* logits, uint vocab, global const LogprobRowArgs* args,
                         global const uint* bitmask, uint bitmask_words, global float* out) {
  const LogprobRowArgs a = args[get_global_id(0)];
  global const float* row = logits + (size_t)a.row * vocab;
  global const uint* mask_row = a.use_mask ? bitmask + (size_t)a.row * bitmask_words : 0;
  global float* o = out + get_global_id(0) * (2 + 2 * MAX_TOP_LOGPROBS);
  // Pass 1: argmax (the max for a stable log-sum-exp) and the top-n ranks (sorted, best first).
  // Scaling by inv_t > 0 keeps the order, so ranks come from the unscaled logits.
  uint n_allowed;
  const uint argmax = row_argmax(row, mask_row, vocab, &n_allowed);
  ulong top[MAX_TOP_LOGPROBS];
  uint size = 0;
  uint worst_key = 0;  // 0 while filling
  if (a.top_n > 0) {
    for (uint g = 0; g < vocab; g += GROUP) {
      if (!group_has_key_in(row, mask_row, vocab, g, worst_key + 1, 0xFFFFFFFFu)) continue;
      for (uint i = g; i < min(vocab, g + GROUP); i += CHUNK) {
        uint16 key;
        const uint cand =
            chunk_keys_above(row, mask_row, i, min((uint)CHUNK, vocab - i), worst_key, &key);
        if (cand) top_ranks_insert(cand, key, i, top, &size, a.top_n, &worst_key);
      }
    }
  }
  o[1] = as_float(size);
  if (n_allowed == 0) {
    o[0] = -INFINITY;
    return;
  }
  // Pass 2: log Z = max + log(sum exp(l - max)) in the fixed order of sampling_common.cl
  // (row_mass; sampling_wg.cl's wg_row_mass gives the same bits).
  const float m = fmin(row[argmax], FLT_MAX) * a.inv_temperature;
  const float log_z = m + log(row_mass(row, mask_row, vocab, a.inv_temperature, m));
  const bool token_ok =
      a.token >= 0 && (uint)a.token < vocab && row[a.token] > -INFINITY &&
      (!mask_row || ((mask_row[(uint)a.token >> 5] >> ((uint)a.token & 31u)) & 1u));
  o[0] = token_ok ? fmin(row[a.token], FLT_MAX) * a.inv_temperature - log_z : -INFINITY;
  for (uint k = 0; k < size; ++k) {
    const uint id = ~(uint)top[k];
    o[2 + 2 * k] = as_float(id);
    o[3 + 2 * k] = fmin(row[id], FLT_MAX) * a.inv_temperature - log_z;
  }
}
