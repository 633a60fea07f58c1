// Token embedding lookup: y[t, :] = table[tokens[t], :] * multiplier. One work-item per token.
// Build option: -DWEIGHT_BF16=0|1.

#if WEIGHT_BF16
typedef ushort wtype;
#define LOADW(p) bf16_to_f32(*(p))
#else
typedef float wtype;
#define LOADW(p) (*(p))
#endif

kernel void embedding(global const int* tokens, global const wtype* table, global float* y,
                      uint H, uint vocab, float multiplier) {
  const uint t = get_global_id(0);
  const int tok = tokens[t];
  global float* yr = y + (size_t)t * H;
  if (tok < 0 || (uint)tok >= vocab) {  // the host validates ids; never read out of bounds
    for (uint i = 0; i < H; ++i) yr[i] = 0.0f;
    return;
  }
  global const wtype* e = table + (size_t)tok * H;
  for (uint i = 0; i < H; ++i) yr[i] = LOADW(e + i) * multiplier;
}
