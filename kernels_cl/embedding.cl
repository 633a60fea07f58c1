// Token embedding lookup: y[t, :] = table[tokens[t] - vocab_begin, :] * multiplier, zeros for ids
// outside the table (a vocabulary shard under tensor parallelism). One work-item per token.
// Build option: -DWEIGHT_TYPE=0|1|2 (f32, bf16, f16; see common.cl).


kernel void embedding(global const int* tokens, global const wtype* table, global float* y,
                      uint H, uint vocab_begin, uint vocab, float multiplier) {
  const uint t = get_global_id(0);
  const int tok = tokens[t] - (int)vocab_begin;
  global float* yr = y + (size_t)t * H;
  if (tok < 0 || (uint)tok >= vocab) {  // another shard's id (the host validates ids)
    for (uint i = 0; i < H; ++i) yr[i] = 0.0f;
    return;
  }
  global const wtype* e = table + (size_t)tok * H;
  for (uint i = 0; i < H; ++i) yr[i] = LOADW1(e + i) * multiplier;
}
