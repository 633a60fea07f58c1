#include "runtime/ops_moe.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "runtime/device.h"
#include "runtime/ops.h"

namespace clshard {

namespace {

constexpr uint32_t kQuantBlock = 128;  // DeepSeek-V3's weight_block_size [128, 128]
constexpr uint32_t kRowChunk = 256;    // CHUNK in moe.cl

uint32_t ceil_div(uint32_t a, uint32_t b) { return (a + b - 1) / b; }

std::string shape_str(const std::vector<int64_t>& s) {
  std::string r = "[";
  for (size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
  return r + "]";
}

// The rows per column tile from which FP8 4-row tiles decode the column tile's weight rows once
// into a private panel (fp8_tile.cl's Fp8TileCache): ops::linear_fp8's M, the grouped experts'
// average rows per expert. Measured in-process on the 2-core EPYC (bench_fp8, 2048 x 2048): 32
// rows 1.04x, 64 and 512 rows 1.11-1.13x, 8 and 16 rows 0.75-0.9x; dsv3-mini's grouped experts
// at f32 compute 0.92x at 8.9 rows per expert, 1.05-1.10x from 17.7 to 71. Below it the grouped
// experts' tiles read their columns in turn (kFp8InTurnTileRows; ops::linear_fp8's below
// kFp8InTurnRowsBelow).
constexpr uint32_t kFp8PanelRowsFrom = 32;

// The most rows of an FP8 tile in turn (fp8_tile.cl): their x rows, scaled, stay in L1 beside the
// weight stream (4 x 8 KiB at K = 2048; 8 rows had been no faster than 4 at M = 8), and a tile
// of fewer rows (the last of a launch or of an expert) computes only its own
// (fp8_in_turn_sums), so an expert's 2-3 rows decode its weights once. The grouped experts take
// these below kFp8PanelRowsFrom rows per expert, where there had been one-row tiles below 4 rows
// (their 4-row tiles had run 0.6x at 8 tokens) and 4-row tiles from 4 (an expert's 5 rows: two
// 4-row tiles). In turn in one process on the 2-core Xeon with AMX:
// - dsv3-mini fp8's decode (bench_deepseek) with tiles of up to 3 rows: batch 8, against one-row
//   tiles, 99.3 -> 86.8 ms a step (1.14x, 15 rounds); batch 32 (4 rows per expert), against 4-row
//   tiles, 283.6 -> 230.7 (1.24x [1.19, 1.37], 9 rounds); batch 1 0.99x [0.81, 1.16];
// - bench_moe's layer (medians of 5-15), tiles of up to 3 rows: against one-row tiles, 8 tokens
//   1.10x, 16 tokens 1.36x, 1 token 0.96x and 0.84x (its spread about 10%); against 4-row tiles,
//   32 tokens (4 rows per expert) 1.37x, 48 1.59x, 64 1.30x, 96 1.44x, 128 (16 rows) 1.06x,
//   256 (32 rows, the decoded panels there) 0.81x. Up to 4 rows against 4-row tiles: 128 tokens
//   1.36x, 192 (24 rows) 1.22x.
// On the 2-core Zen 4 EPYC (2026-11-30, bench_deepseek, both rules in turn: these tiles and
// linear_fp8's 16-row bound against the rules before them) dsv3-mini fp8's decode at batch 8
// 55.1 -> 51.6 ms a step (1.06x [1.02, 1.09], 11 rounds), at batch 32 197.4 -> 164.5 (1.19x
// [1.17, 1.23], 9 rounds), batch 1 0.99x.
constexpr uint32_t kFp8InTurnTileRows = 4;

// The rows from which ops::linear_fp8 takes 4x4 tiles rather than tiles in turn. Tiles in turn of
// up to 4 rows against 4x4 tiles (bench_fp8, medians of 5-7 in turn, the 2-core Xeon with AMX):
// 2048 x 2048 4 rows 1.17x and 1.21x, 8 rows 1.27x and 1.24x, 12 rows 1.18x, 16 rows 1.12x and
// 1.01x, 24 rows 1.13x; 7168 x 2048 4 rows 1.24x, 8 rows 1.18x, 12 rows 1.33x, 16 rows 1.10x and
// 0.84x, 24 rows 0.87x; 8 x 2048 x 4608 0.99x, 8 x 2048 x 7168 1.17x; 32 rows 0.68x against the
// panels (kFp8PanelRowsFrom). The grouped experts, whose 4-row tiles also end every expert's rows
// with a tile of 1-4, take tiles in turn up to the panels.
constexpr uint32_t kFp8InTurnRowsBelow = 16;

// The plan's buffers and tile shape for `rows` grouped rows over n_experts: 4-row tiles where the
// experts average 4 rows or more (prefill), one-row tiles for decode. A work-item takes up to
// 64 rows of one expert on GPUs (a work-group per output feature and tile there, so smaller tiles
// are more work-groups), up to 256 on CPUs: there a work-item reads (or, for FP8 at bf16
// compute, dequantizes) its column tile's weight rows once for all its rows, and an expert of 65
// to 128 rows (a 512-token prefill over 64 experts averages 64) had been two tiles, the second a
// few rows that read the weights again. In-process A/B on the 2-core EPYC (dsv3-mini's 64 + 1
// experts, 512 tokens, 256 rows against 64, both in moe_grouped_linear's reversed order; 512 ran
// as 256): f32 compute, bf16 experts gate|up 1.01x and down 1.01x, FP8 1.03x and 1.02x; bf16
// compute 1.05x and 1.03x, FP8 1.15x and 1.12x.
ops::GroupedPlan plan_shape(Device& dev, uint32_t rows, uint32_t n_experts) {
  ops::GroupedPlan p;
  p.rows = rows;
  p.n_experts = n_experts;
  p.tm = rows >= 4 * n_experts ? 4 : 1;
  p.rows_per_tile = dev.kernel_shape() == KernelShape::Chunks ? 256 : 64;
  p.max_tiles = ceil_div(rows, p.rows_per_tile) + std::min(rows, n_experts);
  p.expert_offsets = Scratch(dev, (size_t(n_experts) + 1) * 4);
  p.tiles = Scratch(dev, size_t(std::max(p.max_tiles, 1u)) * 2 * 4);
  p.tile_count = Scratch(dev, 4);
  return p;
}

}  // namespace

namespace ops {

// Which e4m3 decode linear_fp8.cl compiles (see there): the shortest one builds f32 denormals and
// needs a device that keeps them; others take the f16 route. CLSHARD_FP8_DECODE=f16 forces the
// latter, so that it can be tested on devices where it would not be chosen.
std::string fp8_decode_option(const Device& dev, float subnormal_share) {
  const auto fp = cl::device_value<cl_device_fp_config>(dev.id(), CL_DEVICE_SINGLE_FP_CONFIG);
  bool denorm = (fp & CL_FP_DENORM) != 0 && (dev.info().kind != DeviceKind::Cpu ||
                                             subnormal_share <= kFp8DenormMaxSubnormalShare);
  if (const char* force = std::getenv("CLSHARD_FP8_DECODE"); force && std::string(force) == "f16")
    denorm = false;
  return denorm ? "-DFP8_DENORM=1" : "-DFP8_DENORM=0";
}

std::string fp8_tile_options(const Device& dev, bool nan_free, bool in_turn, bool panel,
                             uint32_t K) {
  std::string o = std::string(" -DFP8_NAN_WATCH=") + (nan_free ? "0" : "1");
  if (in_turn) o += " -DFP8_XS_MAX=" + std::to_string(ceil_div(dev.tuning().fp8_stream_k, 16) * 16);
  if (panel) o += " -DFP8_PANEL_K=" + std::to_string(ceil_div(K, 16) * 16);
  return o;
}

std::pair<uint32_t, uint32_t> check_fp8_weight(const char* op, const Weight& w,
                                               const Weight& scale_inv) {
  if (w.dtype != DType::F8_E4M3 || w.shape.size() != 2)
    throw std::invalid_argument(std::string(op) + ": weight '" + w.name + "' is " +
                                dtype_name(w.dtype) + " " + shape_str(w.shape) +
                                "; expected a 2-D F8_E4M3 tensor");
  const uint32_t N = uint32_t(w.dim(0)), K = uint32_t(w.dim(1));
  const std::vector<int64_t> want = {ceil_div(N, kQuantBlock), ceil_div(K, kQuantBlock)};
  if (scale_inv.dtype != DType::F32 || scale_inv.shape != want)
    throw std::invalid_argument(std::string(op) + ": scale '" + scale_inv.name + "' of weight '" +
                                w.name + "' is " + dtype_name(scale_inv.dtype) + " " +
                                shape_str(scale_inv.shape) + "; expected F32 " + shape_str(want) +
                                " (one scale per 128x128 block)");
  return {N, K};
}

namespace {

// Whether bf16 compute's FP8 tiles in turn sum in bf16 (fp8_tile.cl's FP8_BF16_DOT): PoCL's CPU
// device on a host with vdpbf16ps, for weights with the short decode (`decode`:
// fp8_decode_option's), whose subnormal codes are few enough to count as 0.
bool fp8_in_turn_bf16_sums(const Device& dev, ComputeDType compute, const std::string& decode) {
  return compute == ComputeDType::BF16 && decode == "-DFP8_DENORM=1" && bf16_dot_product(dev);
}

}  // namespace

std::string fp8_bf16_panel_options(const Device& dev, uint32_t K, Fp8Codes codes) {
  return " -DFP8_BF16_PANEL=1 -DBF16_PANEL_K=" + std::to_string(ceil_div(K, 16) * 16) + " " +
         fp8_decode_option(dev, codes.subnormal_share) +
         fp8_tile_options(dev, codes.nan_free, false);
}

namespace {
// linear_fp8's CPU-shape launch over w ([N0, K], checked by the caller), and over w1 (scale1)
// side by side past w's columns where w1 is given (linear_fp8_pair: the same K, N0 a multiple of
// the tile's 4, the same decode).
void linear_fp8_tiles(Device& dev, const cl::Mem& x, uint32_t x_off, uint32_t ldx, const Weight& w,
                      const Weight& scale_inv, uint32_t N0, uint32_t K, const Weight* w1,
                      const Weight* scale1, const cl::Mem& y, uint32_t y_off, uint32_t ldy,
                      uint32_t M, float alpha, bool accumulate, ComputeDType compute) {
  const uint32_t N = N0 + (w1 ? uint32_t(w1->dim(0)) : 0);
  const bool nan_free = w.fp8_nan_free && (!w1 || w1->fp8_nan_free);
  // Below kFp8InTurnRowsBelow rows (decode, a speculative verify, batched decode) tiles in turn
  // of up to kFp8InTurnTileRows rows, which read their columns in turn (KernelTuning::fp8_stream_k,
  // see linear.cl) and decode each weight vector once for the tile's rows: below 4 rows one tile
  // of all M rows, against one-row tiles per row, in-process A/B on the 2-core EPYC (e4m3 of
  // normal weights) 2 x 2048 x 2048 1.24x, 3 rows 1.11x, 2 x 7168 x 2048 1.15x, 2 x 2048 x 512
  // 1.22x, 2 x 2048 x 7168 (past the then stream bound, 4096) 1.28x, 3 x 512 x 2048 1.03x; the same
  // bits. From there 4x4 tiles, which read four weight rows side by side, over decoded panels
  // from kFp8PanelRowsFrom rows.
  const bool in_turn = M < kFp8InTurnRowsBelow && K <= ops::in_turn_max_k(dev, w.dtype);
  const uint32_t tm = in_turn ? std::min(M, kFp8InTurnTileRows) : 4, tn = 4;
  const std::string decode = fp8_decode_option(dev, w.fp8_subnormal_share);
  // bf16 compute's tiles in turn take vdpbf16ps (fp8_tile.cl's fp8_in_turn_sums_bf16), for the
  // weights with the short decode. Against the f32 tiles on the 2-core Zen 4 EPYC (bench_fp8,
  // medians of 5 interleaved): 4 x 2048 x 2048 221 us against 358 (1.62x), 8 x 2048 x 2048
  // 367-378 against 626-654 (1.66-1.78x), 8 x 512 x 2048 122 against 181 (1.49x), 8 x 7168 x 2048
  // 1.30 ms against 2.25 (1.74x); dsv3-mini fp8's decode at batch 8 and bf16 compute 53.2 -> 47.9
  // ms a step (bench_deepseek, 9 rounds in turn, 1.11x [1.09, 1.14]).
  // Below kGemmRowsFrom rows too, as the grouped experts' tiles: a row's sums are the same among
  // 1 to 4 rows (fp8_in_turn_sums_bf16_R). The f32 decode is some 4 instructions per 16 codes,
  // so the GEMV had been bound by them rather than the memory whenever the weights read faster
  // than about 35-40 GB/s. In-process on the Zen 4 EPYC (in turn, 7 rounds), weights in L3: M = 1
  // 2048 x 2048 1.50-1.59x (36.7 -> 55.1 GB/s), 7168 x 2048 1.52x, 2048 x 512 1.26x, M = 2 1.55x;
  // from memory at 28-30 GB/s M = 1 1.01x, M = 3 1.67x; dsv3-mini fp8's decode at bf16 compute
  // (bench_deepseek, 11 rounds in turn, read loop 35 GB/s) batch 1 1.05x [1.01, 1.19], batch 2
  // 1.04x [0.99, 1.08].
  const bool bf16_dot = in_turn && fp8_in_turn_bf16_sums(dev, compute, decode);
  cl::Kernel k = dev.kernel(
      "linear_fp8.cl", "linear_fp8",
      decode + " -DTM=" + std::to_string(tm) + " -DTN=" + std::to_string(tn) +
          (in_turn ? ops::columns_in_turn_option(dev) : "") +
          fp8_tile_options(dev, nan_free, in_turn, !in_turn && M >= kFp8PanelRowsFrom, K) +
          (bf16_dot ? " -DFP8_BF16_DOT=1" : ""));
  // Work per work-item as ops::linear: up to 64 rows, and enough column tiles that a launch is a
  // few hundred work-items rather than thousands. Tiles in turn are split as
  // ops::stream_launch_items says: each work-item scales its x rows first, which at 2 tiles
  // (256-512 work-items) had cost 13-29% of the GEMV (bench_fp8's shapes).
  const uint32_t m_rows = std::min<uint32_t>(ceil_div(M, tm) * tm, 64);
  const uint32_t col_tiles = ceil_div(N, tn), row_blocks = ceil_div(M, m_rows);
  const uint64_t min_items = in_turn ? ops::stream_launch_items(dev) : 256;
  const uint32_t n_tiles = ops::tiles_per_item(uint64_t(col_tiles) * row_blocks, min_items);
  cl::set_args(k, x, x_off, ldx, w.mem, scale_inv.mem, ceil_div(K, kQuantBlock), y, y_off, ldy, M,
               N, K, alpha, int(accumulate), n_tiles, m_rows, w1 ? w1->mem : w.mem,
               scale1 ? scale1->mem : scale_inv.mem, N0);
  dev.launch(k, {ceil_div(col_tiles, n_tiles), row_blocks, 1}, 2);
}
}  // namespace

void linear_fp8(Device& dev, const cl::Mem& x, uint32_t x_off, uint32_t ldx, const Weight& w,
                const Weight& scale_inv, const cl::Mem& y, uint32_t y_off, uint32_t ldy, uint32_t M,
                float alpha, bool accumulate, ComputeDType compute) {
  const auto [N, K] = check_fp8_weight("linear_fp8", w, scale_inv);
  if (dev.kernel_shape() == KernelShape::WorkGroups) {
    // linear_wg's layout, work-group size and rows (KernelTuning::linear_wg, wg_linear_rows).
    const uint32_t wg = dev.tuning().linear_wg, rb = wg_linear_rows(dev, M);
    cl::Kernel k = dev.kernel("linear_fp8.cl", "linear_fp8_wg",
                              fp8_decode_option(dev, w.fp8_subnormal_share) +
                                  " -DWG=" + std::to_string(wg) + " -DRB=" + std::to_string(rb));
    cl::set_args(k, x, x_off, ldx, w.mem, scale_inv.mem, ceil_div(K, kQuantBlock), y, y_off, ldy, M,
                 N, K, alpha, int(accumulate));
    const size_t local[3] = {wg, 1, 1};
    dev.launch(k, {size_t(N) * wg, ceil_div(M, rb), 1}, 2, local);
    return;
  }
  linear_fp8_tiles(dev, x, x_off, ldx, w, scale_inv, N, K, nullptr, nullptr, y, y_off, ldy, M,
                   alpha, accumulate, compute);
}

void linear_fp8_pair(Device& dev, const cl::Mem& x, uint32_t x_off, uint32_t ldx, const Weight& w0,
                     const Weight& scale0, const Weight& w1, const Weight& scale1, const cl::Mem& y,
                     uint32_t y_off, uint32_t ldy, uint32_t M, float alpha, bool accumulate,
                     ComputeDType compute) {
  const auto [N0, K0] = check_fp8_weight("linear_fp8_pair", w0, scale0);
  const auto [N1, K1] = check_fp8_weight("linear_fp8_pair", w1, scale1);
  if (K0 != K1)
    throw std::invalid_argument("linear_fp8_pair: '" + w0.name + "' has " + std::to_string(K0) +
                                " columns, '" + w1.name + "' " + std::to_string(K1) +
                                "; side by side they take the same x");
  const bool one_launch = dev.kernel_shape() == KernelShape::Chunks && N0 % 4 == 0 &&
                          fp8_decode_option(dev, w0.fp8_subnormal_share) ==
                              fp8_decode_option(dev, w1.fp8_subnormal_share);
  if (!one_launch) {
    linear_fp8(dev, x, x_off, ldx, w0, scale0, y, y_off, ldy, M, alpha, accumulate, compute);
    linear_fp8(dev, x, x_off, ldx, w1, scale1, y, y_off + N0, ldy, M, alpha, accumulate, compute);
    return;
  }
  linear_fp8_tiles(dev, x, x_off, ldx, w0, scale0, N0, K0, &w1, &scale1, y, y_off, ldy, M, alpha,
                   accumulate, compute);
}

namespace {

// dequantize_fp8(_bf16): a work-item per row in the CPU shape, per 16 columns in the GPU shape.
void launch_dequantize(Device& dev, const char* op, const Weight& w, const Weight& scale_inv,
                       const cl::Mem& out, bool bf16) {
  const auto [N, K] = check_fp8_weight(op, w, scale_inv);
  const bool wg = dev.kernel_shape() == KernelShape::WorkGroups;
  cl::Kernel k =
      dev.kernel("linear_fp8.cl", wg ? "dequantize_fp8_wg" : "dequantize_fp8",
                 fp8_decode_option(dev, w.fp8_subnormal_share) + (bf16 ? " -DOUT_BF16=1" : ""));
  cl::set_args(k, w.mem, scale_inv.mem, ceil_div(K, kQuantBlock), out, N, K);
  if (wg) {
    const size_t local[3] = {64, 1, 1};
    dev.launch(k, {(size_t(K) / 16 + 1 + 63) / 64 * 64, N, 1}, 2, local);
  } else {
    dev.launch(k, {N, 1, 1}, 1);
  }
}

}  // namespace

void dequantize_fp8(Device& dev, const Weight& w, const Weight& scale_inv, const cl::Mem& out) {
  launch_dequantize(dev, "dequantize_fp8", w, scale_inv, out, false);
}

void dequantize_fp8_bf16(Device& dev, const Weight& w, const Weight& scale_inv, const cl::Mem& out) {
  launch_dequantize(dev, "dequantize_fp8_bf16", w, scale_inv, out, true);
}

void validate(const RouterConfig& c) {
  auto fail = [&](const std::string& why) {
    throw std::invalid_argument("router config (n_experts " + std::to_string(c.n_experts) +
                                ", top_k " + std::to_string(c.top_k) + ", n_group " +
                                std::to_string(c.n_group) + ", topk_group " +
                                std::to_string(c.topk_group) + "): " + why);
  };
  if (c.n_experts == 0) fail("n_experts must be > 0");
  if (c.top_k == 0) fail("top_k (num_experts_per_tok) must be > 0");
  if (c.n_group == 0) fail("n_group must be > 0");
  if (c.n_experts % c.n_group != 0) fail("n_experts must be a multiple of n_group");
  if (c.topk_group == 0 || c.topk_group > c.n_group)
    fail("topk_group must be between 1 and n_group");
  const uint32_t per_group = c.n_experts / c.n_group;
  if (c.n_group > 1 && per_group < 2)
    fail("each group needs at least 2 experts: the group score is the sum of its top 2");
  if (c.top_k > c.topk_group * per_group)
    fail("top_k exceeds the " + std::to_string(c.topk_group * per_group) +
         " experts in the kept groups");
  if (!std::isfinite(c.routed_scaling_factor)) fail("routed_scaling_factor must be finite");
}

void moe_route(Device& dev, const cl::Mem& logits, const Weight* correction_bias, uint32_t T,
               const RouterConfig& cfg, const cl::Mem& topk_ids, const cl::Mem& topk_weights) {
  validate(cfg);
  int bias_mode = 0;
  if (correction_bias) {
    const Weight& b = *correction_bias;
    if (b.shape != std::vector<int64_t>{cfg.n_experts} ||
        (b.dtype != DType::F32 && b.dtype != DType::BF16))
      throw std::invalid_argument("moe_route: correction bias '" + b.name + "' is " +
                                  dtype_name(b.dtype) + " " + shape_str(b.shape) +
                                  "; expected F32 or BF16 [" + std::to_string(cfg.n_experts) + "]");
    bias_mode = b.dtype == DType::F32 ? 1 : 2;
  }
  const std::string options = "-DN_EXPERTS=" + std::to_string(cfg.n_experts) +
                              " -DTOP_K=" + std::to_string(cfg.top_k) +
                              " -DN_GROUP=" + std::to_string(cfg.n_group) +
                              " -DTOPK_GROUP=" + std::to_string(cfg.topk_group) +
                              " -DNORM_TOPK=" + std::to_string(int(cfg.norm_topk_prob)) +
                              " -DBIAS=" + std::to_string(bias_mode);
  const bool wg_shape = dev.kernel_shape() == KernelShape::WorkGroups;
  const size_t wg = dev.tuning().route_wg;
  cl::Kernel k = wg_shape ? dev.kernel("moe.cl", "moe_route_wg",
                                       options + " -DROUTE_WG=" + std::to_string(wg))
                          : dev.kernel("moe.cl", "moe_route", options);
  // Without a bias the kernel never reads its bias argument; any valid buffer fills the slot.
  cl::set_args(k, logits, correction_bias ? correction_bias->mem : logits,
               cfg.routed_scaling_factor, topk_ids, topk_weights);
  if (wg_shape)
    dev.launch(k, {T * wg, 1, 1}, 1, &wg);
  else
    dev.launch(k, {T, 1, 1}, 1);
}

ExpertBatches group_by_expert(const std::vector<int32_t>& topk_ids, uint32_t T, uint32_t top_k,
                              uint32_t n_experts) {
  const size_t n = size_t(T) * top_k;
  if (topk_ids.size() != n)
    throw std::invalid_argument("group_by_expert: " + std::to_string(topk_ids.size()) +
                                " ids for " + std::to_string(T) + " tokens x top_k " +
                                std::to_string(top_k));
  ExpertBatches b;
  b.expert_offsets.assign(size_t(n_experts) + 1, 0);
  for (size_t i = 0; i < n; ++i) {
    const int32_t e = topk_ids[i];
    if (e < 0 || uint32_t(e) >= n_experts)
      throw std::out_of_range("group_by_expert: token " + std::to_string(i / top_k) + " slot " +
                              std::to_string(i % top_k) + " names expert " + std::to_string(e) +
                              " of " + std::to_string(n_experts));
    ++b.expert_offsets[size_t(e) + 1];
  }
  for (uint32_t e = 0; e < n_experts; ++e) b.expert_offsets[e + 1] += b.expert_offsets[e];
  // A counting sort: walking tokens and slots in order fills each expert's rows in ascending
  // (token, slot) order.
  std::vector<uint32_t> next(b.expert_offsets.begin(), b.expert_offsets.end() - 1);
  b.src_token.resize(n);
  b.slot_row.resize(n);
  for (size_t i = 0; i < n; ++i) {
    const uint32_t row = next[size_t(topk_ids[i])]++;
    b.src_token[row] = uint32_t(i / top_k);
    b.slot_row[i] = row;
  }
  return b;
}

void gather_rows(Device& dev, const cl::Mem& x, uint32_t ldx, const cl::Mem& rows, uint32_t n,
                 uint32_t width, const cl::Mem& y, uint32_t ldy) {
  if (n == 0 || width == 0) return;
  if (dev.kernel_shape() == KernelShape::WorkGroups) {
    const size_t wg = dev.tuning().row_wg;
    cl::Kernel k = dev.kernel("moe.cl", "gather_rows_wg", "-DROW_WG=" + std::to_string(wg));
    cl::set_args(k, x, ldx, rows, y, ldy, width);
    const size_t local[3] = {wg, 1, 1};
    dev.launch(k, {ceil_div(width, uint32_t(wg)) * wg, n, 1}, 2, local);
    return;
  }
  cl::Kernel k = dev.kernel("moe.cl", "gather_rows");
  cl::set_args(k, x, ldx, rows, y, ldy, width);
  dev.launch(k, {n, ceil_div(width, kRowChunk), 1}, 2);
}

void moe_combine(Device& dev, const cl::Mem& expert_out, uint32_t ld, const cl::Mem& slot_row,
                 const cl::Mem& topk_weights, uint32_t T, uint32_t top_k, uint32_t H,
                 const cl::Mem& out, uint32_t ldo, bool accumulate, bool with_shared) {
  if (dev.kernel_shape() == KernelShape::WorkGroups) {
    const size_t wg = dev.tuning().row_wg;
    cl::Kernel k = dev.kernel("moe.cl", "moe_combine_wg", "-DROW_WG=" + std::to_string(wg));
    cl::set_args(k, expert_out, ld, slot_row, topk_weights, top_k, H, out, ldo, int(accumulate),
                 int(with_shared));
    const size_t local[3] = {wg, 1, 1};
    dev.launch(k, {ceil_div(H, uint32_t(wg)) * wg, T, 1}, 2, local);
    return;
  }
  cl::Kernel k = dev.kernel("moe.cl", "moe_combine");
  cl::set_args(k, expert_out, ld, slot_row, topk_weights, top_k, H, out, ldo, int(accumulate),
               int(with_shared));
  dev.launch(k, {T, ceil_div(H, kRowChunk), 1}, 2);
}

bool grouped_rows_aligned(const std::vector<uint64_t>& table, uint32_t hidden, uint32_t inter) {
  if (hidden % 2 || inter % 2 || table.size() % 6) return false;
  for (size_t i = 0; i < table.size(); ++i)
    if (i % 6 < 3 && table[i] % 2) return false;
  return true;
}

GroupedPlan plan_experts(Device& dev, const cl::Mem& topk_ids, uint32_t T, uint32_t top_k,
                         uint32_t n_experts, bool with_shared) {
  if (with_shared && n_experts < 2)
    throw std::invalid_argument("plan_experts: a shared expert needs n_experts >= 2 (the routed "
                                "ones and the shared one last), got " + std::to_string(n_experts));
  GroupedPlan p = plan_shape(dev, T * (top_k + uint32_t(with_shared)), n_experts);
  p.max_expert_rows = T;  // a token's top-k experts are distinct, the shared one once
  p.src_token = Scratch(dev, size_t(std::max(p.rows, 1u)) * 4);
  p.slot_row = Scratch(dev, size_t(std::max(p.rows, 1u)) * 4);
  p.cursor = Scratch(dev, size_t(n_experts) * 4);
  cl::Kernel k = dev.kernel("moe.cl", "moe_plan");
  cl::set_args(k, topk_ids, T, top_k, n_experts, int(with_shared), p.rows_per_tile,
               p.expert_offsets.mem(),
               p.src_token.mem(), p.slot_row.mem(), p.cursor.mem(), p.tiles.mem(),
               p.tile_count.mem());
  dev.launch(k, {1, 1, 1}, 1);
  return p;
}

GroupedPlan plan_expert_tiles(Device& dev, const std::vector<uint32_t>& expert_offsets) {
  if (expert_offsets.empty())
    throw std::invalid_argument("plan_expert_tiles: no expert offsets");
  const uint32_t E = uint32_t(expert_offsets.size() - 1);
  GroupedPlan p = plan_shape(dev, expert_offsets.back(), E);
  for (uint32_t e = 0; e < E; ++e)
    p.max_expert_rows = std::max(p.max_expert_rows, expert_offsets[e + 1] - expert_offsets[e]);
  dev.write(p.expert_offsets.mem(), expert_offsets.data(), expert_offsets.size() * 4);
  cl::Kernel k = dev.kernel("moe.cl", "moe_tiles");
  cl::set_args(k, p.expert_offsets.mem(), E, p.rows_per_tile, p.tiles.mem(), p.tile_count.mem());
  dev.launch(k, {1, 1, 1}, 1);
  return p;
}

namespace {

// The CPU shape's grouped launch (moe.cl's moe_grouped_linear, any of its weight types): as
// ops::linear, enough column tiles (tn features) per work-item that a launch is a few hundred
// work-items (PoCL pays about a microsecond per work-group), counting the tiles that will have
// rows. Tiles in turn (decode) are split as ops::linear_fp8's: into as few work-items as
// ops::stream_launch_items says, of up to 64 column tiles, where there had been 16 tiles and a few
// hundred work-items. In-process A/B on the 2-core EPYC (dsv3-mini's 64 + 1 experts, top 8,
// 3 layers' copies in turn), gate|up and down faster by:
//   FP8 experts: 1 token 1.08-1.19x and 1.08-1.19x, 2 tokens 1.02-1.10x and 1.09-1.11x,
//                3 tokens 0.83-0.96x and 1.04-1.14x, 8 tokens 1.24x and 1.11x,
//                16 tokens 0.99x and 1.06x;
//   bf16 experts: 1 token 0.98x and 1.01x, 8 tokens 1.00x and 1.26x.
// packed_from: the tiles of experts with that many rows or more return at once (the packed GEMM
// takes them; 0: none).
void launch_grouped(Device& dev, cl::Kernel& k, const cl::Mem& x, uint32_t ldx,
                    const cl::Mem* x_rows, const GroupedExperts& g, uint32_t slot0, uint32_t n_mats,
                    const GroupedPlan& plan, const cl::Mem& y, uint32_t ldy, uint32_t N, uint32_t K,
                    uint32_t tn, bool in_turn, uint32_t packed_from = 0) {
  const uint32_t col_tiles = ceil_div(N, tn) * n_mats;
  const uint32_t busy_tiles = std::min(plan.max_tiles, ceil_div(plan.rows, plan.rows_per_tile) +
                                                           std::min(plan.rows, plan.n_experts));
  const uint64_t min_items = in_turn ? ops::stream_launch_items(dev) : 256;
  const uint32_t per_item =
      ops::tiles_per_item(uint64_t(col_tiles) * busy_tiles, min_items, in_turn ? 64 : 16);
  cl::set_args(k, x, ldx, x_rows ? *x_rows : x, int(x_rows != nullptr), g.mem, g.mem, g.table,
               slot0, n_mats, plan.tiles.mem(), plan.tile_count.mem(), plan.expert_offsets.mem(),
               plan.rows_per_tile, y, ldy, N, K, per_item, packed_from);
  dev.launch(k, {ceil_div(col_tiles, per_item), plan.max_tiles, 1}, 2);
}

void check_grouped(const char* op, const GroupedExperts& g, uint32_t slot0, uint32_t n_mats,
                   const GroupedPlan& plan) {
  if (!g || slot0 + n_mats > 3 || g.n_experts != plan.n_experts)
    throw std::invalid_argument(std::string(op) + ": the plan covers " +
                                std::to_string(plan.n_experts) + " experts, the weights " +
                                std::to_string(g.n_experts) + "; matrices " +
                                std::to_string(slot0) + " + " + std::to_string(n_mats) + " of 3");
}

// The average rows per expert from which bf16 compute takes the grouped experts (4-row tiles
// then). In-process on the 2-core EPYC (dsv3-mini's experts: 64 + 1 shared, top-8, gate|up with
// the SwiGLU then down), bf16 against f32 tiles: FP8 experts 0.75x at 4.4 rows, 0.89x at 5.5,
// 0.99x at 6.6, 1.13x at 8.9, 1.40x at 17.7, 1.88x at 71 (512-token prefill); bf16 experts 0.90x,
// 0.95x, 0.96x, 1.11x, 1.31x. Below it (decode batches up to ~50 streams) they stay f32, but for
// bf16 experts in one-row tiles (under 4 rows per expert on average) where ops::bf16_gemv holds.
constexpr uint32_t kGroupedBf16RowsFrom = 8;

// bf16 compute as ops::linear's GEMMs of 4 rows and more, where the experts average
// kGroupedBf16RowsFrom rows; decode's one-row tiles stream their weights in f32. dsv3-mini's
// 512-token prefill with model.compute_dtype: bf16 ran 489-514 tok/s against 371-378 with these
// tiles in f32 (3 interleaved pairs, the 2-core EPYC).
// FP8 experts too (moe.cl's FP8_BF16_PANEL): each column tile's weight rows dequantized to bf16
// once into a work-item's private panel, read by the tile's up to 64 row tiles.
// Decode's one-row tiles of bf16 experts (plan.tm 1) take the bf16 sums too where ops::bf16_gemv
// holds: the dense GEMVs' one-row tiles in turn, so an expert's row gets the bits ops::linear
// gives it at any row count. dsv3-mini bf16 at bf16 compute with the read loop at 25 GB/s
// (bench_deepseek --tuning-ab gemm_bf16_gemv=0, dense and grouped GEMVs together, 9 rounds in
// turn): batch 8 1.11x [1.03, 1.14], batch 1 0.98x [0.89, 1.01]; kernel by kernel at batch 1
// (bench_step_breakdown, 2 runs each) the steps 20.8-22.3 ms against 21.1-22.3, with 37 more
// launches (the x rows' rounding).
bool grouped_bf16(const Device& dev, const GroupedExperts& g, const GroupedPlan& plan,
                  ComputeDType compute) {
  if (compute != ComputeDType::BF16 || dev.kernel_shape() != KernelShape::Chunks) return false;
  if (plan.tm == 1) return g.dtype == DType::BF16 && bf16_gemv(dev);
  return (g.dtype == DType::BF16 || g.dtype == DType::F8_E4M3) && plan.tm >= kGemmRowsFrom &&
         plan.rows >= kGroupedBf16RowsFrom * plan.n_experts;
}

// The bf16-compute grouped launches: the experts of ops::moe_bf16_packed_rows_from rows or more in
// the packed GEMM (moe.cl's moe_grouped_packed; AMX where the host has it), the others in the tiles
// of linear_bf16.cl's micro-kernels (moe.cl with -DGROUPED_BF16=1): each expert's rows get the
// sums ops::linear's bf16 GEMM gives them at that expert's row count. The rows of x are rounded
// once; where the packed GEMM runs, in plan order (its row tiles read rows one stride apart),
// else the tokens as they are, read through x_rows. With glu gate and up in one tile, y getting
// silu(gate) * up.
// dsv3-mini bf16, 512-token prefill at bf16 compute on the 2-core Xeon with AMX
// (bench_step_breakdown, one run each): the grouped experts took 340 ms per step so, against
// 1272 ms in the dot-product tiles alone (FP8 experts 401 against 1299).
void grouped_bf16_launch(Device& dev, const cl::Mem& x, uint32_t ldx, const cl::Mem* x_rows,
                         uint32_t x_count, const GroupedExperts& g, uint32_t slot0,
                         uint32_t n_mats, bool glu, const GroupedPlan& plan, const cl::Mem& y,
                         uint32_t ldy) {
  const bool down = slot0 == 2;
  const uint32_t N = down ? g.hidden : g.inter, K = down ? g.inter : g.hidden;
  if (x_rows && x_count == 0)
    throw std::invalid_argument("moe_grouped_linear: bf16 compute over token rows needs x_count");
  const bool fp8 = g.dtype == DType::F8_E4M3;
  // No expert has more rows than plan.max_expert_rows (decode batches: the tokens), so such
  // steps launch no packed GEMM: dsv3-mini's batch-1 decode had two a layer of empty work-items
  // (139 launches a step, now 129; the step's time unchanged: 1.009x and 0.991x, 15 rounds each of
  // bench_deepseek --compute-dtype bf16 --tuning-ab gemm_bf16_packed_rows=0 before this).
  const uint32_t packed_from = moe_bf16_packed_rows_from(dev, g.dtype);
  const bool packed_rows = packed_from != 0 && plan.max_expert_rows >= packed_from;
  // The x rows are rounded at an even stride; FP8 weights reach the micro-kernels from aligned
  // panels. Aligned bf16 weight rows gave the portable tiles 2.2x: dsv3-mini-sized experts (32 of
  // H 2048 and F 512, 192 tokens at top 8, none packed) 68-72 ms against 154-161 in pairs of
  // ushorts (clshard tune's moe op), and dsv3-mini bf16's 128-token prefill at bf16 compute
  // (bench_step_breakdown, 5 runs in turn) 677-727 ms per step against 913-1063, its tiles
  // 373-469 ms against 705-860 (the 2-core Xeon without AMX, gemm_bf16_dot 0, 2026-12-03).
  const bool pairs_aligned = fp8 || g.pairs_aligned;
  const PackedGemmShape shape =
      packed_rows
          ? packed_gemm_shape(dev, PackedRows::Bf16, glu,
                              fp8 ? std::optional(fp8_codes(g)) : std::nullopt, pairs_aligned, K)
          : PackedGemmShape{};
  const bool packed = packed_rows && shape.fits;
  const bool gather = packed && x_rows != nullptr;
  const uint32_t rows = x_rows && !gather ? x_count : plan.rows;
  const uint32_t ldxb = bf16_gemm_row_stride(K);
  Scratch xb(dev, size_t(rows) * ldxb * 2);
  round_bf16(dev, x, 0, ldx, rows, K, xb.mem(), ldxb, false, gather ? x_rows : nullptr);
  const cl::Mem* tile_rows = gather ? nullptr : x_rows;
  if (packed) {
    cl::Kernel k = dev.kernel("moe.cl", "moe_grouped_packed", "-DGROUPED_PACKED=1" + shape.options);
    cl::set_args(k, xb.mem(), ldxb, g.mem, g.mem, g.table, slot0, n_mats, plan.tiles.mem(),
                 plan.tile_count.mem(), plan.expert_offsets.mem(), plan.rows_per_tile, packed_from,
                 y, ldy, N, K);
    const uint32_t col_tiles = ceil_div(N, shape.tile_cols) * (glu ? 1 : n_mats);
    dev.launch(k, {col_tiles, plan.max_tiles, 1}, 2);
  }
  // One-row tiles (decode) as ops::linear's bf16 GEMVs.
  const Bf16OneRowTile one_row = bf16_one_row_tile(dev, glu, K);
  const bool in_turn = plan.tm == 1 && one_row.columns_in_turn;
  const uint32_t tn_any = dev.tuning().gemm_bf16_tn;
  const uint32_t tn = plan.tm == 1 ? one_row.tn : glu ? (tn_any + 1) / 2 * 2 : tn_any;
  std::string opts =
      " -DTM=" + std::to_string(plan.tm) + " -DTN=" + std::to_string(tn) +
      " -DGROUPED_BF16=1 -DWEIGHT_TYPE=1 -DPAIRS_ALIGNED=" + (pairs_aligned ? "1" : "0") +
      " -DGLU=" + (glu ? "1" : "0") + " -DBF16_DOT=" + (bf16_dot_product(dev) ? "1" : "0") +
      (in_turn ? " -DCOLUMNS_IN_TURN=1" : "");
  if (fp8) opts += fp8_bf16_panel_options(dev, K, fp8_codes(g));
  cl::Kernel k = dev.kernel("moe.cl", "moe_grouped_linear", opts);
  launch_grouped(dev, k, xb.mem(), ldxb, tile_rows, g, slot0, glu ? 1 : n_mats, plan, y, ldy, N, K,
                 glu ? tn / 2 : tn, in_turn, packed ? packed_from : 0);
}

// compute_dtype f32 over bf16 experts with AMX, as ops::linear's GEMMs from gemm_f32_amx_rows
// rows (ops.cpp's gemm_f32_amx_terms): the experts of that many rows or more in
// moe_grouped_packed over their rows' three bf16 terms (round_bf16 -DX_SPLIT=3, in plan order),
// each expert's rows getting the bits ops::linear gives that many rows. Returns the row count
// from which it took the experts, for the f32 tiles to leave them (0: none, launching nothing:
// another dtype or shape, no AMX, the field 0, a panel that does not fit).
uint32_t grouped_f32_amx_terms(Device& dev, const cl::Mem& x, uint32_t ldx, const cl::Mem* x_rows,
                               const GroupedExperts& g, uint32_t slot0, uint32_t n_mats,
                               const GroupedPlan& plan, const cl::Mem& y, uint32_t ldy,
                               ComputeDType compute) {
  const uint32_t from = dev.tuning().gemm_f32_amx_rows;
  // No expert has more rows than plan.max_expert_rows (decode batches: the tokens), so such
  // steps round nothing and launch nothing here.
  if (compute != ComputeDType::F32 || g.dtype != DType::BF16 || from == 0 ||
      plan.max_expert_rows < from || dev.kernel_shape() != KernelShape::Chunks || !bf16_amx(dev))
    return 0;
  const bool down = slot0 == 2;
  const uint32_t N = down ? g.hidden : g.inter, K = down ? g.inter : g.hidden;
  const PackedGemmShape shape =
      packed_gemm_shape(dev, PackedRows::F32Terms, false, std::nullopt, false, K);
  if (!shape.fits) return 0;
  const uint32_t ldr = bf16_gemm_row_stride(K);
  Scratch terms(dev, size_t(plan.rows) * 3 * ldr * 2);
  bf16_terms(dev, x, 0, ldx, plan.rows, K, terms.mem(), ldr, x_rows);
  cl::Kernel k = dev.kernel("moe.cl", "moe_grouped_packed", "-DGROUPED_PACKED=1" + shape.options);
  cl::set_args(k, terms.mem(), 3 * ldr, g.mem, g.mem, g.table, slot0, n_mats, plan.tiles.mem(),
               plan.tile_count.mem(), plan.expert_offsets.mem(), plan.rows_per_tile, from, y, ldy,
               N, K);
  dev.launch(k, {ceil_div(N, shape.tile_cols) * n_mats, plan.max_tiles, 1}, 2);
  return from;
}

}  // namespace

void moe_grouped_swiglu(Device& dev, const cl::Mem& x, uint32_t ldx, const cl::Mem* x_rows,
                        const GroupedExperts& g, const GroupedPlan& plan, const cl::Mem& y,
                        uint32_t ldy, ComputeDType compute, uint32_t x_count) {
  check_grouped("moe_grouped_swiglu", g, 0, 2, plan);
  if (plan.rows == 0) return;
  if (grouped_bf16(dev, g, plan, compute)) {
    // One launch: no [gate | up] rows written and read back by silu_mul. dsv3-mini's
    // bf16-compute prefill: 509-538 tok/s against 468-522 unfused (3 interleaved pairs, noisy).
    grouped_bf16_launch(dev, x, ldx, x_rows, x_count, g, 0, 2, true, plan, y, ldy);
    return;
  }
  // The f32 tiles stage [gate | up] for silu_mul. Tried on 2026-12-05 and left out: the same
  // tiles taking gate and up in one launch with the SwiGLU in the epilogue, as the bf16-compute
  // tiles above do (TN / 2 gate rows, then the same columns' up rows), ran slower on the 2-core
  // Zen 5 EPYC (bench_step_breakdown --timeline, dsv3-mini at batch 1, 5 rounds in turn of the
  // two builds; medians of the gate|up launches' time per step): bf16 experts 5.64 ms fused
  // against 4.26 + 0.17 unfused (the gate|up launch, then silu_mul with its gaps), FP8 2.39
  // against 2.16 + 0.15; without the next tile's prefetch 6.17 and 2.47 ms, with the bf16
  // rounds spread over 4.2-7.0 ms. Alternating short runs of two matrices' rows (a page or two
  // each) streams slower than one matrix's rows in order, and silu_mul costs less than that.
  // Also tried that day and left out: the FP8 tiles in turn of the down projection reading the
  // [gate | up] rows and taking silu(gate) * up in their private copy of x (no silu_mul launch;
  // bit for bit the same sums). dsv3-mini fp8 at batch 1, 12 rounds in turn of the two builds:
  // the untouched step was 0.45 ms slower (median; slower in 10 of 12), the queue's span no
  // shorter (-0.04 ms), because the down launch's gap grew from 10.7 to 18.7 us (medians) and its
  // time from 243 to 252 us: a short launch between two long ones hides PoCL's thread wake-up
  // (perf/README.md, "Gaps between launches"), so dropping it saves less than its time.
  const uint32_t F = g.inter;
  Scratch gu(dev, size_t(plan.rows) * 2 * F * 4);
  moe_grouped_linear(dev, x, ldx, x_rows, g, 0, 2, plan, gu.mem(), 2 * F, compute, x_count);
  silu_mul(dev, gu.mem(), 0, 2 * F, gu.mem(), F, 2 * F, y, ldy, plan.rows, F);
}

void moe_grouped_linear(Device& dev, const cl::Mem& x, uint32_t ldx, const cl::Mem* x_rows,
                        const GroupedExperts& g, uint32_t slot0, uint32_t n_mats,
                        const GroupedPlan& plan, const cl::Mem& y, uint32_t ldy,
                        ComputeDType compute, uint32_t x_count) {
  check_grouped("moe_grouped_linear", g, slot0, n_mats, plan);
  if (plan.rows == 0) return;
  const bool down = slot0 == 2;
  const uint32_t N = down ? g.hidden : g.inter, K = down ? g.inter : g.hidden;
  const uint32_t tn = 4;
  const bool chunks = dev.kernel_shape() == KernelShape::Chunks, fp8 = g.dtype == DType::F8_E4M3;
  // The row tile: the plan's (4 rows from 4 rows per expert on average), and on the CPU shape 4
  // rows for f32, bf16 and f16 experts from one row per expert (batched decode), where the 4-row
  // tiles read their weight rows side by side with the next tile's prefetched and the one-row
  // tiles in turn had streamed them slower; each output's sum is the same in either tile. bench_moe
  // (dsv3-mini's layer, bf16 experts, 2-core Xeon with AMX, 2026-11-29): 8 tokens (43 experts)
  // 15.6-18.4 -> 20.0-22.8 GB/s, 16 tokens (56) 11.3-12.8 -> 17.7-22.3; dsv3-mini bf16's decode
  // at batch 8 (bench_deepseek, 3 interleaved pairs) 1.00, 1.07, 1.04x, at batch 16 1.16, 1.00x.
  // FP8 experts take tiles in turn instead, below kFp8PanelRowsFrom rows per expert.
  const bool fp8_in_turn = chunks && fp8 && plan.rows < kFp8PanelRowsFrom * plan.n_experts &&
                           K <= ops::in_turn_max_k(dev, g.dtype);
  uint32_t tm = plan.tm;
  if (fp8_in_turn)
    tm = kFp8InTurnTileRows;
  else if (chunks && !fp8 && plan.rows >= plan.n_experts)
    tm = 4;
  std::string opts = " -DTM=" + std::to_string(tm) + " -DTN=" + std::to_string(tn);
  if (grouped_bf16(dev, g, plan, compute)) {
    grouped_bf16_launch(dev, x, ldx, x_rows, x_count, g, slot0, n_mats, false, plan, y, ldy);
    return;
  }
  const uint32_t terms_from =
      grouped_f32_amx_terms(dev, x, ldx, x_rows, g, slot0, n_mats, plan, y, ldy, compute);
  switch (g.dtype) {
    case DType::F32: opts += " -DWEIGHT_TYPE=0"; break;
    case DType::BF16: opts += " -DWEIGHT_TYPE=1"; break;
    case DType::F16: opts += " -DWEIGHT_TYPE=2"; break;
    case DType::F8_E4M3: {
      const std::string decode = fp8_decode_option(dev, g.fp8_subnormal_share);
      opts += " -DGROUPED_FP8=1 " + decode;
      // bf16 compute: every tile in turn summed in bf16, from one row (fp8_tile.cl's
      // fp8_in_turn_sums_bf16_R), so that an expert's row gets the same sums whatever the
      // batch routes to it. dsv3-mini fp8 at bf16 compute on the 2-core Zen 4 EPYC
      // (bench_deepseek --tuning-ab through a throwaway switch, 11 rounds in turn): batch 8
      // 47.2 -> 39.6 ms a step, 1.19x [1.15, 1.20]; batch 1 12.97 -> 12.23 ms a token, 1.06x
      // [1.03, 1.25] (again 1.02x [0.83, 1.04], 7 rounds); batch 32 139.1 -> 107.7 ms a step, 1.29x
      // [1.28, 1.31] (7 rounds). Only tiles of 2 rows or more (batch 8): 1.18x [1.12, 1.19].
      if (fp8_in_turn && fp8_in_turn_bf16_sums(dev, compute, decode)) opts += " -DFP8_BF16_DOT=1";
      break;
    }
    default:
      throw std::invalid_argument(std::string("moe_grouped_linear: expert weights of dtype ") +
                                  dtype_name(g.dtype));
  }
  // One-row tiles (FP8: up to 4 rows) read their columns in turn, as ops::linear's
  // (ops::in_turn_max_k); tiles prefetch their next tile's rows as ops::linear's. CPU shape only:
  // the GPU shape's kernels have no such tiles, and their program need not hold the private x row.
  const bool in_turn = fp8_in_turn || (chunks && tm == 1 && K <= ops::in_turn_max_k(dev, g.dtype));
  if (in_turn) opts += ops::columns_in_turn_option(dev);
  if (fp8)
    opts += fp8_tile_options(
        dev, g.fp8_nan_free, in_turn,
        chunks && plan.tm == 4 && plan.rows >= kFp8PanelRowsFrom * plan.n_experts, K);
  opts += ops::weight_prefetch_option(dev);
  if (dev.kernel_shape() == KernelShape::WorkGroups) {
    // linear_wg's / linear_fp8_wg's order per row (ops::linear's and ops::linear_fp8's GPU
    // shape), with their work-group size.
    const uint32_t wg = dev.tuning().linear_wg, rb = dev.tuning().linear_rows;
    cl::Kernel k = dev.kernel("moe.cl", fp8 ? "moe_grouped_linear_fp8_wg" : "moe_grouped_linear_wg",
                              opts + " -DGROUPED_WG=" + std::to_string(wg) +
                                  " -DRB=" + std::to_string(rb) +
                                  " -DVW=" + std::to_string(dev.tuning().linear_vector));
    if (fp8)
      cl::set_args(k, x, ldx, x_rows ? *x_rows : x, int(x_rows != nullptr), g.mem, g.mem, g.table,
                   slot0, plan.tiles.mem(), plan.tile_count.mem(), plan.expert_offsets.mem(),
                   plan.rows_per_tile, y, ldy, N, K);
    else
      cl::set_args(k, x, ldx, x_rows ? *x_rows : x, int(x_rows != nullptr), g.mem, g.table, slot0,
                   plan.tiles.mem(), plan.tile_count.mem(), plan.expert_offsets.mem(),
                   plan.rows_per_tile, y, ldy, N, K);
    const size_t local[3] = {wg, 1, 1};
    dev.launch(k, {size_t(n_mats) * N * wg, plan.max_tiles, 1}, 2, local);
    return;
  }
  cl::Kernel k = dev.kernel("moe.cl", "moe_grouped_linear", opts);
  launch_grouped(dev, k, x, ldx, x_rows, g, slot0, n_mats, plan, y, ldy, N, K, tn, in_turn,
                 terms_from);
}

}  // namespace ops

namespace reference {

void route(const float* logits, const float* bias, uint32_t T, const ops::RouterConfig& cfg,
           int32_t* ids, float* weights) {
  ops::validate(cfg);
  const uint32_t E = cfg.n_experts, per_group = E / cfg.n_group;
  std::vector<float> score(E), sel(E), group_score(cfg.n_group);
  std::vector<char> eligible(E), group_kept(cfg.n_group);
  for (uint32_t t = 0; t < T; ++t) {
    const float* lt = logits + size_t(t) * E;
    for (uint32_t e = 0; e < E; ++e) {
      score[e] = 1.0f / (1.0f + std::exp(-lt[e]));
      sel[e] = bias ? score[e] + bias[e] : score[e];
    }
    if (cfg.n_group > 1) {
      for (uint32_t g = 0; g < cfg.n_group; ++g) {
        float best = -std::numeric_limits<float>::infinity(), second = best;
        for (uint32_t e = g * per_group; e < (g + 1) * per_group; ++e) {
          if (sel[e] > best) {
            second = best;
            best = sel[e];
          } else if (sel[e] > second) {
            second = sel[e];
          }
        }
        group_score[g] = best + second;
      }
      std::fill(group_kept.begin(), group_kept.end(), 0);
      for (uint32_t r = 0; r < cfg.topk_group; ++r) {
        int bi = -1;
        for (uint32_t g = 0; g < cfg.n_group; ++g)
          if (!group_kept[g] && (bi < 0 || group_score[g] > group_score[size_t(bi)])) bi = int(g);
        group_kept[size_t(bi)] = 1;
      }
      for (uint32_t e = 0; e < E; ++e) eligible[e] = group_kept[e / per_group];
    } else {
      std::fill(eligible.begin(), eligible.end(), 1);
    }
    int32_t* it = ids + size_t(t) * cfg.top_k;
    float* wt = weights + size_t(t) * cfg.top_k;
    float sum = 0.0f;
    for (uint32_t r = 0; r < cfg.top_k; ++r) {
      int bi = -1;
      for (uint32_t e = 0; e < E; ++e)
        if (eligible[e] && (bi < 0 || sel[e] > sel[size_t(bi)])) bi = int(e);
      eligible[size_t(bi)] = 0;
      it[r] = bi;
      sum += score[size_t(bi)];
    }
    for (uint32_t r = 0; r < cfg.top_k; ++r) {
      float w = score[size_t(it[r])];
      if (cfg.norm_topk_prob) w = w / sum;
      wt[r] = w * cfg.routed_scaling_factor;
    }
  }
}

float e4m3_to_f32(uint8_t v) {
  const bool negative = v & 0x80;
  const int exponent = (v >> 3) & 0xF, mantissa = v & 0x7;
  float mag;
  if (exponent == 0xF && mantissa == 0x7)
    mag = std::numeric_limits<float>::quiet_NaN();
  else if (exponent == 0)
    mag = std::ldexp(float(mantissa), -9);  // subnormal: 0.mmm x 2^(1-7)
  else
    mag = std::ldexp(1.0f + float(mantissa) / 8.0f, exponent - 7);
  return negative ? -mag : mag;
}

void dequantize_fp8(const uint8_t* w, const float* scale_inv, uint32_t N, uint32_t K, float* out) {
  const uint32_t KB = ceil_div(K, kQuantBlock);
  for (uint32_t n = 0; n < N; ++n)
    for (uint32_t k = 0; k < K; ++k)
      out[size_t(n) * K + k] = e4m3_to_f32(w[size_t(n) * K + k]) *
                               scale_inv[size_t(n / kQuantBlock) * KB + k / kQuantBlock];
}

}  // namespace reference

}  // namespace clshard
