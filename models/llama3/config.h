// Llama3Config: the fields of MAX's Llama3Config that come from a Hugging Face config.json, plus
// what the tensor names tell (stacked qkv_proj / gate_up_proj, tied embeddings).
#pragma once

#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace clshard {
class WeightStore;
}

namespace clshard::llama3 {

struct Llama3RopeScaling {  // rope_scaling.rope_type == "llama3"
  double factor = 1.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  double original_max_position = 8192;
};

struct LongRopeScaling {  // rope_scaling.rope_type == "longrope"
  std::vector<double> short_factor;
  std::vector<double> long_factor;
  int64_t original_max_position = 0;
};

struct Llama3Config {
  std::string architecture;  // LlamaForCausalLM (or a Granite/OLMo/Exaone sibling)
  int64_t hidden_size = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;
  int64_t head_dim = 0;  // hf head_dim, or hidden_size / num_attention_heads
  int64_t num_hidden_layers = 0;
  int64_t intermediate_size = 0;
  int64_t vocab_size = 0;
  double rope_theta = 10000.0;
  int64_t max_position_embeddings = 0;
  double rms_norm_eps = 1e-5;
  bool tie_word_embeddings = false;
  bool attention_bias = false;
  std::optional<Llama3RopeScaling> rope_scaling;
  std::optional<LongRopeScaling> longrope_scaling;
  // Granite / OLMo fields (1.0 / none when absent).
  double attention_multiplier = 0;  // softmax scale; default 1/sqrt(head_dim)
  double embedding_multiplier = 1.0;
  double residual_multiplier = 1.0;
  double logits_scaling = 1.0;
  std::optional<double> clip_qkv;
  // From the tensor names.
  bool stacked_qkv = false;
  bool stacked_mlp = false;
  std::vector<int64_t> eos_token_ids;  // config.json / generation_config.json
  std::optional<int64_t> bos_token_id;

  // Reads config.json (and generation_config.json when present) in `dir`. Errors name the file and
  // the field.
  static Llama3Config from_json(const nlohmann::json& j, const std::string& where);
  static Llama3Config from_dir(const std::filesystem::path& dir);
  // finalize(): what the weights tell.
  void finalize(const WeightStore& weights);

  // Per head, the rotary inverse frequencies with the llama3 scaling applied (d/2 values).
  std::vector<float> rope_inv_freqs() const;
  // For longrope: a second table for positions >= original_max_position.
  std::vector<float> rope_inv_freqs_long() const;
  float attention_scale() const;
};

}  // namespace clshard::llama3
