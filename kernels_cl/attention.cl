// Causal GQA attention of the new tokens over each row's paged KV cache (cached tokens and this
// step's, which rope_store_kv wrote first). Prefill and decode rows mix freely: a token at
// position p attends to positions 0..p of its row.
//
// One work-item per (token, QH query heads of one KV head); it streams the KV head's keys and
// values through the page table in blocks of 16 positions with an online softmax (running max and
// sum, rescaled once per block), so nothing of size context is stored. Its QH heads share each
// key and value it loads (GQA): a prefill reads the cache QH times less, and each head's sums are
// the same operations in the same order as alone. A head's 16 scores of a block come out as one
// vector (16-lane partial dot products, then common.cl's hsum16_x16), where one score at a time
// had taken a float8 sum and its reduction each: llama3-1b's attention over a 512-token prefill
// ran 1.20x faster so, and 1.11x at 64 tokens (in-process A/B, 15 pairs, on the 2-core EPYC).
// Build options: -DHEAD_DIM=d (a multiple of 8), -DQH (query heads per work-item, dividing the
// GQA group), -DCACHE_TYPE (common.cl: the cache's element type, widened to f32 as it is read).
// The cache layout is rope.cl's.

#ifdef HEAD_DIM
#define BLOCK 16
#ifndef QH
#define QH 1
#endif

#define V16 ((HEAD_DIM + 15) / 16)
kernel void paged_attention(global const float* q, uint ldq, global const ctype* cache,
                            global const uint* token_row, global const uint* token_pos,
                            global const uint* lookup, uint pages_per_row, uint page_size,
                            uint n_heads, uint n_kv_heads, float scale, global float* out,
                            uint ldo) {
  const uint t = get_global_id(0);
  const uint h0 = get_global_id(1) * QH;
  const uint kvh = h0 / (n_heads / n_kv_heads);
  const uint b = token_row[t];
  const uint last = token_pos[t];
  global const uint* lut = lookup + (size_t)b * pages_per_row;
  const size_t kv_row = (size_t)n_kv_heads * HEAD_DIM;

  float16 qv[QH][V16], acc[QH][V16];
  float m[QH], l[QH];
#pragma unroll
  for (int g = 0; g < QH; ++g) {
    global const float* qp = q + (size_t)t * ldq + (h0 + g) * HEAD_DIM;
#pragma unroll
    for (int i = 0; i < V16; ++i) {
      qv[g][i] = CHUNK16(i, qp, HEAD_DIM, vload8, vload16) * scale;
      acc[g][i] = (float16)(0.0f);
    }
    m[g] = -INFINITY;
    l[g] = 0.0f;
  }

  for (uint p0 = 0; p0 <= last; p0 += BLOCK) {
    const uint n = min((uint)BLOCK, last + 1 - p0);
    // The block's key offsets from one division: its positions are consecutive, so the slot moves
    // to the next page only where the offset within the page reaches page_size (a division per
    // key, twice, had been a tenth of the kernel's time). Past n the last key again: its scores
    // are computed and masked.
    size_t key_at[BLOCK];
    {
      uint page = p0 / page_size, off = p0 % page_size;
      for (uint j = 0; j < BLOCK; ++j) {
        key_at[j] = ((size_t)lut[page] * 2 * page_size + off) * kv_row + kvh * HEAD_DIM;
        if (j + 1 < n && ++off == page_size) {
          off = 0;
          ++page;
        }
      }
    }
    const size_t value_from_key = (size_t)page_size * kv_row;
    // Each head's 16 scores as one vector: a 16-lane partial dot product per key, the 16 reduced
    // together (common.cl's hsum16_x16); then the block's weights exp(s - max) as one vector exp
    // (a scalar exp per score had been the kernel's largest cost). Past n: exp(-inf) = 0.
    float w[QH][BLOCK];
#pragma unroll
    for (int g = 0; g < QH; ++g) {
      float16 dots[BLOCK];
#pragma unroll
      for (int j = 0; j < BLOCK; ++j) {
        global const ctype* k = cache + key_at[j];
        float16 d = qv[g][0] * CHUNK16(0, k, HEAD_DIM, LOADC8, LOADC16);
#pragma unroll
        for (int i = 1; i < V16; ++i)
          d = fma(qv[g][i], CHUNK16(i, k, HEAD_DIM, LOADC8, LOADC16), d);
        dots[j] = d;
      }
      float16 e;
      const float corr = softmax_block16(hsum16_x16(dots), n, &m[g], &l[g], &e);
#pragma unroll
      for (int i = 0; i < V16; ++i) acc[g][i] *= corr;
      vstore16(e, 0, w[g]);
    }
    for (uint j = 0; j < n; ++j) {
      global const ctype* v = cache + key_at[j] + value_from_key;
      float16 vv[V16];
#pragma unroll
      for (int i = 0; i < V16; ++i) vv[i] = CHUNK16(i, v, HEAD_DIM, LOADC8, LOADC16);
#pragma unroll
      for (int g = 0; g < QH; ++g)
#pragma unroll
        for (int i = 0; i < V16; ++i) acc[g][i] = fma((float16)(w[g][j]), vv[i], acc[g][i]);
    }
  }
#pragma unroll
  for (int g = 0; g < QH; ++g) {
    global float* o = out + (size_t)t * ldo + (h0 + g) * HEAD_DIM;
    const float inv_l = 1.0f / l[g];
#pragma unroll
    for (int i = 0; i < V16; ++i) {
#if HEAD_DIM % 16
      if (i == V16 - 1) {
        vstore8((acc[g][i] * inv_l).lo, 2 * i, o);
        continue;
      }
#endif
      vstore16(acc[g][i] * inv_l, i, o);
    }
  }
}
#endif  // HEAD_DIM

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
      pr[idx] = idx % TILE < n ? exp(pr[idx] - m_run[idx / TILE]) : 0.0f;
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
void paged_attention_prefill_wg(global const float* q, uint q_off, uint q_ldt, uint q_ldh,
                                global const ctype* cache, ulong page_stride, uint slot_stride,
                                uint k_off, uint v_off, uint kv_head_stride, uint heads_per_kv,
                                global const float* kv, uint ldkv, uint kv_head_ld,
                                global const uint* ctx_start, global const uint* token_row,
                                global const uint* token_pos, global const uint* lookup,
                                uint pages_per_row, uint page_size, uint n_tokens, float scale,
                                global float* out, uint o_ldt, uint o_ldh) {
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
        pr[idx] = pr[idx] == -INFINITY ? 0.0f : exp(pr[idx] - m_run[idx / PF_KT]);
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
