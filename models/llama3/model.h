// The Llama 3 forward pass on one device (MAX's Llama3 / TransformerBlock):
//   h = embed(tokens) * embedding_multiplier
//   per layer: h += m * o_proj(attention(rope(qkv(norm(h)))));  h += m * down(silu(gate) * up)
//   logits = lm_head(norm(h[rows])) / logits_scaling
#pragma once

#include <filesystem>
#include <memory>

#include "models/llama3/config.h"
#include "models/llama3/weights.h"
#include "runtime/model.h"
#include "runtime/safetensors.h"

namespace clshard::llama3 {

class Llama3Model : public CausalLM {
 public:
  Llama3Model(const std::filesystem::path& dir, const LoadOptions& opts);

  const ModelInfo& info() const override { return info_; }
  uint64_t kv_bytes_per_token() const override;
  void allocate_kv_cache(uint32_t num_pages, uint32_t page_size) override;
  uint32_t kv_num_pages() const override { return num_pages_; }
  uint32_t kv_page_size() const override { return page_size_; }
  // The returned logits buffer is the model's and stays valid until the next forward.
  StepOutputs forward(const StepInputs& step) override;
  std::vector<Device*> devices() const override { return {&dev_}; }

  const Llama3Config& config() const { return cfg_; }

 private:
  Llama3Config cfg_;
  Device& dev_;
  std::unique_ptr<WeightStore> store_;  // keeps the mapped files alive under the weights
  Llama3Weights w_;
  ModelInfo info_;
  cl::Mem inv_freq_, inv_freq_long_;
  uint32_t long_from_ = 0xffffffffu;
  // Paged KV cache, one buffer per layer (each stays under the device's max allocation).
  std::vector<cl::Mem> kv_;
  uint32_t num_pages_ = 0, page_size_ = 0;
  cl::Mem logits_;
  size_t logits_capacity_ = 0;
};

}  // namespace clshard::llama3
