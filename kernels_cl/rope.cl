// RoPE on the new tokens' queries and keys, and the store of keys and values into the paged cache.
// Hugging Face checkpoints rotate half-split pairs (x[i], x[i + d/2]). The angle is
// position * inv_freq[i] in f32, as the reference implementations compute it.
//
// Paged MHA cache of one layer: [num_pages + 1][2 (K, V)][page_size][n_kv_heads][head_dim]; the
// last page is the null page that pads lookup tables; elements are ctype (common.cl: f32, or bf16
// rounded to nearest even with -DCACHE_TYPE=1). One work-item per new token.

kernel void rope_store_kv(global float* qkv, uint ld, uint n_heads, uint n_kv_heads,
                          uint head_dim, global const float* inv_freq,
                          global const float* inv_freq_long, uint long_from,
                          global const uint* token_row, global const uint* token_pos,
                          global const uint* lookup, uint pages_per_row, uint page_size,
                          global ctype* cache) {
  const uint t = get_global_id(0);
  const uint pos = token_pos[t];
  const uint half_dim = head_dim / 2;
  global const float* freqs = pos >= long_from ? inv_freq_long : inv_freq;
  global float* row = qkv + (size_t)t * ld;
  const uint n_rot = n_heads + n_kv_heads;  // queries then keys; values are not rotated
  // 16 pairs at a time where the half is whole vectors (Llama's 64 and 128), each pair's
  // arithmetic as below (the same bits): a 512-token prefill's launch at llama3-1b's shapes on the
  // 2-core EPYC 0.93-1.36 -> 0.71-1.04 ms (in-process, in turn, two runs of 9 rounds), inside the
  // prefill 1.05 -> 0.71-0.74 ms (bench_step_breakdown --preset llama3-1b --prefill 512).
  const uint vec_half = half_dim % 16 == 0 ? half_dim : 0;
  for (uint i0 = 0; i0 < vec_half; i0 += 16) {
    float cs[16], sn[16];
    for (uint j = 0; j < 16; ++j) {
      const float angle = (float)pos * freqs[i0 + j];
      cs[j] = cos(angle);
      sn[j] = sin(angle);
    }
    const float16 c = vload16(0, cs), s = vload16(0, sn);
    for (uint h = 0; h < n_rot; ++h) {
      global float* x = row + h * head_dim + i0;
      const float16 a = vload16(0, x), b = vload16(0, x + half_dim);
      vstore16(a * c - b * s, 0, x);
      vstore16(b * c + a * s, 0, x + half_dim);
    }
  }
  for (uint i = vec_half; i < half_dim; ++i) {
    const float angle = (float)pos * freqs[i];
    const float c = cos(angle), s = sin(angle);
    for (uint h = 0; h < n_rot; ++h) {
      global float* x = row + h * head_dim;
      const float a = x[i], b = x[i + half_dim];
      x[i] = a * c - b * s;
      x[i + half_dim] = b * c + a * s;
    }
  }
  const uint b = token_row[t];
  const uint page = lookup[b * pages_per_row + pos / page_size];
  const uint slot = pos % page_size;
  const size_t kv_row = (size_t)n_kv_heads * head_dim;
  global ctype* kdst = cache + ((size_t)page * 2 * page_size + slot) * kv_row;
  global ctype* vdst = kdst + (size_t)page_size * kv_row;
  global const float* k = row + (size_t)n_heads * head_dim;
  global const float* v = k + kv_row;
  for (uint i = 0; i < kv_row; ++i) {
    STOREC1(k[i], kdst + i);
    STOREC1(v[i], vdst + i);
  }
}

#ifdef ROPE_WG
// The GPU shape (-DROPE_WG lanes): one work-group per new token. The (head, pair) rotations are
// spread over the lanes so neighbouring lanes touch neighbouring floats; the lane that rotates a
// key also stores it in the cache (no lane reads another's result, so no barrier), and the values
// are copied by all lanes. The same arithmetic per element as rope_store_kv.
// Launch: global (T * ROPE_WG), local (ROPE_WG).
kernel __attribute__((reqd_work_group_size(ROPE_WG, 1, 1)))
void rope_store_kv_wg(global float* qkv, uint ld, uint n_heads, uint n_kv_heads, uint head_dim,
                      global const float* inv_freq, global const float* inv_freq_long,
                      uint long_from, global const uint* token_row, global const uint* token_pos,
                      global const uint* lookup, uint pages_per_row, uint page_size,
                      global ctype* cache) {
  const uint t = get_group_id(0), lane = get_local_id(0);
  const uint pos = token_pos[t];
  const uint half_dim = head_dim / 2;
  global const float* freqs = pos >= long_from ? inv_freq_long : inv_freq;
  global float* row = qkv + (size_t)t * ld;
  const size_t kv_row = (size_t)n_kv_heads * head_dim;
  global const uint* lut = lookup + (size_t)token_row[t] * pages_per_row;
  global ctype* kdst = cache + paged_slot(lut, pos, page_size, 2 * page_size * kv_row, kv_row);
  global ctype* vdst = kdst + (size_t)page_size * kv_row;
  const uint n_pairs = (n_heads + n_kv_heads) * half_dim;
  for (uint idx = lane; idx < n_pairs; idx += ROPE_WG) {
    const uint h = idx / half_dim, i = idx % half_dim;
    const float angle = (float)pos * freqs[i];
    const float c = cos(angle), s = sin(angle);
    global float* x = row + h * head_dim;
    const float a = x[i], b = x[i + half_dim];
    const float ra = a * c - b * s, rb = b * c + a * s;
    x[i] = ra;
    x[i + half_dim] = rb;
    if (h >= n_heads) {
      global ctype* k = kdst + (h - n_heads) * head_dim;
      STOREC1(ra, k + i);
      STOREC1(rb, k + i + half_dim);
    }
  }
  global const float* v = row + (size_t)(n_heads + n_kv_heads) * head_dim;
  for (uint i = lane; i < kv_row; i += ROPE_WG) STOREC1(v[i], vdst + i);
}
#endif
