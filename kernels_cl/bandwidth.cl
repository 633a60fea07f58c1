// Memory bandwidth probe for perf/: each work-item sums one contiguous chunk with 16-wide loads
// (the access pattern of the GEMV kernels), so its GB/s is the decode roofline on this device.
kernel void read_sum(global const float* x, uint chunk16, global float* out) {
  const uint g = get_global_id(0);
  global const float* p = x + (size_t)g * chunk16 * 16;
  float16 acc = (float16)(0.0f);
  for (uint i = 0; i < chunk16; ++i) acc += vload16(i, p);
  const float8 a8 = acc.lo + acc.hi;
  const float4 a4 = a8.lo + a8.hi;
  out[g] = a4.x + a4.y + a4.z + a4.w;
}
