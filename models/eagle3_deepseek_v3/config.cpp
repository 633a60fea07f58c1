#include "models/eagle3_deepseek_v3/config.h"

#include <cmath>

#include "runtime/json_fields.h"
#include "runtime/safetensors.h"

namespace clshard::eagle3_deepseek_v3 {

namespace {

constexpr const char* kMlaArch = "Eagle3DeepseekV3ForCausalLM";
constexpr const char* kMhaArch = "LlamaForCausalLMEagle3";
constexpr const char* kAuxKey = "eagle_config.eagle_aux_hidden_state_layer_ids";

MhaAttentionConfig read_mha(const JsonFields& f, int64_t hidden) {
  MhaAttentionConfig m;
  m.num_attention_heads = f.integer("num_attention_heads");
  m.num_key_value_heads = f.integer("num_key_value_heads", m.num_attention_heads);
  if (m.num_attention_heads <= 0) f.error("num_attention_heads", "must be positive");
  if (m.num_key_value_heads <= 0 || m.num_attention_heads % m.num_key_value_heads != 0)
    f.error("num_key_value_heads", "must divide num_attention_heads (" +
                                       std::to_string(m.num_attention_heads) + "), got " +
                                       std::to_string(m.num_key_value_heads));
  m.head_dim = f.integer("head_dim", hidden / m.num_attention_heads);
  // The paged attention kernel reads heads in vectors of 8.
  if (m.head_dim <= 0 || m.head_dim % 8 != 0)
    f.error("head_dim", "must be a positive multiple of 8, got " + std::to_string(m.head_dim));
  m.rope_theta = f.number("rope_theta", 10000.0);
  if (!(m.rope_theta > 1.0)) f.error("rope_theta", "must be > 1");
  if (auto rs = f.object("rope_scaling")) {
    const std::string type = rs->string("rope_type", rs->string("type", ""));
    if (type == "yarn")
      m.rope_scaling = deepseek_v3::read_yarn_scaling(*rs);
    else if (!type.empty() && type != "default")
      rs->error(rs->has("rope_type") ? "rope_type" : "type",
                "'" + type +
                    "' is not supported for an Eagle3 draft over DeepSeek-V3 (yarn or "
                    "default)");
  }
  if (f.boolean("attention_bias", false))
    f.error("attention_bias", "q/k/v biases are not supported for the Eagle3 MHA draft");
  if (f.boolean("mlp_bias", false)) f.error("mlp_bias", "MLP biases are not supported");
  if (f.has("sliding_window"))
    f.error("sliding_window", "sliding-window attention is not supported for the draft");
  if (f.has("hidden_act") && f.string("hidden_act", "silu") != "silu")
    f.error("hidden_act", "only silu is supported, got '" + f.string("hidden_act", "") + "'");
  if (f.boolean("tie_word_embeddings", false))
    f.error("tie_word_embeddings", "the draft has its own lm_head");
  return m;
}

}  // namespace

std::vector<float> MhaAttentionConfig::rope_inv_freqs() const {
  return deepseek_v3::yarn_inv_freqs(head_dim, rope_theta, rope_scaling);
}

float MhaAttentionConfig::softmax_scale() const {
  const double f = deepseek_v3::yarn_attention_factor(rope_scaling);
  return float(f * f / std::sqrt(double(head_dim)));
}

Eagle3Config Eagle3Config::from_json(const nlohmann::json& j, const std::string& where) {
  JsonFields f(j, where);
  Eagle3Config c;
  c.config_path = where;
  c.architecture = f.architecture({kMlaArch, kMhaArch}, "");
  if (c.architecture.empty())
    f.error("architectures",
            std::string("missing (an Eagle3 draft names ") + kMlaArch + " or " + kMhaArch + ")");
  c.kind = c.architecture == kMlaArch ? DraftKind::Mla : DraftKind::Mha;
  if (c.kind == DraftKind::Mla) {
    // The MLA draft's config is a DeepSeek-V3 config under another architecture name: parse it as
    // one, so the attention, YaRN and quantization fields mean what they mean for the target.
    nlohmann::json as_target = j;
    as_target["architectures"] = nlohmann::json::array({"DeepseekV3ForCausalLM"});
    c.mla = deepseek_v3::DeepseekV3Config::from_json(as_target, where);
    c.mla.architecture = c.architecture;
    if (c.mla.num_hidden_layers != 1)
      f.error("num_hidden_layers",
              "an Eagle3 draft has one layer, got " + std::to_string(c.mla.num_hidden_layers));
    c.hidden_size = c.mla.hidden_size;
    c.intermediate_size = c.mla.intermediate_size;
    c.vocab_size = c.mla.vocab_size;
    c.rms_norm_eps = c.mla.rms_norm_eps;
    c.max_position_embeddings = c.mla.max_position_embeddings;
  } else {
    c.hidden_size = f.integer("hidden_size");
    c.intermediate_size = f.integer("intermediate_size");
    c.vocab_size = f.integer("vocab_size");
    for (auto [k, v] : {std::pair{"hidden_size", c.hidden_size},
                        {"intermediate_size", c.intermediate_size},
                        {"vocab_size", c.vocab_size}})
      if (v <= 0) f.error(k, "must be positive, got " + std::to_string(v));
    if (f.integer("num_hidden_layers", 1) != 1)
      f.error("num_hidden_layers", "an Eagle3 draft has one layer, got " +
                                       std::to_string(f.integer("num_hidden_layers")));
    c.rms_norm_eps = f.number("rms_norm_eps", 1e-6);
    c.max_position_embeddings = f.integer("max_position_embeddings", 4096);
    c.mha = read_mha(f, c.hidden_size);
  }
  c.draft_vocab_size = f.integer("draft_vocab_size", c.vocab_size);
  if (c.draft_vocab_size <= 0 || c.draft_vocab_size > c.vocab_size)
    f.error("draft_vocab_size", "must be in [1, vocab_size = " + std::to_string(c.vocab_size) +
                                    "], got " + std::to_string(c.draft_vocab_size));
  c.target_hidden_size = f.optional_integer("target_hidden_size");

  auto eagle = f.object("eagle_config");
  if (!eagle || !eagle->has("eagle_aux_hidden_state_layer_ids"))
    throw std::runtime_error(where + ": field '" + kAuxKey +
                             "': missing (the target layers whose outputs the draft reads)");
  c.aux_layer_ids = eagle->integers("eagle_aux_hidden_state_layer_ids");
  if (c.aux_layer_ids.size() < 2)
    eagle->error("eagle_aux_hidden_state_layer_ids",
                 "needs at least 2 layer ids (the draft's fc reads their outputs concatenated), "
                 "got " +
                     std::to_string(c.aux_layer_ids.size()));
  // The flags of the one layer layout MAX builds.
  for (auto [key, want] : {std::pair{"use_aux_hidden_state", true},
                           {"use_input_layernorm_in_first_layer", true},
                           {"use_last_layernorm", true},
                           {"use_mtp_layernorm", false}})
    if (eagle->boolean(key, want) != want)
      eagle->error(key, std::string("only ") + (want ? "true" : "false") + " is supported");
  return c;
}

Eagle3Config Eagle3Config::from_dir(const std::filesystem::path& dir) {
  const auto path = dir / "config.json";
  if (!std::filesystem::is_directory(dir))
    throw std::runtime_error(dir.string() + ": draft model directory not found");
  return from_json(read_json_file(path), path.string());
}

void Eagle3Config::check_target(const deepseek_v3::DeepseekV3Config& t,
                                const std::string& target_where) const {
  auto fail = [&](const std::string& key, const std::string& msg) {
    throw std::runtime_error(config_path + ": field '" + key + "': " + msg);
  };
  if (hidden_size != t.hidden_size)
    fail("hidden_size", "the draft's hidden size " + std::to_string(hidden_size) +
                            " does not match the target's hidden_size " +
                            std::to_string(t.hidden_size) + " (" + target_where + ")");
  if (target_hidden_size && *target_hidden_size != t.hidden_size)
    fail("target_hidden_size", std::to_string(*target_hidden_size) +
                                   " does not match the target's hidden_size " +
                                   std::to_string(t.hidden_size) + " (" + target_where + ")");
  if (vocab_size != t.vocab_size)
    fail("vocab_size", "the draft's vocabulary " + std::to_string(vocab_size) +
                           " does not match the target's vocab_size " +
                           std::to_string(t.vocab_size) + " (" + target_where + ")");
  for (int64_t id : aux_layer_ids) {
    if (id == 0)
      fail(kAuxKey,
           "id 0 would capture the embedding output, which is not supported (HF "
           "convention: id L is the output of decoder layer L - 1; ids start at 1)");
    if (id < 0 || id > t.num_hidden_layers)
      fail(kAuxKey, "id " + std::to_string(id) + " is out of range: the target has " +
                        std::to_string(t.num_hidden_layers) + " decoder layers (ids 1.." +
                        std::to_string(t.num_hidden_layers) + ", " + target_where + ")");
  }
}

std::vector<uint32_t> Eagle3Config::target_layers() const {
  std::vector<uint32_t> layers;
  for (int64_t id : aux_layer_ids) layers.push_back(uint32_t(id - 1));
  return layers;
}

}  // namespace clshard::eagle3_deepseek_v3
