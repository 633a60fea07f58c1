#include "models/deepseek_v3/presets.h"

#include <cmath>
#include <cstring>
#include <fstream>
#include <map>
#include <stdexcept>

#include <nlohmann/json.hpp>

#include "runtime/safetensors.h"
#include "runtime/text/make_tokenizer.h"

namespace clshard::deepseek_v3 {

namespace {

struct Shape {
  int64_t hidden, layers, first_dense, dense_ffn, heads, q_lora, kv_lora, nope, rope, v;
  int64_t experts, moe_ffn, top_k, n_group, topk_group, shared, vocab, mtp;
  double routed_scale, yarn_factor;
};

const std::map<std::string, Shape> kPresets = {
    {"dsv3-tiny", {128, 3, 1, 256, 4, 96, 64, 32, 16, 32, 16, 64, 4, 4, 2, 1, 512, 0, 2.5, 40.0}},
    {"dsv3-mini",
     {2048, 6, 1, 4608, 16, 768, 512, 128, 64, 128, 64, 512, 8, 8, 4, 1, 32000, 0, 2.5, 40.0}},
    {"dsv3-mini-mtp",
     {2048, 6, 1, 4608, 16, 768, 512, 128, 64, 128, 64, 512, 8, 8, 4, 1, 32000, 1, 2.5, 40.0}},
};

// DeepSeek-V3's pre-tokenizer is a sequence of three isolated splits (digit runs of up to 3, CJK
// runs, then the word/punctuation pattern); as one Split the alternation keeps that priority.
const char* kDeepseekRegex =
    "\\p{N}{1,3}|[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+|"
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|"
    "[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+";

const char* kBos = "<\uff5cbegin\u2581of\u2581sentence\uff5c>";
const char* kEos = "<\uff5cend\u2581of\u2581sentence\uff5c>";
const char* kUser = "<\uff5cUser\uff5c>";
const char* kAssistant = "<\uff5cAssistant\uff5c>";

// DeepSeek-V3's chat template without the tool-call branches.
std::string chat_template() {
  return std::string("{% if not add_generation_prompt is defined %}{% set add_generation_prompt = "
                     "false %}{% endif %}{{ bos_token }}{% for message in messages %}{% if "
                     "message['role'] == 'system' %}{{ message['content'] }}{% elif "
                     "message['role'] == 'user' %}{{ '") +
         kUser +
         "' + message['content'] }}{% elif message['role'] == 'assistant' %}{{ '" + kAssistant +
         "' + message['content'] + '" + kEos +
         "' }}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '" + kAssistant +
         "' }}{% endif %}";
}

enum class Mode { F32, BF16, FP8 };

// Weights drawn uniformly with the given standard deviation (cheap: the mini preset has 1.25 B
// parameters); the distribution's shape does not matter for tests and benchmarks.
class Filler {
 public:
  explicit Filler(uint64_t seed) : rng_(seed) {}
  std::vector<float> values(int64_t n, float std, float mean = 0.0f) {
    std::vector<float> v(static_cast<size_t>(n));
    const float a = std * std::sqrt(3.0f);
    for (int64_t i = 0; i < n; i += 2) {
      const uint64_t r = rng_.next_u64();
      const float u0 = float(uint32_t(r) >> 8) * 0x1.0p-24f, u1 = float(uint32_t(r >> 32) >> 8) * 0x1.0p-24f;
      v[size_t(i)] = mean + a * (2.0f * u0 - 1.0f);
      if (i + 1 < n) v[size_t(i + 1)] = mean + a * (2.0f * u1 - 1.0f);
    }
    return v;
  }

 private:
  SeededRandom rng_;
};

TensorToWrite encode(const std::string& name, std::vector<int64_t> shape,
                     const std::vector<float>& v, DType dt) {
  TensorToWrite t{name, dt, std::move(shape), {}};
  t.data.resize(v.size() * dtype_size(dt));
  if (dt == DType::BF16) {
    for (size_t i = 0; i < v.size(); ++i) {
      const uint16_t b = f32_to_bf16(v[i]);
      std::memcpy(t.data.data() + 2 * i, &b, 2);
    }
  } else if (dt == DType::F32) {
    std::memcpy(t.data.data(), v.data(), v.size() * 4);
  } else {
    throw std::logic_error("encode: unsupported dtype");
  }
  return t;
}

class Writer {
 public:
  Writer(Mode mode, uint64_t seed) : mode_(mode), fill_(seed) {}

