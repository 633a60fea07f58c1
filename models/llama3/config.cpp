#include "models/llama3/config.h"

#include <cmath>
#include <vector>

#include "runtime/json_fields.h"
#include "runtime/safetensors.h"

namespace clshard::llama3 {

namespace {

const std::vector<std::string> kArchitectures = {"LlamaForCausalLM", "GraniteForCausalLM",
                                                 "OlmoForCausalLM", "ExaoneForCausalLM",
                                                 "MistralForCausalLM"};

std::vector<double> read_factor_list(const JsonFields& f, const std::string& key) {
  if (!f.has(key)) f.error(key, "missing (longrope needs short_factor and long_factor)");
  const auto& v = f.raw(key);
  if (!v.is_array()) f.type_error(key, "a list of numbers", v);
  std::vector<double> out;
  for (auto& x : v) {
    if (!x.is_number()) f.type_error(key, "a list of numbers", v);
    out.push_back(x.get<double>());
  }
  return out;
}

}  // namespace

Llama3Config Llama3Config::from_json(const nlohmann::json& j, const std::string& where) {
  JsonFields f(j, where);
  Llama3Config c;
  c.architecture = f.architecture(kArchitectures, "LlamaForCausalLM");
  c.hidden_size = f.integer("hidden_size");
  c.num_attention_heads = f.integer("num_attention_heads");
  c.num_key_value_heads = f.integer("num_key_value_heads", c.num_attention_heads);
  c.num_hidden_layers = f.integer("num_hidden_layers");
  c.intermediate_size = f.integer("intermediate_size");
  c.vocab_size = f.integer("vocab_size");
  for (auto [k, v] : {std::pair{"hidden_size", c.hidden_size},
                      {"num_attention_heads", c.num_attention_heads},
                      {"num_key_value_heads", c.num_key_value_heads},
                      {"num_hidden_layers", c.num_hidden_layers},
                      {"intermediate_size", c.intermediate_size}, {"vocab_size", c.vocab_size}})
    if (v <= 0) f.error(k, "must be positive, got " + std::to_string(v));
  if (c.num_attention_heads % c.num_key_value_heads != 0)
    f.error("num_key_value_heads", "must divide num_attention_heads (" +
                                       std::to_string(c.num_attention_heads) + ")");
  c.head_dim = f.integer("head_dim", c.hidden_size / c.num_attention_heads);
  if (c.head_dim <= 0 || c.head_dim % 2 != 0)
    f.error("head_dim", "must be a positive even number, got " + std::to_string(c.head_dim));
  c.rope_theta = f.number("rope_theta", 10000.0);
  c.max_position_embeddings = f.integer("max_position_embeddings", 2048);
  c.rms_norm_eps = f.number("rms_norm_eps", 1e-5);
  c.tie_word_embeddings = f.boolean("tie_word_embeddings", false);
  c.attention_bias = f.boolean("attention_bias", false);
  c.attention_multiplier = f.number("attention_multiplier", 1.0 / std::sqrt(double(c.head_dim)));
  c.embedding_multiplier = f.number("embedding_multiplier", 1.0);
  c.residual_multiplier = f.number("residual_multiplier", 1.0);
  c.logits_scaling = f.number("logits_scaling", 1.0);
  c.clip_qkv = f.optional_number("clip_qkv");
  if (f.has("hidden_act") && f.string("hidden_act", "silu") != "silu")
    f.error("hidden_act", "only silu is supported, got '" + f.string("hidden_act", "") + "'");
  if (f.has("eos_token_id")) c.eos_token_ids = f.integers("eos_token_id");
  c.bos_token_id = f.optional_integer("bos_token_id");

  if (auto rs = f.object("rope_scaling")) {
    std::string type = rs->string("rope_type", rs->string("type", ""));
    if (type == "llama3") {
      Llama3RopeScaling s;
      s.factor = rs->number("factor");
      s.low_freq_factor = rs->number("low_freq_factor", 1.0);
      s.high_freq_factor = rs->number("high_freq_factor", 4.0);
      s.original_max_position = rs->number("original_max_position_embeddings", 8192);
      c.rope_scaling = s;
    } else if (type == "longrope") {
      LongRopeScaling s;
      s.short_factor = read_factor_list(*rs, "short_factor");
      s.long_factor = read_factor_list(*rs, "long_factor");
      s.original_max_position =
          f.integer("original_max_position_embeddings",
                    rs->integer("original_max_position_embeddings", c.max_position_embeddings));
      if (int64_t(s.short_factor.size()) != c.head_dim / 2 ||
          int64_t(s.long_factor.size()) != c.head_dim / 2)
        rs->error("short_factor", "longrope factors need head_dim/2 = " +
                                      std::to_string(c.head_dim / 2) + " entries each");
      c.longrope_scaling = s;
      // MAX: the softmax scale grows with the context extension (compute_scale()).
      const double factor = double(c.max_position_embeddings) / double(s.original_max_position);
      if (factor > 1.0 && !f.has("attention_multiplier")) {
        const double hd = double(c.hidden_size / c.num_attention_heads);
        c.attention_multiplier = 1.0 / std::sqrt(hd) *
                                 std::sqrt(1.0 + std::log(factor) /
                                                     std::log(double(s.original_max_position)));
      }
    } else if (type != "default" && !type.empty()) {
      rs->error("rope_type", "'" + type + "' is not supported for Llama 3 (llama3, longrope)");
    }
  }
  return c;
}

Llama3Config Llama3Config::from_dir(const std::filesystem::path& dir) {
  auto path = dir / "config.json";
  auto j = read_json_file(path);
  Llama3Config c = from_json(j, path.string());
  auto gen = dir / "generation_config.json";
  if (std::filesystem::exists(gen)) {
    auto g = read_json_file(gen);
    JsonFields f(g, gen.string());
    if (f.has("eos_token_id")) c.eos_token_ids = f.integers("eos_token_id");
    if (f.has("bos_token_id")) c.bos_token_id = f.integer("bos_token_id");
  }
  return c;
}

void Llama3Config::finalize(const WeightStore& w) {
  stacked_qkv = w.has("model.layers.0.self_attn.qkv_proj.weight");
  stacked_mlp = w.has("model.layers.0.mlp.gate_up_proj.weight");
  if (!w.has("lm_head.weight")) tie_word_embeddings = true;
  if (stacked_qkv && attention_bias)
    throw std::runtime_error(w.dir().string() +
                             ": a stacked qkv_proj cannot be combined with attention_bias");
}

std::vector<float> Llama3Config::rope_inv_freqs() const {
  const int64_t half = head_dim / 2;
  std::vector<float> inv(half);
  for (int64_t i = 0; i < half; ++i) {
    // As the references do: exponent and power in f32.
    float e = float(2 * i) / float(head_dim);
    inv[i] = 1.0f / std::pow(float(rope_theta), e);
  }
  if (rope_scaling) {
    const auto& s = *rope_scaling;
    const double low_wl = s.original_max_position / s.low_freq_factor;
    const double high_wl = s.original_max_position / s.high_freq_factor;
    for (auto& f : inv) {
      const double wl = 2.0 * M_PI / f;
      if (wl < high_wl) continue;
      if (wl > low_wl) {
        f = float(f / s.factor);
      } else {
        const double smooth = s.high_freq_factor == s.low_freq_factor
                                  ? 0.0
                                  : (s.original_max_position / wl - s.low_freq_factor) /
                                        (s.high_freq_factor - s.low_freq_factor);
        f = float((1 - smooth) * f / s.factor + smooth * f);
      }
    }
  }
  if (longrope_scaling)
    for (int64_t i = 0; i < half; ++i) inv[i] = float(inv[i] / longrope_scaling->short_factor[i]);
  return inv;
}

std::vector<float> Llama3Config::rope_inv_freqs_long() const {
  std::vector<float> inv(head_dim / 2);
  for (int64_t i = 0; i < head_dim / 2; ++i) {
    float e = float(2 * i) / float(head_dim);
    inv[i] = float(1.0f / std::pow(float(rope_theta), e) / longrope_scaling->long_factor[i]);
  }
  return inv;
}

float Llama3Config::attention_scale() const { return float(attention_multiplier); }

}  // namespace clshard::llama3
