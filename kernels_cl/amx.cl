// Intel AMX's tile configuration (ldtilecfg's 64-byte operand, palette 1), which the AMX kernels
// (bf16_packed.cl's panel tiles, bf16_amx_stream.cl's decode GEMM) load before their tiles: the
// bytes per row and rows of each of the 8 tile registers. They reach the instructions through
// clang's per-function target attribute; the host grants the process the tile state first
// (runtime/ops.cpp: Linux faults a thread's first tile instruction without arch_prctl's
// permission).
#ifndef CLSHARD_AMX_CL
#define CLSHARD_AMX_CL

typedef struct {
  uchar palette, start_row;
  uchar reserved[14];
  ushort colsb[16];
  uchar rows[16];
} AmxTileConfig;

// A configuration of palette 1 with every tile unused (0 rows, 0 bytes).
inline void amx_config_clear(AmxTileConfig* cfg) {
  for (int i = 0; i < 64; ++i) ((uchar*)cfg)[i] = 0;
  cfg->palette = 1;
}

#endif  // CLSHARD_AMX_CL
