// The memory and parameter plan of a DeepSeek-V3 checkpoint from its config.json alone (so the real
// 671B model can be planned without its weights): every tensor the checkpoint holds, counted from
// the config (the same list the weight loader reads, plus the MTP blocks), in the dtypes the
// released checkpoints use; the paged MLA cache; and this engine's activation scratch for a step.
#pragma once

#include <cstdint>

#include <nlohmann/json.hpp>

#include "models/deepseek_v3/config.h"

namespace clshard::deepseek_v3 {

struct PlanOptions {
  uint32_t page_size = 128;          // MAX's default KV page
  uint32_t max_batch_tokens = 8192;  // new tokens per step (sizes the activation estimate)
  uint32_t max_context_tokens = 8192;  // cached + new tokens a prefill step decompresses
  uint32_t cache_dtype_bytes = 4;    // this engine keeps the MLA cache in f32
};

struct ParamCounts {
  uint64_t embedding = 0, lm_head = 0;
  uint64_t attention_per_layer = 0;    // MLA projections and their norms
  uint64_t dense_mlp_per_layer = 0;
  uint64_t routed_expert = 0;          // one expert (gate, up, down)
  uint64_t moe_per_layer = 0;          // routed + shared experts + router
  uint64_t main = 0;                   // embedding, num_hidden_layers layers, norm, lm_head
  uint64_t mtp = 0;                    // the MTP blocks as stored (with their embedding/head copies)
  uint64_t mtp_unique = 0;             // without those copies (DeepSeek's "11.5B unique")
  uint64_t active_per_token = 0;       // main model, top-k routed + shared experts per MoE layer
  uint64_t total() const { return main + mtp; }
};

struct MemoryPlan {
  ParamCounts params;
  std::string linear_dtype;      // "F8_E4M3+scales", "BF16" or "F32"
  uint64_t weight_bytes_main = 0, weight_bytes_mtp = 0;
  uint64_t routed_expert_bytes_main = 0;  // every routed expert of the main model (what EP splits)
  // Of weight_bytes_mtp: the routed experts of the MTP layers, and their copies of the embedding
  // and lm_head (which the NextN draft does not read: it uses the target's).
  uint64_t routed_expert_bytes_mtp = 0, mtp_copy_bytes = 0;
  uint64_t active_weight_bytes_per_token = 0;  // what one decode token streams (roofline)
  uint64_t kv_bytes_per_token = 0, kv_bytes_per_page = 0;
  uint64_t activation_bytes = 0;  // scratch of a step of max_batch_tokens (prefill path)
  PlanOptions options;
  uint32_t n_routed_experts = 0, num_experts_per_tok = 0, hidden_size = 0;
};

MemoryPlan plan_memory(const DeepseekV3Config& cfg, const PlanOptions& opts = {});
nlohmann::json to_json(const MemoryPlan& p);

}  // namespace clshard::deepseek_v3
