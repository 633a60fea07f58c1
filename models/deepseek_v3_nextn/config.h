// DeepSeek-V3's NextN/MTP head as a draft model (MAX's deepseekV3_nextn, DeepseekV3NextNConfig):
// the target's DeepseekV3Config with one decoder layer, the block that sits after the main layers
// in the target checkpoint (model.layers.{num_hidden_layers}.*) or layer 0 of a standalone NextN
// checkpoint.
#pragma once

#include <filesystem>
#include <optional>
#include <string>

#include "models/deepseek_v3/config.h"

namespace clshard::deepseek_v3_nextn {

struct NextNConfig {
  deepseek_v3::DeepseekV3Config target;  // sizes, rope, router: the block is a V3 decoder layer
  std::filesystem::path weights_dir;     // where the block's tensors are
  std::string prefix;                    // their names: prefix + "enorm.weight", ...
  // MAX builds the block with layer_idx = max(num_hidden_layers, first_k_dense_replace): an MoE
  // layer whenever the target has routed experts.
  bool is_moe = true;

  // The block of the target checkpoint in target_dir, or of a standalone NextN checkpoint in
  // nextn_dir (names "model.layers.0.*" or "layers.0.*"). Throws naming the directory and the
  // missing tensor or the config field (num_nextn_predict_layers) when there is no block.
  static NextNConfig locate(const std::filesystem::path& target_dir,
                            const std::optional<std::filesystem::path>& nextn_dir);
};

}  // namespace clshard::deepseek_v3_nextn
