// LoRA over a batch whose rows use different adapters (Punica's shrink / expand, S-LoRA's
// batched form): y[t] += alpha * scale[s] * B_s (A_s x[t]) for every token t whose request's
// adapter sits in slot s (token_slot[t] = s; -1: the base model, left alone). One launch of each
// kernel serves every adapter of the batch. The adapters of one layer target are stacked in slots padded to max_rank:
// A [slots, max_rank, K] and B [slots, N, max_rank] f32, rank[s] <= max_rank the rows in use.

// v[t, j] = sum_k A[s, j, k] x[t, k] for j < rank[s] (0 beyond). Global (T, max_rank).
kernel void lora_shrink(global const float* x, uint x_off, uint ldx, global const float* A,
                        global const int* token_slot, global const uint* rank, uint max_rank,
                        uint K, global float* v) {
  const uint t = get_global_id(0), j = get_global_id(1);
  const int s = token_slot[t];
  float acc = 0.0f;
  if (s >= 0 && j < rank[s]) {
    global const float* a = A + ((size_t)s * max_rank + j) * K;
    global const float* xr = x + x_off + (size_t)t * ldx;
    for (uint k = 0; k < K; ++k) acc = fma(a[k], xr[k], acc);
  }
  v[(size_t)t * max_rank + j] = acc;
}

// y[t, n] += alpha * scale[s] * sum_j B[s, n, j] v[t, j], CHUNK outputs per work-item.
// Global (T, ceil(N / CHUNK)).
#define CHUNK 64
kernel void lora_expand(global const float* v, global const float* B,
                        global const int* token_slot, global const uint* rank,
                        global const float* scale, uint max_rank, uint N, float alpha,
                        global float* y, uint y_off, uint ldy) {
  const uint t = get_global_id(0);
  const int s = token_slot[t];
  if (s < 0) return;
  const uint n0 = get_global_id(1) * CHUNK, n1 = min(n0 + CHUNK, N);
  const uint r = rank[s];
  const float c = alpha * scale[s];
  global const float* vr = v + (size_t)t * max_rank;
  global float* yr = y + y_off + (size_t)t * ldy;
  for (uint n = n0; n < n1; ++n) {
    global const float* b = B + ((size_t)s * N + n) * max_rank;
    float acc = 0.0f;
    for (uint j = 0; j < r; ++j) acc = fma(b[j], vr[j], acc);
    yr[n] = fma(c, acc, yr[n]);
  }
}

// The GPU shape of the pair (ops::lora past the one-launch kernel's rank on work-group devices),
// built with -DWG (a power of two). Each returns v and y as lora_shrink and lora_expand do.
#if defined(WG) && !defined(MAXR)
// v[t, j]: a work-group of WG lanes per (token t, rank row j) reads A_s's row j side by side
// (lane, lane + WG, ...; coalesced), and the lanes' sums meet in common.cl's wg_tree_sum.
// Global (T * WG, max_rank), local (WG, 1).
kernel void lora_shrink_wg(global const float* x, uint x_off, uint ldx, global const float* A,
                           global const int* token_slot, global const uint* rank, uint max_rank,
                           uint K, global float* v) {
  local float partial[WG];
  const uint t = get_group_id(0), j = get_group_id(1), lane = get_local_id(0);
  const int s = token_slot[t];
  float acc = 0.0f;
  if (s >= 0 && j < rank[s]) {
    global const float* a = A + ((size_t)s * max_rank + j) * K;
    global const float* xr = x + x_off + (size_t)t * ldx;
    for (uint k = lane; k < K; k += WG) acc = fma(a[k], xr[k], acc);
  }
  partial[lane] = acc;
  wg_tree_sum(partial, 1, WG, lane);
  if (lane == 0) v[(size_t)t * max_rank + j] = partial[0];
}

