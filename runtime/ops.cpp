#include "runtime/ops.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#if defined(__x86_64__) && defined(__linux__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "runtime/device.h"
#include "runtime/ops_blas.h"
#include "runtime/ops_moe.h"

namespace clshard::ops {

namespace {

// Build option for kernels that read a weight: bf16 is widened in the kernel, f32 read as is.
std::string weight_option(const Weight& w) {
  switch (w.dtype) {
    case DType::F32: return "-DWEIGHT_TYPE=0";
    case DType::BF16: return "-DWEIGHT_TYPE=1";
    case DType::F16: return "-DWEIGHT_TYPE=2";
    default:
      throw std::runtime_error("weight '" + w.name + "' has dtype " + dtype_name(w.dtype) +
                               "; this kernel takes F32, BF16 or F16");
  }
}

// Rows per tile: one for decode-sized batches (the weights stream once either way), four from
// kTileRowsFrom rows on, reusing each loaded x and W vector four times.
constexpr uint32_t kTileRowsFrom = 4;

// How a linear launch splits on CPUs (see linear.cl): TM-row tiles of tile_cols output columns;
// each work-item takes up to 64 rows and n_tiles column tiles, enough that a launch is a few
// hundred work-items rather than tens of thousands (PoCL pays per work-group).
struct LinearBlocks {
  uint32_t tm, m_rows, n_tiles, col_blocks, row_blocks;
};
LinearBlocks linear_blocks(const Device& dev, uint32_t M, uint32_t N, uint32_t tile_cols) {
  LinearBlocks b;
  b.tm = linear_tile_rows(dev, M);
  b.m_rows = std::min<uint32_t>((M + b.tm - 1) / b.tm * b.tm, 64 / b.tm * b.tm);
  const uint32_t col_tiles = (N + tile_cols - 1) / tile_cols;
  b.row_blocks = (M + b.m_rows - 1) / b.m_rows;
  b.n_tiles = dev.kernel_shape() == KernelShape::Chunks
                  ? tiles_per_item(uint64_t(col_tiles) * b.row_blocks, 256)
                  : 1;
  b.col_blocks = (col_tiles + b.n_tiles - 1) / b.n_tiles;
  return b;
}

// Whether linear.cl's one-row tiles take their columns in turn (a sequential weight stream) over
// this K: while the x row stays in L1 beside the stream (KernelTuning::gemv_stream_k).
bool columns_in_turn(const Device& dev, uint32_t M, uint32_t K) {
  return M < kTileRowsFrom && K <= dev.tuning().gemv_stream_k;
}

// linear.cl's tile options: TM x TN, columns in turn, the next tile's prefetch.
std::string tile_options(const Device& dev, const LinearBlocks& b, uint32_t tn, bool in_turn) {
  return " -DTM=" + std::to_string(b.tm) + " -DTN=" + std::to_string(tn) +
         (in_turn ? columns_in_turn_option(dev) : "") + weight_prefetch_option(dev);
}

// Whether a GEMM over `ws` runs in bf16 (ComputeDType in ops.h): from kGemmRowsFrom rows, and
// below that (the GEMVs of decode) on the CPU shape where the host has vdpbf16ps but not AMX.
bool bf16_gemm(const Device& dev, ComputeDType compute, uint32_t M,
               const std::vector<const Weight*>& ws) {
  if (compute != ComputeDType::BF16) return false;
  for (const Weight* w : ws)
    if (w->dtype != DType::BF16) return false;
  return M >= kGemmRowsFrom || bf16_gemv(dev);
}

// A work-item's rows where its panel runs in chunks (KernelTuning's gemm_bf16_packed_kp steps at
// a time): their partial sums wait in local memory between chunks (512 rows x 64 columns: 128 KiB).
constexpr uint32_t kPackedPartialRows = 512;

}  // namespace

uint32_t wg_linear_rows(const Device& dev, uint32_t M) {
  return std::max(1u, std::min(dev.tuning().linear_rows, M));
}

uint32_t linear_tile_rows(const Device& dev, uint32_t M) {
  // Each row's sums are the same FMAs in the same order whatever the tile (linear_tile.cl), so
  // the rows per tile change no bit.
  const uint32_t batch_tm = dev.tuning().linear_batch_tm;
  return M < kTileRowsFrom ? 1 : M >= batch_tm && M <= 64 ? batch_tm : 4;
}

PackedGemmShape packed_gemm_shape(const Device& dev, PackedRows x, bool glu,
                                  std::optional<Fp8Codes> fp8, bool pairs_aligned, uint32_t K) {
  const KernelTuning& t = dev.tuning();
  PackedGemmShape p;
  const bool x_f32 = x == PackedRows::F32;
  // AMX tiles (bf16 rows, or their terms): 16 rows, and at most 5 vectors beside the x and
  // weight tiles.
  const bool amx = !x_f32 && bf16_amx(dev);
  if (x == PackedRows::F32Terms && !amx)
    throw std::logic_error("packed_gemm_shape: f32 rows as bf16 terms need AMX");
  p.tm = amx ? 16 : std::max(1u, t.gemm_bf16_packed_tm);
  // With GLU the vectors split evenly into gate and up.
  p.nv =
      glu ? std::max(2u, (t.gemm_bf16_packed_nv + 1) / 2 * 2) : std::max(1u, t.gemm_bf16_packed_nv);
  if (amx) p.nv = std::min(p.nv, glu ? 4u : 5u);
  p.tile_cols = glu ? 8 * p.nv : 16 * p.nv;
  const uint32_t steps = (K + 1) / 2;
  // Whole groups of 16 steps: AMX reads the panel 16 steps at a time.
  const uint32_t chunk = std::max(16u, t.gemm_bf16_packed_kp / 16 * 16);
  p.chunk_steps = std::min(steps, chunk);
  p.partial_rows = steps > chunk ? kPackedPartialRows / p.tm * p.tm : 0;
  const bool bf16_dot = !x_f32 && !amx && bf16_dot_product(dev);
  auto local_bytes = [&](bool widened) {
    return uint64_t((p.chunk_steps + 15) / 16 * 16) * 16 * p.nv * 4 * (widened ? 2 : 1) +
           uint64_t(p.partial_rows) * 16 * p.nv * 4;
  };
  // The widened panel (twice the bytes) where the tuning asks for it and it fits, else the pairs.
  const bool widened = !bf16_dot && !amx && t.gemm_bf16_packed_wf32 != 0 &&
                       local_bytes(true) <= dev.info().local_mem;
  p.fits = local_bytes(widened) <= dev.info().local_mem;
  p.options = " -DPANEL_TM=" + std::to_string(p.tm) + " -DPANEL_NV=" + std::to_string(p.nv) +
              " -DPANEL_KP=" + std::to_string(p.chunk_steps) + " -DGLU=" + (glu ? "1" : "0") +
              " -DBF16_DOT=" + (bf16_dot ? "1" : "0") + (widened ? " -DPANEL_WF32=1" : "") +
              " -DBF16_AMX=" + (amx ? "1" : "0") +
              " -DPAIRS_ALIGNED=" + (pairs_aligned ? "1" : "0") + weight_prefetch_option(dev);
  if (x_f32) p.options += " -DPANEL_XF32=1";
  if (x == PackedRows::F32Terms) p.options += " -DX_SPLIT=3";
  if (p.partial_rows) p.options += " -DPANEL_ROWS=" + std::to_string(p.partial_rows);
  if (fp8)
    p.options += " -DPANEL_FP8=1 " + fp8_decode_option(dev, fp8->subnormal_share) +
                 fp8_tile_options(dev, fp8->nan_free, false);
  return p;
}

namespace {

// linear_bf16.cl's linear_bf16_packed over the rounded rows xb (from element xb_off, row stride
// ldxb), or over f32 rows as they are or as their bf16 terms (PackedRows; bf16 weights only;
// with terms ldxb is three rows of terms, round_bf16's -DX_SPLIT=3): bf16 weights
// side by side (or gate and up with glu; n1, n2 where the second and third start), or one FP8
// weight with its block scales fp8_scale, dequantized as it is packed; the tile
// packed_gemm_shape's. False, launching nothing, where the panel (and the partial sums of K past
// one chunk) would not fit the device's local memory.
bool launch_bf16_packed(Device& dev, const cl::Mem& xb, uint32_t xb_off, uint32_t ldxb,
                        PackedRows x, const std::vector<const Weight*>& ws, bool glu,
                        const Weight* bias, const Weight* fp8_scale, bool pairs_aligned,
                        const cl::Mem& y, uint32_t y_off, uint32_t ldy, uint32_t M, uint32_t N,
                        uint32_t K, uint32_t n1, uint32_t n2, float alpha, bool accumulate) {
  const PackedGemmShape shape = packed_gemm_shape(
      dev, x, glu, fp8_scale ? std::optional(fp8_codes(*ws[0])) : std::nullopt, pairs_aligned, K);
  if (!shape.fits) return false;
  const uint32_t col_tiles = (N + shape.tile_cols - 1) / shape.tile_cols;
  // A work-item packs its column tile once for all its rows: all M where the column tiles alone
  // make 8 work-items per compute unit, else M split until they do (rows that wait between
  // chunks: at most partial_rows).
  const uint32_t want = 8 * std::max(dev.info().compute_units, 1u);
  const uint32_t row_blocks = std::max(1u, (want + col_tiles - 1) / col_tiles);
  uint32_t m_rows = ((M + row_blocks - 1) / row_blocks + shape.tm - 1) / shape.tm * shape.tm;
  if (shape.partial_rows) m_rows = std::min(m_rows, shape.partial_rows);
  const std::string opts = "-DLINEAR_BF16_PACKED=1 -DWEIGHT_TYPE=1" + shape.options;
  cl::Kernel k = dev.kernel("linear_bf16.cl", "linear_bf16_packed", opts);
  const Weight& w0 = *ws[0];
  const Weight& w1 = *ws[std::min<size_t>(1, ws.size() - 1)];
  const Weight& w2 = *ws[std::min<size_t>(2, ws.size() - 1)];
  const int has_bias = bias != nullptr;
  cl::set_args(k, xb, xb_off, ldxb, w0.mem, uint32_t(w0.offset), uint32_t(w0.row_stride()), n1,
               w1.mem, uint32_t(w1.offset), uint32_t(w1.row_stride()), n2, w2.mem,
               uint32_t(w2.offset), uint32_t(w2.row_stride()), has_bias ? bias->mem : w0.mem,
               uint32_t(has_bias ? bias->offset : 0), has_bias, fp8_scale ? fp8_scale->mem : w0.mem,
               (K + 127) / 128, y, y_off, ldy, M, N, K, alpha, int(accumulate), m_rows);
  dev.launch(k, {col_tiles, (M + m_rows - 1) / m_rows, 1}, 2);
  return true;
}

// The output columns of weights side by side (with glu, gate and up: N is one's rows), where the
// second and third start (n1, n2; N where absent), and whether every weight row starts on a
// 4-byte word: the portable micro-kernels load words there (the rounded rows always do: their
// stride is a multiple of 32; FP8 rows are read as bytes).
struct WeightColumns {
  uint32_t N = 0, n1 = 0, n2 = 0;
  bool pairs_aligned = true;
};
WeightColumns weight_columns(const std::vector<const Weight*>& ws, bool glu, bool fp8) {
  WeightColumns c;
  uint32_t ends[3] = {0, 0, 0};
  for (size_t i = 0; i < ws.size(); ++i) {
    if (!glu) c.N += uint32_t(ws[i]->dim(0));
    ends[i] = c.N;
  }
  if (glu) c.N = uint32_t(ws[0]->dim(0));
  c.n1 = ws.size() > 1 ? ends[0] : c.N;
  c.n2 = ws.size() > 2 ? ends[1] : c.N;
  for (const Weight* w : ws)
    c.pairs_aligned &= fp8 || (w->row_stride() % 2 == 0 && w->offset % 2 == 0);
  return c;
}

// compute_dtype f32 over bf16 weights on the CPU shape, from gemm_bf16_packed_rows rows: the
// packed GEMM on the f32 rows as they are (bf16_packed.cl's PANEL_XF32; bf16 weights are exact
// in f32, so this is the f32 product, summed as one chain per output). False, launching nothing,
// where it does not apply (another shape, another dtype, fewer rows, too little local memory).
bool packed_f32_rows(Device& dev, const cl::Mem& x, uint32_t x_off, uint32_t ldx,
                     const std::vector<const Weight*>& ws, bool glu, const Weight* bias,
                     const cl::Mem& y, uint32_t y_off, uint32_t ldy, uint32_t M, float alpha,
                     bool accumulate) {
  const KernelTuning& t = dev.tuning();
  if (dev.kernel_shape() != KernelShape::Chunks || t.gemm_bf16_packed_rows == 0 ||
      M < t.gemm_bf16_packed_rows || (bias && bias->dtype != DType::BF16))
    return false;
  for (const Weight* w : ws)
    if (w->dtype != DType::BF16) return false;
  const WeightColumns wc = weight_columns(ws, glu, false);
  return launch_bf16_packed(dev, x, x_off, ldx, PackedRows::F32, ws, glu, bias, nullptr,
                            wc.pairs_aligned, y, y_off, ldy, M, wc.N, uint32_t(ws[0]->dim(1)),
                            wc.n1, wc.n2, alpha, accumulate);
}

// Whether a bf16-compute GEMM of M rows over `ws` takes linear_bf16_amx_stream
// (bf16_amx_stream.cl): AMX, bf16 weights (and bias), at most gemm_bf16_amx_stream_rows rows.
bool amx_stream_gemm(const Device& dev, const std::vector<const Weight*>& ws, const Weight* bias,
                     const Weight* fp8_scale, uint32_t M) {
  if (fp8_scale || M > bf16_amx_stream_rows(dev) || (bias && bias->dtype != DType::BF16))
    return false;
  for (const Weight* w : ws)
    if (w->dtype != DType::BF16) return false;
  return true;
}

// linear_bf16_amx_stream over x's M rows (amx_stream_gemm): the rows packed as AMX's B operand
// (round_bf16's OUT_VNNI; with terms = 3 as their three bf16 terms, X_SPLIT), then units of
// gemm_bf16_amx_stream_na groups of 16 weight rows split over stream_launch_items work-items, as
// the streaming GEMVs are.
void gemm_bf16_amx_stream(Device& dev, const cl::Mem& x, uint32_t x_off, uint32_t ldx,
                          const std::vector<const Weight*>& ws, bool glu, const Weight* bias,
                          const cl::Mem& y, uint32_t y_off, uint32_t ldy, uint32_t M, float alpha,
                          bool accumulate, uint32_t terms = 1) {
  const uint32_t K = uint32_t(ws[0]->dim(1));
  const uint32_t groups = (K + 31) / 32, nb = (M + 15) / 16;
  const std::string split = " -DX_SPLIT=" + std::to_string(terms);
  Scratch xp(dev, size_t(groups) * terms * nb * 1024);
  {
    cl::Kernel k = dev.kernel("linear_bf16.cl", "round_bf16", "-DOUT_VNNI=1" + split);
    cl::set_args(k, x, x_off, ldx, x, 0, xp.mem(), M, K);
    dev.launch(k, {(K + 63) / 64, 16 * nb, 1}, 2);
  }
  const WeightColumns wc = weight_columns(ws, glu, false);
  uint32_t na = dev.tuning().gemm_bf16_amx_stream_na >= 4   ? 4
                : dev.tuning().gemm_bf16_amx_stream_na >= 2 ? 2
                                                            : 1;
  const bool in_turn = na == 1;
  if (glu) na = std::max(na, 2u);
  if (nb == 2 && !in_turn) na = 2;  // at most 4 C tiles read together
  if (terms > 1) na = std::min(na, 2u);  // the A tiles held across the terms: 2 registers
  const uint32_t unit_cols = glu ? 8 * na : 16 * na;
  const uint32_t units = (wc.N + unit_cols - 1) / unit_cols;
  const uint32_t per_item = tiles_per_item(units, stream_launch_items(dev));
  const std::string opts =
      "-DLINEAR_BF16_AMX_STREAM=1 -DWEIGHT_TYPE=1 -DAMX_NA=" + std::to_string(na) +
      " -DGLU=" + (glu ? "1" : "0") + " -DAMX_IN_TURN=" + (in_turn ? "1" : "0") +
      " -DAMX_NB=" + std::to_string(nb) + split;
  cl::Kernel k = dev.kernel("linear_bf16.cl", "linear_bf16_amx_stream", opts);
  const Weight& w0 = *ws[0];
  const Weight& w1 = *ws[std::min<size_t>(1, ws.size() - 1)];
  const Weight& w2 = *ws[std::min<size_t>(2, ws.size() - 1)];
  const int has_bias = bias != nullptr;
  cl::set_args(k, xp.mem(), w0.mem, uint32_t(w0.offset), uint32_t(w0.row_stride()), wc.n1, w1.mem,
               uint32_t(w1.offset), uint32_t(w1.row_stride()), wc.n2, w2.mem, uint32_t(w2.offset),
               uint32_t(w2.row_stride()), has_bias ? bias->mem : w0.mem,
               uint32_t(has_bias ? bias->offset : 0), has_bias, y, y_off, ldy, M, wc.N, K, alpha,
               int(accumulate), per_item);
  dev.launch(k, {(units + per_item - 1) / per_item, 1, 1}, 2);
}

// compute_dtype f32 over bf16 weights with AMX, from KernelTuning's gemm_f32_amx_rows rows: each
// f32 row as its three bf16 terms (linear_bf16.cl's bf16_terms), whose
// products with a bf16 weight are exact in f32, on AMX's tiles: up to bf16_amx_stream_rows rows
// the streaming GEMM, beyond them the packed one (rows 3 m + t of the terms). False, launching
// nothing, where it does not apply (no AMX, the field 0, another dtype, fewer rows, a panel that
// does not fit).
bool gemm_f32_amx_terms(Device& dev, const cl::Mem& x, uint32_t x_off, uint32_t ldx,
                        const std::vector<const Weight*>& ws, bool glu, const Weight* bias,
                        const cl::Mem& y, uint32_t y_off, uint32_t ldy, uint32_t M, float alpha,
                        bool accumulate) {
  const uint32_t from = dev.tuning().gemm_f32_amx_rows;
  if (dev.kernel_shape() != KernelShape::Chunks || from == 0 || M < from || !bf16_amx(dev) ||
      (bias && bias->dtype != DType::BF16))
    return false;
  for (const Weight* w : ws)
    if (w->dtype != DType::BF16) return false;
  if (M <= bf16_amx_stream_rows(dev)) {
    gemm_bf16_amx_stream(dev, x, x_off, ldx, ws, glu, bias, y, y_off, ldy, M, alpha, accumulate, 3);
    return true;
  }
  const uint32_t K = uint32_t(ws[0]->dim(1)), ldr = bf16_gemm_row_stride(K);
  Scratch terms(dev, size_t(M) * 3 * ldr * 2);
  bf16_terms(dev, x, x_off, ldx, M, K, terms.mem(), ldr);
  const WeightColumns wc = weight_columns(ws, glu, false);
  return launch_bf16_packed(dev, terms.mem(), 0, 3 * ldr, PackedRows::F32Terms, ws, glu, bias,
                            nullptr, wc.pairs_aligned, y, y_off, ldy, M, wc.N, K, wc.n1, wc.n2,
                            alpha, accumulate);
}

// y[M, :N] (+)= alpha * (bf16(x) [ws...]^T (+ bias)) on the CPU shape (linear_bf16.cl): the rows
// rounded once into a scratch of 32-aligned rows, then the tiled GEMM, or from
// gemm_bf16_packed_rows rows the packed one; batches with AMX stream their weights
// (amx_stream_gemm). With glu, ws = {gate, up} and y gets silu(gate) * up. With x_rounded, x
// holds those rounded rows already (from x_off 0, row stride ldx: round_bf16's layout, as the
// fused ops' norm writes them), never where AMX streams.
void gemm_bf16(Device& dev, const cl::Mem& x, uint32_t x_off, uint32_t ldx,
               const std::vector<const Weight*>& ws, bool glu, const Weight* bias, const cl::Mem& y,
               uint32_t y_off, uint32_t ldy, uint32_t M, float alpha, bool accumulate,
               const Weight* fp8_scale = nullptr, bool x_rounded = false) {
  if (amx_stream_gemm(dev, ws, bias, fp8_scale, M)) {
    if (x_rounded) throw std::logic_error("gemm_bf16: AMX's stream packs f32 rows, given bf16");
    return gemm_bf16_amx_stream(dev, x, x_off, ldx, ws, glu, bias, y, y_off, ldy, M, alpha,
                                accumulate);
  }
  const uint32_t K = uint32_t(ws[0]->dim(1));
  if (x_rounded && x_off != 0)
    throw std::logic_error("gemm_bf16: rounded rows start at element 0, given " +
                           std::to_string(x_off));
  const uint32_t ldxb = x_rounded ? ldx : bf16_gemm_row_stride(K);
  Scratch rounded;
  if (!x_rounded) {
    rounded = Scratch(dev, size_t(M) * ldxb * 2);
    round_bf16(dev, x, x_off, ldx, M, K, rounded.mem(), ldxb);
  }
  const cl::Mem& xb = x_rounded ? x : rounded.mem();
  const WeightColumns wc = weight_columns(ws, glu, fp8_scale != nullptr);
  const uint32_t N = wc.N, n1 = wc.n1, n2 = wc.n2;
  const bool pairs_aligned = wc.pairs_aligned;
  const KernelTuning& t = dev.tuning();
  const uint32_t packed_from = bf16_packed_rows_from(dev);
  if (packed_from != 0 && M >= packed_from &&
      launch_bf16_packed(dev, xb, 0, ldxb, PackedRows::Bf16, ws, glu, bias, fp8_scale,
                         pairs_aligned, y, y_off, ldy, M, N, K, n1, n2, alpha, accumulate))
    return;
  // Batches below one work-item's rows (decode) take their own tile (KernelTuning), and below
  // kGemmRowsFrom rows one-row tiles (bf16_one_row_tile).
  const bool batch = M < t.gemm_bf16_rows, gemv = M < kGemmRowsFrom;
  const Bf16OneRowTile one_row = bf16_one_row_tile(dev, glu, K);
  const uint32_t tm = gemv ? 1 : batch ? t.gemm_bf16_batch_tm : t.gemm_bf16_tm;
  const uint32_t tn_any = batch ? t.gemm_bf16_batch_tn : t.gemm_bf16_tn;
  const uint32_t tn = gemv ? one_row.tn : glu ? (tn_any + 1) / 2 * 2 : tn_any;
  const uint32_t tile_cols = glu ? tn / 2 : tn;
  // As linear_blocks: enough column tiles per work-item that a launch is a few hundred of them;
  // batches of at most 16 rows, bound by the weights' stream, are split as linear_fp8's GEMVs
  // (stream_launch_items): only a work-item's first tile has no prefetched rows. In-process A/B
  // on the 2-core EPYC (M = 4 / 8 / 16): 3072 x 2048 1.15 / 1.30-1.33 / 1.13x, 2048 x 2048
  // 1.20 / 1.20-1.24 / 1.09x, 2048 x 8192 1.12 / 1.17-1.25 / 1.05x, 16384 x 2048 (16 tiles
  // either way) 1.0x; at M = 32 0.96-1.08x, so not there. llama3-1b's `clshard bench --batch 8`:
  // 1.02-1.25x in 3 interleaved pairs.
  const uint32_t m_rows = std::min((M + tm - 1) / tm * tm, (t.gemm_bf16_rows + tm - 1) / tm * tm);
  const uint32_t row_blocks = (M + m_rows - 1) / m_rows;
  const uint32_t col_tiles = (N + tile_cols - 1) / tile_cols;
  const uint64_t min_items = batch && M <= 16 ? stream_launch_items(dev) : 256;
  const uint32_t n_tiles = tiles_per_item(uint64_t(col_tiles) * row_blocks, min_items);
  const uint32_t col_blocks = (col_tiles + n_tiles - 1) / n_tiles;
  // Batches below one row block (decode) stream their weights and prefetch the next column
  // tile's rows (llama3-1b at batch 8: the whole step 10% faster); a prefill's row blocks are
  // compute-bound, and there the prefetched rows only took cache from the x rows (134.7-147.5
  // against 146.3-149.2 tok/s without, 3 interleaved pairs of a 512-token prefill).
  // An FP8 weight (one, no GLU, no bias) is dequantized per column tile into the work-item's
  // bf16 panel (bf16_tile.cl's FP8_BF16_PANEL), whose rows are aligned.
  std::string opts = "-DLINEAR_BF16=1 -DWEIGHT_TYPE=1 -DTM=" + std::to_string(tm) +
                     " -DTN=" + std::to_string(tn) + " -DGLU=" + (glu ? "1" : "0") +
                     " -DBF16_DOT=" + (bf16_dot_product(dev) ? "1" : "0") +
                     " -DPAIRS_ALIGNED=" + (pairs_aligned ? "1" : "0") +
                     (gemv && one_row.columns_in_turn ? " -DCOLUMNS_IN_TURN=1" : "");
  if (fp8_scale)
    opts += fp8_bf16_panel_options(dev, K, fp8_codes(*ws[0]));
  else if (batch)
    opts += weight_prefetch_option(dev);
  cl::Kernel k = dev.kernel("linear_bf16.cl", "linear_bf16", opts);
  const Weight& w0 = *ws[0];
  const Weight& w1 = *ws[std::min<size_t>(1, ws.size() - 1)];
  const Weight& w2 = *ws[std::min<size_t>(2, ws.size() - 1)];
  const int has_bias = bias != nullptr;
  cl::set_args(k, xb, ldxb, w0.mem, uint32_t(w0.offset), uint32_t(w0.row_stride()), n1, w1.mem,
               uint32_t(w1.offset), uint32_t(w1.row_stride()), n2, w2.mem, uint32_t(w2.offset),
               uint32_t(w2.row_stride()), has_bias ? bias->mem : w0.mem,
               uint32_t(has_bias ? bias->offset : 0), has_bias, fp8_scale ? fp8_scale->mem : w0.mem,
               (K + 127) / 128, y, y_off, ldy, M, N, K, alpha, int(accumulate), n_tiles, m_rows);
  // Row blocks first (linear_bf16.cl): a column block's weights are read from memory once, not
  // once per row block; 1.01-1.10x at M = 512 (bench_kernels, interleaved pairs).
  dev.launch(k, {row_blocks, col_blocks, 1}, 2);
}

// Whether this process may run AMX's bf16 tiles: the CPU has them (CPUID leaf 7: AMX-TILE, EDX
// bit 24, and AMX-BF16, bit 22) and Linux granted the process the tile data state
// (arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA; without it a thread's first tile
// instruction faults). Asked once, before any kernel that uses them is built.
bool host_amx_bf16_permitted() {
#if defined(__x86_64__) && defined(__linux__)
  static const bool permitted = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << 22)))
      return false;
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return permitted;
#else
  return false;
