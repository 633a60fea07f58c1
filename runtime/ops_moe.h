// The Mixture-of-Experts and FP8 pieces of DeepSeek-V3 as plain functions, in the style of ops.h:
// each sets its kernel's arguments and enqueues it on the device's in-order queue (no wait), except
// group_by_expert, which plans on the host. Buffers are f32 activations unless a Weight or said
// otherwise. Offsets and row strides are in elements.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "runtime/cl.h"
#include "runtime/device.h"
#include "runtime/ops.h"
#include "runtime/tensor.h"

namespace clshard {
class Device;
}

namespace clshard::ops {

// y[M, N] (+)= alpha * x[M, K] W^T, W F8_E4M3 [N, K] with block scales scale_inv F32
// [ceil(N/128), ceil(K/128)] that MULTIPLY each 128x128 block (partial blocks at the edges).
// Dequantized inside the kernel (e4m3fn: 1 sign, 4 exponent bits bias 7, 3 mantissa bits,
// subnormals, no infinities, 0x7F/0xFF NaN) — never expanded to an f32 copy in memory.
// Same tiling as linear.cl (TM=1 for M<4 else 4; TN=4; 16-wide loads along K). The decode is
// chosen per device and weight (ops::fp8_decode_option, kernels_cl/linear_fp8.cl): f32-denormal
// based where the device keeps denormals (on CPUs, for weights with few subnormal codes), f16 based
// elsewhere or when CLSHARD_FP8_DECODE=f16. Either agrees with f32 arithmetic
// on the dequantized weight to rounding (the scale multiplies x, not W) while |x * scale| < 2^28.
// A NaN code makes its output feature NaN.
// compute BF16 (ops::linear_any below kFp8Bf16GemmRowsFrom rows): at any row count, on PoCL's CPU
// device where the host has vdpbf16ps (bf16_dot_product) and for weights with the short decode,
// the tiles in turn round x to bf16 and sum 32 products per vdpbf16ps, subnormal codes counting
// as 0 (fp8_tile.cl's fp8_in_turn_sums_bf16), each row the same bits among 1 to 4 rows; elsewhere
// as F32.
void linear_fp8(Device& dev, const cl::Mem& x, uint32_t x_off, uint32_t ldx, const Weight& w,
                const Weight& scale_inv, const cl::Mem& y, uint32_t y_off, uint32_t ldy, uint32_t M,
                float alpha = 1.0f, bool accumulate = false,
                ComputeDType compute = ComputeDType::F32);

// linear_fp8 of two FP8 weights with the same K side by side in y: columns [0, N0) from w0,
// [N0, N0 + N1) from w1, in one launch where both take its CPU shape's tiles (w0's rows a
// multiple of 4, the same e4m3 decode), else one each; every output the bits of linear_fp8 over
// its own weight. dsv3-mini's q_a_proj and kv_a_proj_with_mqa (MLA's first GEMVs).
void linear_fp8_pair(Device& dev, const cl::Mem& x, uint32_t x_off, uint32_t ldx, const Weight& w0,
                     const Weight& scale0, const Weight& w1, const Weight& scale1, const cl::Mem& y,
                     uint32_t y_off, uint32_t ldy, uint32_t M, float alpha = 1.0f,
                     bool accumulate = false, ComputeDType compute = ComputeDType::F32);

// The (N, K) of an FP8 weight after checking it and its scale tensor against each other (an
// error naming both, what they are and what was expected); `op` names the caller.
std::pair<uint32_t, uint32_t> check_fp8_weight(const char* op, const Weight& w,
                                               const Weight& scale_inv);

// linear_fp8 under model.compute_dtype: bf16, CPU shape (KernelShape::Chunks): x rounded to bf16,
// each column tile's weight rows dequantized to bf16 (dequantize_fp8_bf16's values) once per
// work-item into a private panel, then linear_bf16's micro-kernels; every row the bits of
// ops::linear's bf16 GEMM over dequantize_fp8_bf16's weight, without that N x K copy.
void linear_fp8_bf16(Device& dev, const cl::Mem& x, uint32_t x_off, uint32_t ldx, const Weight& w,
                     const Weight& scale_inv, const cl::Mem& y, uint32_t y_off, uint32_t ldy,
                     uint32_t M, float alpha = 1.0f, bool accumulate = false);

// out[N, K] f32 = e4m3(w) * scale_inv[n/128, k/128]: the dequantized weight, for the places that
// need it materialised (MLA's absorbed kv_b_proj slices, checks against a reference). Uses the
// same in-kernel decode as linear_fp8.
void dequantize_fp8(Device& dev, const Weight& w, const Weight& scale_inv, const cl::Mem& out);
// out[N, K] bf16 = the same values rounded to bf16 (nearest even), as linear_fp8_bf16's panels
// hold them.
void dequantize_fp8_bf16(Device& dev, const Weight& w, const Weight& scale_inv, const cl::Mem& out);

struct RouterConfig {
  uint32_t n_experts = 0, top_k = 0, n_group = 1, topk_group = 1;
  bool norm_topk_prob = true;
  float routed_scaling_factor = 1.0f;
};
// Throws std::invalid_argument naming the broken rule: n_experts > 0, top_k > 0, n_group > 0,
// n_experts % n_group == 0, 1 <= topk_group <= n_group, top_k <= experts in the kept groups, and
// at least 2 experts per group when there is more than one group (the group score is a top-2 sum).
void validate(const RouterConfig& cfg);

// DeepSeek-V3 noaux_tc routing for T tokens from router logits [T, E] (f32, = x . gate^T, computed
// by the caller with ops::linear): scores = sigmoid(logits); selection uses scores + correction
// bias (bias may be null; F32 or BF16 [E]); group score = sum of the top-2 (biased) scores in each
// group; keep the top `topk_group` groups; pick the top `top_k` experts among them; weights come
// from the UNBIASED scores, normalised to sum 1 when norm_topk_prob, times routed_scaling_factor.
// Ties go to the lower expert / group id. n_group == 1 works. Outputs topk_ids int32 [T, top_k]
// (in descending selection-score order) and topk_weights f32 [T, top_k]. One work-item per token.
void moe_route(Device& dev, const cl::Mem& logits, const Weight* correction_bias, uint32_t T,
               const RouterConfig& cfg, const cl::Mem& topk_ids, const cl::Mem& topk_weights);

// Host-side plan of the expert computation after routing (topk_ids read back to the host):
// token-slot pairs grouped by expert, in ascending (expert, token, slot) order.
struct ExpertBatches {
  std::vector<uint32_t> expert_offsets;  // [E+1] rows of expert e are [offsets[e], offsets[e+1])
  std::vector<uint32_t> src_token;       // [T*k] the token each grouped row comes from
  std::vector<uint32_t> slot_row;        // [T*k] for token t slot s: its grouped row index
};
// Throws std::out_of_range on an id outside [0, n_experts) and std::invalid_argument when
// topk_ids does not hold T * top_k ids.
ExpertBatches group_by_expert(const std::vector<int32_t>& topk_ids, uint32_t T, uint32_t top_k,
                              uint32_t n_experts);

// y[i] = x[rows[i]] for i < n (row width `width` floats): permute tokens into expert order.
// rows: uint32 [n].
void gather_rows(Device& dev, const cl::Mem& x, uint32_t ldx, const cl::Mem& rows, uint32_t n,
                 uint32_t width, const cl::Mem& y, uint32_t ldy);

// out[t] (+)= sum over s in 0..k-1, IN SLOT ORDER, of weights[t, s] * expert_out[slot_row[t*k + s]]
// — the combine; the fixed order makes the sum independent of which device computed which expert.
// slot_row: uint32 [T*k]; topk_weights: f32 [T, k]; expert_out rows have stride ld.
// with_shared: slot_row is [T*(k+1)] (plan_experts with a shared expert), the last row of each
// token the shared expert's output, added unweighted after: out = (out + routed) + shared, what
// the routed combine followed by an accumulating shared expert gives.
void moe_combine(Device& dev, const cl::Mem& expert_out, uint32_t ld, const cl::Mem& slot_row,
                 const cl::Mem& topk_weights, uint32_t T, uint32_t top_k, uint32_t H,
                 const cl::Mem& out, uint32_t ldo, bool accumulate, bool with_shared = false);


// Every local routed expert of one MoE layer in one buffer, so that one launch reaches them all
// (moe_grouped_linear in kernels_cl/moe.cl): `mem` holds the weights (and FP8 block scales),
// table (ulong [n_experts][6]) the element offsets of gate, up, down and of their scales.
struct GroupedExperts {
  cl::Mem mem, table;
  DType dtype = DType::F32;  // F32, BF16, F16 or F8_E4M3 (then with scales)
  uint32_t n_experts = 0, hidden = 0, inter = 0;
  bool fp8_nan_free = false;  // as Weight::fp8_nan_free, over every expert's FP8 weights
  float fp8_subnormal_share = 0.0f;  // as Weight::fp8_subnormal_share, over them all
  // Every bf16 weight row starts on a 4-byte boundary (grouped_rows_aligned, and `mem` itself
  // 4-byte aligned): bf16 compute's portable micro-kernel then loads the pairs as words.
  bool pairs_aligned = false;
  explicit operator bool() const { return bool(mem); }
};
// Whether every weight row of 2-byte experts at `table`'s element offsets (GroupedExperts::table's
// layout, [n_experts][6]) starts an even number of elements into the buffer: even offsets of gate,
// up and down, and rows of even length (hidden for gate and up, inter for down).
bool grouped_rows_aligned(const std::vector<uint64_t>& table, uint32_t hidden, uint32_t inter);
inline Fp8Codes fp8_codes(const GroupedExperts& g) {
  return {g.fp8_nan_free, g.fp8_subnormal_share};
}

// Where the grouped rows of a step are, on the device: expert_offsets [E + 1], the token of each
// grouped row (src_token [rows]), the grouped row of each (token, slot) (slot_row [rows]) and the
// row tiles the grouped kernels walk. Built by plan_experts (from the router's ids, nothing read
// back) or plan_expert_tiles (from offsets the host planned). plan_experts is one work-item's
// counting sort (no atomics), so the plan is group_by_expert's on every device. with_shared: the
// last of the n_experts is a shared expert every token visits after its top_k routed ones (its
// slot top_k in slot_row, which then holds T * (top_k + 1) rows).
struct GroupedPlan {
  Scratch expert_offsets, src_token, slot_row, cursor, tiles, tile_count;
  uint32_t rows = 0, n_experts = 0, tm = 1, rows_per_tile = 0, max_tiles = 0;
  uint32_t max_expert_rows = 0;  // no expert has more rows (plan_experts: the tokens)
};
GroupedPlan plan_experts(Device& dev, const cl::Mem& topk_ids, uint32_t T, uint32_t top_k,
                         uint32_t n_experts, bool with_shared = false);
// Uploads expert_offsets with a blocking write: the device's queue has drained when it returns.
GroupedPlan plan_expert_tiles(Device& dev, const std::vector<uint32_t>& expert_offsets);

// y[r, mat * N + n] = x[row(r)] . W_{e(r), slot0 + mat}[n] for mat < n_mats over every grouped row
// r of the plan (slot 0 gate, 1 up, 2 down; N, K the matrix's shape): gate and up together write
// dense_mlp's [gate | up] rows. row(r) = src_token[r] when x_rows is given (tokens read in place),
// else r. Each row's sums are those ops::linear / linear_fp8 form for it in the device's kernel
// shape (linear_wg's order in the WorkGroups shape for f32 / bf16 / f16). With
// ComputeDType::BF16, bf16 or FP8 experts averaging 8 rows or more (prefill), on the CPU shape,
// the rows are rounded to bf16 and each expert's rows take the sums of ops::linear's bf16 GEMM,
// bit for bit: the packed GEMM's (moe_grouped_packed; AMX where the host has it) for experts of
// ops::moe_bf16_packed_rows_from rows or more, the tiles' of linear_bf16.cl for the others (what
// ops::linear gives that many rows where the tuning's moe_bf16_packed_rows, for FP8 experts
// moe_fp8_packed_rows, and gemm_bf16_packed_rows agree);
// x_count is then the number of rows of x (the tokens, when x_rows is given). Below that average
// (decode), FP8 experts under ComputeDType::BF16 on the CPU shape, where ops::linear_fp8 sums in
// bf16 (vdpbf16ps, the short decode), take those bf16 sums for every row, an expert of fewer than
// kGemmRowsFrom rows included: each row the bits linear_fp8 gives it (among any 1 to 4 rows).
void moe_grouped_linear(Device& dev, const cl::Mem& x, uint32_t ldx, const cl::Mem* x_rows,
                        const GroupedExperts& experts, uint32_t slot0, uint32_t n_mats,
                        const GroupedPlan& plan, const cl::Mem& y, uint32_t ldy,
                        ComputeDType compute = ComputeDType::F32, uint32_t x_count = 0);

// The experts' SwiGLU: y[r, n] = silu(x[row(r)] . gate_e[n]) * (x[row(r)] . up_e[n]) for n < inter,
// the grouped rows' gate and up GEMMs (slots 0 and 1, as moe_grouped_linear) then silu_mul. Where
// moe_grouped_linear takes the bf16-compute tiles, one launch computes both and writes y; the
// other paths stage [gate | up] in a scratch.
void moe_grouped_swiglu(Device& dev, const cl::Mem& x, uint32_t ldx, const cl::Mem* x_rows,
                        const GroupedExperts& experts, const GroupedPlan& plan, const cl::Mem& y,
                        uint32_t ldy, ComputeDType compute = ComputeDType::F32,
                        uint32_t x_count = 0);
}  // namespace clshard::ops

// Plain C++ references used by the tests (and by the model's tests).
namespace clshard::reference {

// The same routing as ops::moe_route, on the host (validates cfg).
void route(const float* logits, const float* bias /*nullable*/, uint32_t T,
           const ops::RouterConfig& cfg, int32_t* ids, float* weights);

// One e4m3fn code as f32 (exact: every e4m3fn value is an f32 value).
float e4m3_to_f32(uint8_t v);

// out[N*K] = e4m3_to_f32(w[n, k]) * scale_inv[n/128, k/128], the checkpoint's dequantization.
void dequantize_fp8(const uint8_t* w, const float* scale_inv, uint32_t N, uint32_t K, float* out);

}  // namespace clshard::reference
