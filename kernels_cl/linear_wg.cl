// y = alpha * x W^T (+ bias) (+ y): linear.cl's contract, shaped for GPUs. A work-group of
// WG lanes owns one output feature n for up to RB rows: lane l reads W[n, l], W[n, l + WG], ...
// so a row of W is read by consecutive lanes (coalesced), and the lanes' partial sums meet in
// local memory. Build options: -DWEIGHT_TYPE (common.cl), -DWG (a power of two), -DRB.
// Launch: global (N * WG, ceil(M / RB)), local (WG, 1).

kernel void linear_wg(global const float* x, uint x_off, uint ldx,
                      global const wtype* w_base, uint w_off, uint ldw,
                      global const wtype* bias_base, uint b_off, int has_bias,
                      global float* y, uint y_off, uint ldy,
                      uint M, uint N, uint K, float alpha, int accumulate) {
  local float partial[RB][WG];
  const uint lane = get_local_id(0);
  const uint n = get_group_id(0);
  const uint m0 = get_group_id(1) * RB;
  global const wtype* wr = w_base + w_off + (size_t)n * ldw;
  float acc[RB];
  for (int r = 0; r < RB; ++r) acc[r] = 0.0f;
  for (uint k = lane; k < K; k += WG) {
    const float wv = LOADW1(wr + k);
    for (int r = 0; r < RB; ++r)
      if (m0 + r < M) acc[r] = fma(x[x_off + (size_t)(m0 + r) * ldx + k], wv, acc[r]);
  }
  for (int r = 0; r < RB; ++r) partial[r][lane] = acc[r];
  barrier(CLK_LOCAL_MEM_FENCE);
  for (uint stride = WG / 2; stride > 0; stride >>= 1) {
    if (lane < stride)
      for (int r = 0; r < RB; ++r) partial[r][lane] += partial[r][lane + stride];
    barrier(CLK_LOCAL_MEM_FENCE);
  }
  if (lane < RB && m0 + lane < M) {
    float v = partial[lane][0];
    if (has_bias) v += LOADW1(bias_base + b_off + n);
    v *= alpha;
    global float* out = y + y_off + (size_t)(m0 + lane) * ldy + n;
    *out = accumulate ? *out + v : v;
  }
}
