// Reductions for parallel/collectives.cpp: out = ((in0 + in1) + in2) + ... element by element, the
// inputs in rank order, so every device that reduces the same elements gets bitwise the same sums
// as the single-device twin that adds in the same order. CPU-shaped: one work-item owns `chunk`
// contiguous floats and walks them with 16-wide loads (opencl-on-pocl.md: GPU-style work-groups
// run several times slower on PoCL).
//
// Up to 8 inputs per launch (OpenCL C has no arrays of buffers); more ranks reduce in several
// launches with `accumulate` set, which starts from `out` instead of in0: ((p + in8) + in9) ... is
// still the same left fold.
kernel void reduce_ranks_f32(global float* out, ulong out_off, uint count, uint chunk, uint n_in,
                             uint accumulate,
                             global const float* in0, ulong off0, global const float* in1,
                             ulong off1, global const float* in2, ulong off2,
                             global const float* in3, ulong off3, global const float* in4,
                             ulong off4, global const float* in5, ulong off5,
                             global const float* in6, ulong off6, global const float* in7,
                             ulong off7) {
  const uint begin = get_global_id(0) * chunk;
  if (begin >= count) return;
  const uint end = min(begin + chunk, count);
  global const float* src[8] = {in0 + off0, in1 + off1, in2 + off2, in3 + off3,
                                in4 + off4, in5 + off5, in6 + off6, in7 + off7};
  global float* dst = out + out_off;
  const uint first = accumulate ? 0 : 1;
  uint i = begin;
  for (; i + 16 <= end; i += 16) {
    float16 s = accumulate ? vload16(0, dst + i) : vload16(0, src[0] + i);
    for (uint r = first; r < n_in; ++r) s += vload16(0, src[r] + i);
    vstore16(s, 0, dst + i);
  }
  for (; i < end; ++i) {
    float s = accumulate ? dst[i] : src[0][i];
    for (uint r = first; r < n_in; ++r) s += src[r][i];
    dst[i] = s;
  }
}
