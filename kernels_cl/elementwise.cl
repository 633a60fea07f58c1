// y += alpha * x over n floats: a residual add of an all-reduced partial sum (tensor parallelism).
// One work-item per chunk of 4096 floats.
#define CHUNK 4096

kernel void axpy(global float* y, global const float* x, float alpha, uint n) {
  const uint i0 = get_global_id(0) * CHUNK;
  const uint i1 = min(i0 + CHUNK, n);
  for (uint i = i0; i < i1; ++i) y[i] = fma(alpha, x[i], y[i]);
}
