// Batched token sampling (sample_rows_wg) and log-probabilities (row_logprobs_wg) in the GPU
// shape: one work-group of SAMPLE_WG lanes per row, lane t owning the 16-token chunks t,
// t + SAMPLE_WG, ... (neighbouring lanes read neighbouring 64-byte chunks). The semantics are
// those of kernels_cl/sampling.cl (the CPU shape), and both sum in the fixed order of
// sampling_common.cl, so for the same seeds the two shapes draw the same tokens and give the same
// log-probabilities bit for bit:
//   - a pass hands each lane one chunk (16 tokens, as float16, the same exp() as the CPU shape's)
//     into local memory; then 16 lanes per 512-token segment sum one column each over its 32
//     chunks in id order and meet in a tree in hsum16's order (wg_segment_sums);
//   - the segment masses are added in id order, and the inverse-CDF walk inside the segment that
//     crosses the draw is sequential, by lane 0 (at most 512 tokens);
//   - the top-k boundary is a work-group radix select over (key, ~id), 8 bits a level: the k-th
//     best token, exactly as the CPU shape's heap or radix select finds it;
//   - the top-n log-probabilities: each lane keeps its own best n, then n rounds of a group max.
//
// Every loop that contains a barrier runs the same number of times on every lane and has a single
// exit (no return or break inside it): a barrier inside a loop that some lanes leave early is
// undefined, and PoCL's compiler spent minutes on such loops. Nor is a barrier inside a branch
// that more barriers follow: PoCL copies the code after a branch that holds a barrier once per
// path, and the copies multiply. A step that only some rows take runs on every row instead, its
// loops running no times where it does not apply (a top-k of 0, no draw for a greedy row). With
// its three such branches (greedy, top-k, top-p) wg_sample_row made PoCL 3.1 generate
// sample_rows_wg's work-group function in 11.3-12.6 s on the 2-core EPYC and accept_rows_wg's in
// 13.8-17.8 s; without them in 4.3-6.5 s and 7.8-8.7 s. accept_rows_wg's own branch (a relaxed or
// a strict position) ends its loop's body, so nothing follows it to copy: one body running both
// kinds, the other over a vocabulary of 0, took 26.5 s. SAMPLE_WG is a power of two >= 32
// (runtime/engine/sampling.cpp passes it).

#include "sampling_common.cl"

#ifndef SAMPLE_WG
#define SAMPLE_WG 256
#endif
#define PASS_SEGMENTS (SAMPLE_WG / SEGMENT_CHUNKS)  // segments a pass of one chunk per lane covers
#define COLUMN_LANES (PASS_SEGMENTS * CHUNK)       // lanes that sum the segments' columns

// The argmax of the row's allowed tokens (highest order key, ties to the lowest id) and their
// count in *n_allowed, on every lane. lk, li, lc: SAMPLE_WG uints of local scratch each.
inline uint wg_row_argmax(global const float* row, global const uint* mask_row, uint vocab,
                          local uint* lk, local uint* li, local uint* lc, uint* n_allowed) {
  const uint lane = get_local_id(0);
  uint16 best_key = 0u, best_id = 0xFFFFFFFFu;
  uint count = 0;
  for (uint i = lane * CHUNK; i < vocab; i += SAMPLE_WG * CHUNK) {
    const uint n = min((uint)CHUNK, vocab - i);
    const float16 l = load_logits(row, i, n);
    const int16 ok = allowed_lanes(l, mask_row, i, n);
    const uint16 key = order_keys(clamped(l));
    const int16 better = ok & (key > best_key);
    best_key = select(best_key, key, better);
    best_id = select(best_id, (uint16)i + kLane, better);
    count += popcount(lane_bits(ok));
  }
  uint bk[CHUNK], bi[CHUNK];
  vstore16(best_key, 0, bk);
  vstore16(best_id, 0, bi);
  uint max_key = 0, argmax = 0xFFFFFFFFu;
  for (uint j = 0; j < CHUNK; ++j) {
    if (bk[j] > max_key || (bk[j] == max_key && bi[j] < argmax)) {
      max_key = bk[j];
      argmax = bi[j];
    }
  }
  lk[lane] = max_key;
  li[lane] = argmax;
  lc[lane] = count;
  barrier(CLK_LOCAL_MEM_FENCE);
  for (uint s = SAMPLE_WG / 2; s > 0; s >>= 1) {
    if (lane < s) {
      const uint ok = lk[lane + s], oi = li[lane + s];
      if (ok > lk[lane] || (ok == lk[lane] && oi < li[lane])) {
        lk[lane] = ok;
        li[lane] = oi;
      }
      lc[lane] += lc[lane + s];
    }
    barrier(CLK_LOCAL_MEM_FENCE);
  }
  *n_allowed = lc[0];
  const uint result = li[0];
  barrier(CLK_LOCAL_MEM_FENCE);  // the scratch is free again
  return result;
}

