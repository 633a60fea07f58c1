// The registry itself: architecture -> family, preset -> family, and the loaders that ask it. No
// family is named here; the folders register themselves (models/folders.cpp).
#include "models/registry.h"

#include <algorithm>
#include <stdexcept>

#include "runtime/safetensors.h"

namespace clshard {

namespace {

// architectures[0], or model_type for configs without it; the model's own config checks it.
std::string architecture_name(const nlohmann::json& cfg) {
  if (cfg.contains("architectures") && cfg["architectures"].is_array() &&
      !cfg["architectures"].empty() && cfg["architectures"][0].is_string())
    return cfg["architectures"][0].get<std::string>();
  if (cfg.contains("model_type") && cfg["model_type"].is_string())
    return cfg["model_type"].get<std::string>();
  return "";
}

std::filesystem::path config_json(const std::filesystem::path& dir_or_config_json) {
  return std::filesystem::is_directory(dir_or_config_json) ? dir_or_config_json / "config.json"
                                                          : dir_or_config_json;
}

// The family of the checkpoint whose config.json is `cfg` (read from `path`).
const ModelFamily& family_of(const nlohmann::json& cfg, const std::filesystem::path& path) {
  const ModelRegistry& registry = ModelRegistry::get();
  const std::string arch = architecture_name(cfg);
  if (const ModelFamily* f = registry.find(arch)) return *f;
  throw std::runtime_error(path.string() + ": unknown architecture '" + arch +
                           "' (supported: " + registry.architectures() + ")");
}

template <typename Family>
const Family* find_in(const std::vector<Family>& families, const std::string& architecture) {
  for (const Family& f : families)
    if (std::find(f.architectures.begin(), f.architectures.end(), architecture) !=
        f.architectures.end())
      return &f;
  return nullptr;
}

}  // namespace

const ModelRegistry& ModelRegistry::get() {
  static const ModelRegistry registry = [] {
    ModelRegistry r;
    register_model_folders(r);
    return r;
  }();
  return registry;
}

void ModelRegistry::add(ModelFamily family) { families_.push_back(std::move(family)); }
void ModelRegistry::add(DraftFamily family) { drafts_.push_back(std::move(family)); }

const ModelFamily* ModelRegistry::find(const std::string& architecture) const {
  return find_in(families_, architecture);
}

const DraftFamily* ModelRegistry::find_draft(const std::string& method) const {
  for (const DraftFamily& f : drafts_)
    if (f.method == method) return &f;
  return nullptr;
}

const ModelFamily* ModelRegistry::find_preset(const std::string& preset) const {
  for (const ModelFamily& f : families_)
    if (std::find(f.presets.begin(), f.presets.end(), preset) != f.presets.end()) return &f;
  return nullptr;
}

std::string ModelRegistry::architectures() const {
  std::string names;
  for (const ModelFamily& f : families_)
    for (const std::string& a : f.architectures) names += (names.empty() ? "" : ", ") + a;
  return names;
}

std::unique_ptr<CausalLM> load_model(const std::filesystem::path& dir, const LoadOptions& opts) {
  const auto cfg_path = dir / "config.json";
  if (!std::filesystem::is_directory(dir))
    throw std::runtime_error(dir.string() + ": model directory not found");
  const ModelFamily& family = family_of(read_json_file(cfg_path), cfg_path);
  const parallel::Topology topology(family.layout, opts.degrees(), opts.ranks(), family.name,
                                    opts.processes());
  return family.load(dir, opts, topology);
}

namespace {
const DraftFamily& draft_family(const std::string& method) {
  const ModelRegistry& registry = ModelRegistry::get();
  if (const DraftFamily* family = registry.find_draft(method)) return *family;
  std::string methods;
  for (const DraftFamily& f : registry.drafts()) methods += (methods.empty() ? "" : ", ") + f.method;
  throw std::runtime_error("speculative.method: unknown method '" + method + "' (" + methods + ")");
}
}  // namespace

nlohmann::json plan_draft(const std::string& method, const std::filesystem::path& target_dir,
                          const std::optional<std::filesystem::path>& draft_dir) {
  return draft_family(method).plan(target_dir, draft_dir);
}

std::unique_ptr<DraftModel> load_draft(const std::string& method,
                                       const std::filesystem::path& target_dir,
                                       const std::optional<std::filesystem::path>& draft_dir,
                                       const LoadOptions& opts) {
  const DraftFamily* family = &draft_family(method);
  const auto cfg_path = target_dir / "config.json";
  const std::string arch = architecture_name(read_json_file(cfg_path));
  if (std::find(family->target_architectures.begin(), family->target_architectures.end(), arch) ==
      family->target_architectures.end())
    throw std::runtime_error(cfg_path.string() + ": speculative decoding runs on DeepSeek-V3 "
                             "targets (with their MTP layer or an Eagle3 draft); this checkpoint "
                             "is '" + arch + "' and has no " + family->name + " draft "
                             "(speculative.method)");
  return family->load(target_dir, draft_dir, opts);
}

std::vector<std::string> model_presets() {
  std::vector<std::string> names;
  for (const ModelFamily& f : ModelRegistry::get().families())
    names.insert(names.end(), f.presets.begin(), f.presets.end());
  return names;
}

void make_model(const std::string& preset, const std::filesystem::path& out,
                const MakeModelOptions& opts) {
  if (const ModelFamily* f = ModelRegistry::get().find_preset(preset))
    return f->write_preset(preset, out, opts);
  std::string names;
  for (const auto& n : model_presets()) names += (names.empty() ? "" : ", ") + n;
  throw std::runtime_error("make-model: unknown preset '" + preset + "' (known: " + names + ")");
}

nlohmann::json plan_checkpoint(const std::filesystem::path& dir_or_config_json,
                               DType kv_cache_dtype) {
  const auto path = config_json(dir_or_config_json);
  const auto cfg = read_json_file(path);
  nlohmann::json j = family_of(cfg, path).plan(cfg, path);
  if (kv_cache_dtype != DType::F32 && j.contains("kv_cache") &&
      j["kv_cache"].contains("dtype_bytes")) {
    // The same elements per token in the narrower type.
    auto& kv = j["kv_cache"];
    const uint64_t from = kv["dtype_bytes"].get<uint64_t>(), to = dtype_size(kv_cache_dtype);
    kv["dtype"] = dtype_name(kv_cache_dtype);
    kv["dtype_bytes"] = to;
    kv["bytes_per_token"] = kv["bytes_per_token"].get<uint64_t>() / from * to;
    kv["bytes_per_page"] = kv["bytes_per_page"].get<uint64_t>() / from * to;
  }
  j["config"] = path.string();
  return j;
}

parallel::Topology checkpoint_topology(const std::filesystem::path& dir_or_config_json,
                                       const parallel::ParallelDegrees& degrees, size_t devices) {
  const auto path = config_json(dir_or_config_json);
  const ModelFamily& family = family_of(read_json_file(path), path);
  return parallel::Topology(family.layout, degrees, devices, family.name);
}

}  // namespace clshard