#endif
}

bool host_cpu_has_avx512_bf16() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  static const bool has = __builtin_cpu_supports("avx512bf16");
  return has;
#else
  return false;
#endif
}

}  // namespace

namespace {

// PoCL's CPU device: the host's instructions are the kernel's.
bool pocl_cpu(const Device& dev) { return clshard::pocl_cpu(dev.info()); }

}  // namespace

bool bf16_dot_product(const Device& dev) {
  // The target attribute reaches the instruction there, and only a host that has it may run it.
  return pocl_cpu(dev) && dev.tuning().gemm_bf16_dot != 0 && host_cpu_has_avx512_bf16();
}

bool bf16_amx(const Device& dev) {
  return pocl_cpu(dev) && dev.tuning().gemm_bf16_amx != 0 && host_amx_bf16_permitted();
}

bool bf16_gemv(const Device& dev) {
  return dev.kernel_shape() == KernelShape::Chunks && dev.tuning().gemm_bf16_gemv != 0 &&
         bf16_dot_product(dev) && !bf16_amx(dev);
}

// In turn up to gemv_stream_k, as the f32 GEMV's columns: past it the tile's TN chains side by
// side gain more than the single stream. 2048 x 8192 (llama3-1b's down_proj) in turn ran 74 GB/s
// from L3 against 100 side by side; side by side against the f32 GEMV from memory at 29-31 GB/s
// 1.21-1.29x. The GLU tile is one gate row and its up row, as the f32 GEMV's (launch_fused): two
// of each, run in turn, took llama3-1b's gate|up stage at bf16 compute 1.08-1.10x longer than the
// f32 GEMV's, one of each 0.99-1.01x (bench_decode_breakdown --tuning-ab gemm_bf16_gemv=0).
Bf16OneRowTile bf16_one_row_tile(const Device& dev, bool glu, uint32_t K) {
  const KernelTuning& t = dev.tuning();
  return {glu ? 2u : t.gemm_bf16_batch_tn, K <= t.gemv_stream_k};
}

