// Memory bandwidth probe for perf/: each work-item sums one contiguous chunk with 16-wide loads
// (the access pattern of the GEMV kernels), so its GB/s is the decode roofline on this device.
kernel void read_sum(global const float* x, uint chunk16, global float* out) {
  const uint g = get_global_id(0);
  global const float* p = x + (size_t)g * chunk16 * 16;
  float16 acc = (float16)(0.0f);
  for (uint i = 0; i < chunk16; ++i) acc += vload16(i, p);
  out[g] = hsum16(acc);
}
