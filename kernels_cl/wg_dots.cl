// The GPU shape's sums over one weight row for up to RB rows of x, one lane's share of them
// (linear_wg.cl's linear_wg and linear_fused_wg, and moe.cl's moe_grouped_linear_wg include this,
// so a row's value is the same in all of them). Build options: -DWEIGHT_TYPE (common.cl), -DRB,
// -DVW (weights per lane per step: 1, 2, 4 or 8; KernelTuning::linear_vector) and -DVEC_ALIGNED=1
// where the host saw every row of x and W start on a VW-element boundary.
//
// Lane `lane` of `wg` takes the VW consecutive columns at VW * lane, VW * (lane + wg), ... while a
// whole step of wg * VW columns fits, then the remaining columns one at a time at lane, lane + wg,
// ...; each column's product is added in column order. With VW = 1 that is the plain stride-wg
// walk. Wider steps exist for GPUs: a 32-lane warp reading one bf16 per lane moves 64 bytes per
// load instruction, four per lane 256, so fewer loads keep the memory busy. VEC_ALIGNED turns the
// loads into single vector loads (vloadn only promises element alignment); the sums are the same.
#ifndef VW
#define VW 1
#endif
#ifndef VEC_ALIGNED
#define VEC_ALIGNED 0
#endif
#define WG_VEC_(t, n) t##n
#define WG_VEC(t, n) WG_VEC_(t, n)
// wtype's scalar name, for its vector types (a typedef cannot be pasted).
#if WEIGHT_TYPE == 1
#define WG_WSCALAR ushort
#else
#define WG_WSCALAR float
#endif

// VW weights at p, widened to f32, into v.
inline void wg_load_weights(global const wtype* p, float v[VW]) {
#if VW == 1
  v[0] = LOADW1(p);
#else
#if WEIGHT_TYPE == 2
  const WG_VEC(float, VW) f = WG_VEC(vload_half, VW)(0, p);
#else
#if VEC_ALIGNED
  const WG_VEC(WG_WSCALAR, VW) raw = *(global const WG_VEC(WG_WSCALAR, VW)*)p;
#else
  const WG_VEC(WG_WSCALAR, VW) raw = WG_VEC(vload, VW)(0, p);
#endif
#if WEIGHT_TYPE == 1
  const WG_VEC(float, VW) f = WG_VEC(as_float, VW)(WG_VEC(convert_uint, VW)(raw) << 16);
#else
  const WG_VEC(float, VW) f = raw;
#endif
#endif
  WG_VEC(vstore, VW)(f, 0, v);
#endif
}

// VW activations at p into v.
inline void wg_load_x(global const float* p, float v[VW]) {
#if VW == 1
  v[0] = *p;
#elif VEC_ALIGNED
  WG_VEC(vstore, VW)(*(global const WG_VEC(float, VW)*)p, 0, v);
#else
  WG_VEC(vstore, VW)(WG_VEC(vload, VW)(0, p), 0, v);
#endif
}

// acc[r] (r < rows) = this lane's share of x row r . wr over K columns; rows past `rows` are left
// untouched and xr[r] is not read for them.
inline void wg_lane_dots(global const float* xr[RB], uint rows, global const wtype* wr, uint K,
                         uint lane, uint wg, float acc[RB]) {
  for (int r = 0; r < RB; ++r) acc[r] = 0.0f;
  const uint span = wg * VW, whole = K / span * span;
  for (uint k = lane * VW; k < whole; k += span) {
    float wv[VW];
    wg_load_weights(wr + k, wv);
    for (int r = 0; r < RB; ++r)
      if (r < rows) {
        float xv[VW];
        wg_load_x(xr[r] + k, xv);
        for (int j = 0; j < VW; ++j) acc[r] = fma(xv[j], wv[j], acc[r]);
      }
  }
  for (uint k = whole + lane; k < K; k += wg) {
    const float wv = LOADW1(wr + k);
    for (int r = 0; r < RB; ++r)
      if (r < rows) acc[r] = fma(xr[r][k], wv, acc[r]);
  }
}