namespace {
uint32_t packed_rows_from(const Device& dev, uint32_t rows) {
  if (rows == 0 || !bf16_amx(dev)) return rows;
  return std::max(1u, std::min(rows, dev.tuning().gemm_bf16_amx_rows));
}
}  // namespace

uint32_t bf16_packed_rows_from(const Device& dev) {
  return packed_rows_from(dev, dev.tuning().gemm_bf16_packed_rows);
}

uint32_t moe_bf16_packed_rows_from(const Device& dev, DType experts) {
  const KernelTuning& t = dev.tuning();
  return packed_rows_from(
      dev, experts == DType::F8_E4M3 ? t.moe_fp8_packed_rows : t.moe_bf16_packed_rows);
}

uint32_t bf16_amx_stream_rows(const Device& dev) {
  return bf16_amx(dev) ? std::min(dev.tuning().gemm_bf16_amx_stream_rows, 32u) : 0;
}

namespace {

// Whether the first row at element `offset` (elements of `elem` bytes) of a buffer whose start
// has byte alignment `start_align` (mem_start_alignment), and every row `ld` elements after it,
// start on a `vw`-element boundary on the device. Exact for vw * elem a power of two up to
// kMaxStartAlign, every width wg_dots.cl takes.
bool rows_aligned(uint32_t start_align, size_t offset, size_t ld, size_t elem, uint32_t vw) {
  return offset % vw == 0 && ld % vw == 0 && start_align % (size_t(vw) * elem) == 0;
}

// linear_wg.cl's width options (wg_dots.cl): -DVW, KernelTuning::linear_vector, and
// -DVEC_ALIGNED=1 where x's rows and every weight's rows start on a VW-element boundary, so the
// lanes' loads are single vector loads. A weight's start alignment is the one recorded when it was
// built (Weight::start_align), asked of OpenCL only for a weight built by hand; x's is asked each
// launch (a cl::Mem has nowhere to record it), and only once the weights are found aligned.
std::string wg_vector_options(const Device& dev, const cl::Mem& x, uint32_t x_off, uint32_t ldx,
                              const std::vector<const Weight*>& ws) {
  const uint32_t vw = dev.tuning().linear_vector;
  std::string opts = " -DVW=" + std::to_string(vw);
  if (vw == 1) return opts;
  for (const Weight* w : ws) {
    const uint32_t start = w->start_align ? w->start_align : mem_start_alignment(w->mem);
    if (!rows_aligned(start, w->offset, size_t(w->row_stride()), dtype_size(w->dtype), vw))
      return opts;
  }
  if (x_off % vw != 0 || ldx % vw != 0) return opts;
  return rows_aligned(mem_start_alignment(x), x_off, ldx, sizeof(float), vw)
             ? opts + " -DVEC_ALIGNED=1"
             : opts;
}

}  // namespace

