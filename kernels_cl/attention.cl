// Causal GQA attention of the new tokens over each row's paged KV cache (cached tokens and this
// step's, which rope_store_kv wrote first). Prefill and decode rows mix freely: a token at
// position p attends to positions 0..p of its row.
//
// One work-item per (token, query head); it streams its KV head's keys and values through the
// page table in blocks of 16 positions with an online softmax (running max and sum, rescaled once
// per block), so nothing of size context is stored. Build option: -DHEAD_DIM=d (a multiple of 8).
// The cache layout is rope.cl's.

#define BLOCK 16
#define VECS (HEAD_DIM / 8)

kernel void paged_attention(global const float* q, uint ldq, global const float* cache,
                            global const uint* token_row, global const uint* token_pos,
                            global const uint* lookup, uint pages_per_row, uint page_size,
                            uint n_heads, uint n_kv_heads, float scale, global float* out,
                            uint ldo) {
  const uint t = get_global_id(0);
  const uint h = get_global_id(1);
  const uint kvh = h / (n_heads / n_kv_heads);
  const uint b = token_row[t];
  const uint last = token_pos[t];
  global const uint* lut = lookup + (size_t)b * pages_per_row;
  const size_t kv_row = (size_t)n_kv_heads * HEAD_DIM;

  float8 qv[VECS], acc[VECS];
  global const float* qp = q + (size_t)t * ldq + h * HEAD_DIM;
#pragma unroll
  for (int i = 0; i < VECS; ++i) {
    qv[i] = vload8(i, qp) * scale;
    acc[i] = (float8)(0.0f);
  }
  float m = -INFINITY, l = 0.0f;

  for (uint p0 = 0; p0 <= last; p0 += BLOCK) {
    const uint n = min((uint)BLOCK, last + 1 - p0);
    float s[BLOCK];
    float bmax = -INFINITY;
    for (uint j = 0; j < n; ++j) {
      const uint p = p0 + j;
      global const float* k =
          cache + ((size_t)lut[p / page_size] * 2 * page_size + p % page_size) * kv_row +
          kvh * HEAD_DIM;
      float8 d = (float8)(0.0f);
#pragma unroll
      for (int i = 0; i < VECS; ++i) d = fma(qv[i], vload8(i, k), d);
      const float4 d4 = d.lo + d.hi;
      s[j] = d4.x + d4.y + d4.z + d4.w;
      bmax = fmax(bmax, s[j]);
    }
    const float m_new = fmax(m, bmax);
    const float corr = exp(m - m_new);
    l *= corr;
#pragma unroll
    for (int i = 0; i < VECS; ++i) acc[i] *= corr;
    for (uint j = 0; j < n; ++j) {
      const uint p = p0 + j;
      global const float* v =
          cache + (((size_t)lut[p / page_size] * 2 + 1) * page_size + p % page_size) * kv_row +
          kvh * HEAD_DIM;
      const float w = exp(s[j] - m_new);
      l += w;
#pragma unroll
      for (int i = 0; i < VECS; ++i) acc[i] = fma((float8)(w), vload8(i, v), acc[i]);
    }
    m = m_new;
  }
  global float* o = out + (size_t)t * ldo + h * HEAD_DIM;
  const float inv_l = 1.0f / l;
#pragma unroll
  for (int i = 0; i < VECS; ++i) vstore8(acc[i] * inv_l, i, o);
}