// y[t, n0 .. n0 + WG): B_s's rows n0 .. n0 + WG - 1 lie one after another, so the lanes copy them
// side by side (runs of LORA_TJ floats) into local memory, LORA_TJ rank columns at a time, and
// lane i sums row n0 + i from there in rank order, as lora_expand sums it (the same products,
// order and final FMA: given the same v, the same bits). Every lane reads v[t, j] at the same j,
// one address. Global (T * WG, ceil(N / WG)), local (WG, 1).
#define LORA_TJ 32
kernel void lora_expand_wg(global const float* v, global const float* B,
                           global const int* token_slot, global const uint* rank,
                           global const float* scale, uint max_rank, uint N, float alpha,
                           global float* y, uint y_off, uint ldy) {
  local float tile[WG * (LORA_TJ + 1)];  // one float of padding a row: lanes read rows apart
  const uint t = get_group_id(0), n0 = get_group_id(1) * WG, lane = get_local_id(0);
  const int s = token_slot[t];
  if (s < 0) return;  // the whole work-group, before any barrier
  const uint r = rank[s], rows = min((uint)WG, N - n0);
  global const float* b = B + ((size_t)s * N + n0) * max_rank;
  global const float* vr = v + (size_t)t * max_rank;
  float acc = 0.0f;
  for (uint j0 = 0; j0 < r; j0 += LORA_TJ) {
    const uint cols = min((uint)LORA_TJ, r - j0);
    for (uint i = lane; i < rows * LORA_TJ; i += WG) {
      const uint row = i / LORA_TJ, col = i % LORA_TJ;
      if (col < cols) tile[row * (LORA_TJ + 1) + col] = b[(size_t)row * max_rank + j0 + col];
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    if (lane < rows)
      for (uint c = 0; c < cols; ++c) acc = fma(tile[lane * (LORA_TJ + 1) + c], vr[j0 + c], acc);
    barrier(CLK_LOCAL_MEM_FENCE);
  }
  if (lane < rows) {
    global float* out = y + y_off + (size_t)t * ldy + n0 + lane;
    *out = fma(alpha * scale[s], acc, *out);
  }
}
#endif

// Both products in one launch (what ops::lora runs for max_rank <= WG): one work-group of WG
// items per token. The items split K for v = A_s x (each keeping MAXR partial sums), the partial
// sums meet in local memory, then the items split N for y += alpha * scale[s] * B_s v. Built with
// -DWG and -DMAXR (the stack's max_rank, at most WG). Slot and rank are the same for every item
// of a group, so a group leaves before its barriers whole or not at all.
#ifdef MAXR
kernel void lora_fused(global const float* x, uint x_off, uint ldx, global const float* A,
                       global const float* B, global const int* token_slot,
                       global const uint* rank, global const float* scale, uint K, uint N,
                       float alpha, global float* y, uint y_off, uint ldy) {
  local float part[MAXR * WG];
  local float v[MAXR];
  const uint t = get_group_id(0), lid = get_local_id(0);
  const int s = token_slot[t];
  if (s < 0) return;
  const uint r = rank[s];
  if (r == 0) return;
  global const float* xr = x + x_off + (size_t)t * ldx;
  global const float* a = A + (size_t)s * MAXR * K;
  float acc[MAXR];
  for (uint j = 0; j < r; ++j) acc[j] = 0.0f;
  for (uint k = lid; k < K; k += WG) {
    const float xk = xr[k];
    for (uint j = 0; j < r; ++j) acc[j] = fma(a[(size_t)j * K + k], xk, acc[j]);
  }
  for (uint j = 0; j < r; ++j) part[j * WG + lid] = acc[j];
  barrier(CLK_LOCAL_MEM_FENCE);
  if (lid < r) {
    float sum = 0.0f;
    for (uint i = 0; i < WG; ++i) sum += part[lid * WG + i];
    v[lid] = sum;
  }
  barrier(CLK_LOCAL_MEM_FENCE);
  const float c = alpha * scale[s];
  global const float* b = B + (size_t)s * N * MAXR;
  global float* yr = y + y_off + (size_t)t * ldy;
  for (uint n = lid; n < N; n += WG) {
    float sum = 0.0f;
    for (uint j = 0; j < r; ++j) sum = fma(b[(size_t)n * MAXR + j], v[j], sum);
    yr[n] = fma(c, sum, yr[n]);
  }
}
#endif