uint64_t stream_launch_items(const Device& dev) {
  return std::max<uint64_t>(16ull * std::max(dev.info().compute_units, 1u), 32);
}

uint32_t tiles_per_item(uint64_t tiles, uint64_t min_items, uint32_t max_per_item) {
  uint32_t n = 1;
  while (n < max_per_item && tiles / (n * 2) >= min_items) n *= 2;
  return n;
}

uint32_t in_turn_max_k(const Device& dev, DType dtype) {
  return dtype == DType::F8_E4M3 ? dev.tuning().fp8_stream_k : dev.tuning().gemv_stream_k;
}

std::string columns_in_turn_option(const Device& dev) {
  std::string o = " -DCOLUMNS_IN_TURN=1";
  if (dev.tuning().gemv_row_pairs != 0) o += " -DGEMV_ROW_PAIRS=1";
#if defined(__x86_64__)
  const KernelTuning& t = dev.tuning();
  if (pocl_cpu(dev) &&
      (t.stream_prefetch != 0 || t.stream_prefetch_l1 != 0 || t.gemv_stream_prefetch != 0)) {
    o += " -DPREFETCH_X86=1";
    if (t.stream_prefetch) o += " -DSTREAM_PREFETCH=" + std::to_string(t.stream_prefetch);
    if (t.stream_prefetch_l1) o += " -DSTREAM_PREFETCH_L1=" + std::to_string(t.stream_prefetch_l1);
    if (t.gemv_stream_prefetch)
      o += " -DGEMV_STREAM_PREFETCH=" + std::to_string(t.gemv_stream_prefetch);
  }
#endif
  return o;
}

std::string weight_prefetch_option(const Device& dev) {
#if defined(__x86_64__)
  if (pocl_cpu(dev) && dev.tuning().weight_prefetch != 0) return " -DPREFETCH_X86=1";
#endif
  (void)dev;
  return "";
}

namespace {
void launch_round_bf16(Device& dev, const std::string& options, const cl::Mem& x, uint32_t x_off,
                       uint32_t ldx, uint32_t M, uint32_t K, const cl::Mem& xb, uint32_t ldxb,
                       const cl::Mem* x_rows) {
  if (M == 0 || K == 0) return;
  cl::Kernel k = dev.kernel("linear_bf16.cl", "round_bf16", options);
  cl::set_args(k, x, x_off, ldx, x_rows ? *x_rows : x, int(x_rows != nullptr), xb, ldxb, K);
  dev.launch(k, {(K + 63) / 64, M, 1}, 2);
}
}  // namespace

void round_bf16(Device& dev, const cl::Mem& x, uint32_t x_off, uint32_t ldx, uint32_t M, uint32_t K,
                const cl::Mem& xb, uint32_t ldxb, bool as_f32, const cl::Mem* x_rows) {
  launch_round_bf16(dev, as_f32 ? "-DOUT_F32=1" : "", x, x_off, ldx, M, K, xb, ldxb, x_rows);
}

void bf16_terms(Device& dev, const cl::Mem& x, uint32_t x_off, uint32_t ldx, uint32_t M, uint32_t K,
                const cl::Mem& xt, uint32_t ldxt, const cl::Mem* x_rows) {
  launch_round_bf16(dev, "-DX_SPLIT=3", x, x_off, ldx, M, K, xt, ldxt, x_rows);
}

uint32_t bf16_gemm_row_stride(uint32_t K) {
  // Whole steps for aligned loads, and one step more so that row starts do not fall on one
  // power-of-two stride: with 16 KB rows (K = 8192, Llama's down_proj) the M = 512 GEMM ran
  // 1.11-1.13x faster so (K = 16384 1.12x, K = 2048-6144 0.99-1.01x; in-process A/B on the 2-core
  // EPYC; likely cache-set conflicts between the rows of a tile).
  return (K + 31) / 32 * 32 + 32;
}

void copy_rows(Device& dev, const cl::Mem& x, uint32_t x_off, uint32_t ldx, const cl::Mem& y,
               uint32_t y_off, uint32_t ldy, uint32_t R, uint32_t width) {
  if (R == 0 || width == 0) return;
  const size_t f = sizeof(float);
  const size_t src_origin[3] = {x_off * f, 0, 0}, dst_origin[3] = {y_off * f, 0, 0};
  const size_t region[3] = {width * f, R, 1};
  cl::check(clEnqueueCopyBufferRect(dev.queue(), x.get(), y.get(), src_origin, dst_origin, region,
                                    ldx * f, 0, ldy * f, 0, 0, nullptr, nullptr),
            "clEnqueueCopyBufferRect (copy_rows)");
}

void linear_fp8_bf16(Device& dev, const cl::Mem& x, uint32_t x_off, uint32_t ldx, const Weight& w,
                     const Weight& scale_inv, const cl::Mem& y, uint32_t y_off, uint32_t ldy,
                     uint32_t M, float alpha, bool accumulate) {
  if (dev.kernel_shape() != KernelShape::Chunks)
    throw std::invalid_argument("linear_fp8_bf16: '" + w.name +
                                "' needs the CPU kernel shape (the bf16 panels are private memory)");
  check_fp8_weight("linear_fp8_bf16", w, scale_inv);
  if (M == 0) return;
  gemm_bf16(dev, x, x_off, ldx, {&w}, false, nullptr, y, y_off, ldy, M, alpha, accumulate,
            &scale_inv);
}

