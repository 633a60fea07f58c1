// DeepSeek-V3 in the model registry: one DeepseekV3Model over every device (MAX's DP_EP).
#include "models/deepseek_v3/config.h"
#include "models/deepseek_v3/model.h"
#include "models/deepseek_v3/plan.h"
#include "models/deepseek_v3/presets.h"
#include "models/registry.h"

namespace clshard::deepseek_v3 {

void register_folder(ModelRegistry& registry) {
  ModelFamily f;
  f.name = DeepseekV3Model::kName;
  f.architectures = {"DeepseekV3ForCausalLM", "deepseek_v3"};
  f.layout = DeepseekV3Model::kLayout;
  f.load = [](const std::filesystem::path& dir, const LoadOptions& opts,
              const parallel::Topology& topology) -> std::unique_ptr<CausalLM> {
    return std::make_unique<DeepseekV3Model>(dir, opts, topology);
  };
  f.plan = [](const nlohmann::json& cfg, const std::filesystem::path& path) -> nlohmann::json {
    return to_json(plan_memory(DeepseekV3Config::from_json(cfg, path.string())));
  };
  f.presets = preset_names();
  f.write_preset = write_preset;
  registry.add(std::move(f));
}

}  // namespace clshard::deepseek_v3
