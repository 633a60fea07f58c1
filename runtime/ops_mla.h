// Multi-head latent attention (DeepSeek-V3's MLA, MAX's LatentAttentionWithRope) as plain functions
// over kernels_cl/mla.cl, in the style of ops.h: each enqueues on the device's in-order queue.
//
// Per layer and step: the fused projection gives q [T, heads * (nope + rope)] and the raw
// kv_a_proj_with_mqa output [T, kv_lora + rope]; mla_rope_store ropes q_pe and writes each token's
// cache row [RMSNorm(c_kv) * gamma | RoPE(k_pe)]; then one of two paths computes
// out [T, heads * v] (before o_proj) from the cache:
//   decode  — absorbed: q_lat = q_nope W_uk, attention in the latent space against whole cache
//             rows, o = (p . c_kv) W_uv^T;
//   prefill — decompressed: K-nope and V of every cached + new token = c_kv kv_b_proj^T, then
//             ordinary attention with the shared roped key from the cache.
// Both give the same numbers up to f32 rounding; MAX picks decode while every request has at most
// a few query tokens (choose_mla_path).
#pragma once

#include <cstdint>
#include <vector>

#include "runtime/cl.h"
#include "runtime/device.h"
#include "runtime/ops.h"
#include "runtime/step.h"
#include "runtime/tensor.h"