void linear(Device& dev, const cl::Mem& x, uint32_t x_off, uint32_t ldx, const Weight& w,
            const Weight* bias, const cl::Mem& y, uint32_t y_off, uint32_t ldy, uint32_t M,
            float alpha, bool accumulate, ComputeDType compute) {
  const uint32_t N = uint32_t(w.dim(0)), K = uint32_t(w.dim(1));
  const uint32_t ldw = uint32_t(w.row_stride());
  const int has_bias = bias != nullptr;
  if (bf16_gemm(dev, compute, M, {&w}) && (!bias || bias->dtype == DType::BF16)) {
    if (dev.kernel_shape() == KernelShape::Chunks) {
      gemm_bf16(dev, x, x_off, ldx, {&w}, false, bias, y, y_off, ldy, M, alpha, accumulate);
      return;
    }
    // Work-group devices: the rounded rows through the f32 kernel (bf16 products are exact in f32).
    Scratch xr(dev, size_t(M) * K * 4);
    round_bf16(dev, x, x_off, ldx, M, K, xr.mem(), K, true);
    linear(dev, xr.mem(), 0, K, w, bias, y, y_off, ldy, M, alpha, accumulate);
    return;
  }
  if (compute == ComputeDType::F32 &&
      (gemm_f32_amx_terms(dev, x, x_off, ldx, {&w}, false, bias, y, y_off, ldy, M, alpha,
                          accumulate) ||
       packed_f32_rows(dev, x, x_off, ldx, {&w}, false, bias, y, y_off, ldy, M, alpha, accumulate)))
    return;
  if (blas_linear_applies(dev, M, w, bias)) {
    blas_linear(dev, x, x_off, ldx, w, y, y_off, ldy, M, alpha, accumulate);
    return;
  }
  if (dev.kernel_shape() == KernelShape::WorkGroups) {
    const uint32_t wg = dev.tuning().linear_wg, rb = wg_linear_rows(dev, M);
    cl::Kernel k = dev.kernel("linear_wg.cl", "linear_wg",
                              weight_option(w) + " -DWG=" + std::to_string(wg) +
                                  " -DRB=" + std::to_string(rb) +
                                  wg_vector_options(dev, x, x_off, ldx, {&w}));
    cl::set_args(k, x, x_off, ldx, w.mem, uint32_t(w.offset), ldw, has_bias ? bias->mem : w.mem,
                 uint32_t(has_bias ? bias->offset : 0), has_bias, y, y_off, ldy, M, N, K, alpha,
                 int(accumulate));
    const size_t local[3] = {wg, 1, 1};
    dev.launch(k, {size_t(N) * wg, (M + rb - 1) / rb, 1}, 2, local);
    return;
  }
  const LinearBlocks b = linear_blocks(dev, M, N, 4);
  cl::Kernel k = dev.kernel("linear.cl", "linear",
                            weight_option(w) + tile_options(dev, b, 4, columns_in_turn(dev, M, K)));
  cl::set_args(k, x, x_off, ldx, w.mem, uint32_t(w.offset), ldw, has_bias ? bias->mem : w.mem,
               uint32_t(has_bias ? bias->offset : 0), has_bias, y, y_off, ldy, M, N, K, alpha,
               int(accumulate), b.n_tiles, b.m_rows);
  dev.launch(k, {b.col_blocks, b.row_blocks, 1}, 2);
}

namespace {

// Checks that the weights of one fused launch agree in K and dtype; returns K.
uint32_t common_k(const std::vector<const Weight*>& ws, const char* op) {
  for (const Weight* w : ws)
    if (w->dim(1) != ws[0]->dim(1) || w->dtype != ws[0]->dtype)
      throw std::invalid_argument(std::string(op) + ": weight '" + w->name + "' is [" +
                                  std::to_string(w->dim(0)) + ", " + std::to_string(w->dim(1)) +
                                  "] " + dtype_name(w->dtype) + ", '" + ws[0]->name + "' [" +
                                  std::to_string(ws[0]->dim(0)) + ", " +
                                  std::to_string(ws[0]->dim(1)) + "] " +
                                  dtype_name(ws[0]->dtype) + ": one launch needs one K and dtype");
  return uint32_t(ws[0]->dim(1));
}

// linear_fused's kernel over `ws` (1 to 3 weights; with glu, gate and up), or for bf16 weights
// AMX's with the rows as bf16 terms (gemm_f32_amx_terms, from gemm_f32_amx_rows rows) or from
// gemm_bf16_packed_rows rows the packed GEMM (packed_f32_rows).
void launch_fused(Device& dev, const cl::Mem& x, uint32_t x_off, uint32_t ldx,
                  const std::vector<const Weight*>& ws, bool glu, const cl::Mem& y, uint32_t y_off,
                  uint32_t ldy, uint32_t M, float alpha, bool accumulate) {
  const uint32_t K = common_k(ws, glu ? "linear_swiglu" : "linear_fused");
  if (gemm_f32_amx_terms(dev, x, x_off, ldx, ws, glu, nullptr, y, y_off, ldy, M, alpha,
                         accumulate) ||
      packed_f32_rows(dev, x, x_off, ldx, ws, glu, nullptr, y, y_off, ldy, M, alpha, accumulate))
    return;
  uint32_t N = 0;
  uint32_t ends[3] = {0, 0, 0};
  for (size_t i = 0; i < ws.size(); ++i) {
    if (!glu) N += uint32_t(ws[i]->dim(0));
    ends[i] = N;
  }
  if (glu) N = uint32_t(ws[0]->dim(0));
  // TN = 4 dot products per row, with glu gate/up pairs; columns in turn, glu reads one gate row
  // then its up row (two runs side by side would halve the stream rate, see linear.cl).
  const bool in_turn = columns_in_turn(dev, M, K);
  const uint32_t tn = glu && in_turn ? 2 : 4, tile_cols = glu ? tn / 2 : tn;
  const LinearBlocks b = linear_blocks(dev, M, N, tile_cols);
  std::string opts = weight_option(*ws[0]) + tile_options(dev, b, tn, in_turn);
  if (glu) opts += " -DGLU=1";
  cl::Kernel k = dev.kernel("linear.cl", "linear_fused", opts);
  const Weight& w0 = *ws[0];
  const Weight& w1 = *ws[std::min<size_t>(1, ws.size() - 1)];
  const Weight& w2 = *ws[std::min<size_t>(2, ws.size() - 1)];
  const uint32_t n1 = ws.size() > 1 ? ends[0] : N, n2 = ws.size() > 2 ? ends[1] : N;
  cl::set_args(k, x, x_off, ldx, w0.mem, uint32_t(w0.offset),
               uint32_t(w0.row_stride()), n1, w1.mem, uint32_t(w1.offset),
               uint32_t(w1.row_stride()), n2, w2.mem, uint32_t(w2.offset),
               uint32_t(w2.row_stride()), y, y_off, ldy, M, N, K, alpha, int(accumulate),
               b.n_tiles, b.m_rows);
  dev.launch(k, {b.col_blocks, b.row_blocks, 1}, 2);
}

// linear_wg.cl's linear_fused_wg over `ws` (1 to 3 weights side by side; with glu, gate and up
// and silu(gate) * up stored): one launch where separate linear_wg launches (and silu_mul) would
// take three or four, with the same bits. At bf16 compute the rows are rounded first, as
// ops::linear's GPU shape does.
void launch_fused_wg(Device& dev, ComputeDType compute, const cl::Mem& x_in, uint32_t x_off,
                     uint32_t ldx, const std::vector<const Weight*>& ws, bool glu,
                     const cl::Mem& y, uint32_t y_off, uint32_t ldy, uint32_t M, float alpha,
                     bool accumulate) {
  const uint32_t K = common_k(ws, glu ? "linear_swiglu" : "linear_fused");
  const cl::Mem* x = &x_in;
  Scratch rounded;
  if (bf16_gemm(dev, compute, M, ws)) {
    rounded = Scratch(dev, size_t(M) * K * 4);
    round_bf16(dev, x_in, x_off, ldx, M, K, rounded.mem(), K, true);
    x = &rounded.mem();
    x_off = 0;
    ldx = K;
  }
  uint32_t N = 0, ends[3] = {0, 0, 0};
  for (size_t i = 0; i < ws.size(); ++i) {
    N += uint32_t(ws[i]->dim(0));
    ends[i] = N;
  }
  if (glu) N = uint32_t(ws[0]->dim(0));
  const uint32_t wg = dev.tuning().linear_wg, rb = wg_linear_rows(dev, M);
  cl::Kernel k = dev.kernel("linear_wg.cl", "linear_fused_wg",
                            weight_option(*ws[0]) + " -DWG=" + std::to_string(wg) +
                                " -DRB=" + std::to_string(rb) + (glu ? " -DGLU=1" : "") +
                                wg_vector_options(dev, *x, x_off, ldx, ws));
  const Weight& w0 = *ws[0];
  const Weight& w1 = *ws[std::min<size_t>(1, ws.size() - 1)];
  const Weight& w2 = *ws[std::min<size_t>(2, ws.size() - 1)];
  const uint32_t n1 = ws.size() > 1 ? ends[0] : N, n2 = ws.size() > 2 ? ends[1] : N;
  cl::set_args(k, *x, x_off, ldx, w0.mem, uint32_t(w0.offset), uint32_t(w0.row_stride()), n1,
               w1.mem, uint32_t(w1.offset), uint32_t(w1.row_stride()), n2, w2.mem,
               uint32_t(w2.offset), uint32_t(w2.row_stride()), y, y_off, ldy, M, N, K, alpha,
               int(accumulate));
  const size_t local[3] = {wg, 1, 1};
  dev.launch(k, {size_t(N) * wg, (M + rb - 1) / rb, 1}, 2, local);
}

// Whether every weight's GEMM goes to CLBlast (ops_blas.h): the GPU shape's prefill.
bool all_blas(const Device& dev, uint32_t M, const std::vector<const Weight*>& ws) {
  for (const Weight* w : ws)
    if (!blas_linear_applies(dev, M, *w, nullptr)) return false;
  return true;
}

// The rows a fused GEMM reads: x as given, or with a norm its RMSNorm (over `rows` of x where
// given) in `scratch`. The norm is a launch of its own in every shape: folded into the CPU
// shape's decode tiles (x times the norm weight in the dot product, 1/rms at the end) it made the
// GEMV slower by far more than a launch costs. On the 2-core EPYC, folded against apart: q/k/v of
// llama3-1b (3072 x 2048, bf16) 1.19-1.36x slower at 1-3 rows and dsv3-mini's q_b (3072 x 768)
// 1.27-1.33x (in-process A/B, 41 pairs each); gate/up slower in 8 of 9 pairs of
// bench_decode_breakdown (22-33 ms against 18-27 ms a step). Decode and prefill now normalise a
// row with the same launch (prefill had the norm apart already).
// Where the CPU shape's bf16-compute GEMM follows (bf16_rows), the norm writes the rows rounded
// to bf16 in round_bf16's layout, so that no round_bf16 launch comes between (rounded), with the
// same bits. llama3-1b's decode step had 65 of those launches, 33 after a norm; all 65 skipped
// (a throwaway switch, timing only) made the step 1.017x faster in fast bandwidth phases (median
// of 16 runs of 20 rounds in turn) and 1.005x in slow ones. These 33 (bench_decode_breakdown
// --compute-dtype bf16, A/B in turn, 30 runs of 20 rounds): 1.006x in fast phases (13 runs at 51-59
// ms a step), 1.005x in slow ones (17 at 74-79 ms); the 512-token prefill 196 -> 163 launches,
// round_bf16's time 24.4 -> 17.1 ms of about 2480.
// norm.cl's rmsnorm on the CPU shape (ops::rmsnorm's), with out_bf16 its rows rounded to bf16 in
// round_bf16's layout (y's row stride ldy in bf16 elements).
void rmsnorm_chunks(Device& dev, const cl::Mem& x, uint32_t x_off, uint32_t ldx,
                    const cl::Mem* rows, const Weight& w, const cl::Mem& y, uint32_t y_off,
                    uint32_t ldy, uint32_t R, uint32_t H, float eps, bool out_bf16) {
  cl::Kernel k =
      dev.kernel("norm.cl", "rmsnorm", weight_option(w) + (out_bf16 ? " -DOUT_BF16=1" : ""));
  cl::set_args(k, x, x_off, ldx, rows ? *rows : x, int(rows != nullptr), w.mem, y, y_off, ldy, H,
               eps);
  dev.launch(k, {R, 1, 1}, 1);
}

struct GemmInput {
  const cl::Mem* x;
  uint32_t off, ld;
  bool rounded = false;
};
GemmInput gemm_input(Device& dev, const cl::Mem& x, uint32_t x_off, uint32_t ldx,
                     const cl::Mem* rows, const Weight* norm, float eps, uint32_t M, uint32_t K,
                     Scratch& scratch, bool bf16_rows = false) {
  if (!norm) return {&x, x_off, ldx};
  if (bf16_rows) {
    const uint32_t ldxb = bf16_gemm_row_stride(K);
    scratch = Scratch(dev, size_t(M) * ldxb * 2);
    rmsnorm_chunks(dev, x, x_off, ldx, rows, *norm, scratch.mem(), 0, ldxb, M, K, eps, true);
    return {&scratch.mem(), 0, ldxb, true};
  }
  scratch = Scratch(dev, size_t(M) * K * 4);
  rmsnorm(dev, x, x_off, ldx, rows, *norm, scratch.mem(), 0, K, M, K, eps);
  return {&scratch.mem(), 0, K};
}

// Whether a fused op over `ws` at `compute` runs gemm_bf16 on rows it may take rounded (GemmInput).
bool bf16_gemm_rows(Device& dev, ComputeDType compute, uint32_t M,
                    const std::vector<const Weight*>& ws) {
  return bf16_gemm(dev, compute, M, ws) && dev.kernel_shape() == KernelShape::Chunks &&
         !amx_stream_gemm(dev, ws, nullptr, nullptr, M);
}

}  // namespace

