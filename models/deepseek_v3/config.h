// DeepseekV3Config: the fields of MAX's DeepseekV3Config that come from a Hugging Face config.json
// (DeepSeek-V3 and its smaller siblings), validated against what this engine computes.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace clshard {
class JsonFields;
}

namespace clshard::deepseek_v3 {

// rope_scaling with type (or rope_type) "yarn".
struct YarnScaling {
  double factor = 1.0;
  int64_t original_max_position = 4096;
  double beta_fast = 32.0;
  double beta_slow = 1.0;
  double mscale = 1.0;
  double mscale_all_dim = 0.0;
};

// DeepSeek's YaRN for any config that uses it (DeepSeek-V3, and the Eagle3 MHA draft, whose
// Llama-style config carries a DeepSeek rope_scaling): the rope_scaling object's fields (its type
// checked by the caller), the dim/2 inverse frequencies, and the multiplier on cos/sin.
YarnScaling read_yarn_scaling(const JsonFields& rope_scaling);
std::vector<float> yarn_inv_freqs(int64_t dim, double rope_theta,
                                  const std::optional<YarnScaling>& scaling);
float yarn_attention_factor(const std::optional<YarnScaling>& scaling);

// quantization_config of the released FP8 checkpoints: e4m3 weights with one f32 multiplier
// (`weight_scale_inv`) per block_n x block_k block; activations dynamic.
struct Fp8BlockQuant {
  int64_t block_n = 128;
  int64_t block_k = 128;
};

struct DeepseekV3Config {
  std::string architecture;  // DeepseekV3ForCausalLM
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;      // dense MLP of the first layers
  int64_t moe_intermediate_size = 0;  // per routed (and shared) expert
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;  // informational: MLA has one latent "head"
  int64_t q_lora_rank = 0;          // 0: no low-rank query (plain q_proj)
  int64_t kv_lora_rank = 0;
  int64_t qk_nope_head_dim = 0;
  int64_t qk_rope_head_dim = 0;
  int64_t v_head_dim = 0;
  int64_t n_routed_experts = 0;
  int64_t n_shared_experts = 0;
  int64_t num_experts_per_tok = 0;
  int64_t n_group = 1;
  int64_t topk_group = 1;
  std::string topk_method = "noaux_tc";
  std::string scoring_func = "sigmoid";
  bool norm_topk_prob = true;
  double routed_scaling_factor = 1.0;
  int64_t first_k_dense_replace = 0;
  int64_t moe_layer_freq = 1;
  double rope_theta = 10000.0;
  std::optional<YarnScaling> rope_scaling;
  bool rope_interleave = true;
  int64_t num_nextn_predict_layers = 0;
  double rms_norm_eps = 1e-6;
  int64_t max_position_embeddings = 0;
  std::optional<Fp8BlockQuant> quantization;
  std::string torch_dtype;  // "bfloat16", "float32", ...
  std::vector<int64_t> eos_token_ids;
  std::optional<int64_t> bos_token_id;

  // Parses and validates; errors name `where` (the file) and the field.
  static DeepseekV3Config from_json(const nlohmann::json& j, const std::string& where);
  // config.json (+ generation_config.json for eos/bos when present) in `dir`.
  static DeepseekV3Config from_dir(const std::filesystem::path& dir);

  int64_t qk_head_dim() const { return qk_nope_head_dim + qk_rope_head_dim; }
  // One paged-cache row per token per layer: normalised latent then roped key part.
  int64_t cache_row_width() const { return kv_lora_rank + qk_rope_head_dim; }
  // MAX's _get_mlp: a routed MoE from first_k_dense_replace on, every moe_layer_freq-th layer.
  bool is_moe_layer(int64_t layer) const {
    return n_routed_experts > 0 && layer >= first_k_dense_replace && layer % moe_layer_freq == 0;
  }
  // yarn_get_mscale(factor, m) = 0.1 * m * ln(factor) + 1 for factor > 1, else 1.
  static double yarn_mscale(double factor, double m);
  // 1/sqrt(qk_head_dim) * mscale^2 with MAX's mscale (rope_scaling.mscale).
  float softmax_scale() const;
  // The multiplier YaRN puts on cos/sin: mscale(factor, mscale) / mscale(factor, mscale_all_dim).
  float rope_attention_factor() const;
  // qk_rope_head_dim/2 inverse frequencies with YaRN's ramp between interpolation and
  // extrapolation (DeepseekYarnRotaryEmbedding._compute_yarn_freqs), in f32 as the references.
  std::vector<float> rope_inv_freqs() const;
};

}  // namespace clshard::deepseek_v3
