#include "models/deepseek_v3_nextn/config.h"

#include <stdexcept>

#include "runtime/safetensors.h"

namespace clshard::deepseek_v3_nextn {

NextNConfig NextNConfig::locate(const std::filesystem::path& target_dir,
                                const std::optional<std::filesystem::path>& nextn_dir) {
  NextNConfig c;
  c.target = deepseek_v3::DeepseekV3Config::from_dir(target_dir);
  c.is_moe = c.target.n_routed_experts > 0;
  if (nextn_dir) {
    c.weights_dir = *nextn_dir;
    const WeightStore store(*nextn_dir);
    for (const std::string p : {"model.layers.0.", "layers.0."})
      if (store.has(p + "eh_proj.weight")) c.prefix = p;
    if (c.prefix.empty())
      throw std::runtime_error(nextn_dir->string() +
                               ": not a NextN checkpoint (no model.layers.0.eh_proj.weight or "
                               "layers.0.eh_proj.weight) — speculative.draft_model");
    return c;
  }
  c.weights_dir = target_dir;
  c.prefix = "model.layers." + std::to_string(c.target.num_hidden_layers) + ".";
  const WeightStore store(target_dir);
  if (c.target.num_nextn_predict_layers < 1 || !store.has(c.prefix + "eh_proj.weight"))
    throw std::runtime_error(
        target_dir.string() + ": speculative.method mtp needs the checkpoint's NextN layer (" +
        c.prefix + "*; config.json has num_nextn_predict_layers = " +
        std::to_string(c.target.num_nextn_predict_layers) +
        "), or a standalone NextN checkpoint in speculative.draft_model");
  return c;
}

}  // namespace clshard::deepseek_v3_nextn
