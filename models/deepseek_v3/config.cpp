#include "models/deepseek_v3/config.h"

#include <algorithm>
#include <cmath>

#include "runtime/json_fields.h"
#include "runtime/safetensors.h"

namespace clshard::deepseek_v3 {

namespace {

void require_positive(const JsonFields& f, const char* key, int64_t v) {
  if (v <= 0) f.error(key, "must be positive, got " + std::to_string(v));
}

Fp8BlockQuant read_quantization(const JsonFields& q) {
  const std::string method = q.string("quant_method", "");
  if (method != "fp8")
    q.error("quant_method", "'" + method +
                                "' is not supported (DeepSeek-V3 checkpoints: fp8 with 128x128 "
                                "block scales)");
  const std::string fmt = q.string("fmt", "e4m3");
  if (fmt != "e4m3") q.error("fmt", "'" + fmt + "' is not supported (e4m3 only)");
  const std::string act = q.string("activation_scheme", "dynamic");
  if (act != "dynamic")
    q.error("activation_scheme", "'" + act + "' is not supported (dynamic only)");
  if (!q.has("weight_block_size")) q.error("weight_block_size", "missing (expected [128, 128])");
  const auto& b = q.raw("weight_block_size");
  if (!b.is_array() || b.size() != 2 || !b[0].is_number_integer() || !b[1].is_number_integer())
    q.type_error("weight_block_size", "a list of two integers", b);
  Fp8BlockQuant fq{b[0].get<int64_t>(), b[1].get<int64_t>()};
  // The block GEMM kernels index scales as [n / 128, k / 128], as the released checkpoints do.
  if (fq.block_n != 128 || fq.block_k != 128)
    q.error("weight_block_size", "[" + std::to_string(fq.block_n) + ", " +
                                     std::to_string(fq.block_k) +
                                     "] is not supported (only [128, 128])");
  return fq;
}

}  // namespace

YarnScaling read_yarn_scaling(const JsonFields& rs) {
  YarnScaling y;
  y.factor = rs.number("factor");
  y.original_max_position = rs.integer("original_max_position_embeddings", 4096);
  y.beta_fast = rs.number("beta_fast", 32.0);
  y.beta_slow = rs.number("beta_slow", 1.0);
  y.mscale = rs.number("mscale", 1.0);
  y.mscale_all_dim = rs.number("mscale_all_dim", 0.0);
  if (!(y.factor > 0)) rs.error("factor", "must be positive");
  if (y.original_max_position <= 0)
    rs.error("original_max_position_embeddings", "must be positive");
  if (!(y.beta_fast > 0) || !(y.beta_slow > 0)) rs.error("beta_fast", "betas must be positive");
  return y;
}

DeepseekV3Config DeepseekV3Config::from_json(const nlohmann::json& j, const std::string& where) {
  JsonFields f(j, where);
  DeepseekV3Config c;
  c.architecture = f.architecture({"DeepseekV3ForCausalLM"}, "DeepseekV3ForCausalLM");
  c.vocab_size = f.integer("vocab_size");
  c.hidden_size = f.integer("hidden_size");
  c.intermediate_size = f.integer("intermediate_size");
  c.moe_intermediate_size = f.integer("moe_intermediate_size");
  c.num_hidden_layers = f.integer("num_hidden_layers");
  c.num_attention_heads = f.integer("num_attention_heads");
  c.num_key_value_heads = f.integer("num_key_value_heads", c.num_attention_heads);
  // q_lora_rank null (or absent) means a plain q_proj, as DeepSeek-V2-Lite.
  c.q_lora_rank = f.has("q_lora_rank") ? f.integer("q_lora_rank") : 0;
  c.kv_lora_rank = f.integer("kv_lora_rank");
  c.qk_nope_head_dim = f.integer("qk_nope_head_dim");
  c.qk_rope_head_dim = f.integer("qk_rope_head_dim");
  c.v_head_dim = f.integer("v_head_dim");
  for (auto [k, v] : {std::pair{"vocab_size", c.vocab_size}, {"hidden_size", c.hidden_size},
                      {"intermediate_size", c.intermediate_size},
                      {"moe_intermediate_size", c.moe_intermediate_size},
                      {"num_hidden_layers", c.num_hidden_layers},
                      {"num_attention_heads", c.num_attention_heads},
                      {"kv_lora_rank", c.kv_lora_rank}, {"qk_nope_head_dim", c.qk_nope_head_dim},
                      {"qk_rope_head_dim", c.qk_rope_head_dim}, {"v_head_dim", c.v_head_dim}})
    require_positive(f, k, v);
  if (c.q_lora_rank < 0) f.error("q_lora_rank", "must be positive or null");
  if (c.qk_rope_head_dim % 2 != 0)
    f.error("qk_rope_head_dim", "must be even (RoPE rotates pairs), got " +
                                    std::to_string(c.qk_rope_head_dim));

  // Experts and routing.
  c.n_routed_experts = f.integer("n_routed_experts");
  c.n_shared_experts = f.integer("n_shared_experts", 0);
  c.num_experts_per_tok = f.integer("num_experts_per_tok");
  c.n_group = f.integer("n_group", 1);
  c.topk_group = f.integer("topk_group", 1);
  c.topk_method = f.string("topk_method", "noaux_tc");
  c.scoring_func = f.string("scoring_func", "sigmoid");
  c.norm_topk_prob = f.boolean("norm_topk_prob", true);
  c.routed_scaling_factor = f.number("routed_scaling_factor", 1.0);
  c.first_k_dense_replace = f.integer("first_k_dense_replace", 0);
  c.moe_layer_freq = f.integer("moe_layer_freq", 1);
  require_positive(f, "n_routed_experts", c.n_routed_experts);
  if (c.n_shared_experts < 0) f.error("n_shared_experts", "must not be negative");
  if (c.num_experts_per_tok <= 0 || c.num_experts_per_tok > c.n_routed_experts)
    f.error("num_experts_per_tok", "must be in [1, n_routed_experts = " +
                                       std::to_string(c.n_routed_experts) + "], got " +
                                       std::to_string(c.num_experts_per_tok));
  if (c.n_group <= 0 || c.n_routed_experts % c.n_group != 0)
    f.error("n_group", "must divide n_routed_experts (" + std::to_string(c.n_routed_experts) +
                           "), got " + std::to_string(c.n_group));
  if (c.topk_group <= 0 || c.topk_group > c.n_group)
    f.error("topk_group", "must be in [1, n_group = " + std::to_string(c.n_group) + "], got " +
                              std::to_string(c.topk_group));
  const int64_t group_size = c.n_routed_experts / c.n_group;
  if (c.n_group > 1 && group_size < 2)
    f.error("n_group", "groups of " + std::to_string(group_size) +
                           " expert(s): group scores sum each group's top 2, so a group needs 2");
  if (c.num_experts_per_tok > c.topk_group * group_size)
    f.error("num_experts_per_tok", std::to_string(c.num_experts_per_tok) +
                                       " experts cannot be chosen from topk_group x group size = " +
                                       std::to_string(c.topk_group * group_size) + " candidates");
  // MAX's DeepseekV3TopKRouter: sigmoid scores with the aux-loss-free correction bias only.
  if (c.topk_method != "noaux_tc")
    f.error("topk_method", "'" + c.topk_method +
                               "' is not supported (DeepSeek-V3 routes with noaux_tc; greedy and "
                               "group_limited_greedy are DeepSeek-V2's softmax routers)");
  if (c.scoring_func != "sigmoid")
    f.error("scoring_func", "'" + c.scoring_func + "' is not supported (sigmoid only)");
  if (!(c.routed_scaling_factor > 0))
    f.error("routed_scaling_factor", "must be positive");
  if (c.first_k_dense_replace < 0 || c.first_k_dense_replace > c.num_hidden_layers)
    f.error("first_k_dense_replace", "must be in [0, num_hidden_layers = " +
                                         std::to_string(c.num_hidden_layers) + "]");
  require_positive(f, "moe_layer_freq", c.moe_layer_freq);

  // Positions.
  c.rope_theta = f.number("rope_theta", 10000.0);
  if (!(c.rope_theta > 1.0)) f.error("rope_theta", "must be > 1");
  c.max_position_embeddings = f.integer("max_position_embeddings", 4096);
  require_positive(f, "max_position_embeddings", c.max_position_embeddings);
  c.rope_interleave = f.boolean("rope_interleave", true);
  if (auto rs = f.object("rope_scaling")) {
    const std::string type = rs->string("type", rs->string("rope_type", ""));
    if (type != "yarn")
      rs->error(rs->has("type") ? "type" : "rope_type",
                "'" + type + "' is not supported for DeepSeek-V3 (yarn only)");
    c.rope_scaling = read_yarn_scaling(*rs);
  }
  c.num_nextn_predict_layers = f.integer("num_nextn_predict_layers", 0);
  if (c.num_nextn_predict_layers < 0) f.error("num_nextn_predict_layers", "must not be negative");
  c.rms_norm_eps = f.number("rms_norm_eps", 1e-6);

  if (f.has("hidden_act") && f.string("hidden_act", "silu") != "silu")
    f.error("hidden_act", "only silu is supported, got '" + f.string("hidden_act", "") + "'");
  if (f.boolean("tie_word_embeddings", false))
    f.error("tie_word_embeddings", "DeepSeek-V3 has a separate lm_head (MAX rejects tied "
                                   "embeddings)");
  if (f.boolean("attention_bias", false))
    f.error("attention_bias", "MLA projections have no bias");
  if (auto q = f.object("quantization_config")) c.quantization = read_quantization(*q);
  c.torch_dtype = f.string("torch_dtype", "bfloat16");
  if (f.has("eos_token_id")) c.eos_token_ids = f.integers("eos_token_id");
  c.bos_token_id = f.optional_integer("bos_token_id");
  return c;
}

DeepseekV3Config DeepseekV3Config::from_dir(const std::filesystem::path& dir) {
  const auto path = dir / "config.json";
  DeepseekV3Config c = from_json(read_json_file(path), path.string());
  const auto gen = dir / "generation_config.json";
  if (std::filesystem::exists(gen)) {
    const auto g = read_json_file(gen);
    JsonFields f(g, gen.string());
    if (f.has("eos_token_id")) c.eos_token_ids = f.integers("eos_token_id");
    if (f.has("bos_token_id")) c.bos_token_id = f.integer("bos_token_id");
  }
  return c;
}

double DeepseekV3Config::yarn_mscale(double factor, double m) {
  return factor <= 1.0 ? 1.0 : 0.1 * m * std::log(factor) + 1.0;
}

float DeepseekV3Config::softmax_scale() const {
  double s = 1.0 / std::sqrt(double(qk_head_dim()));
  if (rope_scaling) {
    // MAX takes rope_scaling["mscale"] here (HF takes mscale_all_dim; V3 has both 1.0).
    const double m = yarn_mscale(rope_scaling->factor, rope_scaling->mscale);
    s *= m * m;
  }
  return float(s);
}

float DeepseekV3Config::rope_attention_factor() const {
  return yarn_attention_factor(rope_scaling);
}

std::vector<float> DeepseekV3Config::rope_inv_freqs() const {
  return yarn_inv_freqs(qk_rope_head_dim, rope_theta, rope_scaling);
}

float yarn_attention_factor(const std::optional<YarnScaling>& scaling) {
  if (!scaling) return 1.0f;
  using C = DeepseekV3Config;
  return float(C::yarn_mscale(scaling->factor, scaling->mscale) /
               C::yarn_mscale(scaling->factor, scaling->mscale_all_dim));
}

std::vector<float> yarn_inv_freqs(int64_t dim, double rope_theta,
                                  const std::optional<YarnScaling>& rope_scaling) {
  const int64_t half = dim / 2;
  std::vector<float> inv(static_cast<size_t>(half));
  for (int64_t i = 0; i < half; ++i)
    inv[size_t(i)] = 1.0f / std::pow(float(rope_theta), float(2 * i) / float(dim));
  if (!rope_scaling) return inv;
  const YarnScaling& y = *rope_scaling;
  // Dimension index at which a frequency completes `rotations` turns over the original context.
  auto correction_dim = [&](double rotations) {
    return double(dim) * std::log(double(y.original_max_position) / (rotations * 2.0 * M_PI)) /
           (2.0 * std::log(double(int64_t(rope_theta))));
  };
  const double low = std::max(std::floor(correction_dim(y.beta_fast)), 0.0);
  const double high = std::min(std::ceil(correction_dim(y.beta_slow)), double(dim - 1));
  const double span = high == low ? 0.001 : high - low;
  for (int64_t i = 0; i < half; ++i) {
    // ramp 0: keep the original (extrapolated) frequency; 1: interpolate by 1/factor.
    const float ramp = float(std::clamp((double(i) - low) / span, 0.0, 1.0));
    const float extra = inv[size_t(i)], inter = extra / float(y.factor);
    inv[size_t(i)] = inter * ramp + extra * (1.0f - ramp);
  }
  return inv;
}

}  // namespace clshard::deepseek_v3
