// LoRA adapters on DeepSeek-V3 (runtime/ops_lora.h reads, checks, keeps resident and applies
// them): the attention projections q_a_proj, q_b_proj (q_proj when the model has no q_lora_rank),
// kv_a_proj_with_mqa and o_proj, and the MLPs of the dense layers and of the shared experts
// (gate/up/down_proj). Routed experts are not supported (one adapter product per expert would be
// a grouped GEMM of its own), nor kv_b_proj, whose K and V halves MLA absorbs into the query and
// the output (an adapter there would have to be absorbed the same way).
#pragma once

#include <cstddef>

#include "models/deepseek_v3/config.h"
#include "runtime/ops_lora.h"

namespace clshard::deepseek_v3 {

// A layer's targets; module layer * kLoraTargets + t of lora_targets() is layer's target t. The
// MLP targets are mlp.* on dense layers and mlp.shared_experts.* on MoE layers.
enum LoraTarget { kLoraQa, kLoraQb, kLoraQ, kLoraKvA, kLoraO, kLoraGate, kLoraUp, kLoraDown,
                  kLoraTargets };

// Every layer's targets (a target a layer lacks, q_proj beside q_a/q_b say, has an empty path).
LoraTargets lora_targets(const DeepseekV3Config& cfg);

// A layer's view of a step's LoRA (inactive by default: the base model, the drafts' layers).
struct LayerLora {
  const LoraAdapters::Batch* batch = nullptr;
  size_t layer = 0;
  bool active() const { return batch && batch->active(); }
  void apply(LoraTarget t, const cl::Mem& x, uint32_t x_off, uint32_t ldx, const cl::Mem& y,
             uint32_t y_off, uint32_t ldy) const {
    if (active()) batch->apply(layer * kLoraTargets + t, x, x_off, ldx, y, y_off, ldy);
  }
};

}  // namespace clshard::deepseek_v3
