// Eagle3Config: the config.json of an Eagle3 draft for a DeepSeek-V3 target (max-reference.md §6),
// in either of the two kinds MAX runs over an MLA target:
//   Eagle3DeepseekV3ForCausalLM — the MLA draft: a DeepSeek-V3 config (a copy of the target's,
//     num_hidden_layers 1), its attention reading 2H; parsed by DeepseekV3Config.
//   LlamaForCausalLMEagle3 — the Llama-style MHA draft: heads, kv heads and head_dim of its own,
//     half-split RoPE with DeepSeek's YaRN from its rope_scaling.
// Both name the target layers they read in eagle_config.eagle_aux_hidden_state_layer_ids (HF
// convention: id L is the output of decoder layer L - 1).
#pragma once

#include <cstdint>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "models/deepseek_v3/config.h"

namespace clshard::eagle3_deepseek_v3 {

enum class DraftKind { Mla, Mha };

// The MHA draft's attention (LlamaForCausalLMEagle3).
struct MhaAttentionConfig {
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;
  int64_t head_dim = 0;
  double rope_theta = 10000.0;
  std::optional<deepseek_v3::YarnScaling> rope_scaling;  // DeepSeek YaRN, or none

  // head_dim/2 inverse frequencies (DeepSeek's YaRN ramp when scaled).
  std::vector<float> rope_inv_freqs() const;
  // head_dim^-0.5 (MAX's AttentionWithRope: no YaRN mscale^2), times the square of YaRN's cos/sin
  // multiplier, which the rope kernel does not apply: q.k carries it once from each side.
  float softmax_scale() const;
};

struct Eagle3Config {
  std::string architecture;  // config.json architectures[0]
  DraftKind kind = DraftKind::Mla;
  std::string config_path;  // for error messages
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;  // the dense MLP
  int64_t vocab_size = 0;         // the target's vocabulary
  int64_t draft_vocab_size = 0;   // rows of lm_head (d2t maps them to target ids when smaller)
  std::optional<int64_t> target_hidden_size;
  double rms_norm_eps = 1e-6;
  int64_t max_position_embeddings = 0;
  // eagle_config.eagle_aux_hidden_state_layer_ids, HF convention (1-based outputs).
  std::vector<int64_t> aux_layer_ids;
  deepseek_v3::DeepseekV3Config mla;  // kind == Mla: the draft's own DeepSeek config
  MhaAttentionConfig mha;             // kind == Mha

  // Parses and validates config.json in `dir`; errors name the file and the field.
  static Eagle3Config from_json(const nlohmann::json& j, const std::string& where);
  static Eagle3Config from_dir(const std::filesystem::path& dir);

  // Errors (naming this config's file and key, and the target's file) unless the draft fits the
  // target: hidden size and vocabulary equal, aux ids in [1, target num_hidden_layers].
  void check_target(const deepseek_v3::DeepseekV3Config& target,
                    const std::string& target_where) const;
  // The target layers to capture, 0-based (id - 1).
  std::vector<uint32_t> target_layers() const;
};

}  // namespace clshard::eagle3_deepseek_v3