  // Norms, embedding, lm_head, router, eh_proj: F32 in f32 mode, BF16 otherwise.
  void plain(const std::string& name, std::vector<int64_t> shape, float std, float mean = 0.0f) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    out_.push_back(encode(name, std::move(shape), fill_.values(n, std, mean),
                          mode_ == Mode::F32 ? DType::F32 : DType::BF16));
  }
  void f32(const std::string& name, std::vector<int64_t> shape, float std) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    out_.push_back(encode(name, std::move(shape), fill_.values(n, std), DType::F32));
  }
  // A decoder-layer linear weight [rows, cols]: F32/BF16, or e4m3 + weight_scale_inv in fp8 mode.
  void linear(const std::string& prefix, int64_t rows, int64_t cols, float std) {
    const std::vector<float> v = fill_.values(rows * cols, std);
    if (mode_ != Mode::FP8) {
      out_.push_back(encode(prefix + ".weight", {rows, cols}, v,
                            mode_ == Mode::F32 ? DType::F32 : DType::BF16));
      return;
    }
    const int64_t rb = (rows + 127) / 128, cb = (cols + 127) / 128;
    std::vector<float> scale(size_t(rb * cb));
    TensorToWrite q{prefix + ".weight", DType::F8_E4M3, {rows, cols}, {}};
    q.data.resize(size_t(rows * cols));
    quantize_fp8_blocks(v.data(), rows, cols, q.data.data(), scale.data());
    out_.push_back(std::move(q));
    out_.push_back(encode(prefix + ".weight_scale_inv", {rb, cb}, scale, DType::F32));
  }

  std::vector<TensorToWrite>& tensors() { return out_; }

 private:
  Mode mode_;
  Filler fill_;
  std::vector<TensorToWrite> out_;
};

void write_decoder_layer(Writer& w, const Shape& s, int64_t l, bool moe) {
  const std::string p = "model.layers." + std::to_string(l) + ".";
  const int64_t H = s.hidden, qk = s.nope + s.rope;
  // Scaled like a trained model's weights so activations stay O(1) through the layers.
  const float w_std = 0.02f, o_std = 0.02f / std::sqrt(2.0f * float(s.layers));
  w.plain(p + "input_layernorm.weight", {H}, 0.05f, 1.0f);
  w.linear(p + "self_attn.q_a_proj", s.q_lora, H, w_std * 2);
  w.plain(p + "self_attn.q_a_layernorm.weight", {s.q_lora}, 0.05f, 1.0f);
  w.linear(p + "self_attn.q_b_proj", s.heads * qk, s.q_lora, w_std * 4);
  w.linear(p + "self_attn.kv_a_proj_with_mqa", s.kv_lora + s.rope, H, w_std * 2);
  w.plain(p + "self_attn.kv_a_layernorm.weight", {s.kv_lora}, 0.05f, 1.0f);
  w.linear(p + "self_attn.kv_b_proj", s.heads * (s.nope + s.v), s.kv_lora, w_std * 4);
  w.linear(p + "self_attn.o_proj", H, s.heads * s.v, o_std);
  w.plain(p + "post_attention_layernorm.weight", {H}, 0.05f, 1.0f);
  auto mlp = [&](const std::string& q, int64_t F) {
    w.linear(q + "gate_proj", F, H, w_std);
    w.linear(q + "up_proj", F, H, w_std);
    w.linear(q + "down_proj", H, F, o_std);
  };
  if (!moe) {
    mlp(p + "mlp.", s.dense_ffn);
    return;
  }
  w.plain(p + "mlp.gate.weight", {s.experts, H}, w_std);
  w.f32(p + "mlp.gate.e_score_correction_bias", {s.experts}, 0.01f);
  for (int64_t e = 0; e < s.experts; ++e) mlp(p + "mlp.experts." + std::to_string(e) + ".", s.moe_ffn);
  mlp(p + "mlp.shared_experts.", s.shared * s.moe_ffn);
}

