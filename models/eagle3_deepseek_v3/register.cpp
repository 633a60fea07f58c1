// The Eagle3 drafts (MLA and Llama-style MHA) in the model registry: speculative.method eagle3
// over a DeepSeek-V3 target, with the draft checkpoint in speculative.draft_model.
#include "models/eagle3_deepseek_v3/model.h"
#include "models/registry.h"

namespace clshard::eagle3_deepseek_v3 {

void register_folder(ModelRegistry& registry) {
  DraftFamily f;
  f.name = "Eagle3";
  f.method = "eagle3";
  f.target_architectures = {"DeepseekV3ForCausalLM", "deepseek_v3"};
  f.load = [](const std::filesystem::path& target_dir,
              const std::optional<std::filesystem::path>& draft_dir,
              const LoadOptions& opts) -> std::unique_ptr<DraftModel> {
    if (!draft_dir)
      throw std::runtime_error("speculative.method eagle3 needs speculative.draft_model (the "
                               "Eagle3 draft checkpoint)");
    return load(target_dir, *draft_dir, opts);
  };
  registry.add(std::move(f));
}

}  // namespace clshard::eagle3_deepseek_v3
