// The DeepSeek-V3 forward pass on one device (MAX's DeepseekV3 / DeepseekV3DecoderLayer in DP_EP
// mode with one device, computed as DeepSeek's inference/model.py):
//   h = embed(tokens)
//   per layer: h += o_proj(MLA(norm(h)));  h += MLP(norm(h)) for the first dense layers,
//              h += sum_k w_k expert_k(norm(h)) + shared(norm(h)) for the MoE layers
//   logits = lm_head(norm(h[rows]))
// MLA writes one latent row per token per layer into the paged cache and takes the absorbed
// (decode) or decompressed (prefill) path per step (runtime/ops_mla.h). Routing, permutation and
// combine are runtime/ops_moe.h's; each routed expert runs as its own GEMM over its rows.
#pragma once

#include <filesystem>
#include <memory>

#include "models/deepseek_v3/config.h"
#include "models/deepseek_v3/weights.h"
#include "runtime/model.h"
#include "runtime/ops_mla.h"
#include "runtime/ops_moe.h"
#include "runtime/safetensors.h"

namespace clshard::deepseek_v3 {

class DeepseekV3Model : public CausalLM {
 public:
  DeepseekV3Model(const std::filesystem::path& dir, const LoadOptions& opts);

  const ModelInfo& info() const override { return info_; }
  uint64_t kv_bytes_per_token() const override;
  void allocate_kv_cache(uint32_t num_pages, uint32_t page_size) override;
  uint32_t kv_num_pages() const override { return num_pages_; }
  uint32_t kv_page_size() const override { return page_size_; }
  // The returned logits buffer is the model's and stays valid until the next forward.
  StepOutputs forward(const StepInputs& step) override;
  std::vector<Device*> devices() const override { return {&dev_}; }

  const DeepseekV3Config& config() const { return cfg_; }
  const DeepseekV3Weights& weights() const { return w_; }
  // Auto (the default) chooses the MLA path per step as MAX does; Decode/Prefill force one, so
  // tests can run both on the same inputs.
  void set_mla_path(ops::MlaPath p) { mla_path_ = p; }
  ops::MlaPath last_mla_path() const { return last_path_; }
  // The MTP layers found in the checkpoint (kept on disk for speculative decoding).
  const std::vector<int64_t>& mtp_layers() const { return mtp_layers_; }

 private:
  // y (+)= down(silu(gate(x)) * up(x)) for M rows; gu is scratch of at least M x 2F floats.
  void mlp(const MlpWeights& m, const cl::Mem& x, uint32_t x_off, uint32_t M, uint32_t F,
           const cl::Mem& gu, const cl::Mem& y, uint32_t y_off, bool accumulate);
  // h += routed experts + shared expert of xn (T rows).
  void moe(const MoeWeights& m, const cl::Mem& xn, const cl::Mem& h, uint32_t T);

  DeepseekV3Config cfg_;
  Device& dev_;
  std::unique_ptr<WeightStore> store_;  // keeps the mapped files alive under the weights
  DeepseekV3Weights w_;
  std::vector<int64_t> mtp_layers_;
  ModelInfo info_;
  ops::MlaShape mla_;
  ops::RouterConfig router_;
  cl::Mem inv_freq_;
  ops::MlaPath mla_path_ = ops::MlaPath::Auto, last_path_ = ops::MlaPath::Auto;
  // Paged MLA cache, one buffer per layer: [(num_pages + 1) * page_size, kv_lora + rope] f32.
  std::vector<cl::Mem> cache_;
  uint32_t num_pages_ = 0, page_size_ = 0;
  cl::Mem logits_;
  size_t logits_capacity_ = 0;
};

}  // namespace clshard::deepseek_v3