void linear_fused(Device& dev, const cl::Mem& x, uint32_t x_off, uint32_t ldx,
                  const cl::Mem* rows, const Weight* norm, float eps,
                  const std::vector<const Weight*>& weights, const cl::Mem& y, uint32_t y_off,
                  uint32_t ldy, uint32_t M, float alpha, bool accumulate, ComputeDType compute) {
  if (weights.empty() || weights.size() > 3)
    throw std::invalid_argument("linear_fused takes 1 to 3 weights, got " +
                                std::to_string(weights.size()));
  if (rows && !norm)
    throw std::invalid_argument("linear_fused: a row gather needs the norm, which gathers them");
  if (M == 0) return;
  const uint32_t K = common_k(weights, "linear_fused");
  Scratch normed;
  const bool bf16_rows = bf16_gemm_rows(dev, compute, M, weights);
  const GemmInput in = gemm_input(dev, x, x_off, ldx, rows, norm, eps, M, K, normed, bf16_rows);
  if (bf16_gemm(dev, compute, M, weights) && dev.kernel_shape() == KernelShape::Chunks) {
    gemm_bf16(dev, *in.x, in.off, in.ld, weights, false, nullptr, y, y_off, ldy, M, alpha,
              accumulate, nullptr, in.rounded);
    return;
  }
  if (dev.kernel_shape() == KernelShape::WorkGroups) {
    // The weights side by side in one launch, or one CLBlast GEMM each where they take that route.
    if (!all_blas(dev, M, weights)) {
      launch_fused_wg(dev, compute, *in.x, in.off, in.ld, weights, false, y, y_off, ldy, M, alpha,
                      accumulate);
      return;
    }
    uint32_t col = y_off;
    for (const Weight* w : weights) {
      linear(dev, *in.x, in.off, in.ld, *w, nullptr, y, col, ldy, M, alpha, accumulate, compute);
      col += uint32_t(w->dim(0));
    }
    return;
  }
  launch_fused(dev, *in.x, in.off, in.ld, weights, false, y, y_off, ldy, M, alpha, accumulate);
}

void linear_swiglu(Device& dev, const cl::Mem& x, uint32_t x_off, uint32_t ldx, const Weight* norm,
                   float eps, const Weight& gate, const Weight& up, const cl::Mem& y,
                   uint32_t y_off, uint32_t ldy, uint32_t M, ComputeDType compute) {
  if (gate.dim(0) != up.dim(0))
    throw std::invalid_argument("linear_swiglu: gate '" + gate.name + "' has " +
                                std::to_string(gate.dim(0)) + " rows, up '" + up.name + "' " +
                                std::to_string(up.dim(0)));
  if (M == 0) return;
  const uint32_t K = common_k({&gate, &up}, "linear_swiglu"), F = uint32_t(gate.dim(0));
  Scratch normed;
  const bool bf16_rows = bf16_gemm_rows(dev, compute, M, {&gate, &up});
  const GemmInput in = gemm_input(dev, x, x_off, ldx, nullptr, norm, eps, M, K, normed, bf16_rows);
  if (bf16_gemm(dev, compute, M, {&gate, &up}) && dev.kernel_shape() == KernelShape::Chunks) {
    gemm_bf16(dev, *in.x, in.off, in.ld, {&gate, &up}, true, nullptr, y, y_off, ldy, M, 1.0f, false,
              nullptr, in.rounded);
    return;
  }
  if (dev.kernel_shape() == KernelShape::WorkGroups) {
    if (!all_blas(dev, M, {&gate, &up})) {  // gate, up and SwiGLU in one launch
      launch_fused_wg(dev, compute, *in.x, in.off, in.ld, {&gate, &up}, true, y, y_off, ldy, M,
                      1.0f, false);
      return;
    }
    Scratch gu(dev, size_t(M) * 2 * F * 4);
    linear(dev, *in.x, in.off, in.ld, gate, nullptr, gu.mem(), 0, 2 * F, M, 1.0f, false, compute);
    linear(dev, *in.x, in.off, in.ld, up, nullptr, gu.mem(), F, 2 * F, M, 1.0f, false, compute);
    Scratch out(dev, size_t(M) * F * 4);
    silu_mul(dev, gu.mem(), 0, 2 * F, gu.mem(), F, 2 * F, out.mem(), F, M, F);
    copy_rows(dev, out.mem(), 0, F, y, y_off, ldy, M, F);
    return;
  }
  launch_fused(dev, *in.x, in.off, in.ld, {&gate, &up}, true, y, y_off, ldy, M, 1.0f, false);
}

