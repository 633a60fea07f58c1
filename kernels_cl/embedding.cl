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

#ifdef ROW_WG
// The GPU shape (-DROW_WG lanes): a work-group per token, lane l writing columns l, l + ROW_WG, ...
// (neighbouring lanes, neighbouring floats). Launch: global (T * ROW_WG), local (ROW_WG).
kernel __attribute__((reqd_work_group_size(ROW_WG, 1, 1)))
void embedding_wg(global const int* tokens, global const wtype* table, global float* y, uint H,
                  uint vocab_begin, uint vocab, float multiplier) {
  const uint t = get_group_id(0), lane = get_local_id(0);
  const int tok = tokens[t] - (int)vocab_begin;
  global float* yr = y + (size_t)t * H;
  const bool here = tok >= 0 && (uint)tok < vocab;  // else another shard's id: zeros
  global const wtype* e = table + (size_t)(here ? tok : 0) * H;
  for (uint i = lane; i < H; i += ROW_WG) yr[i] = here ? LOADW1(e + i) * multiplier : 0.0f;
}
#endif
