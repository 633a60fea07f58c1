#include "models/llama3/lora.h"

#include <regex>
#include <stdexcept>

#include "runtime/device.h"

namespace clshard::llama3 {

const std::vector<std::string>& lora_module_names() {
  static const std::vector<std::string> names = {"q_proj",    "k_proj",  "v_proj", "o_proj",
                                                 "gate_proj", "up_proj", "down_proj"};
  return names;
}

LlamaLora load_llama_lora(const Llama3Config& cfg, const LoadOptions& opts, Device& dev) {
  LlamaLora lora;
  if (opts.lora_adapters.empty()) return lora;
  if (opts.lora_adapters.size() > opts.lora_max_loaded)
    throw std::runtime_error("lora.max_loaded: " + std::to_string(opts.lora_adapters.size()) +
                             " adapters declared, max_loaded is " +
                             std::to_string(opts.lora_max_loaded) +
                             " (every declared adapter is loaded at start)");
  const auto& names = lora_module_names();
  const int64_t H = cfg.hidden_size, hd = cfg.head_dim, F = cfg.intermediate_size;
  const int64_t q = cfg.num_attention_heads * hd, kv = cfg.num_key_value_heads * hd;
  // [in, out] of each target, in LoraTarget order.
  const std::array<std::pair<int64_t, int64_t>, kLoraTargets> shapes = {
      {{H, q}, {H, kv}, {H, kv}, {q, H}, {H, F}, {H, F}, {F, H}}};
  std::vector<LoraAdapter> adapters;
  const std::regex path_re(R"(model\.layers\.(\d+)\.(self_attn|mlp)\.([a-z_]+))");
  for (const auto& spec : opts.lora_adapters) {
    LoraAdapter a = read_peft_adapter(spec.name, spec.dir, opts.lora_max_rank, names);
    for (const auto& [path, m] : a.modules) {
      const std::string who = "LoRA adapter '" + a.name + "': " + m.a_name;
      std::smatch match;
      if (!std::regex_match(path, match, path_re))
        throw std::runtime_error(who + ": not a module of a Llama decoder layer "
                                       "(model.layers.N.self_attn.* or model.layers.N.mlp.*)");
      const int64_t layer = std::stoll(match[1]);
      if (layer >= cfg.num_hidden_layers)
        throw std::runtime_error(who + ": layer " + std::to_string(layer) +
                                 ", but the base model has " +
                                 std::to_string(cfg.num_hidden_layers) +
                                 " layers (an adapter for another base model?)");
      const size_t t =
          size_t(std::find(names.begin(), names.end(), match[3].str()) - names.begin());
      const bool attn = t <= kLoraO;
      if (match[2] != (attn ? "self_attn" : "mlp"))
        throw std::runtime_error(who + ": " + match[3].str() + " belongs under " +
                                 (attn ? "self_attn" : "mlp"));
      const auto [in, out] = shapes[t];
      if (m.in != in || m.out != out)
        throw std::runtime_error("LoRA adapter '" + a.name + "': " + m.a_name + " is [" +
                                 std::to_string(a.rank) + ", " + std::to_string(m.in) + "] and " +
                                 m.b_name + " [" + std::to_string(m.out) + ", " +
                                 std::to_string(a.rank) + "], but the base model's " +
                                 match[3].str() + " takes " + std::to_string(in) +
                                 " inputs and gives " + std::to_string(out) +
                                 " outputs (an adapter for another base model?)");
    }
    adapters.push_back(std::move(a));
  }
  std::vector<const LoraAdapter*> slots;
  for (const auto& a : adapters) {
    slots.push_back(&a);
    lora.max_rank = std::max(lora.max_rank, a.rank);
  }
  lora.adapters = uint32_t(adapters.size());
  lora.layers.resize(size_t(cfg.num_hidden_layers));
  for (int64_t l = 0; l < cfg.num_hidden_layers; ++l)
    for (size_t t = 0; t < kLoraTargets; ++t) {
      const std::string path = "model.layers." + std::to_string(l) +
                               (t <= kLoraO ? ".self_attn." : ".mlp.") + names[t];
      LoraStack& s = lora.layers[l][t];
      s = upload_lora_stack(dev, slots, path, uint32_t(shapes[t].first),
                            uint32_t(shapes[t].second), lora.max_rank);
      if (!s.empty())
        lora.device_bytes += uint64_t(s.slots) * s.max_rank * (s.in + s.out) * 4;
    }
  return lora;
}

}  // namespace clshard::llama3
