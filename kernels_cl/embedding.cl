// Token embedding lookup: y[t, :] = table[tokens[t] - vocab_begin, :] * multiplier, zeros for ids
// outside the table (a vocabulary shard under tensor parallelism). One work-item per token.
// Build option: -DWEIGHT_BF16=0|1.

#if WEIGHT_BF16
typedef ushort wtype;
#define LOADW(p) bf16_to_f32(*(p))
#else
typedef float wtype;
#define LOADW(p) (*(p))
#endif

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
  for (uint i = 0; i < H; ++i) yr[i] = LOADW(e + i) * multiplier;
}