void rmsnorm(Device& dev, const cl::Mem& x, uint32_t x_off, uint32_t ldx, const cl::Mem* rows,
             const Weight& w, const cl::Mem& y, uint32_t y_off, uint32_t ldy, uint32_t R,
             uint32_t H, float eps) {
  const int use_rows = rows != nullptr;
  if (dev.kernel_shape() == KernelShape::WorkGroups) {
    const size_t wg = dev.tuning().norm_wg;
    cl::Kernel k = dev.kernel("norm.cl", "rmsnorm_wg",
                              weight_option(w) + " -DNORM_WG=" + std::to_string(wg));
    cl::set_args(k, x, x_off, ldx, use_rows ? *rows : x, use_rows, w.mem, y, y_off, ldy, H, eps);
    dev.launch(k, {R * wg, 1, 1}, 1, &wg);
    return;
  }
  rmsnorm_chunks(dev, x, x_off, ldx, rows, w, y, y_off, ldy, R, H, eps, false);
}

void embedding(Device& dev, const cl::Mem& tokens, uint32_t T, const Weight& table,
               const cl::Mem& y, float multiplier, uint32_t vocab_begin) {
  if (dev.kernel_shape() == KernelShape::WorkGroups) {
    const size_t wg = dev.tuning().row_wg;
    cl::Kernel k = dev.kernel("embedding.cl", "embedding_wg",
                              weight_option(table) + " -DROW_WG=" + std::to_string(wg));
    cl::set_args(k, tokens, table.mem, y, uint32_t(table.dim(1)), vocab_begin,
                 uint32_t(table.dim(0)), multiplier);
    dev.launch(k, {T * wg, 1, 1}, 1, &wg);
    return;
  }
  cl::Kernel k = dev.kernel("embedding.cl", "embedding", weight_option(table));
  cl::set_args(k, tokens, table.mem, y, uint32_t(table.dim(1)), vocab_begin,
               uint32_t(table.dim(0)), multiplier);
  dev.launch(k, {T, 1, 1}, 1);
}

void silu_mul(Device& dev, const cl::Mem& gate, uint32_t gate_off, uint32_t ldg, const cl::Mem& up,
              uint32_t up_off, uint32_t ldu, const cl::Mem& y, uint32_t ldy, uint32_t T,
              uint32_t F) {
  if (dev.kernel_shape() == KernelShape::WorkGroups) {
    const size_t wg = dev.tuning().row_wg;
    cl::Kernel k = dev.kernel("activation.cl", "silu_mul_wg", "-DROW_WG=" + std::to_string(wg));
    cl::set_args(k, gate, gate_off, ldg, up, up_off, ldu, y, ldy, F);
    const size_t local[3] = {wg, 1, 1};
    dev.launch(k, {(F + wg - 1) / wg * wg, T, 1}, 2, local);
    return;
  }
  constexpr uint32_t chunk = 256;  // CHUNK in activation.cl
  cl::Kernel k = dev.kernel("activation.cl", "silu_mul");
  cl::set_args(k, gate, gate_off, ldg, up, up_off, ldu, y, ldy, F);
  dev.launch(k, {T, (F + chunk - 1) / chunk, 1}, 2);
}

void axpy(Device& dev, const cl::Mem& y, const cl::Mem& x, float alpha, uint32_t n) {
  constexpr uint32_t chunk = 4096;  // CHUNK in elementwise.cl
  cl::Kernel k = dev.kernel("elementwise.cl", "axpy");
  cl::set_args(k, y, x, alpha, n);
  dev.launch(k, {(n + chunk - 1) / chunk, 1, 1}, 1);
}

std::string cache_type_option(DType dtype) {
  switch (dtype) {
    case DType::F32: return "";
    case DType::BF16: return " -DCACHE_TYPE=1";
    case DType::F8_E4M3: return " -DCACHE_TYPE=2";
    default:
      throw std::invalid_argument(std::string("a KV cache holds F32, BF16 or F8_E4M3 elements, not ") +
                                  dtype_name(dtype));
  }
}

void rope_store_kv(Device& dev, const cl::Mem& qkv, uint32_t ld, uint32_t n_heads,
                   uint32_t n_kv_heads, uint32_t head_dim, const cl::Mem& inv_freq,
                   const cl::Mem& inv_freq_long, uint32_t long_from, const StepTokens& st,
                   const cl::Mem& cache_layer, DType cache_dtype) {
  const bool wg_shape = dev.kernel_shape() == KernelShape::WorkGroups;
  const size_t wg = dev.tuning().rope_wg;
  const std::string ct = cache_type_option(cache_dtype);
  cl::Kernel k = wg_shape ? dev.kernel("rope.cl", "rope_store_kv_wg",
                                       "-DROPE_WG=" + std::to_string(wg) + ct)
                          : dev.kernel("rope.cl", "rope_store_kv", ct);
  cl::set_args(k, qkv, ld, n_heads, n_kv_heads, head_dim, inv_freq, inv_freq_long, long_from,
               st.token_row, st.token_pos, st.lookup, st.pages_per_row, st.page_size,
               cache_layer);
  if (wg_shape)
    dev.launch(k, {st.T * wg, 1, 1}, 1, &wg);
  else
    dev.launch(k, {st.T, 1, 1}, 1);
}

namespace {

uint64_t local_mem_bytes(const Device& dev) {
  cl_ulong bytes = 0;
  cl::check(clGetDeviceInfo(dev.id(), CL_DEVICE_LOCAL_MEM_SIZE, sizeof(bytes), &bytes, nullptr),
            "clGetDeviceInfo(CL_DEVICE_LOCAL_MEM_SIZE)");
  return bytes;
}

}  // namespace

void paged_attention(Device& dev, const cl::Mem& q, uint32_t ldq, const cl::Mem& cache_layer,
                     const StepTokens& st, uint32_t n_heads, uint32_t n_kv_heads, uint32_t head_dim,
                     float scale, const cl::Mem& out, uint32_t ldo, DType cache_dtype,
                     ComputeDType compute) {
  if (head_dim % 8 != 0)
    throw std::runtime_error("paged_attention: head_dim " + std::to_string(head_dim) +
                             " is not a multiple of 8");
  // rope.cl's cache: [page][K, V][slot][kv head][head_dim].
  const uint32_t kv_row = n_kv_heads * head_dim;
  PagedKvLayout lay;
  lay.page_stride = uint64_t(2) * st.page_size * kv_row;
  lay.slot_stride = kv_row;
  lay.v_off = st.page_size * kv_row;
  lay.kv_head_stride = head_dim;
  lay.heads_per_kv = n_heads / n_kv_heads;
  lay.dk = lay.dv = head_dim;
  lay.cache_dtype = cache_dtype;
  if (dev.kernel_shape() != KernelShape::WorkGroups || st.max_query_len > kPrefillAttentionFrom) {
    paged_attention_prefill(dev, q, 0, ldq, head_dim, cache_layer, st, n_heads, lay, nullptr, scale,
                            out, ldo, head_dim, compute);
    return;
  }
  const KernelTuning& tu = dev.tuning();
  lay.wg = tu.attn_wg;
  lay.tile = tu.attn_tile;
  lay.max_heads = tu.attn_heads;
  paged_attention_split_k(dev, q, ldq, head_dim, cache_layer, st, n_heads, lay, scale, out, ldo,
                          head_dim);
}

bool attention_bf16(const Device& dev, ComputeDType compute) {
  return compute == ComputeDType::BF16 && dev.kernel_shape() == KernelShape::Chunks &&
         bf16_dot_product(dev);
}

namespace {

// Query rows (token, head) per work-item of attention.cl's tiles: at most 16, which its softmax
// takes as one vector per block (softmax_rows16). Against 8 (each measured in-process against the
// former kernel, 7-9 pairs, on the 2-core EPYC): llama3-1b's 512-token prefill attention 1.21x,
// dsv3-mini's 512-token MLA prefill attention 1.17x, its 64-token one 0.87x.
constexpr uint32_t kAttentionTileRows = 16;

// The CPU shape of paged_attention_prefill: attention.cl's paged_attention_tiles, up to 4 query
// heads of one KV head per work-item (one with MLA's decompressed keys, which differ per head)
// and kAttentionTileRows / heads tokens.
void paged_attention_tiles(Device& dev, const cl::Mem& q, uint32_t q_off, uint32_t q_ldt,
                           uint32_t q_ldh, const cl::Mem& cache_layer, const StepTokens& st,
                           uint32_t n_heads, const PagedKvLayout& lay, const DecompressedKv* dense,
                           float scale, const cl::Mem& out, uint32_t o_ldt, uint32_t o_ldh,
                           bool bf16) {
  const uint32_t nope = dense ? dense->nope : 0;
  if (nope % 8 != 0 || (lay.dk - nope) % 8 != 0 || lay.dv % 8 != 0)
    throw std::invalid_argument("paged_attention_prefill: the CPU shape needs keys (" +
                                std::to_string(nope) + " + " + std::to_string(lay.dk - nope) +
                                ") and values (" + std::to_string(lay.dv) +
                                ") in multiples of 8 floats");
  uint32_t gh = dense ? 1 : std::min<uint32_t>(4, lay.heads_per_kv);
  while (lay.heads_per_kv % gh != 0) --gh;
  const uint32_t tq = std::max<uint32_t>(1, kAttentionTileRows / gh);
  cl::Kernel k =
      dev.kernel("attention.cl", "paged_attention_tiles",
                 "-DAT_TQ=" + std::to_string(tq) + " -DAT_GH=" + std::to_string(gh) +
                     " -DAT_DK=" + std::to_string(lay.dk) + " -DAT_DV=" + std::to_string(lay.dv) +
                     " -DAT_NOPE=" + std::to_string(nope) + cache_type_option(lay.cache_dtype) +
                     (bf16 ? " -DAT_BF16=1" : "") + weight_prefetch_option(dev));
  cl::set_args(k, q, q_off, q_ldt, q_ldh, cache_layer, lay.page_stride, lay.slot_stride, lay.k_off,
               lay.v_off, lay.kv_head_stride, lay.heads_per_kv, dense ? *dense->kv : out,
               dense ? dense->ldkv : 0u, dense ? dense->head_ld : 0u,
               dense ? *dense->ctx_start : st.token_row, st.token_row, st.token_pos, st.lookup,
               st.pages_per_row, st.page_size, st.T, scale, out, o_ldt, o_ldh);
  dev.launch(k, {size_t((st.T + tq - 1) / tq), n_heads / gh, 1}, 2);
}

}  // namespace

