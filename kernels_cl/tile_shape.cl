// The tile shape of the CPU-shape GEMM kernels (linear.cl, linear_fp8.cl, moe.cl, mla.cl), where
// the host leaves it out: TM rows x TN output columns per tile (-DTM, -DTN), and whether one-row
// tiles read their columns in turn (-DCOLUMNS_IN_TURN; linear_tile.cl, fp8_tile.cl), there two
// at a time (-DGEMV_ROW_PAIRS; linear_tile.cl). Included before the tile files.
#ifndef TM
#define TM 1
#endif
#ifndef TN
#define TN 4
#endif
#ifndef COLUMNS_IN_TURN
#define COLUMNS_IN_TURN 0
#endif
#ifndef GEMV_ROW_PAIRS
#define GEMV_ROW_PAIRS 0
#endif
