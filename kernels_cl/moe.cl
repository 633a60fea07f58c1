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

#ifdef ROUTE_WG
// The GPU shape of moe_route (-DROUTE_WG lanes, a power of two): one work-group per token, the
// scores in local memory with lane l computing experts l, l + ROUTE_WG, ... Each of the TOP_K
// picks is a work-group argmax (largest b, ties to the lower expert id: moe_route's order), so the
// ids and weights are moe_route's bit for bit; the group scores and the weights' sum run on one
// lane in moe_route's order. Launch: global (T * ROUTE_WG), local (ROUTE_WG).
kernel __attribute__((reqd_work_group_size(ROUTE_WG, 1, 1)))
void moe_route_wg(global const float* logits, global const bias_t* bias,
                  float routed_scaling_factor, global int* topk_ids,
                  global float* topk_weights) {
  local float score[N_EXPERTS], sel[N_EXPERTS];
  local uchar eligible[N_EXPERTS];
  local float best_v[ROUTE_WG];
  local int best_i[ROUTE_WG];
  local int picked[TOP_K];
  const uint t = get_group_id(0), lane = get_local_id(0);
  global const float* lt = logits + (size_t)t * N_EXPERTS;
  for (uint e = lane; e < N_EXPERTS; e += ROUTE_WG) {
    const float s = 1.0f / (1.0f + exp(-lt[e]));
    score[e] = s;
#if BIAS
    sel[e] = s + LOAD_BIAS(bias, e);
#else
    sel[e] = s;
#endif
    eligible[e] = 1;
  }
  barrier(CLK_LOCAL_MEM_FENCE);
#if N_GROUP > 1
  local float group_score[N_GROUP];
  local uchar group_kept[N_GROUP];
  for (uint g = lane; g < N_GROUP; g += ROUTE_WG) {
    float best = -INFINITY, second = -INFINITY;
    for (uint e = g * EXPERTS_PER_GROUP; e < (g + 1) * EXPERTS_PER_GROUP; ++e) {
      const float v = sel[e];
      if (v > best) {
        second = best;
        best = v;
      } else if (v > second) {
        second = v;
      }
    }
    group_score[g] = best + second;
    group_kept[g] = 0;
  }
  barrier(CLK_LOCAL_MEM_FENCE);
  if (lane == 0)
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
  barrier(CLK_LOCAL_MEM_FENCE);
  for (uint e = lane; e < N_EXPERTS; e += ROUTE_WG) eligible[e] = group_kept[e / EXPERTS_PER_GROUP];
  barrier(CLK_LOCAL_MEM_FENCE);
#endif
  for (int r = 0; r < TOP_K; ++r) {
    int bi = -1;
    float bv = 0.0f;
    for (uint e = lane; e < N_EXPERTS; e += ROUTE_WG)
      if (eligible[e] && (bi < 0 || sel[e] > bv)) {
        bi = (int)e;
        bv = sel[e];
      }
    best_v[lane] = bv;
    best_i[lane] = bi;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (uint s = ROUTE_WG / 2; s > 0; s >>= 1) {
      if (lane < s) {
        const int ia = best_i[lane], ib = best_i[lane + s];
        const float va = best_v[lane], vb = best_v[lane + s];
        if (ib >= 0 && (ia < 0 || vb > va || (!(vb < va) && ib < ia))) {
          best_i[lane] = ib;
          best_v[lane] = vb;
        }
      }
      barrier(CLK_LOCAL_MEM_FENCE);
    }
    if (lane == 0) {
      picked[r] = best_i[0];
      eligible[best_i[0]] = 0;
    }
    barrier(CLK_LOCAL_MEM_FENCE);
  }
  if (lane == 0) {
    float sum = 0.0f;
    for (int r = 0; r < TOP_K; ++r) sum += score[picked[r]];
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
}
#endif  // ROUTE_WG
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
// with_shared: slot_row holds top_k + 1 rows per token, the last the shared expert's output, added
// unweighted after the routed sum: (out + routed) + shared, the order of the unfused path.
kernel void moe_combine(global const float* expert_out, uint ld, global const uint* slot_row,
                        global const float* weights, uint top_k, uint H, global float* out,
                        uint ldo, int accumulate, int with_shared) {
  const uint t = get_global_id(0);
  const uint c0 = get_global_id(1) * CHUNK;
  const uint c1 = min(c0 + CHUNK, H);
  global const uint* rows = slot_row + (size_t)t * (top_k + with_shared);
  global const float* wt = weights + (size_t)t * top_k;
  global const float* shared = expert_out + (size_t)rows[with_shared ? top_k : 0] * ld;
  global float* o = out + (size_t)t * ldo;
  uint c = c0;
  for (; c + 16 <= c1; c += 16) {
    float16 acc = (float16)(0.0f);
    for (uint s = 0; s < top_k; ++s)
      acc = fma((float16)(wt[s]), vload16(0, expert_out + (size_t)rows[s] * ld + c), acc);
    if (accumulate) acc = vload16(0, o + c) + acc;
    if (with_shared) acc = acc + vload16(0, shared + c);
    vstore16(acc, 0, o + c);
  }
  for (; c < c1; ++c) {
    float acc = 0.0f;
    for (uint s = 0; s < top_k; ++s) acc = fma(wt[s], expert_out[(size_t)rows[s] * ld + c], acc);
    if (accumulate) acc = o[c] + acc;
    if (with_shared) acc = acc + shared[c];
    o[c] = acc;
  }
}

#ifdef ROW_WG
// gather_rows' GPU shape (-DROW_WG lanes): a lane per column, work-groups of ROW_WG neighbouring
// columns of one row. Launch: global (ceil(width / ROW_WG) * ROW_WG, n), local (ROW_WG, 1).
kernel __attribute__((reqd_work_group_size(ROW_WG, 1, 1)))
void gather_rows_wg(global const float* x, uint ldx, global const uint* rows, global float* y,
                    uint ldy, uint width) {
  const uint c = get_global_id(0), i = get_global_id(1);
  if (c < width) y[(size_t)i * ldy + c] = x[(size_t)rows[i] * ldx + c];
}

// moe_combine's GPU shape (-DROW_WG lanes): a lane per column, work-groups of ROW_WG neighbouring
// columns of one token; the same sum in the same order per element.
// Launch: global (ceil(H / ROW_WG) * ROW_WG, T), local (ROW_WG, 1).
kernel __attribute__((reqd_work_group_size(ROW_WG, 1, 1)))
void moe_combine_wg(global const float* expert_out, uint ld, global const uint* slot_row,
                    global const float* weights, uint top_k, uint H, global float* out, uint ldo,
                    int accumulate, int with_shared) {
  const uint c = get_global_id(0), t = get_global_id(1);
  if (c >= H) return;
  global const uint* rows = slot_row + (size_t)t * (top_k + with_shared);
  global const float* wt = weights + (size_t)t * top_k;
  float acc = 0.0f;
  for (uint s = 0; s < top_k; ++s) acc = fma(wt[s], expert_out[(size_t)rows[s] * ld + c], acc);
  global float* o = out + (size_t)t * ldo + c;
  if (accumulate) acc = *o + acc;
  if (with_shared) acc = acc + expert_out[(size_t)rows[top_k] * ld + c];
  *o = acc;
}
#endif

// ---------------------------------------------------------------------------------------------
// The routed experts of a step without the host: the plan (counts, offsets, the token
// permutation and the row tiles of each expert) is made on the device from the router's ids, and
// one launch of moe_grouped_linear computes a projection of every active expert.

// Tiles of at most rows_per_tile rows, none straddling two experts, in expert order.
inline void make_tiles(global const uint* expert_offsets, uint n_experts, uint rows_per_tile,
                       global uint* tiles, global uint* tile_count) {
  uint t = 0;
  for (uint e = 0; e < n_experts; ++e)
    for (uint r = expert_offsets[e]; r < expert_offsets[e + 1]; r += rows_per_tile) {
      tiles[2 * t] = e;
      tiles[2 * t + 1] = r;
      ++t;
    }
  *tile_count = t;
}

// One work-item: ops::group_by_expert on the device (a counting sort over the n (token, slot)
// pairs, rows of an expert in ascending (token, slot) order, no atomics: the same plan on every
// device), then the tiles. with_shared: every token has one more slot, top_k, that names the last
// expert (the shared expert, n_experts - 1), after its routed ones.
// cursor: scratch of n_experts uints.
kernel void moe_plan(global const int* topk_ids, uint T, uint top_k, uint n_experts,
                     int with_shared, uint rows_per_tile, global uint* expert_offsets,
                     global uint* src_token, global uint* slot_row, global uint* cursor,
                     global uint* tiles, global uint* tile_count) {
  const uint slots = top_k + (with_shared ? 1 : 0), n = T * slots;
#define PLAN_EXPERT(i) \
  ((i) % slots < top_k ? (uint)topk_ids[(i) / slots * top_k + (i) % slots] : n_experts - 1)
  for (uint e = 0; e <= n_experts; ++e) expert_offsets[e] = 0;
  for (uint i = 0; i < n; ++i) ++expert_offsets[PLAN_EXPERT(i) + 1];
  for (uint e = 0; e < n_experts; ++e) {
    expert_offsets[e + 1] += expert_offsets[e];
    cursor[e] = expert_offsets[e];
  }
  for (uint i = 0; i < n; ++i) {
    const uint row = cursor[PLAN_EXPERT(i)]++;
    src_token[row] = i / slots;
    slot_row[i] = row;
  }
#undef PLAN_EXPERT
  make_tiles(expert_offsets, n_experts, rows_per_tile, tiles, tile_count);
}

// The tiles alone, from offsets the host planned (the expert-parallel exchange).
kernel void moe_tiles(global const uint* expert_offsets, uint n_experts, uint rows_per_tile,
                      global uint* tiles, global uint* tile_count) {
  make_tiles(expert_offsets, n_experts, rows_per_tile, tiles, tile_count);
}

// moe_grouped_linear: for every tile (dimension 1; work-items past tile_count return at once) of
// expert e's rows r, y[r, mat * N + n] = x[x_row(r)] . W_{e,mat}[n] for the n_mats matrices
// slot0 .. slot0 + n_mats - 1 of the expert (0 gate, 1 up, 2 down): gate and up in one launch
// write [gate | up] rows as dense_mlp does. x_row(r) = x_rows[r] when indirect (the tokens of the
// expert's rows, read in place: no gathered copy), else r. Every expert's tensors live in one
// buffer `w`; table[6 e + s] is the element offset of matrix s of expert e, table[6 e + 3 + s] that
// of its block scales in `scales` (FP8). Each row's sums run in the order linear.cl /
// linear_fp8.cl use for it, whichever rows share its tile. Dimension 0 walks blocks of
// col_tiles_per_item column tiles (TN features each, within one matrix). Tiles of experts with
// packed_from rows or more return at once (moe_grouped_packed takes them; 0: none).
// Build options: -DTM -DTN, -DWEIGHT_TYPE=0|1|2 (common.cl) or -DGROUPED_FP8=1 -DFP8_DENORM, and
// -DCOLUMNS_IN_TURN=0|1 (one-row tiles, as linear.cl); -DGROUPED_BF16=1 with -DWEIGHT_TYPE=1,
// -DBF16_DOT and -DPAIRS_ALIGNED (bf16_tile.cl) takes x as bf16 rows (ldx their stride), and
// with -DFP8_BF16_PANEL=1 -DBF16_PANEL_K (K rounded up to 16) FP8 experts (below).
#if defined(WEIGHT_TYPE) || defined(GROUPED_FP8)
#include "tile_shape.cl"
#if GROUPED_FP8
typedef uchar gw_t;
typedef float gx_t;
#define GLU 0
#define FP8_TILE_ROWS_VARY 1  // an expert's last row tile may have fewer rows than TM
#include "fp8_tile.cl"
#elif GROUPED_BF16
// model.compute_dtype: bf16 with bf16 experts averaging 8 rows or more (4-row tiles; the host's
// kGroupedBf16RowsFrom), or decode's one-row tiles (-DCOLUMNS_IN_TURN=1) where the host's
// ops::bf16_gemv holds: x rows rounded to bf16, the sums of linear_bf16.cl's GEMM (bf16_tile.cl).
// FP8_BF16_PANEL: FP8 experts the same way, through bf16_tile.cl's panels: a work-item
// dequantizes each column tile's TN weight rows to bf16 once, for the tile's up to 64 row tiles.
#if FP8_BF16_PANEL
typedef uchar gw_t;
#else
typedef ushort gw_t;
#endif
typedef ushort gx_t;
#ifndef BF16_DOT
#define BF16_DOT 0
#endif
#ifndef GLU
#define GLU 0  // -DGLU=1: gate and up in one tile, y = silu(gate) * up (moe_grouped_swiglu)
#endif
#include "bf16_tile.cl"
typedef struct { int unused; } Fp8TileCache;
#else
typedef wtype gw_t;
typedef float gx_t;
#define GLU 0
#include "linear_tile.cl"
typedef struct { int unused; } Fp8TileCache;
#endif

// The element type and address space of the rows a tile reads: the weights' own, or a panel's.
#if GROUPED_BF16
typedef ushort tw_t;
#define TW_SPACE BF16_W_SPACE
#else
typedef gw_t tw_t;
#define TW_SPACE global
#endif

// The TN weight rows of the column tile from n0 (rows past N repeat the last: computed on, not
// stored). With GLU, w is the gate matrix and wu the up one: the tile's TN / 2 gate rows, then the
// same columns' up rows, stored as silu(gate) * up.
inline void grouped_weight_rows(global const gw_t* w, global const gw_t* wu, uint N, uint K,
                                uint n0, global const gw_t* wr[TN]) {
#pragma unroll
  for (int j = 0; j < TN; ++j)
#if GLU
    wr[j] = j < TN / 2 ? w + (size_t)min(n0 + j, N - 1) * K
                       : wu + (size_t)min(n0 + j - TN / 2, N - 1) * K;
#else
    wr[j] = w + (size_t)min(n0 + j, N - 1) * K;
#endif
}

#if FP8_BF16_PANEL
// The block-scale rows of those weight rows (sw, su: the scales of w and wu; KB blocks a row).
inline void grouped_scale_rows(global const float* sw, global const float* su, uint N, uint KB,
                               uint n0, global const float* sr[TN]) {
#pragma unroll
  for (int j = 0; j < TN; ++j)
#if GLU
    sr[j] = j < TN / 2 ? fp8_scale_row(sw, min(n0 + j, N - 1), KB)
                       : fp8_scale_row(su, min(n0 + j - TN / 2, N - 1), KB);
#else
    sr[j] = fp8_scale_row(sw, min(n0 + j, N - 1), KB);
#endif
}

#endif

inline void grouped_tile(global const gx_t* x, uint ldx, global const uint* x_rows, int indirect,
                         TW_SPACE const tw_t* wr[TN], global const float* srow, uint KB,
                         global float* y, uint ldy, uint y_col, uint N, uint K, uint m0,
                         uint m_end, uint n0, uint pf_stride, Fp8TileCache* sx) {
  global const gx_t* xr[TM];
#pragma unroll
  for (int i = 0; i < TM; ++i) {
    const uint r = min(m0 + i, m_end - 1);
    xr[i] = x + (size_t)(indirect ? x_rows[r] : r) * ldx;
  }
#if GLU
  const uint tile_cols = TN / 2;
#else
  const uint tile_cols = TN;
#endif
#if GROUPED_BF16
  float sums[OUT_PADDED];
  tile_sums_bf16(xr, wr, K, 0, sums);
#if GLU
  float act[GLU_PADDED];
  glu_act(sums, act);
#define OUT(i, j) act[(i) * (TN / 2) + (j)]
#else
#define OUT(i, j) sums[OUT_INDEX(i, j)]
#endif
#else
  float out[TM][TN];
#define OUT(i, j) out[i][j]
#endif
#if GROUPED_FP8
  bool row_has_nan[TN];
  fp8_tile_dots(xr, wr, srow, KB, K, min((uint)TM, m_end - m0), sx, out, row_has_nan);
#elif !GROUPED_BF16
  tile_dots(xr, wr, K, pf_stride, out);
#endif
#pragma unroll
  for (int i = 0; i < TM; ++i) {
    if (m0 + i >= m_end) break;
    global float* yr = y + (size_t)(m0 + i) * ldy + y_col;
#pragma unroll
    for (int j = 0; j < tile_cols; ++j) {
      const uint n = n0 + j;
      if (n >= N) break;
#if GROUPED_FP8
      yr[n] = row_has_nan[j] ? NAN : OUT(i, j);
#else
      yr[n] = OUT(i, j);
#endif
    }
  }
#undef OUT
}

kernel void moe_grouped_linear(global const gx_t* x, uint ldx, global const uint* x_rows,
                               int indirect, global const gw_t* w, global const float* scales,
                               global const ulong* table, uint slot0, uint n_mats,
                               global const uint* tiles, global const uint* tile_count,
                               global const uint* expert_offsets, uint rows_per_tile,
                               global float* y, uint ldy, uint N, uint K,
                               uint col_tiles_per_item, uint packed_from) {
  // The tiles in reverse: the plan's unused slots (past tile_count, at the end) first, the last
  // tiles run being ordinary experts'. PoCL deals work-groups to its threads in runs of
  // consecutive ones (tens at a time, near the end half of what is left), and in plan order a
  // launch had ended on the shared expert's tiles, every token's rows, one thread idle.
  // In-process A/B on the 2-core EPYC (dsv3-mini's experts, 512 tokens, 64-row tiles), reversed
  // against plan order: f32 compute, bf16 experts gate|up 1.14x and down 1.04x, FP8 1.17x and
  // 1.06x; bf16 compute 1.02x, 1.01x, 1.04x, 1.01x.
  const uint tile = get_global_size(1) - 1 - get_global_id(1);
  if (tile >= *tile_count) return;
  const uint e = tiles[2 * tile], r_begin = tiles[2 * tile + 1];
  const uint r_end = min(r_begin + rows_per_tile, expert_offsets[e + 1]);
  // Experts of packed_from rows or more: moe_grouped_packed's (0: none).
  if (packed_from != 0 && expert_offsets[e + 1] - expert_offsets[e] >= packed_from) return;
#if GLU
  const uint tile_cols = TN / 2;  // the gate and up rows of TN / 2 columns: one output each
  n_mats = 1;
#else
  const uint tile_cols = TN;
#endif
  const uint per_mat = (N + tile_cols - 1) / tile_cols;
  const uint c_begin = get_global_id(0) * col_tiles_per_item;
  const uint c_end = min(c_begin + col_tiles_per_item, per_mat * n_mats);
#if GROUPED_FP8 || FP8_BF16_PANEL
  const uint KB = (K + QBLOCK - 1) / QBLOCK;
#else
  const uint KB = 0;
#endif
  Fp8TileCache sx;  // FP8 tiles in turn: the scaled x row; 4-row tiles: the weight panel
#if GROUPED_FP8
  sx.row = 0;
#ifdef FP8_PANEL_K
  sx.panel_row = 0;
#endif
#endif
#if FP8_BF16_PANEL
  ushort panel[TN][BF16_PANEL_K] __attribute__((aligned(64)));  // rows: whole 32-byte vectors
  private const ushort* panel_rows[TN];
#pragma unroll
  for (int j = 0; j < TN; ++j) panel_rows[j] = panel[j];
#endif
#if GROUPED_FP8 && COLUMNS_IN_TURN
  // Row tiles outer, as linear_fp8's tiles in turn: each row's scaled x copy is made once.
  for (uint m0 = r_begin; m0 < r_end; m0 += TM)
    for (uint c = c_begin; c < c_end; ++c) {
#else
  for (uint c = c_begin; c < c_end; ++c)
    for (uint m0 = r_begin; m0 < r_end; m0 += TM) {
#endif
      const uint mat = c / per_mat, n0 = (c % per_mat) * tile_cols;
      global const gw_t* wm = w + table[6 * e + slot0 + mat];
      global const gw_t* wu = w + table[6 * e + slot0 + (GLU ? 1 : mat)];
#if GROUPED_FP8
      global const float* srow =
          fp8_scale_row(scales + table[6 * e + 3 + slot0 + mat], n0, KB);
#else
      global const float* srow = scales;
#endif
      // The next tile's rows while this one's stream (linear_tile.cl), within one matrix.
      const uint pf = m0 == r_begin && c + 1 < c_end && (c + 1) % per_mat != 0 ? TN * K : 0;
      global const gw_t* wr[TN];
      grouped_weight_rows(wm, wu, N, K, n0, wr);
#if FP8_BF16_PANEL
      if (m0 == r_begin) {  // the column tile's first row tile (columns outer here)
        global const float* sr[TN];
        grouped_scale_rows(scales + table[6 * e + 3 + slot0 + mat],
                           scales + table[6 * e + 3 + slot0 + (GLU ? 1 : mat)], N, KB, n0, sr);
        fp8_panel(wr, sr, K, panel);
      }
      grouped_tile(x, ldx, x_rows, indirect, panel_rows, srow, KB, y, ldy, mat * N, N, K, m0,
                   r_end, n0, pf, &sx);
#else
      grouped_tile(x, ldx, x_rows, indirect, wr, srow, KB, y, ldy, mat * N, N, K, m0, r_end, n0,
                   pf, &sx);
#endif
    }
}
#endif  // WEIGHT_TYPE || GROUPED_FP8

#if defined(GROUPED_WG)
// The frame of the GPU-shaped grouped kernels below, one work-group per output feature of one
// matrix for one tile: the tile's expert e and rows [r_begin, r_end), the matrix and feature n
// (false past tile_count: the whole group returns).
typedef struct {
  uint e, r_begin, r_end, mat, n;
} GroupedWgTile;

inline bool grouped_wg_tile(global const uint* tiles, global const uint* tile_count,
                            global const uint* expert_offsets, uint rows_per_tile, uint N,
                            GroupedWgTile* t) {
  const uint tile = get_group_id(1);
  if (tile >= *tile_count) return false;
  t->e = tiles[2 * tile];
  t->r_begin = tiles[2 * tile + 1];
  t->r_end = min(t->r_begin + rows_per_tile, expert_offsets[t->e + 1]);
  t->mat = get_group_id(0) / N;
  t->n = get_group_id(0) % N;
  return true;
}

// The x rows of the pass at m0 (rows past r_end repeat its last; they are not stored).
inline void grouped_wg_rows(global const float* x, uint ldx, global const uint* x_rows,
                            int indirect, uint m0, uint r_end, global const float* xr[RB]) {
  for (int r = 0; r < RB; ++r) {
    const uint m = min(m0 + r, r_end - 1);
    xr[r] = x + (size_t)(indirect ? x_rows[m] : m) * ldx;
  }
}

// The lanes' sums of the pass at m0 into y's column `col`: linear_wg's tree, lane r stores row
// m0 + r, then the barrier before partial is reused.
inline void grouped_wg_store(local float* partial, const float acc[RB], uint lane, uint m0,
                             uint r_end, global float* y, uint ldy, uint col) {
  for (int r = 0; r < RB; ++r) partial[r * GROUPED_WG + lane] = acc[r];
  wg_tree_sum(partial, RB, GROUPED_WG, lane);
  if (lane < RB && m0 + lane < r_end) y[(size_t)(m0 + lane) * ldy + col] = partial[lane * GROUPED_WG];
  barrier(CLK_LOCAL_MEM_FENCE);
}
#endif  // GROUPED_WG

// The GPU shape of moe_grouped_linear for f32 / bf16 / f16 weights: linear_wg.cl's contract per
// row. A work-group of GROUPED_WG lanes (the WG linear_wg uses on the device) owns one output
// feature of one matrix for one tile: the lanes' sums are linear_wg's (wg_dots.cl's
// wg_lane_dots) and meet in local memory in linear_wg's tree, so every row's value equals
// linear_wg's for it, bit for bit. Tiles past tile_count return at once (the whole group).
// Build options: -DWEIGHT_TYPE, -DGROUPED_WG (a power of two), -DRB (rows per pass), -DVW (as
// linear_wg; unaligned vector loads, since the experts' offsets are read on the device).
// Launch: global (n_mats * N * GROUPED_WG, max_tiles), local (GROUPED_WG, 1).
#if defined(WEIGHT_TYPE) && defined(GROUPED_WG)
#include "wg_dots.cl"

kernel __attribute__((reqd_work_group_size(GROUPED_WG, 1, 1)))
void moe_grouped_linear_wg(global const float* x, uint ldx, global const uint* x_rows,
                           int indirect, global const wtype* w, global const ulong* table,
                           uint slot0, global const uint* tiles, global const uint* tile_count,
                           global const uint* expert_offsets, uint rows_per_tile,
                           global float* y, uint ldy, uint N, uint K) {
  local float partial[RB * GROUPED_WG];
  GroupedWgTile t;
  if (!grouped_wg_tile(tiles, tile_count, expert_offsets, rows_per_tile, N, &t)) return;
  const uint lane = get_local_id(0);
  global const wtype* wr = w + table[6 * t.e + slot0 + t.mat] + (size_t)t.n * K;
  for (uint m0 = t.r_begin; m0 < t.r_end; m0 += RB) {
    global const float* xr[RB];
    grouped_wg_rows(x, ldx, x_rows, indirect, m0, t.r_end, xr);
    float acc[RB];
    wg_lane_dots(xr, min((uint)RB, t.r_end - m0), wr, K, lane, GROUPED_WG, acc);
    grouped_wg_store(partial, acc, lane, m0, t.r_end, y, ldy, t.mat * N + t.n);
  }
}
#endif  // WEIGHT_TYPE && GROUPED_WG

// The GPU shape of moe_grouped_linear for FP8 experts: linear_fp8_wg's contract per row (the same
// lane sums, fp8_tile.cl's fp8_lane_dots, and the same tree), so every row's value equals
// linear_fp8_wg's for it, bit for bit. One work-group per output feature of one matrix for one
// tile, as moe_grouped_linear_wg. Build options: -DGROUPED_FP8=1, -DGROUPED_WG, -DRB.
// Launch: global (n_mats * N * GROUPED_WG, max_tiles), local (GROUPED_WG, 1).
#if defined(GROUPED_FP8) && defined(GROUPED_WG)
kernel __attribute__((reqd_work_group_size(GROUPED_WG, 1, 1)))
void moe_grouped_linear_fp8_wg(global const float* x, uint ldx, global const uint* x_rows,
                               int indirect, global const uchar* w, global const float* scales,
                               global const ulong* table, uint slot0,
                               global const uint* tiles, global const uint* tile_count,
                               global const uint* expert_offsets, uint rows_per_tile,
                               global float* y, uint ldy, uint N, uint K) {
  local float partial[RB * GROUPED_WG];
  GroupedWgTile t;
  if (!grouped_wg_tile(tiles, tile_count, expert_offsets, rows_per_tile, N, &t)) return;
  const uint lane = get_local_id(0);
  const uint KB = (K + QBLOCK - 1) / QBLOCK;
  global const uchar* wr = w + table[6 * t.e + slot0 + t.mat] + (size_t)t.n * K;
  global const float* srow =
      fp8_scale_row(scales + table[6 * t.e + 3 + slot0 + t.mat], t.n, KB);
  for (uint m0 = t.r_begin; m0 < t.r_end; m0 += RB) {
    global const float* xr[RB];
    grouped_wg_rows(x, ldx, x_rows, indirect, m0, t.r_end, xr);
    float acc[RB];
    fp8_lane_dots(xr, wr, srow, K, lane, GROUPED_WG, acc);
    // linear_fp8_wg stores alpha * sum; with alpha 1 that is the sum's bits.
    grouped_wg_store(partial, acc, lane, m0, t.r_end, y, ldy, t.mat * N + t.n);
  }
}
#endif  // GROUPED_FP8 && GROUPED_WG

#ifdef GROUPED_PACKED
// moe_grouped_packed: the grouped experts' bf16-compute products in the packed GEMM's form
// (bf16_packed.cl), for the experts of rows_from rows or more: the sums ops::linear's bf16 GEMM
// gives an expert's rows from ops::bf16_packed_rows_from rows on (AMX's tiles where the host has
// them), since both run packed_column_tile with the same build options. Experts of fewer rows
// return here; moe_grouped_linear's dot-product tiles take them. xb: the rounded rows in plan
// order (round_bf16 through src_token, or rows already grouped), ldxb their stride. Work-item
// (c, slot): column tile c (PANEL_NC weight rows of one matrix of slot0 .. slot0 + n_mats - 1;
// with GLU PANEL_NC / 2 gate rows then the same columns' up rows, y getting silu(gate) * up) of
// the plan's tile `slot` (reversed, as moe_grouped_linear's), y[r, mat * N + n] for its rows r.
// Build options: packed_gemm_shape's (-DPANEL_TM, -DPANEL_NV, -DPANEL_KP, -DGLU, -DBF16_DOT,
// -DBF16_AMX, -DPANEL_ROWS, -DPANEL_FP8 ...). Launch: global (column tiles, plan tiles), local 1.
#include "bf16_packed.cl"

kernel void moe_grouped_packed(global const panel_x_t* xb, uint ldxb, global const panel_w_t* w,
                               global const float* scales, global const ulong* table, uint slot0,
                               uint n_mats, global const uint* tiles,
                               global const uint* tile_count, global const uint* expert_offsets,
                               uint rows_per_tile, uint rows_from, global float* y, uint ldy,
                               uint N, uint K) {
  PACKED_LOCALS
  const uint tile = get_global_size(1) - 1 - get_global_id(1);
  if (tile >= *tile_count) return;
  const uint e = tiles[2 * tile], r_begin = tiles[2 * tile + 1], e_end = expert_offsets[e + 1];
  if (e_end - expert_offsets[e] < rows_from) return;
  const uint r_end = min(r_begin + rows_per_tile, e_end);
#if GLU
  const uint tile_cols = PANEL_NC / 2;
  n_mats = 1;
#else
  const uint tile_cols = PANEL_NC;
#endif
  const uint per_mat = (N + tile_cols - 1) / tile_cols, c = get_global_id(0);
  if (c >= per_mat * n_mats) return;
  const uint mat = c / per_mat, n0 = (c % per_mat) * tile_cols;
  const uint s0 = slot0 + mat, s1 = slot0 + (GLU ? 1 : mat);
  global const panel_w_t* w0 = w + table[6 * e + s0];
  global const panel_w_t* w1 = w + table[6 * e + s1];
  const uint KB = (K + 127) / 128;
  // The tile's weight rows (columns past N take the last: computed on, not stored), as
  // linear_bf16_packed's.
  global const panel_w_t* rows[PANEL_NC];
  global const float* srows[PANEL_NC];
  for (int j = 0; j < PANEL_NC; ++j) {
#if GLU
    const bool up = j >= PANEL_NC / 2;
    const uint n = min(n0 + j % (PANEL_NC / 2), N - 1);
#else
    const bool up = false;
    const uint n = min(n0 + j, N - 1);
#endif
    rows[j] = (up ? w1 : w0) + (size_t)n * K;
#if PANEL_FP8
    srows[j] = fp8_scale_row(scales + table[6 * e + 3 + (up ? s1 : s0)], n, KB);
#else
    srows[j] = scales;  // unread: bf16 rows have no scales
#endif
  }
  // The next column tile's weights (within the matrix), prefetched while this one's rows run.
  PanelPrefetch next;
  const bool has_next = (K + 1) / 2 <= PANEL_KP && n0 + tile_cols < N;
  if (has_next) {
    const uint n_next = n0 + tile_cols, n_half = min(N - n_next, tile_cols / (GLU ? 1 : 2));
    next.base[0] = (global const uchar*)(w0 + (size_t)n_next * K);
    next.base[1] = GLU ? (global const uchar*)(w1 + (size_t)n_next * K)
                       : (global const uchar*)(w0 + (size_t)min(n_next + n_half, N - 1) * K);
    next.half_lines = n_half * K * sizeof(panel_w_t) / 64;
    next.line = 0;
  }
  packed_column_tile(xb, ldxb, rows, srows, K, r_begin, r_end, n0, N, has_next ? &next : 0,
                     packed_panel, PACKED_PARTIAL, xb, 0, y + mat * N, ldy, 1.0f, 0);
}
#endif  // GROUPED_PACKED
