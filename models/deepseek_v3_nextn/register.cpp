// The NextN/MTP draft in the model registry: speculative.method mtp over a DeepSeek-V3 target.
#include "models/deepseek_v3/plan.h"
#include "models/deepseek_v3_nextn/model.h"
#include "models/registry.h"

namespace clshard::deepseek_v3_nextn {

void register_folder(ModelRegistry& registry) {
  DraftFamily f;
  f.name = "NextN/MTP";
  f.method = "mtp";
  f.target_architectures = {"DeepseekV3ForCausalLM", "deepseek_v3"};
  f.load = [](const std::filesystem::path& target_dir,
              const std::optional<std::filesystem::path>& draft_dir,
              const LoadOptions& opts) -> std::unique_ptr<DraftModel> {
    return std::make_unique<DeepseekV3NextN>(target_dir, draft_dir, opts);
  };
  f.plan = [](const std::filesystem::path& target_dir,
              const std::optional<std::filesystem::path>& draft_dir) -> nlohmann::json {
    // One NextN block of the target's shapes (a standalone checkpoint holds the same block).
    auto c = deepseek_v3::DeepseekV3Config::from_dir(target_dir);
    if (draft_dir) c.num_nextn_predict_layers = 1;
    c.num_nextn_predict_layers = std::min<int64_t>(c.num_nextn_predict_layers, 1);
    const auto p = deepseek_v3::plan_memory(c);
    return {{"weight_bytes", p.weight_bytes_mtp - p.mtp_copy_bytes - p.routed_expert_bytes_mtp},
            {"routed_expert_bytes", p.routed_expert_bytes_mtp},
            {"kv_bytes_per_token", uint64_t(c.cache_row_width()) * sizeof(float)}};
  };
  registry.add(std::move(f));
}

}  // namespace clshard::deepseek_v3_nextn
