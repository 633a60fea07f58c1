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
  // 16 columns at a time, as silu_tile (common.cl): the loop of scalar exps had cost about 4-8 ns a
  // column on PoCL (dsv3-mini's MoE rows on the 2-core EPYC: 8 x 512 in 35-38 us, now 17-19 us;
  // 64 x 512 in 151-155 us, now 17-29 us). A chunk's last F % 16 columns go one at a time.
  uint i = c0;
  for (; i + 16 <= c1; i += 16) {
    const float16 a = vload16(0, g + i);
    vstore16(a / (1.0f + exp(-a)) * vload16(0, u + i), 0, yr + i);
  }
  for (; i < c1; ++i) {
    const float a = g[i];
    yr[i] = a / (1.0f + exp(-a)) * u[i];
  }
}

#ifdef ROW_WG
// The GPU shape (-DROW_WG lanes): a lane per column, work-groups of ROW_WG neighbouring columns of
// one row. Launch: global (ceil(F / ROW_WG) * ROW_WG, T), local (ROW_WG, 1).
kernel __attribute__((reqd_work_group_size(ROW_WG, 1, 1)))
void silu_mul_wg(global const float* gate, uint gate_off, uint ldg, global const float* up,
                 uint up_off, uint ldu, global float* y, uint ldy, uint F) {
  const uint i = get_global_id(0), t = get_global_id(1);
  if (i >= F) return;
  const float a = gate[gate_off + (size_t)t * ldg + i];
  y[(size_t)t * ldy + i] = a / (1.0f + exp(-a)) * up[up_off + (size_t)t * ldu + i];
}
#endif
