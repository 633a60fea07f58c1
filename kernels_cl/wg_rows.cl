// The frame of the GPU-shaped GEMVs that give a work-group of wg lanes one output feature n for up
// to RB rows from m0 (linear_wg.cl's linear_wg and linear_fused_wg, linear_fp8.cl's
// linear_fp8_wg; each sums its own weights): the x rows they read, and the lanes' sums met in
// local memory and stored, written once so their rows agree bit for bit. The including file is
// built with -DRB.

// The x rows of the work-group's rows m0 .. (rows past M point at row m0; they are not stored).
// Returns how many rows are M's.
inline uint wg_x_rows(global const float* x, uint x_off, uint ldx, uint m0, uint M,
                      global const float* xr[RB]) {
  for (int r = 0; r < RB; ++r) xr[r] = x + x_off + (size_t)(m0 + (m0 + r < M ? r : 0)) * ldx;
  return min((uint)RB, M - m0);
}

// The lanes' sums of the rows m0 .. (acc: this lane's share of each) meet in partial (RB x wg
// floats of local memory) in wg_tree_sum's order; the whole work-group calls this. Returns whether
// this lane stores a row, lane r storing row m0 + r where r < RB and m0 + r < M, and that row's
// sum in *sum.
inline bool wg_row_sum(local float* partial, const float acc[RB], uint wg, uint lane, uint m0,
                       uint M, float* sum) {
  for (int r = 0; r < RB; ++r) partial[r * wg + lane] = acc[r];
  wg_tree_sum(partial, RB, wg, lane);
  if (lane >= RB || m0 + lane >= M) return false;
  *sum = partial[lane * wg];
  return true;
}

// y[m, n] = alpha * v, or y[m, n] + alpha * v when accumulating.
inline void wg_store(global float* y, uint y_off, uint ldy, uint m, uint n, float v, float alpha,
                     int accumulate) {
  global float* out = y + y_off + (size_t)m * ldy + n;
  v *= alpha;
  *out = accumulate ? *out + v : v;
}