// lv holds the pass's chunk vectors (lane t's 16 values at lv[16 t]); afterwards lf[16 q] holds
// the mass of the pass's segment q in sampling_common.cl's order: each of 16 lanes sums one column
// over the segment's 32 chunks in id order (from 0, as the CPU shape's float16 accumulator), then
// the tree over the 16 columns in hsum16's order (j + 8, j + 4, j + 2, j + 1).
inline void wg_segment_sums(local const float* lv, local float* lf) {
  const uint lane = get_local_id(0);
  if (lane < COLUMN_LANES) {
    const uint q = lane / CHUNK, col = lane % CHUNK;
    float acc = 0.0f;
    for (uint c = 0; c < SEGMENT_CHUNKS; ++c) acc += lv[(q * SEGMENT_CHUNKS + c) * CHUNK + col];
    lf[lane] = acc;
  }
  barrier(CLK_LOCAL_MEM_FENCE);
  for (uint s = CHUNK / 2; s > 0; s >>= 1) {
    if (lane < COLUMN_LANES && lane % CHUNK < s) lf[lane] += lf[lane + s];
    barrier(CLK_LOCAL_MEM_FENCE);
  }
}

// Whether segment q of the pass whose first chunk is `base` lies inside the row (the last pass
// can end past it).
inline bool pass_segment_in_row(uint base, uint q, uint vocab) {
  return (base + q * SEGMENT_CHUNKS) * CHUNK < vocab;
}

// row_mass (sampling_common.cl) by the work-group, the same bits: each pass hands a lane one
// chunk's masses, wg_segment_sums adds the pass's segments, and lane 0 adds them in id order with
// kahan_add. Every lane must call (n_chunks alike on all: the row's chunks, or 0 for none); the
// mass is lane 0's, the other lanes get 0.
inline float wg_row_mass(global const float* row, global const uint* mask_row, uint vocab,
                         float inv_t, float m, uint n_chunks, local float* lv, local float* lf) {
  const uint lane = get_local_id(0);
  float z = 0.0f, comp = 0.0f;
  for (uint base = 0; base < n_chunks; base += SAMPLE_WG) {
    const uint i = (base + lane) * CHUNK;
    const float16 e =
        i < vocab ? logprob_chunk_mass(row, mask_row, vocab, i, inv_t, m) : (float16)0.0f;
    vstore16(e, lane, lv);
    barrier(CLK_LOCAL_MEM_FENCE);
    wg_segment_sums(lv, lf);
    if (lane == 0)
      for (uint q = 0; q < PASS_SEGMENTS && pass_segment_in_row(base, q, vocab); ++q)
        kahan_add(&z, &comp, lf[q * CHUNK]);
    barrier(CLK_LOCAL_MEM_FENCE);
  }
  return z;
}

// After wg_segment_sums for the pass whose first chunk is `base`: the pass's segment masses into
// seg (segment base / 32 + q from lf[16 q]), and lane 0 adds them to *total in id order, so that
// over the passes *total is sum_segments' sum (the same bits) without reading seg back.
inline void wg_store_pass_segments(local const float* lf, uint base, uint vocab,
                                   global float* seg, float* total) {
  const uint lane = get_local_id(0);
  const uint q = lane / CHUNK;
  if (lane < COLUMN_LANES && lane % CHUNK == 0 && pass_segment_in_row(base, q, vocab))
    seg[base / SEGMENT_CHUNKS + q] = lf[lane];
  if (lane == 0)
    for (uint p = 0; p < PASS_SEGMENTS && pass_segment_in_row(base, p, vocab); ++p)
      *total += lf[p * CHUNK];
}