Mode mode_of(const std::string& dtype) {
  if (dtype == "f32") return Mode::F32;
  if (dtype == "bf16") return Mode::BF16;
  if (dtype == "fp8") return Mode::FP8;
  throw std::runtime_error("make-model: DeepSeek-V3 presets take --dtype f32, bf16 or fp8, not '" +
                           dtype + "'");
}

const std::vector<std::string>& special_tokens() {
  static const std::vector<std::string> s = {kBos, kEos, kUser, kAssistant,
                                             "<\uff5c\u2581pad\u2581\uff5c>"};
  return s;
}

}  // namespace

nlohmann::ordered_json preset_config(const std::string& name, const std::string& dtype) {
  auto it = kPresets.find(name);
  if (it == kPresets.end()) throw std::runtime_error("make-model: unknown preset '" + name + "'");
  const Shape& s = it->second;
  const Mode mode = mode_of(dtype);
  const int64_t bos = s.vocab - int64_t(special_tokens().size()), eos = bos + 1;
  nlohmann::ordered_json cfg;
  cfg["architectures"] = {"DeepseekV3ForCausalLM"};
  cfg["model_type"] = "deepseek_v3";
  cfg["vocab_size"] = s.vocab;
  cfg["hidden_size"] = s.hidden;
  cfg["intermediate_size"] = s.dense_ffn;
  cfg["moe_intermediate_size"] = s.moe_ffn;
  cfg["num_hidden_layers"] = s.layers;
  cfg["num_attention_heads"] = s.heads;
  cfg["num_key_value_heads"] = s.heads;
  cfg["q_lora_rank"] = s.q_lora;
  cfg["kv_lora_rank"] = s.kv_lora;
  cfg["qk_nope_head_dim"] = s.nope;
  cfg["qk_rope_head_dim"] = s.rope;
  cfg["v_head_dim"] = s.v;
  cfg["n_routed_experts"] = s.experts;
  cfg["n_shared_experts"] = s.shared;
  cfg["num_experts_per_tok"] = s.top_k;
  cfg["n_group"] = s.n_group;
  cfg["topk_group"] = s.topk_group;
  cfg["moe_layer_freq"] = 1;
  cfg["first_k_dense_replace"] = s.first_dense;
  cfg["routed_scaling_factor"] = s.routed_scale;
  cfg["norm_topk_prob"] = true;
  cfg["scoring_func"] = "sigmoid";
  cfg["topk_method"] = "noaux_tc";
  cfg["rms_norm_eps"] = 1e-6;
  cfg["rope_theta"] = 10000.0;
  cfg["rope_scaling"] = {{"type", "yarn"},
                         {"factor", s.yarn_factor},
                         {"original_max_position_embeddings", 4096},
                         {"beta_fast", 32},
                         {"beta_slow", 1},
                         {"mscale", 1.0},
                         {"mscale_all_dim", 1.0}};
  cfg["max_position_embeddings"] = 163840;
  cfg["num_nextn_predict_layers"] = s.mtp;
  cfg["tie_word_embeddings"] = false;
  cfg["hidden_act"] = "silu";
  cfg["attention_bias"] = false;
  cfg["bos_token_id"] = bos;
  cfg["eos_token_id"] = eos;
  cfg["torch_dtype"] = mode == Mode::F32 ? "float32" : "bfloat16";
  if (mode == Mode::FP8)
    cfg["quantization_config"] = {{"activation_scheme", "dynamic"},
                                  {"fmt", "e4m3"},
                                  {"quant_method", "fp8"},
                                  {"weight_block_size", {128, 128}}};
  return cfg;
}

uint8_t f32_to_e4m3(float x) {
  const uint8_t sign = std::signbit(x) ? 0x80 : 0;
  if (std::isnan(x)) return sign | 0x7F;
  const float a = std::fabs(x);
  if (a >= 448.0f) return sign | 0x7E;
  // Below the smallest normal (2^-6) the spacing is 2^-9; rounding up to 8 gives code 8 = 2^-6.
  if (a < 0x1p-6f) return sign | uint8_t(std::nearbyint(a * 512.0f));
  int e = 0;
  const float f = std::frexp(a, &e);  // a = f * 2^e, f in [0.5, 1)
  int exp = e - 1;
  int mant = int(std::nearbyint((2.0f * f - 1.0f) * 8.0f));
  if (mant == 8) {
    mant = 0;
    ++exp;
  }
  const int code = std::min(((exp + 7) << 3) | mant, 0x7E);
  return sign | uint8_t(code);
}

