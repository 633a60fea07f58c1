#include "models/llama3/lora.h"

#include <regex>

namespace clshard::llama3 {

const std::vector<std::string>& lora_module_names() {
  static const std::vector<std::string> names = {"q_proj",    "k_proj",  "v_proj", "o_proj",
                                                 "gate_proj", "up_proj", "down_proj"};
  return names;
}

LoraTargets lora_targets(const Llama3Config& cfg) {
  const auto& names = lora_module_names();
  const int64_t H = cfg.hidden_size, hd = cfg.head_dim, F = cfg.intermediate_size;
  const int64_t q = cfg.num_attention_heads * hd, kv = cfg.num_key_value_heads * hd;
  // [in, out] of each target, in LoraTarget order.
  const std::array<std::pair<int64_t, int64_t>, kLoraTargets> shapes = {
      {{H, q}, {H, kv}, {H, kv}, {q, H}, {H, F}, {H, F}, {F, H}}};
  LoraTargets t;
  t.supported = names;
  for (int64_t l = 0; l < cfg.num_hidden_layers; ++l)
    for (size_t i = 0; i < kLoraTargets; ++i)
      t.modules.push_back({"model.layers." + std::to_string(l) +
                               (i <= kLoraO ? ".self_attn." : ".mlp.") + names[i],
                           uint32_t(shapes[i].first), uint32_t(shapes[i].second)});
  const int64_t layers = cfg.num_hidden_layers;
  t.explain = [layers](const std::string& path) -> std::string {
    static const std::regex path_re(R"(model\.layers\.(\d+)\.(self_attn|mlp)\.([a-z_]+))");
    std::smatch match;
    if (!std::regex_match(path, match, path_re))
      return "not a module of a Llama decoder layer (model.layers.N.self_attn.* or "
             "model.layers.N.mlp.*)";
    const int64_t layer = std::stoll(match[1]);
    if (layer >= layers)
      return "layer " + std::to_string(layer) + ", but the base model has " +
             std::to_string(layers) + " layers (an adapter for another base model?)";
    const std::string m = match[3];
    const bool attn = m == "q_proj" || m == "k_proj" || m == "v_proj" || m == "o_proj";
    return m + " belongs under " + (attn ? "self_attn" : "mlp");
  };
  return t;
}

LoraAdapters load_llama_lora(const Llama3Config& cfg, const LoadOptions& opts, Device& dev) {
  if (opts.lora_adapters.empty()) return {};
  const LoraTargets targets = lora_targets(cfg);
  auto adapters = std::make_shared<const std::vector<LoraAdapter>>(
      read_lora_adapters(opts.lora_adapters, opts.lora_max_rank, targets));
  return LoraAdapters(dev, std::move(adapters), targets.modules, opts.lora_max_loaded);
}

}  // namespace clshard::llama3
