// The model registry: what turns a checkpoint directory into a model (load_model, load_draft), a
// preset name into a random checkpoint (make_model), and a config.json into a memory plan
// (plan_checkpoint). runtime/model.h holds only the interfaces these return; the engine and the
// CLI come here for the loaders, so runtime/ itself never reaches into models/.
//
// Each models/ folder registers its own families (architectures, loader, layout, plan, presets) in
// a register_folder(ModelRegistry&) of its own; models/folders.cpp calls them, one line each, the
// first time the registry is asked. (An explicit list rather than static registration objects: a
// static library drops object files nothing references, and static initialisation order across
// files is unspecified.)
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "models/load_options.h"
#include "parallel/topology.h"
#include "runtime/model.h"

namespace clshard {

// Reads config.json, picks the architecture, builds the deployment's topology by its layout and
// loads the weights as the topology places them.
std::unique_ptr<CausalLM> load_model(const std::filesystem::path& dir, const LoadOptions& opts);

// The draft for a target checkpoint, by the folder registered for the method. method "mtp": the NextN layer of the
// target checkpoint (model.layers.{num_hidden_layers}.*), or draft_dir when given (a standalone
// NextN checkpoint); "eagle3": the Eagle3 checkpoint in draft_dir (MLA or Llama-style MHA draft).
// Throws naming the key (speculative.method / speculative.draft_model) when the pair does not fit.
std::unique_ptr<DraftModel> load_draft(const std::string& method,
                                       const std::filesystem::path& target_dir,
                                       const std::optional<std::filesystem::path>& draft_dir,
                                       const LoadOptions& opts);

struct MakeModelOptions {
  std::string dtype = "f32";  // f32 | bf16 (| fp8 for DeepSeek)
  uint64_t seed = 0;
  // Called after each decoder layer is generated (layers done, layers in all): a 1B preset takes
  // about a minute, so the CLI shows where it is.
  std::function<void(int64_t, int64_t)> on_layer;
};
// Writes a random checkpoint of a named preset in exact Hugging Face layout. Returns the preset
// names when `preset` is unknown (in the error).
void make_model(const std::string& preset, const std::filesystem::path& out,
                const MakeModelOptions& opts);
std::vector<std::string> model_presets();

// `clshard plan` for a checkpoint: parameter counts, weight bytes, KV bytes per token and per page,
// and an activation estimate, from config.json alone (no weights needed). `dir_or_config_json`: a
// checkpoint directory (its config.json is read) or a config.json file. Throws naming the file for
// unknown architectures or bad fields.
// kv_cache_dtype (kv_cache.dtype) sizes the cache figures: the family plans f32 elements.
nlohmann::json plan_checkpoint(const std::filesystem::path& dir_or_config_json,
                               DType kv_cache_dtype = DType::F32);

// The draft's figures for `clshard plan` (DraftFamily::plan) for speculative.method `method`.
nlohmann::json plan_draft(const std::string& method, const std::filesystem::path& target_dir,
                          const std::optional<std::filesystem::path>& draft_dir);
// The topology the checkpoint would load with on `devices` devices (its architecture's layout),
// which `clshard plan` plans by. Throws parallel::TopologyError naming the key that does not fit.
parallel::Topology checkpoint_topology(const std::filesystem::path& dir_or_config_json,
                                       const parallel::ParallelDegrees& degrees, size_t devices);

// What one models/ folder contributes for a family of target models.
struct ModelFamily {
  std::string name;                        // "Llama 3", in messages
  std::vector<std::string> architectures;  // config.json architectures[0] (or model_type)
  parallel::Layout layout = parallel::Layout::TensorParallelReplicas;
  // Loads the checkpoint in `dir` on opts.devices as `topology` (this family's layout, built from
  // opts by load_model) places it.
  std::function<std::unique_ptr<CausalLM>(const std::filesystem::path& dir, const LoadOptions&,
                                          const parallel::Topology&)>
      load;
  // plan_checkpoint's JSON from config.json (`path` names it in errors).
  std::function<nlohmann::json(const nlohmann::json& config, const std::filesystem::path& path)>
      plan;
  std::vector<std::string> presets;  // make-model preset names
  std::function<void(const std::string& preset, const std::filesystem::path& out,
                     const MakeModelOptions&)>
      write_preset;
};

// What one models/ folder contributes for a family of speculative-decoding drafts (NextN/MTP,
// Eagle3): the speculative.method that picks it, the targets it drafts for and its loader.
struct DraftFamily {
  std::string name;                               // "NextN/MTP", in messages
  std::string method;                             // speculative.method: "mtp", "eagle3"
  std::vector<std::string> target_architectures;  // the target checkpoint's config.json
  std::function<std::unique_ptr<DraftModel>(const std::filesystem::path& target_dir,
                                            const std::optional<std::filesystem::path>& draft_dir,
                                            const LoadOptions&)>
      load;
  // `clshard plan`'s figures of the draft, from config files and safetensors headers:
  // {"weight_bytes": the draft's own weights besides its routed experts (replicated on every
  // device), "routed_expert_bytes": its routed experts (split like the target's),
  // "kv_bytes_per_token": its one-layer cache}.
  std::function<nlohmann::json(const std::filesystem::path& target_dir,
                               const std::optional<std::filesystem::path>& draft_dir)>
      plan;
};

class ModelRegistry {
 public:
  // Every folder's families, registered the first time it is asked (models/folders.cpp).
  static const ModelRegistry& get();

  void add(ModelFamily family);
  void add(DraftFamily family);

  // The family that loads `architecture`, or null.
  const ModelFamily* find(const std::string& architecture) const;
  // The draft family of a speculative.method, or null.
  const DraftFamily* find_draft(const std::string& method) const;
  // The family that has `preset`, or null.
  const ModelFamily* find_preset(const std::string& preset) const;
  const std::vector<ModelFamily>& families() const { return families_; }
  const std::vector<DraftFamily>& drafts() const { return drafts_; }
  // Every target architecture, comma-separated (for "supported: ..." in errors).
  std::string architectures() const;

 private:
  std::vector<ModelFamily> families_;
  std::vector<DraftFamily> drafts_;
};

// Calls every folder's register_folder (models/folders.cpp).
void register_model_folders(ModelRegistry& registry);

}  // namespace clshard
