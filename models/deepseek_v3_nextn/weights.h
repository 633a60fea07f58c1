// The NextN block's tensors -> a device. Besides one DeepSeek-V3 decoder layer (deepseek_v3::
// load_layer): enorm and hnorm (RMSNorm weights [H]), eh_proj [H, 2H] and shared_head.norm [H]
// (copied from the target's final norm when absent, as MAX's weight adapter does). The embedding
// and lm_head are the target's (MAX aliases them; the block's own embed_tokens /
// shared_head.head copies are not read).
#pragma once

#include "models/deepseek_v3/weights.h"
#include "models/deepseek_v3_nextn/config.h"

namespace clshard::deepseek_v3_nextn {

struct NextNWeights {
  Weight embed;                      // the target's model.embed_tokens
  Weight enorm, hnorm;
  deepseek_v3::Linear eh_proj;       // [H, 2H]: [enorm(embed) | hnorm(hidden)] -> H
  deepseek_v3::LayerWeights layer;   // routed experts: the rank's block only
  Weight shared_head_norm;
  Weight lm_head;                    // the target's lm_head
};

NextNWeights load_weights(const NextNConfig& cfg, const WeightStore& target,
                          const WeightStore& block, Device& dev, uint32_t expert_begin,
                          uint32_t expert_end);

}  // namespace clshard::deepseek_v3_nextn
