// Mixture-of-Experts plumbing: DeepSeek-V3's router, the gather of tokens into expert order and the
// weighted combine of expert outputs back into token order. Local size 1 on CPU: a work-item owns a
// token (router) or a contiguous chunk of a row (gather, combine).

// ---------------------------------------------------------------------------------------------
// moe_route: noaux_tc routing, one work-item per token. The shape of the router is fixed per model,
// so it comes in as build options and the per-token arrays live in registers / private memory:
//   -DN_EXPERTS -DTOP_K -DN_GROUP -DTOPK_GROUP -DNORM_TOPK=0|1 -DBIAS=0 (none) | 1 (f32) | 2 (bf16)
// Selection score b = sigmoid(logit) + bias; group score = sum of the group's two best b; the best
// TOPK_GROUP groups stay eligible; TOP_K experts are picked from them by b, best first. Every scan
// goes in ascending index order and replaces the current best only on a strictly greater value, so
// ties go to the lower group / expert id. Weights are the unbiased sigmoid scores of the picks.

#ifdef N_EXPERTS
#define EXPERTS_PER_GROUP (N_EXPERTS / N_GROUP)

#if BIAS == 2
typedef ushort bias_t;
#define LOAD_BIAS(p, e) bf16_to_f32((p)[e])
#else
typedef float bias_t;
#define LOAD_BIAS(p, e) ((p)[e])
#endif

kernel void moe_route(global const float* logits, global const bias_t* bias,
                      float routed_scaling_factor, global int* topk_ids,
                      global float* topk_weights) {
  const uint t = get_global_id(0);
  global const float* lt = logits + (size_t)t * N_EXPERTS;

  float score[N_EXPERTS];  // sigmoid(logit): the weights
  float sel[N_EXPERTS];    // score + bias: the selection
  for (int e = 0; e < N_EXPERTS; ++e) {
    score[e] = 1.0f / (1.0f + exp(-lt[e]));
#if BIAS
    sel[e] = score[e] + LOAD_BIAS(bias, e);
#else
    sel[e] = score[e];
#endif
  }

  uchar eligible[N_EXPERTS];
#if N_GROUP > 1
  float group_score[N_GROUP];
  for (int g = 0; g < N_GROUP; ++g) {
    float best = -INFINITY, second = -INFINITY;
    for (int e = g * EXPERTS_PER_GROUP; e < (g + 1) * EXPERTS_PER_GROUP; ++e) {
      const float v = sel[e];
      if (v > best) {
        second = best;
        best = v;
      } else if (v > second) {
        second = v;
      }
    }
    group_score[g] = best + second;
  }
  uchar group_kept[N_GROUP];
  for (int g = 0; g < N_GROUP; ++g) group_kept[g] = 0;
  for (int r = 0; r < TOPK_GROUP; ++r) {
    int bi = -1;
    float bv = 0.0f;
    for (int g = 0; g < N_GROUP; ++g)
      if (!group_kept[g] && (bi < 0 || group_score[g] > bv)) {
        bi = g;
        bv = group_score[g];
      }
    group_kept[bi] = 1;
  }
  for (int e = 0; e < N_EXPERTS; ++e) eligible[e] = group_kept[e / EXPERTS_PER_GROUP];
#else
  for (int e = 0; e < N_EXPERTS; ++e) eligible[e] = 1;
#endif

  int picked[TOP_K];
  float sum = 0.0f;
  for (int r = 0; r < TOP_K; ++r) {
    int bi = -1;
    float bv = 0.0f;
    for (int e = 0; e < N_EXPERTS; ++e)
      if (eligible[e] && (bi < 0 || sel[e] > bv)) {
        bi = e;
        bv = sel[e];
      }
    eligible[bi] = 0;
    picked[r] = bi;
    sum += score[bi];
  }

  global int* ids = topk_ids + (size_t)t * TOP_K;
  global float* wts = topk_weights + (size_t)t * TOP_K;
  for (int r = 0; r < TOP_K; ++r) {
    float w = score[picked[r]];
#if NORM_TOPK
    w = w / sum;
#endif
    ids[r] = picked[r];
    wts[r] = w * routed_scaling_factor;
  }
}
#endif  // N_EXPERTS

// ---------------------------------------------------------------------------------------------
// Row copies and the combine walk a row in chunks of CHUNK floats: dimension 0 is the row,
// dimension 1 the chunk, so short batches with wide rows still spread over the cores.
#define CHUNK 256

// y[i] = x[rows[i]].
kernel void gather_rows(global const float* x, uint ldx, global const uint* rows,
                        global float* y, uint ldy, uint width) {
  const uint i = get_global_id(0);
  const uint c0 = get_global_id(1) * CHUNK;
  const uint c1 = min(c0 + CHUNK, width);
  global const float* src = x + (size_t)rows[i] * ldx;
  global float* dst = y + (size_t)i * ldy;
  uint c = c0;
  for (; c + 16 <= c1; c += 16) vstore16(vload16(0, src + c), 0, dst + c);
  for (; c < c1; ++c) dst[c] = src[c];
}

// out[t] (+)= sum over s < top_k, in slot order, of weights[t, s] * expert_out[slot_row[t, s]].
// The sum is formed first and then added to out, so accumulating equals out + combine(...).
kernel void moe_combine(global const float* expert_out, uint ld, global const uint* slot_row,
                        global const float* weights, uint top_k, uint H, global float* out,
                        uint ldo, int accumulate) {
  const uint t = get_global_id(0);
  const uint c0 = get_global_id(1) * CHUNK;
  const uint c1 = min(c0 + CHUNK, H);
  global const uint* rows = slot_row + (size_t)t * top_k;
  global const float* wt = weights + (size_t)t * top_k;
  global float* o = out + (size_t)t * ldo;
  uint c = c0;
  for (; c + 16 <= c1; c += 16) {
    float16 acc = (float16)(0.0f);
    for (uint s = 0; s < top_k; ++s)
      acc = fma((float16)(wt[s]), vload16(0, expert_out + (size_t)rows[s] * ld + c), acc);
    if (accumulate) acc = vload16(0, o + c) + acc;
    vstore16(acc, 0, o + c);
  }
  for (; c < c1; ++c) {
    float acc = 0.0f;
    for (uint s = 0; s < top_k; ++s) acc = fma(wt[s], expert_out[(size_t)rows[s] * ld + c], acc);
    o[c] = accumulate ? o[c] + acc : acc;
  }
}
