#include "models/deepseek_v3/lora.h"

#include <regex>

namespace clshard::deepseek_v3 {

LoraTargets lora_targets(const DeepseekV3Config& c) {
  const uint32_t H = uint32_t(c.hidden_size), Nh = uint32_t(c.num_attention_heads);
  const uint32_t Dqk = uint32_t(c.qk_head_dim()), Dv = uint32_t(c.v_head_dim);
  const uint32_t Lq = uint32_t(c.q_lora_rank);
  const uint32_t Lkv_r = uint32_t(c.kv_lora_rank + c.qk_rope_head_dim);
  LoraTargets t;
  t.supported = {"q_a_proj", "q_b_proj", "q_proj", "kv_a_proj_with_mqa", "o_proj",
                 "gate_proj", "up_proj", "down_proj"};
  t.unsupported = {
      {"kv_b_proj", "MLA absorbs kv_b_proj into the query and the output"},
      {"gate", "the MoE router (mlp.gate) takes no adapter"}};
  const int64_t layers = c.num_hidden_layers;
  for (int64_t l = 0; l < layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    const bool moe = c.is_moe_layer(l);
    const std::string mlp = moe ? "mlp.shared_experts." : "mlp.";
    const uint32_t F = uint32_t(moe ? c.n_shared_experts * c.moe_intermediate_size
                                    : c.intermediate_size);
    const bool has_mlp = !moe || c.n_shared_experts > 0;
    auto add = [&](bool present, const std::string& path, uint32_t in, uint32_t out) {
      t.modules.push_back(present ? LoraModule{p + path, in, out} : LoraModule{});
    };
    add(Lq > 0, "self_attn.q_a_proj", H, Lq);
    add(Lq > 0, "self_attn.q_b_proj", Lq, Nh * Dqk);
    add(Lq == 0, "self_attn.q_proj", H, Nh * Dqk);
    add(true, "self_attn.kv_a_proj_with_mqa", H, Lkv_r);
    add(true, "self_attn.o_proj", Nh * Dv, H);
    add(has_mlp, mlp + "gate_proj", H, F);
    add(has_mlp, mlp + "up_proj", H, F);
    add(has_mlp, mlp + "down_proj", F, H);
  }
  const bool q_lora = Lq > 0;
  const int64_t first_moe = [&] {
    for (int64_t l = 0; l < layers; ++l)
      if (c.is_moe_layer(l)) return l;
    return layers;
  }();
  t.explain = [layers, q_lora, first_moe](const std::string& path) -> std::string {
    static const std::regex layer_re(R"(model\.layers\.(\d+)\.(.+))");
    std::smatch match;
    if (!std::regex_match(path, match, layer_re))
      return "not a module of a DeepSeek-V3 decoder layer (model.layers.N.self_attn.* or "
             "model.layers.N.mlp.*)";
    const int64_t layer = std::stoll(match[1]);
    const std::string rest = match[2];
    if (layer >= layers)
      return "layer " + std::to_string(layer) + ", but the base model has " +
             std::to_string(layers) + " layers (an adapter for another base model, or its MTP " +
             "layer?)";
    if (rest.starts_with("mlp.experts."))
      return "module " + path + " is a routed expert: LoRA on routed experts is not supported "
             "(only the dense and shared-expert MLPs)";
    if (rest == "self_attn.q_proj" && q_lora)
      return "the base model has q_lora_rank: its query is q_a_proj and q_b_proj, not q_proj";
    if ((rest == "self_attn.q_a_proj" || rest == "self_attn.q_b_proj") && !q_lora)
      return "the base model has no q_lora_rank: its query is q_proj";
    if (rest.starts_with("mlp.shared_experts."))
      return "layer " + std::to_string(layer) + " is a dense layer (mlp.*) or has no shared "
             "experts";
    if (rest.starts_with("mlp."))
      return "layer " + std::to_string(layer) + " is an MoE layer (from layer " +
             std::to_string(first_moe) + " on): its MLP targets are mlp.shared_experts.*";
    return "module " + path + " is not one DeepSeek-V3 applies adapters to";
  };
  return t;
}

}  // namespace clshard::deepseek_v3