namespace clshard::ops {

struct MlaShape {
  uint32_t n_heads = 0, kv_lora = 0, nope = 0, rope = 0, v = 0;
  DType cache_dtype = DType::F32;  // the latent cache's elements (kv_cache.dtype: F32, BF16 or F8_E4M3)
  uint32_t qk() const { return nope + rope; }
  uint32_t row() const { return kv_lora + rope; }  // cache row width (576 for V3)
};
// Throws std::invalid_argument unless kv_lora and rope are multiples of 16 and nope and v of 8
// (the kernels' vector widths; V3: 512, 64, 128, 128).
void validate(const MlaShape& s);

// y = alpha * x W^T (+ y) for a linear weight of any dtype the kernels read: F32/BF16 through
// ops::linear, F8_E4M3 with its block scales through ops::linear_fp8, with the activations
// fake-quantized to fp8 first (act_quant_fp8) when quantize_fp8_activations. With
// ComputeDType::BF16 (and no activation quantization) an F8_E4M3 GEMM of 16 rows or more
// (kFp8Bf16GemmRowsFrom) on the CPU shape runs the bf16 GEMM over the weight dequantized to bf16
// as it goes (linear_fp8_bf16: the tiles' private panels, or from gemm_bf16_packed_rows rows the
// packed GEMM's panels), the bits of ops::linear over dequantize_fp8_bf16's weight (fewer rows
// keep linear_fp8: the dequantization would cost more than it saves). In the GPU shape, FP8 GEMMs
// of the device's blas_gemm_rows and more go to CLBlast (ops_blas.h: blas_linear_fp8).
void linear_any(Device& dev, const cl::Mem& x, uint32_t x_off, uint32_t ldx, const Weight& w,
                const Weight* scale_inv, const cl::Mem& y, uint32_t y_off, uint32_t ldy,
                uint32_t M, float alpha = 1.0f, bool accumulate = false,
                bool quantize_fp8_activations = false,
                ComputeDType compute = ComputeDType::F32);
// linear_any of two weights with the same K side by side in y (w0's N0 columns, then w1's): one
// launch (ops::linear_fp8_pair) where both are FP8 and linear_any would give each linear_fp8,
// else linear_any each; the bits of linear_any over each weight either way.
void linear_any_pair(Device& dev, const cl::Mem& x, uint32_t x_off, uint32_t ldx, const Weight& w0,
                     const Weight* scale0, const Weight& w1, const Weight* scale1, const cl::Mem& y,
                     uint32_t y_off, uint32_t ldy, uint32_t M,
                     bool quantize_fp8_activations = false,
                     ComputeDType compute = ComputeDType::F32);

// y[M, K] (contiguous) = x rows fake-quantized to fp8 per token per 128 columns (MAX's and
// DeepSeek's activation quantization for FP8 weights).
void act_quant_fp8(Device& dev, const cl::Mem& x, uint32_t x_off, uint32_t ldx, uint32_t M,
                   uint32_t K, const cl::Mem& y);

enum class MlaPath { Auto, Decode, Prefill };
// MAX's graph_mode "auto" takes the decode branch iff the longest request of the step has at most
// this many query tokens (MLA_DECODE_MAX_SEQ_LEN on NVIDIA), so MTP verification stays absorbed.
constexpr uint32_t kMlaDecodeMaxQueryLen = 8;
MlaPath choose_mla_path(MlaPath requested, uint32_t max_query_len);
const char* mla_path_name(MlaPath p);

// RoPE (YaRN frequencies, times rope_factor) on every head's q_pe in place, and the store of each
// new token's cache row from the raw kv [T, kv_lora + rope] at kv_off (row stride ldkv).
void mla_rope_store(Device& dev, const cl::Mem& q, uint32_t q_off, uint32_t ldq,
                    const cl::Mem& kv, uint32_t kv_off, uint32_t ldkv, const Weight& kv_norm,
                    float eps, const cl::Mem& inv_freq, float rope_factor, bool interleaved,
                    const MlaShape& s, const StepTokens& st, const cl::Mem& cache_layer);

// ---- decode path (absorbed) -----------------------------------------------------------------
// qf[T, heads, row] = [q_nope W_uk (kv_lora) | q_pe (rope)], W_uk = kv_b_proj's K-nope rows.
void mla_absorb_q(Device& dev, const cl::Mem& q, uint32_t q_off, uint32_t ldq,
                  const Weight& kv_b, const Weight* kv_b_scale, const MlaShape& s, uint32_t T,
                  const cl::Mem& qf);
// o_lat[T, heads, kv_lora] = softmax(scale * qf . rows) . rows[:, :kv_lora], causal per token.
void mla_decode_attention(Device& dev, const cl::Mem& qf, const cl::Mem& cache_layer,
                          const StepTokens& st, const MlaShape& s, float scale,
                          const cl::Mem& o_lat);
// out[T, heads * v] = per head o_lat W_uv^T, W_uv = kv_b_proj's V rows.
void mla_up_project(Device& dev, const cl::Mem& o_lat, const Weight& kv_b,
                    const Weight* kv_b_scale, const MlaShape& s, uint32_t T, const cl::Mem& out,
                    uint32_t out_off, uint32_t ldo);
// The three above: out[T, heads * v] from q (after mla_rope_store) and the cache.
void mla_attention_decode(Device& dev, const cl::Mem& q, uint32_t q_off, uint32_t ldq,
                          const cl::Mem& cache_layer, const StepTokens& st, const Weight& kv_b,
                          const Weight* kv_b_scale, const MlaShape& s, float scale,
                          const cl::Mem& out, uint32_t ldo);

// ---- prefill path (decompressed) --------------------------------------------------------------
// Which cache rows a step's prefill decompresses: every row b's positions 0 .. cache_length +
// new tokens - 1, rows concatenated (MAX's flare_mla_prefill_plan with one chunk); rows without new
// tokens contribute none.
struct MlaPrefillRows {
  std::vector<uint32_t> src_rows;   // cache row index (page * page_size + slot) per buffer row
  std::vector<uint32_t> ctx_start;  // [B] first buffer row of each request
};
MlaPrefillRows mla_prefill_rows(const StepInputs& in, uint32_t page_size);
// The same on the device, built once per step and used by every layer.
struct MlaPrefillPlan {
  Scratch src_rows, ctx_start;
  uint32_t total_rows = 0;
};
MlaPrefillPlan upload_mla_prefill_plan(Device& dev, const StepInputs& in, uint32_t page_size);

// out[T, heads * v]: gathers the latent rows, decompresses K-nope|V = c_kv kv_b_proj^T
// [rows, heads * (nope + v)] (a GEMM of the model's compute dtype, as linear_any), and attends
// with the roped key part read from the cache (in bf16 where ops::attention_bf16 holds).
void mla_attention_prefill(Device& dev, const cl::Mem& q, uint32_t q_off, uint32_t ldq,
                           const cl::Mem& cache_layer, const StepTokens& st,
                           const MlaPrefillPlan& plan, const Weight& kv_b,
                           const Weight* kv_b_scale, const MlaShape& s, float scale,
                           const cl::Mem& out, uint32_t ldo,
                           ComputeDType compute = ComputeDType::F32);

}  // namespace clshard::ops
