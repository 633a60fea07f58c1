// RMSNorm over rows: y = x / sqrt(mean(x^2) + eps) * w, computed in f32 (Llama style: normalise,
// then scale).
// Build option: -DWEIGHT_TYPE=0|1|2 (f32, bf16, f16; see common.cl) for the norm weight.


#ifdef NORM_WG
// The GPU shape (-DNORM_WG lanes, a power of two): one work-group per row; lane l reads
// x[l], x[l + NORM_WG], ... (neighbouring lanes, neighbouring floats) and the sum of squares meets
// in local memory. Launch: global (R * NORM_WG), local (NORM_WG). In place (y == x) is safe: every
// read of a row happens before the reduction's barriers, every write after them.
kernel __attribute__((reqd_work_group_size(NORM_WG, 1, 1)))
void rmsnorm_wg(global const float* x, uint x_off, uint ldx, global const uint* rows, int use_rows,
                global const wtype* w, global float* y, uint y_off, uint ldy, uint H, float eps) {
  local float scratch[NORM_WG];
  const uint r = get_group_id(0), lane = get_local_id(0);
  const uint src = use_rows ? rows[r] : r;
  global const float* xr = x + x_off + (size_t)src * ldx;
  global float* yr = y + y_off + (size_t)r * ldy;
  float ss = 0.0f;
  for (uint i = lane; i < H; i += NORM_WG) ss = fma(xr[i], xr[i], ss);
  ss = wg_sum(ss, scratch);
  const float inv = 1.0f / sqrt(ss / (float)H + eps);
  for (uint i = lane; i < H; i += NORM_WG) yr[i] = (xr[i] * inv) * LOADW1(w + i);
}
#endif

// The CPU shape: one work-item per row, its sum of squares in 16 lanes and its outputs 16 at a
// time. A single scalar chain had cost an FMA's latency per element: on the 2-core EPYC, rows of
// 2048 held in cache, 512 rows took 640 us against 98 now and one row 5-8 us against 4-5.5
// (in-process, 5 rounds in turn); inside llama3-1b's 512-token prefill 0.86 -> 0.31-0.34 ms a
// norm (bench_step_breakdown --preset llama3-1b --prefill 512, two runs).
// In place (y == x) is safe: each element is read before it is written.
// rows: optional row indexes into x (gather), when use_rows != 0: y row r = norm(x row rows[r]).
// With -DOUT_BF16=1 y is the rows rounded to bf16 (round_bf16's bits and layout: from H to the
// next 32 elements zeros) for a bf16-compute GEMM, which then needs no round_bf16 launch.
#if OUT_BF16
typedef ushort norm_out_t;
#define NORM_STORE16(v, k, p) vstore16(f32x16_to_bf16_rne(v), k, p)
#define NORM_STORE1(v, p) (*(p) = f32_to_bf16_rne(v))
#else
typedef float norm_out_t;
#define NORM_STORE16(v, k, p) vstore16(v, k, p)
#define NORM_STORE1(v, p) (*(p) = (v))
#endif
kernel void rmsnorm(global const float* x, uint x_off, uint ldx, global const uint* rows,
                    int use_rows, global const wtype* w, global norm_out_t* y, uint y_off,
                    uint ldy, uint H, float eps) {
  const uint r = get_global_id(0);
  const uint src = use_rows ? rows[r] : r;
  global const float* xr = x + x_off + (size_t)src * ldx;
  global norm_out_t* yr = y + y_off + (size_t)r * ldy;
  const uint H16 = H / 16;
  float16 acc = (float16)(0.0f);
  for (uint k = 0; k < H16; ++k) {
    const float16 v = vload16(k, xr);
    acc = fma(v, v, acc);
  }
  float ss = hsum16(acc);
  for (uint i = H16 * 16; i < H; ++i) ss = fma(xr[i], xr[i], ss);
  const float inv = 1.0f / sqrt(ss / (float)H + eps);
  for (uint k = 0; k < H16; ++k) NORM_STORE16((vload16(k, xr) * inv) * LOADW16(k, w), k, yr);
  for (uint i = H16 * 16; i < H; ++i) NORM_STORE1((xr[i] * inv) * LOADW1(w + i), yr + i);
#if OUT_BF16
  for (uint i = H; i < (H + 31) / 32 * 32; ++i) yr[i] = 0;
#endif
}