void paged_attention_prefill(Device& dev, const cl::Mem& q, uint32_t q_off, uint32_t q_ldt,
                             uint32_t q_ldh, const cl::Mem& cache_layer, const StepTokens& st,
                             uint32_t n_heads, const PagedKvLayout& lay,
                             const DecompressedKv* dense, float scale, const cl::Mem& out,
                             uint32_t o_ldt, uint32_t o_ldh, ComputeDType compute) {
  if (st.T == 0 || n_heads == 0) return;
  if (dev.kernel_shape() != KernelShape::WorkGroups) {
    paged_attention_tiles(dev, q, q_off, q_ldt, q_ldh, cache_layer, st, n_heads, lay, dense, scale,
                          out, o_ldt, o_ldh, attention_bf16(dev, compute));
    return;
  }
  if (lay.dk % 2 != 0 || lay.dv % 2 != 0)
    throw std::invalid_argument("paged_attention_prefill: key width " + std::to_string(lay.dk) +
                                " and value width " + std::to_string(lay.dv) + " must be even");
  const KernelTuning& tu = dev.tuning();
  // Heads per group: the largest count up to prefill_heads dividing the heads of one KV head
  // (one with MLA's decompressed keys, which differ per head).
  uint32_t gh = dense ? 1 : std::max<uint32_t>(1, std::min(tu.prefill_heads, lay.heads_per_kv));
  while (lay.heads_per_kv % gh != 0) --gh;
  uint32_t qt = std::max<uint32_t>(1, tu.prefill_q), kt = std::max<uint32_t>(1, tu.prefill_tile);
  // The kernel's local arrays (floats; see attention.cl), halving the query tile, then the KV
  // tile, then the head group until they fit the device's local memory.
  auto local_bytes = [&](uint64_t qt_, uint64_t kt_, uint64_t gh_) {
    const uint64_t r = qt_ * gh_;
    return 4 * (r * (lay.dk + 1) + kt_ * (lay.dk + 1) + kt_ * lay.dv + r * kt_ + 3 * r + qt_);
  };
  const uint64_t avail = local_mem_bytes(dev);
  while (local_bytes(qt, kt, gh) > avail && qt > 1) qt /= 2;
  while (local_bytes(qt, kt, gh) > avail && kt > 1) kt /= 2;
  while (local_bytes(qt, kt, gh) > avail && gh > 1)
    for (--gh; lay.heads_per_kv % gh != 0;) --gh;
  if (local_bytes(qt, kt, gh) > avail)
    throw std::runtime_error("paged_attention_prefill: keys of " + std::to_string(lay.dk) +
                             " and values of " + std::to_string(lay.dv) + " floats need " +
                             std::to_string(local_bytes(qt, kt, gh)) + " bytes of local memory, " +
                             dev.label() + " has " + std::to_string(avail));
  const uint32_t wg = tu.prefill_wg;
  cl::Kernel k = dev.kernel(
      "attention.cl", "paged_attention_prefill_wg",
      "-DPF_WG=" + std::to_string(wg) + " -DPF_DK=" + std::to_string(lay.dk) +
          " -DPF_DV=" + std::to_string(lay.dv) + " -DPF_QT=" + std::to_string(qt) +
          " -DPF_GH=" + std::to_string(gh) + " -DPF_KT=" + std::to_string(kt) +
          " -DPF_NOPE=" + std::to_string(dense ? dense->nope : 0) +
          cache_type_option(lay.cache_dtype));
  cl::set_args(k, q, q_off, q_ldt, q_ldh, cache_layer, lay.page_stride, lay.slot_stride,
               lay.k_off, lay.v_off, lay.kv_head_stride, lay.heads_per_kv,
               dense ? *dense->kv : out,
               dense ? dense->ldkv : 0u, dense ? dense->head_ld : 0u,
               dense ? *dense->ctx_start : st.token_row, st.token_row, st.token_pos, st.lookup,
               st.pages_per_row, st.page_size, st.T, scale, out, o_ldt, o_ldh);
  const size_t local[3] = {wg, 1, 1};
  dev.launch(k, {size_t((st.T + qt - 1) / qt) * wg, n_heads / gh, 1}, 2, local);
}

void paged_attention_split_k(Device& dev, const cl::Mem& q, uint32_t q_ldt, uint32_t q_ldh,
                             const cl::Mem& cache_layer, const StepTokens& st, uint32_t n_heads,
                             const PagedKvLayout& lay, float scale, const cl::Mem& out,
                             uint32_t o_ldt, uint32_t o_ldh) {
  if (st.T == 0 || n_heads == 0) return;
  const KernelTuning& tu = dev.tuning();
  // Heads per work-group: the largest count up to max_heads that divides the heads sharing a KV
  // head, so a group never straddles two.
  uint32_t g = std::max<uint32_t>(1, std::min(lay.max_heads, lay.heads_per_kv));
  while (lay.heads_per_kv % g != 0) --g;
  // Splits: the longest context a row can hold (its page table) in split_len pieces, fewer when
  // the partials of T x heads x splits would pass the scratch cap.
  const uint32_t tile = lay.tile;
  const uint64_t capacity = uint64_t(st.pages_per_row) * st.page_size;
  auto round_tile = [&](uint64_t n) { return (n + tile - 1) / tile * tile; };
  uint64_t split_len = round_tile(std::max<uint64_t>(tu.attn_split, tile));
  uint64_t n_splits = std::max<uint64_t>(1, (capacity + split_len - 1) / split_len);
  const uint64_t per_split = uint64_t(st.T) * n_heads * (lay.dv + 2) * sizeof(float);
  const uint64_t max_splits = std::max<uint64_t>(1, tu.split_scratch_bytes / per_split);
  if (n_splits > max_splits) {
    n_splits = max_splits;
    split_len = round_tile((capacity + n_splits - 1) / n_splits);
    n_splits = std::max<uint64_t>(1, (capacity + split_len - 1) / split_len);
  }
  const std::string opts = "-DATT_WG=" + std::to_string(lay.wg) + " -DDK=" + std::to_string(lay.dk) +
                           " -DDV=" + std::to_string(lay.dv) + " -DG=" + std::to_string(g) +
                           " -DTILE=" + std::to_string(tile) + " -DV_IN_K=" +
                           std::to_string(int(lay.v_in_k)) + cache_type_option(lay.cache_dtype);
  cl::Kernel k = dev.kernel("attention.cl", "paged_attention_wg", opts);
  Scratch part, part_ml;
  if (n_splits > 1) {
    part = Scratch(dev, per_split / (lay.dv + 2) * lay.dv * n_splits);
    part_ml = Scratch(dev, per_split / (lay.dv + 2) * 2 * n_splits);
  }
  const cl::Mem& pa = n_splits > 1 ? part.mem() : out;
  const cl::Mem& pm = n_splits > 1 ? part_ml.mem() : out;
  cl::set_args(k, q, q_ldt, q_ldh, cache_layer, lay.page_stride, lay.slot_stride, lay.k_off,
               lay.v_off, lay.kv_head_stride, lay.heads_per_kv, st.token_row, st.token_pos,
               st.lookup, st.pages_per_row, st.page_size, n_heads, scale, uint32_t(split_len),
               uint32_t(n_splits), out, o_ldt, o_ldh, pa, pm);
  const size_t local[3] = {lay.wg, 1, 1};
  dev.launch(k, {size_t(n_splits) * lay.wg, n_heads / g, st.T}, 3, local);
  if (n_splits == 1) return;
  cl::Kernel merge = dev.kernel("attention.cl", "attention_merge_splits", opts);
  cl::set_args(merge, pa, pm, st.token_pos, uint32_t(split_len), uint32_t(n_splits), n_heads, out,
               o_ldt, o_ldh);
  dev.launch(merge, {lay.wg, n_heads, st.T}, 3, local);
}

}  // namespace clshard::ops
