#include "models/llama3/presets.h"

#include <cmath>
#include <cstring>
#include <fstream>
#include <iostream>
#include <map>

#include <nlohmann/json.hpp>

#include "runtime/safetensors.h"
#include "runtime/text/make_tokenizer.h"

namespace clshard::llama3 {

namespace {

struct Shape {
  int64_t hidden, layers, heads, kv_heads, ffn, vocab;
  bool tied;
  double rope_theta, rope_factor;
};

const std::map<std::string, Shape> kPresets = {
    {"llama3-tiny", {128, 2, 4, 2, 384, 512, false, 500000.0, 8.0}},
    {"llama-100m", {512, 12, 8, 2, 1536, 128256, true, 500000.0, 8.0}},
    {"llama3-1b", {2048, 16, 32, 8, 8192, 128256, true, 500000.0, 32.0}},
};

// Llama 3's pre-tokenizer split pattern, as its tokenizer.json spells it.
const char* kLlama3Regex =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| "
    "?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

const char* kLlama3ChatTemplate =
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | "
    "trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% "
    "endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ "
    "'<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}";

TensorToWrite random_tensor(const std::string& name, std::vector<int64_t> shape, DType dt,
                            SeededRandom& rng, float std, float mean = 0.0f) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  TensorToWrite t{name, dt, std::move(shape), {}};
  t.data.resize(size_t(n) * dtype_size(dt));
  for (int64_t i = 0; i < n; ++i) {
    const float v = mean + std * rng.normal();
    if (dt == DType::BF16) {
      uint16_t b = f32_to_bf16(v);
      std::memcpy(t.data.data() + i * 2, &b, 2);
    } else {
      std::memcpy(t.data.data() + i * 4, &v, 4);
    }
  }
  return t;
}

}  // namespace

std::vector<std::string> preset_names() {
  std::vector<std::string> n;
  for (const auto& [k, v] : kPresets) n.push_back(k);
  return n;
}

bool has_preset(const std::string& name) { return kPresets.count(name) != 0; }

void write_preset(const std::string& name, const std::filesystem::path& out,
                  const MakeModelOptions& opts) {
  const Shape& s = kPresets.at(name);
  DType dt;
  if (opts.dtype == "f32") dt = DType::F32;
  else if (opts.dtype == "bf16") dt = DType::BF16;
  else
    throw std::runtime_error("make-model: preset " + name + " takes --dtype f32 or bf16, not '" +
                             opts.dtype + "'");
  std::filesystem::create_directories(out);
  const int64_t hd = s.hidden / s.heads;
  const std::vector<std::string> specials = {"<|begin_of_text|>", "<|end_of_text|>",
                                             "<|start_header_id|>", "<|end_header_id|>",
                                             "<|eot_id|>", "<|reserved_special_token_0|>"};
  const int64_t bos = s.vocab - int64_t(specials.size());
  const int64_t eos = bos + 1, eot = bos + 4;

  nlohmann::ordered_json cfg;
  cfg["architectures"] = {"LlamaForCausalLM"};
  cfg["model_type"] = "llama";
  cfg["hidden_size"] = s.hidden;
  cfg["intermediate_size"] = s.ffn;
  cfg["num_attention_heads"] = s.heads;
  cfg["num_key_value_heads"] = s.kv_heads;
  cfg["head_dim"] = hd;
  cfg["num_hidden_layers"] = s.layers;
  cfg["rms_norm_eps"] = 1e-5;
  cfg["rope_theta"] = s.rope_theta;
  cfg["rope_scaling"] = {{"rope_type", "llama3"},
                         {"factor", s.rope_factor},
                         {"low_freq_factor", 1.0},
                         {"high_freq_factor", 4.0},
                         {"original_max_position_embeddings", 8192}};
  cfg["vocab_size"] = s.vocab;
  cfg["tie_word_embeddings"] = s.tied;
  cfg["max_position_embeddings"] = 131072;
  cfg["hidden_act"] = "silu";
  cfg["attention_bias"] = false;
  cfg["mlp_bias"] = false;
  cfg["bos_token_id"] = bos;
  cfg["eos_token_id"] = {eos, eot};
  cfg["torch_dtype"] = dt == DType::BF16 ? "bfloat16" : "float32";
  std::ofstream(out / "config.json") << cfg.dump(2) << "\n";
  nlohmann::ordered_json gen = {{"bos_token_id", bos}, {"eos_token_id", {eos, eot}},
                                {"do_sample", false}};
  std::ofstream(out / "generation_config.json") << gen.dump(2) << "\n";

  SeededRandom rng(opts.seed);
  std::vector<TensorToWrite> t;
  // Scaled like a trained model's weights so activations stay O(1) through the layers.
  const float w_std = 0.02f, o_std = 0.02f / std::sqrt(2.0f * float(s.layers));
  t.push_back(random_tensor("model.embed_tokens.weight", {s.vocab, s.hidden}, dt, rng, 1.0f));
  for (int64_t l = 0; l < s.layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    t.push_back(random_tensor(p + "input_layernorm.weight", {s.hidden}, dt, rng, 0.05f, 1.0f));
    t.push_back(random_tensor(p + "self_attn.q_proj.weight", {s.heads * hd, s.hidden}, dt, rng,
                              w_std * 4));
    t.push_back(random_tensor(p + "self_attn.k_proj.weight", {s.kv_heads * hd, s.hidden}, dt,
                              rng, w_std * 4));
    t.push_back(random_tensor(p + "self_attn.v_proj.weight", {s.kv_heads * hd, s.hidden}, dt,
                              rng, w_std));
    t.push_back(random_tensor(p + "self_attn.o_proj.weight", {s.hidden, s.heads * hd}, dt, rng,
                              o_std));
    t.push_back(random_tensor(p + "post_attention_layernorm.weight", {s.hidden}, dt, rng, 0.05f,
                              1.0f));
    t.push_back(random_tensor(p + "mlp.gate_proj.weight", {s.ffn, s.hidden}, dt, rng, w_std));
    t.push_back(random_tensor(p + "mlp.up_proj.weight", {s.ffn, s.hidden}, dt, rng, w_std));
    t.push_back(random_tensor(p + "mlp.down_proj.weight", {s.hidden, s.ffn}, dt, rng, o_std));
    if (opts.on_layer) opts.on_layer(l + 1, s.layers);
  }
  t.push_back(random_tensor("model.norm.weight", {s.hidden}, dt, rng, 0.05f, 1.0f));
  if (!s.tied)
    t.push_back(random_tensor("lm_head.weight", {s.vocab, s.hidden}, dt, rng, w_std));
  write_safetensors(out / "model.safetensors", t, {{"format", "pt"}});

  SyntheticTokenizerSpec tok;
  tok.vocab_size = uint32_t(s.vocab);
  tok.special_tokens = specials;
  tok.bos_token = specials[0];
  tok.eos_token = specials[1];
  tok.pre_tokenizer_regex = kLlama3Regex;
  tok.chat_template = kLlama3ChatTemplate;
  write_synthetic_tokenizer(out, tok);
}

}  // namespace clshard::llama3
