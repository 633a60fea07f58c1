// y = alpha * x W^T (+ bias) (+ y): linear.cl's contract, shaped for GPUs. A work-group of
// WG lanes owns one output feature n for up to RB rows: the lanes read a row of W side by side
// (coalesced; wg_dots.cl's wg_lane_dots, VW columns per lane and step), and their partial sums
// meet in local memory. Build options: -DWEIGHT_TYPE (common.cl), -DWG (a power of two), -DRB,
// -DVW and -DVEC_ALIGNED (wg_dots.cl).
// Launch: global (N * WG, ceil(M / RB)), local (WG, 1).
#include "wg_dots.cl"
#include "wg_rows.cl"

kernel void linear_wg(global const float* x, uint x_off, uint ldx,
                      global const wtype* w_base, uint w_off, uint ldw,
                      global const wtype* bias_base, uint b_off, int has_bias,
                      global float* y, uint y_off, uint ldy,
                      uint M, uint N, uint K, float alpha, int accumulate) {
  local float partial[RB * WG];
  const uint lane = get_local_id(0);
  const uint n = get_group_id(0);
  const uint m0 = get_group_id(1) * RB;
  global const wtype* wr = w_base + w_off + (size_t)n * ldw;
  global const float* xr[RB];
  const uint rows = wg_x_rows(x, x_off, ldx, m0, M, xr);
  float acc[RB];
  wg_lane_dots(xr, rows, wr, K, lane, WG, acc);
  float v;
  if (wg_row_sum(partial, acc, WG, lane, m0, M, &v)) {
    if (has_bias) v += LOADW1(bias_base + b_off + n);
    wg_store(y, y_off, ldy, m0 + lane, n, v, alpha, accumulate);
  }
}

// linear_fused's GPU shape (its norm, when asked, stays a launch of its own): one launch over up
// to three weights side by side (q/k/v; output column n reads fused_row's row), or with -DGLU=1
// gate row n and up row n summed side by side by the same lanes and silu(gate) * up stored. Every
// sum is linear_wg's for its row (the same lanes, order and tree), so the outputs equal separate
// linear_wg launches (then silu_mul, with GLU) bit for bit. Build options as linear_wg, -DGLU.
// Launch: global (N * WG, ceil(M / RB)), local (WG, 1); N = the feature count (with GLU, gate's).
#ifndef GLU
#define GLU 0
#endif
#define FUSED_SUMS (GLU ? 2 : 1)
kernel void linear_fused_wg(global const float* x, uint x_off, uint ldx,
                            global const wtype* w0, uint w0_off, uint ldw0, uint n1,
                            global const wtype* w1, uint w1_off, uint ldw1, uint n2,
                            global const wtype* w2, uint w2_off, uint ldw2,
                            global float* y, uint y_off, uint ldy,
                            uint M, uint N, uint K, float alpha, int accumulate) {
  local float partial[FUSED_SUMS][RB][WG];
  const uint lane = get_local_id(0);
  const uint n = get_group_id(0);
  const uint m0 = get_group_id(1) * RB;
  global const wtype* wr[FUSED_SUMS];
#if GLU
  wr[0] = w0 + w0_off + (size_t)n * ldw0;
  wr[1] = w1 + w1_off + (size_t)n * ldw1;
#else
  wr[0] = fused_row(n, w0 + w0_off, ldw0, n1, w1 + w1_off, ldw1, n2, w2 + w2_off, ldw2);
#endif
  global const float* xr[RB];
  const uint rows = wg_x_rows(x, x_off, ldx, m0, M, xr);
  float acc[FUSED_SUMS][RB];
  for (int p = 0; p < FUSED_SUMS; ++p) wg_lane_dots(xr, rows, wr[p], K, lane, WG, acc[p]);
  for (int p = 0; p < FUSED_SUMS; ++p)
    for (int r = 0; r < RB; ++r) partial[p][r][lane] = acc[p][r];
  wg_tree_sum(&partial[0][0][0], FUSED_SUMS * RB, WG, lane);
  if (lane < RB && m0 + lane < M) {
#if GLU
    // linear_wg's stores of gate and up (alpha 1), then silu_mul's formula.
    const float a = partial[0][lane][0] * 1.0f, b = partial[1][lane][0] * 1.0f;
    y[y_off + (size_t)(m0 + lane) * ldy + n] = a / (1.0f + exp(-a)) * b;
#else
    wg_store(y, y_off, ldy, m0 + lane, n, partial[0][lane][0], alpha, accumulate);
#endif
  }
}
