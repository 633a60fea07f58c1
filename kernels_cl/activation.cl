// SwiGLU: y = silu(gate) * up, elementwise. gate and up may be two halves of one stacked
// gate_up_proj output (strides say where). dim 0: row, dim 1: chunk of CHUNK columns.
#define CHUNK 256

kernel void silu_mul(global const float* gate, uint gate_off, uint ldg, global const float* up,
                     uint up_off, uint ldu, global float* y, uint ldy, uint F) {
  const uint t = get_global_id(0);
  const uint c0 = get_global_id(1) * CHUNK;
  const uint c1 = min(c0 + CHUNK, F);
  global const float* g = gate + gate_off + (size_t)t * ldg;
  global const float* u = up + up_off + (size_t)t * ldu;
  global float* yr = y + (size_t)t * ldy;
  for (uint i = c0; i < c1; ++i) {
    const float a = g[i];
    yr[i] = a / (1.0f + exp(-a)) * u[i];
  }
}
