// Eagle3 draft weight names -> tensors on a device (MAX's convert_eagle3_draft_state_dict and
// convert_llama_eagle3_draft_state_dict): `fc.*`, `layers.0.*` (or `model.layers.0.*`),
// `norm.*` (or `model.norm.*`), `lm_head.*`, optional `d2t` / `t2d` vocabulary maps. The one
// shared tensor, the embedding, is the target's `model.embed_tokens.weight`.
#pragma once

#include <cstdint>
#include <vector>

#include "models/deepseek_v3/weights.h"
#include "models/eagle3_deepseek_v3/config.h"
#include "runtime/tensor.h"

namespace clshard {
class Device;
class WeightStore;
}  // namespace clshard

namespace clshard::eagle3_deepseek_v3 {

using deepseek_v3::Linear;

struct MhaWeights {
  Linear q, k, v;  // [heads * head_dim | kv_heads * head_dim, 2H]
  Linear o;        // [H, heads * head_dim]
};

struct Eagle3Weights {
  Weight embed;  // the target's [vocab, H]
  Linear fc;     // [H, fc_in]: fc_in = (number of aux layers) x H
  Weight input_norm, hidden_norm, post_attention_norm;
  deepseek_v3::MlaWeights mla;  // kind Mla
  MhaWeights mha;               // kind Mha
  deepseek_v3::MlpWeights mlp;
  Weight final_norm;
  Weight lm_head;  // [draft_vocab_size, H]
};

// The draft vocabulary's place in the target's (d2t: target id = draft id + d2t[draft id]).
struct VocabMap {
  bool identity = true;
  std::vector<int32_t> draft_of_target;  // [vocab_size]: the draft id, -1 where none maps
};

// What the draft checkpoint says before anything goes on a device: the fc input width and the
// vocabulary map. Errors name the file and the tensor (or config key).
struct DraftLayout {
  uint32_t fc_in = 0;
  VocabMap vocab;
};
DraftLayout inspect_draft(const Eagle3Config& cfg, const WeightStore& draft);

// Checks every tensor's shape and dtype (and that the checkpoint holds nothing else), and puts
// them on `dev`; the embedding comes from the target's store.
Eagle3Weights load_weights(const Eagle3Config& cfg, const DraftLayout& layout,
                           const WeightStore& draft, const WeightStore& target, Device& dev);

}  // namespace clshard::eagle3_deepseek_v3