// The inverse-CDF draw of walk_segments (sampling_common.cl) by the work-group, the same token: the
// segment masses go into local memory a window of SAMPLE_WG at a time (one per lane; a 128k
// vocabulary has 251) for lane 0's running sum, then the crossing segment's chunk masses, one
// chunk per lane, for lane 0's walk. A GPU lane alone would wait on each of those loads in turn.
// buf: SAMPLE_WG * CHUNK floats, seg_at: one uint of local memory. The token is lane 0's; the
// other lanes get 0. Every lane must call.
inline uint wg_walk_segments(global const float* work, global const float* row, uint vocab,
                             const global float* seg, float r, int restricted, uint pkey, uint pid,
                             local float* buf, local uint* seg_at) {
  const uint lane = get_local_id(0);
  const uint n_seg = segment_count(vocab);
  float cum = 0.0f;
  uint last = 0, crossing = 0;
  int found = 0;
  for (uint w0 = 0; w0 < n_seg; w0 += SAMPLE_WG) {
    const uint w1 = min(n_seg, w0 + SAMPLE_WG);
    if (w0 + lane < w1) buf[lane] = seg[w0 + lane];
    barrier(CLK_LOCAL_MEM_FENCE);
    if (lane == 0)
      for (uint k = w0; k < w1 && !found; ++k)
        if (segment_crosses(buf[k - w0], k, r, &cum, &last)) {
          found = 1;
          crossing = k;
        }
    barrier(CLK_LOCAL_MEM_FENCE);
  }
  if (lane == 0) *seg_at = found ? crossing : last;
  barrier(CLK_LOCAL_MEM_FENCE);
  const uint s0 = *seg_at * SEGMENT;
  if (lane < SEGMENT_CHUNKS && s0 + lane * CHUNK < vocab)
    vstore16(chunk_mass(work, row, vocab, s0 + lane * CHUNK, restricted, pkey, pid), lane, buf);
  barrier(CLK_LOCAL_MEM_FENCE);
  uint pick = 0;
  if (lane == 0) {
    // As walk_segments: the crossing segment from its running mass, else the last one with mass
    // for its last token.
    float c = found ? cum : 0.0f;
    const float target = found ? r : INFINITY;
    const uint end = min(vocab, s0 + SEGMENT);
    pick = s0;
    for (uint i = s0; i < end; i += CHUNK)
      if (walk_chunk(vload16((i - s0) / CHUNK, buf), i, min((uint)CHUNK, vocab - i), target, &c,
                     &pick))
        break;
  }
  barrier(CLK_LOCAL_MEM_FENCE);  // buf is free again
  return pick;
}

// The segment masses of `work` (restricted to the tokens ranked strictly above (pkey, pid) when
// `restricted`) into seg, by all lanes; visible to every lane on return. Returns their sum in
// sum_segments' order on lane 0 (0 on the others). n_chunks: the row's chunks, or 0 for none
// (alike on every lane).
inline float wg_store_segment_masses(global const float* work, global const float* row,
                                     uint vocab, uint n_chunks, int restricted, uint pkey,
                                     uint pid, global float* seg, local float* lv,
                                     local float* lf) {
  const uint lane = get_local_id(0);
  float total = 0.0f;
  for (uint base = 0; base < n_chunks; base += SAMPLE_WG) {
    const uint i = (base + lane) * CHUNK;
    const float16 w =
        i < vocab ? chunk_mass(work, row, vocab, i, restricted, pkey, pid) : (float16)0.0f;
    vstore16(w, lane, lv);
    barrier(CLK_LOCAL_MEM_FENCE);
    wg_segment_sums(lv, lf);
    wg_store_pass_segments(lf, base, vocab, seg, &total);
    barrier(CLK_LOCAL_MEM_FENCE);
  }
  barrier(CLK_GLOBAL_MEM_FENCE);
  return total;
}

