// The NextN/MTP draft (MAX's DeepseekV3NextN), per position i:
//   x = eh_proj([enorm(embed(t_{i+1})) | hnorm(h_i)])    (embedding first, hidden second)
//   h' = one DeepSeek-V3 decoder layer (MLA with its own one-layer cache + MoE, expert-parallel
//        like the target's, deepseek_v3::DecoderStack)
//   logits = lm_head(shared_head_norm(h'))
// h_i is the target's hidden state after its final norm at the draft's first step, and the draft's
// own h' (before shared_head_norm) at the later one-token steps. Runs on the target's devices with
// the target's replica layout; its cache shares the target's page ids.
#pragma once

#include <filesystem>
#include <memory>
#include <optional>
#include <vector>

#include "models/deepseek_v3/decoder.h"
#include "models/deepseek_v3_nextn/config.h"
#include "models/deepseek_v3_nextn/weights.h"
#include "runtime/model.h"
#include "runtime/safetensors.h"

namespace clshard::deepseek_v3_nextn {

class DeepseekV3NextN : public DraftModel {
 public:
  DeepseekV3NextN(const std::filesystem::path& target_dir,
                  const std::optional<std::filesystem::path>& nextn_dir, const LoadOptions& opts);
  ~DeepseekV3NextN() override;

  const DraftInfo& info() const override { return info_; }
  uint64_t kv_bytes_per_token() const override { return stack_.kv_bytes_per_token(); }
  void allocate_kv_cache(uint32_t num_pages, uint32_t page_size) override {
    stack_.allocate_cache(num_pages, page_size);
  }
  StepOutputs forward(const StepInputs& step, const std::vector<ReplicaHidden>& hidden,
                      uint32_t hidden_width) override;

  const NextNConfig& config() const { return cfg_; }
  void set_mla_path(ops::MlaPath p) { stack_.set_mla_path(p); }

 private:
  NextNConfig cfg_;
  std::unique_ptr<WeightStore> target_store_, block_store_;
  deepseek_v3::DecoderStack stack_;
  std::vector<NextNWeights> weights_;  // per replica
  DraftInfo info_;
};

}  // namespace clshard::deepseek_v3_nextn
