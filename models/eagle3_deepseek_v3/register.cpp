// The Eagle3 drafts (MLA and Llama-style MHA) in the model registry: speculative.method eagle3
// over a DeepSeek-V3 target, with the draft checkpoint in speculative.draft_model.
#include "models/eagle3_deepseek_v3/config.h"
#include "models/eagle3_deepseek_v3/model.h"
#include "models/registry.h"
#include "runtime/safetensors.h"

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
  f.plan = [](const std::filesystem::path&,
              const std::optional<std::filesystem::path>& draft_dir) -> nlohmann::json {
    if (!draft_dir)
      throw std::runtime_error("speculative.method eagle3 needs speculative.draft_model");
    const Eagle3Config c = Eagle3Config::from_dir(*draft_dir);
    // Every tensor of the draft checkpoint but a copy of the embedding (the target's is used).
    const WeightStore store(*draft_dir);
    uint64_t bytes = 0;
    for (const auto& name : store.names())
      if (name.find("embed_tokens") == std::string::npos) bytes += store.get(name).bytes;
    const uint64_t kv = c.kind == DraftKind::Mla
                            ? uint64_t(c.mla.cache_row_width()) * sizeof(float)
                            : uint64_t(2) * c.mha.num_key_value_heads * c.mha.head_dim * sizeof(float);
    return {{"weight_bytes", bytes}, {"routed_expert_bytes", 0}, {"kv_bytes_per_token", kv}};
  };
  registry.add(std::move(f));
}

}  // namespace clshard::eagle3_deepseek_v3