// The k-th best allowed token as (key, id), for 0 < k < allowed count: a radix select over the
// 64-bit rank (key, ~id), 8 bits a level from the top, until the k-th token is alone in its
// bucket; then the one token with that prefix. Every lane picks the bucket from the local
// histogram itself, so the prefix needs no broadcast. k = 0 reads nothing and gives (0, ~0), the
// boundary that keeps every token. hist: 256 uints, found: 2 uints of local memory.
inline uint2 wg_topk_boundary(global const float* row, global const uint* mask_row, uint vocab,
                              uint k, local uint* hist, local uint* found) {
  const uint lane = get_local_id(0);
  uint kp = 0, km = 0, ip = 0, im = 0;  // key prefix and mask, ~id prefix and mask
  uint above = 0;                       // tokens ranked above every token with the prefix
  uint done = k == 0;
  for (uint level = 0; level < 8; ++level) {
    for (uint b = lane; b < 256; b += SAMPLE_WG) hist[b] = 0;
    barrier(CLK_LOCAL_MEM_FENCE);
    const uint shift = 24 - 8 * (level & 3);
    for (uint i = lane * CHUNK; !done && i < vocab; i += SAMPLE_WG * CHUNK) {
      const uint n = min((uint)CHUNK, vocab - i);
      const float16 l = load_logits(row, i, n);
      const uint16 key = order_keys(clamped(l));
      const uint16 nid = ~((uint16)i + kLane);
      uint match = lane_bits(allowed_lanes(l, mask_row, i, n) & ((key & km) == kp) &
                             ((nid & im) == ip));
      uint dt[CHUNK];
      vstore16(level < 4 ? key : nid, 0, dt);
      for (; match; match &= match - 1)
        atomic_inc(&hist[(dt[lowest_lane(match)] >> shift) & 255u]);
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    if (!done) {
      uint b = 256;
      while (b-- > 1 && above + hist[b] < k) above += hist[b];
      if (level < 4) {
        kp |= b << shift;
        km |= 255u << shift;
      } else {
        ip |= b << shift;
        im |= 255u << shift;
      }
      done = hist[b] == 1;  // ranks are unique: at the last level at the latest
    }
    barrier(CLK_LOCAL_MEM_FENCE);  // every lane has read hist
  }
  for (uint i = lane * CHUNK; k > 0 && i < vocab; i += SAMPLE_WG * CHUNK) {
    const uint n = min((uint)CHUNK, vocab - i);
    const float16 l = load_logits(row, i, n);
    const uint16 key = order_keys(clamped(l));
    const uint match = lane_bits(allowed_lanes(l, mask_row, i, n) & ((key & km) == kp) &
                                 ((~((uint16)i + kLane) & im) == ip));
    if (match) {
      const uint j = lowest_lane(match);
      uint kt[CHUNK];
      vstore16(key, 0, kt);
      found[0] = kt[j];
      found[1] = i + j;
    }
  }
  barrier(CLK_LOCAL_MEM_FENCE);
  const uint2 boundary = k > 0 ? (uint2)(found[0], found[1]) : (uint2)(0u, 0xFFFFFFFFu);
  barrier(CLK_LOCAL_MEM_FENCE);
  return boundary;
}

// The local scratch of wg_sample_row, declared by each kernel that calls it (OpenCL C 1.2 puts
// local arrays at kernel scope).
#define WG_SAMPLE_LOCALS                                                      \
  local uint lk[SAMPLE_WG], li[SAMPLE_WG], lc[SAMPLE_WG];                     \
  local float lv[SAMPLE_WG * CHUNK], lf[SAMPLE_WG];                           \
  local uint hist[256];                                                       \
  local uint state[8]; /* the nucleus loop's values; [6] the walk's segment, [7] the token */ \
  local float fstate[1]; /* the nucleus loop's current set mass */
#define WG_SAMPLE_SCRATCH lk, li, lc, lv, lf, hist, state, fstate

// sample_row's token (sampling.cl) drawn by the whole work-group, on every lane: -1 when the row
// allows no token at all. work_row: the kept masses, then the segment masses. Every lane must
// call.
inline int wg_sample_row(global const float* row, global const uint* mask_row, uint vocab,
                         const SamplingRowArgs p, global float* work_row, local uint* lk,
                         local uint* li, local uint* lc, local float* lv, local float* lf,
                         local uint* hist, local uint* state, local float* fstate) {
  const uint lane = get_local_id(0);
  global float* seg = work_row + vocab;

  // 1. Allowed count and argmax. The steps after it draw, and run no times where the row is
  // greedy or allows no token.
  uint n_allowed;
  const uint argmax = wg_row_argmax(row, mask_row, vocab, lk, li, lc, &n_allowed);
  const int draws = n_allowed > 0 && !p.greedy;
  const float max_logit = draws ? fmin(row[argmax], FLT_MAX) : 0.0f;

  // 2. Top-k boundary; k = 0 gives (0, ~0), which keeps every allowed token.
  const uint2 boundary = wg_topk_boundary(
      row, mask_row, vocab, draws && p.top_k > 0 && p.top_k < n_allowed ? p.top_k : 0, hist,
      state);

  // 3. Kept masses into work, segment masses into seg; their sum (lane 0's).
  const uint n_chunks = draws ? (vocab + CHUNK - 1) / CHUNK : 0;
  float total = 0.0f;
  for (uint base = 0; base < n_chunks; base += SAMPLE_WG) {
    const uint i = (base + lane) * CHUNK;
    float16 w = 0.0f;
    if (i < vocab) {
      const uint n = min((uint)CHUNK, vocab - i);
      const float16 l = load_logits(row, i, n);
      const uint16 key = order_keys(clamped(l));
      w = exp((clamped(l) - max_logit) * p.inv_temperature);
      const int16 keep = allowed_lanes(l, mask_row, i, n) &
                         at_or_above(key, (uint16)i + kLane, boundary.x, boundary.y) &
                         (w >= p.min_p);
      w = select((float16)0.0f, w, keep);
      store_work(work_row, i, n, w);
    }
    vstore16(w, lane, lv);
    barrier(CLK_LOCAL_MEM_FENCE);
    wg_segment_sums(lv, lf);
    wg_store_pass_segments(lf, base, vocab, seg, &total);
    barrier(CLK_LOCAL_MEM_FENCE);
  }
  barrier(CLK_GLOBAL_MEM_FENCE);

  // 4. Draw: the nucleus loop as sample_row's (wg_walk_segments: lane 0's token; seg holding the
  // current set's segment masses). Without top-p its first walk is the token, over every kept
  // token as the nucleus loop's first round, so the loop ends there. Only lane 0's total and
  // draws are used. state: accepted, j, pkey, pid, restricted, jkey; fstate[0]: the current set's
  // mass.
  const uint2 seed = (uint2)(p.seed_lo, p.seed_hi);
  const int nucleus = p.top_p < 1.0f;
  const float target = p.top_p * total;
  if (lane == 0) {
    for (uint q = 0; q < 8; ++q) state[q] = 0;
    fstate[0] = total;
  }
  barrier(CLK_LOCAL_MEM_FENCE);
  uint accepted = !draws;
  for (uint round = 0; !accepted; ++round) {
    const float u = uniform_draw(seed, round);
    const uint walked = wg_walk_segments(work_row, row, vocab, seg, u * fstate[0],
                                         (int)state[4], state[2], state[3], lv, state + 6);
    if (lane == 0) {
      state[1] = walked;
      state[5] = order_key(fmin(row[walked], FLT_MAX));
    }
    barrier(CLK_LOCAL_MEM_FENCE | CLK_GLOBAL_MEM_FENCE);
    const uint j = state[1], jkey = state[5];
    const float above = wg_store_segment_masses(work_row, row, vocab, nucleus ? n_chunks : 0, 1,
                                                jkey, j, seg, lv, lf);
    if (lane == 0) {
      if (!nucleus || above < target) {
        state[0] = 1;
      } else {
        state[4] = 1;
        state[2] = jkey;
        state[3] = j;
        fstate[0] = above;
      }
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    accepted = state[0];
    barrier(CLK_LOCAL_MEM_FENCE);
  }
  // Lane 0's walk decided the token: every lane returns it.
  if (lane == 0) state[7] = draws ? state[1] : (uint)(n_allowed == 0 ? -1 : (int)argmax);
  barrier(CLK_LOCAL_MEM_FENCE);
  const int result = (int)state[7];
  barrier(CLK_LOCAL_MEM_FENCE);
  return result;
}

// One token per row, one work-group per row (global size rows * SAMPLE_WG). out[r] = -1 when the
// row allows no token at all. `work` as sample_rows: the kept masses, then the segment masses.
kernel __attribute__((reqd_work_group_size(SAMPLE_WG, 1, 1))) void sample_rows_wg(
    global const float* logits, uint rows, uint vocab, global const SamplingRowArgs* args,
    global const uint* bitmask, uint bitmask_words, global float* work, global int* out) {
  WG_SAMPLE_LOCALS
  const uint r = get_group_id(0);
  const int t = wg_sample_row(logits + (size_t)r * vocab,
                              bitmask ? bitmask + (size_t)r * bitmask_words : 0, vocab, args[r],
                              work + (size_t)r * work_stride(vocab), WG_SAMPLE_SCRATCH);
  if (get_local_id(0) == 0) out[r] = t;
}

// accept_rows (sampling.cl) with a work-group per request (global size batch * SAMPLE_WG): the
// drafts verified in order, each strict position drawing wg_sample_row's token (the token plain
// sampling draws there, in either shape), each relaxed one by wg_row_argmax and relaxed
// acceptance's pieces (sampling_common.cl) summed by the work-group in the CPU shape's order, so
// both shapes give the same (accepted, next token) pairs. The loop's exit is
// decided from values every lane holds alike, so every lane runs it the same number of times.
kernel __attribute__((reqd_work_group_size(SAMPLE_WG, 1, 1))) void accept_rows_wg(
    global const float* logits, uint batch, uint vocab, global const AcceptRowArgs* args,
    global const int* drafts, global const uint* bitmask, uint bitmask_words,
    uint relaxed_top_k, float relaxed_delta, global float* work, global int2* out) {
  WG_SAMPLE_LOCALS
  local uint relaxed_ok;
  const uint b = get_group_id(0);
  const uint lane = get_local_id(0);
  const AcceptRowArgs a = args[b];
  global float* work_row = work + (size_t)b * work_stride(vocab);
  int2 result = (int2)(0, -1);
  int done = 0;
  for (uint i = 0; !done; ++i) {
    global const float* row = accept_logits_row(logits, vocab, a, i);
    global const uint* mask_row = accept_mask_row(bitmask, bitmask_words, a, i);
    const int draft = accept_draft(a, drafts, i);
    if (draft >= 0 && a.thinking) {
      uint n_allowed;
      const uint argmax = wg_row_argmax(row, mask_row, vocab, lk, li, lc, &n_allowed);
      if (n_allowed == 0) {
        result = (int2)((int)i, -1);
        done = 1;
      } else {
        // relaxed_accepts' pieces by the work-group: each lane counts the allowed tokens ranked
        // above the draft in its chunks (the counts meet in lc's tree), the mass is wg_row_mass's.
        const bool allowed = relaxed_draft_allowed(row, mask_row, (uint)draft);
        uint above = 0;
        for (uint c = lane * CHUNK; allowed && c < vocab; c += SAMPLE_WG * CHUNK)
          above += relaxed_chunk_above(row, mask_row, vocab, c, (uint)draft);
        lc[lane] = above;
        barrier(CLK_LOCAL_MEM_FENCE);
        for (uint s = SAMPLE_WG / 2; s > 0; s >>= 1) {
          if (lane < s) lc[lane] += lc[lane + s];
          barrier(CLK_LOCAL_MEM_FENCE);
        }
        const uint n_above = lc[0];
        const float max_logit = fmin(row[argmax], FLT_MAX);
        const float mass = wg_row_mass(row, mask_row, vocab, 1.0f, max_logit,
                                       allowed ? (vocab + CHUNK - 1) / CHUNK : 0, lv, lf);
        if (lane == 0)
          relaxed_ok = allowed && relaxed_rule(fmin(row[draft], FLT_MAX), max_logit, mass,
                                               n_above, relaxed_top_k, relaxed_delta);
        barrier(CLK_LOCAL_MEM_FENCE);
        if (!relaxed_ok) {
          result = (int2)((int)i, (int)argmax);
          done = 1;
        }
        barrier(CLK_LOCAL_MEM_FENCE);
      }
    } else {
      // Strict: the token plain sampling draws here; the draft is accepted iff it is that token.
      const SamplingRowArgs p = accept_position_args(a, i);
      const int t = wg_sample_row(row, mask_row, vocab, p, work_row, WG_SAMPLE_SCRATCH);
      if (draft < 0 || t != draft) {
        result = (int2)((int)i, t);
        done = 1;
      }
    }
  }
  if (lane == 0) out[b] = result;
}

// row_logprobs of sampling.cl, one work-group per requested row (global size rows * SAMPLE_WG);
// the same output layout and the same values bit for bit.
kernel __attribute__((reqd_work_group_size(SAMPLE_WG, 1, 1))) void row_logprobs_wg(
    global const float* logits, uint vocab, global const LogprobRowArgs* args,
    global const uint* bitmask, uint bitmask_words, global float* out) {
  local uint lk[SAMPLE_WG], li[SAMPLE_WG], lc[SAMPLE_WG];
  local float lv[SAMPLE_WG * CHUNK], lf[SAMPLE_WG];
  local ulong lr[SAMPLE_WG];
  const uint g = get_group_id(0);
  const uint lane = get_local_id(0);
  const LogprobRowArgs a = args[g];
  global const float* row = logits + (size_t)a.row * vocab;
  global const uint* mask_row = a.use_mask ? bitmask + (size_t)a.row * bitmask_words : 0;
  global float* o = out + (size_t)g * (2 + 2 * MAX_TOP_LOGPROBS);

  uint n_allowed;
  const uint argmax = wg_row_argmax(row, mask_row, vocab, lk, li, lc, &n_allowed);

  // The lane's own best top_n ranks (token_rank), sorted best first.
  ulong top[MAX_TOP_LOGPROBS];
  uint size = 0;
  uint worst_key = 0;  // 0 while filling
  for (uint i = lane * CHUNK; a.top_n > 0 && i < vocab; i += SAMPLE_WG * CHUNK) {
    uint16 key;
    const uint cand =
        chunk_keys_above(row, mask_row, i, min((uint)CHUNK, vocab - i), worst_key, &key);
    if (cand) top_ranks_insert(cand, key, i, top, &size, a.top_n, &worst_key);
  }
  // The group's top_n: round t takes the best head among the lanes' lists (ranks are unique).
  uint picked[MAX_TOP_LOGPROBS];
  uint n_picked = 0, head = 0;
  for (uint t = 0; t < a.top_n; ++t) {
    const ulong mine = head < size ? top[head] : 0ul;
    lr[lane] = mine;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (uint s = SAMPLE_WG / 2; s > 0; s >>= 1) {
      if (lane < s) lr[lane] = max(lr[lane], lr[lane + s]);
      barrier(CLK_LOCAL_MEM_FENCE);
    }
    const ulong best = lr[0];
    if (best != 0ul) {
      picked[n_picked++] = ~(uint)best;
      if (mine == best) ++head;
    }
    barrier(CLK_LOCAL_MEM_FENCE);
  }

  // log Z in sampling_common.cl's order (wg_row_mass: lane 0's).
  const float m = n_allowed > 0 ? fmin(row[argmax], FLT_MAX) * a.inv_temperature : 0.0f;
  const float z = wg_row_mass(row, mask_row, vocab, a.inv_temperature, m,
                              n_allowed > 0 ? (vocab + CHUNK - 1) / CHUNK : 0, lv, lf);
  if (lane == 0) {
    o[1] = as_float(n_picked);
    if (n_allowed == 0) {
      o[0] = -INFINITY;
    } else {
      const float log_z = m + log(z);
      const bool token_ok =
          a.token >= 0 && (uint)a.token < vocab && row[a.token] > -INFINITY &&
          (!mask_row || ((mask_row[(uint)a.token >> 5] >> ((uint)a.token & 31u)) & 1u));
      o[0] = token_ok ? fmin(row[a.token], FLT_MAX) * a.inv_temperature - log_z : -INFINITY;
      for (uint k = 0; k < n_picked; ++k) {
        const uint id = picked[k];
        o[2 + 2 * k] = as_float(id);
        o[3 + 2 * k] = fmin(row[id], FLT_MAX) * a.inv_temperature - log_z;
      }
    }
  }
}
