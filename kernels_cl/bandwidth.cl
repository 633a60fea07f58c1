// Memory bandwidth probes: the decode roofline of a device, read by the kernels' own access
// patterns. runtime/engine/bench.h (measure_device_read_bandwidth) launches them.

// The CPU shape: each work-item sums one contiguous chunk with 16-wide loads (the access pattern
// of the chunked GEMV kernels).
kernel void read_sum(global const float* x, uint chunk16, global float* out) {
  const uint g = get_global_id(0);
  global const float* p = x + (size_t)g * chunk16 * 16;
  float16 acc = (float16)(0.0f);
  for (uint i = 0; i < chunk16; ++i) acc += vload16(i, p);
  out[g] = hsum16(acc);
}

// The GPU shape: work-group g sums slab g of per_lane * READ_WG float4s; lane l reads float4s
// l, l + READ_WG, ..., so each load instruction of the group reads one contiguous run (coalesced),
// and many groups keep every compute unit's loads in flight. One partial sum per group.
#ifndef READ_WG
#define READ_WG 256
#endif
kernel __attribute__((reqd_work_group_size(READ_WG, 1, 1))) void read_sum_wg(
    global const float4* x, uint per_lane, global float* out) {
  local float scratch[READ_WG];
  global const float4* p = x + (size_t)get_group_id(0) * per_lane * READ_WG + get_local_id(0);
  float4 acc = (float4)(0.0f);
  for (uint i = 0; i < per_lane; ++i) acc += p[(size_t)i * READ_WG];
  const float s = wg_sum((acc.x + acc.y) + (acc.z + acc.w), scratch);
  if (get_local_id(0) == 0) out[get_group_id(0)] = s;
}
