// The NextN/MTP draft in the model registry: speculative.method mtp over a DeepSeek-V3 target.
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
  registry.add(std::move(f));
}

}  // namespace clshard::deepseek_v3_nextn