void quantize_fp8_blocks(const float* v, int64_t rows, int64_t cols, uint8_t* codes,
                         float* scales) {
  const int64_t cb = (cols + 127) / 128;
  for (int64_t br = 0; br * 128 < rows; ++br)
    for (int64_t bc = 0; bc < cb; ++bc) {
      const int64_t r1 = std::min(rows, (br + 1) * 128), c1 = std::min(cols, (bc + 1) * 128);
      float amax = 0;
      for (int64_t r = br * 128; r < r1; ++r)
        for (int64_t c = bc * 128; c < c1; ++c) amax = std::max(amax, std::abs(v[r * cols + c]));
      // The block's largest magnitude maps to e4m3's largest finite value, 448.
      const float s = amax > 0 ? amax / 448.0f : 1.0f;
      scales[br * cb + bc] = s;
      for (int64_t r = br * 128; r < r1; ++r)
        for (int64_t c = bc * 128; c < c1; ++c) codes[r * cols + c] = f32_to_e4m3(v[r * cols + c] / s);
    }
}

std::vector<std::string> preset_names() {
  std::vector<std::string> n;
  for (const auto& [k, v] : kPresets) n.push_back(k);
  return n;
}

bool has_preset(const std::string& name) { return kPresets.count(name) != 0; }

void write_preset(const std::string& name, const std::filesystem::path& out,
                  const MakeModelOptions& opts) {
  const Shape& s = kPresets.at(name);
  const nlohmann::ordered_json cfg = preset_config(name, opts.dtype);
  const Mode mode = mode_of(opts.dtype);
  std::filesystem::create_directories(out);
  const int64_t bos = cfg["bos_token_id"].get<int64_t>(), eos = cfg["eos_token_id"].get<int64_t>();
  std::ofstream(out / "config.json") << cfg.dump(2) << "\n";
  nlohmann::ordered_json gen = {{"bos_token_id", bos}, {"eos_token_id", eos}, {"do_sample", false}};
  std::ofstream(out / "generation_config.json") << gen.dump(2) << "\n";

  Writer w(mode, opts.seed);
  const int64_t H = s.hidden, V = s.vocab;
  w.plain("model.embed_tokens.weight", {V, H}, 1.0f);
  for (int64_t l = 0; l < s.layers; ++l) {
    write_decoder_layer(w, s, l, l >= s.first_dense);
    if (opts.on_layer) opts.on_layer(l + 1, s.layers);
  }
  w.plain("model.norm.weight", {H}, 0.05f, 1.0f);
  w.plain("lm_head.weight", {V, H}, 0.02f);
  for (int64_t m = 0; m < s.mtp; ++m) {
    // The MTP block: its own embedding/head copies, enorm/hnorm, eh_proj [H, 2H], a full MoE
    // decoder layer and shared_head.norm, at layer id num_hidden_layers + m.
    const int64_t l = s.layers + m;
    const std::string p = "model.layers." + std::to_string(l) + ".";
    w.plain(p + "embed_tokens.weight", {V, H}, 1.0f);
    w.plain(p + "enorm.weight", {H}, 0.05f, 1.0f);
    w.plain(p + "hnorm.weight", {H}, 0.05f, 1.0f);
    w.plain(p + "eh_proj.weight", {H, 2 * H}, 0.02f);
    write_decoder_layer(w, s, l, true);
    w.plain(p + "shared_head.norm.weight", {H}, 0.05f, 1.0f);
    w.plain(p + "shared_head.head.weight", {V, H}, 0.02f);
  }
  write_safetensors(out / "model.safetensors", w.tensors(), {{"format", "pt"}});

  SyntheticTokenizerSpec tok;
  tok.vocab_size = uint32_t(V);
  tok.special_tokens = special_tokens();
  tok.bos_token = kBos;
  tok.eos_token = kEos;
  tok.pre_tokenizer_regex = kDeepseekRegex;
  tok.chat_template = chat_template();
  write_synthetic_tokenizer(out, tok);
}

}  // namespace clshard::deepseek_v3
