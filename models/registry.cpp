// The one place that maps a checkpoint's architecture (config.json) to its model class, and a
// preset name to its checkpoint writer.
#include <stdexcept>

#include "models/llama3/model.h"
#include "models/llama3/presets.h"
#include "runtime/model.h"
#include "runtime/safetensors.h"

namespace clshard {

std::unique_ptr<CausalLM> load_model(const std::filesystem::path& dir, const LoadOptions& opts) {
  const auto cfg_path = dir / "config.json";
  if (!std::filesystem::is_directory(dir))
    throw std::runtime_error(dir.string() + ": model directory not found");
  auto cfg = read_json_file(cfg_path);
  std::string arch;
  if (cfg.contains("architectures") && cfg["architectures"].is_array() &&
      !cfg["architectures"].empty() && cfg["architectures"][0].is_string())
    arch = cfg["architectures"][0].get<std::string>();
  else if (cfg.contains("model_type") && cfg["model_type"].is_string())
    arch = cfg["model_type"].get<std::string>();
  if (arch == "LlamaForCausalLM" || arch == "llama" || arch == "GraniteForCausalLM" ||
      arch == "OlmoForCausalLM" || arch == "ExaoneForCausalLM" || arch == "MistralForCausalLM")
    return std::make_unique<llama3::Llama3Model>(dir, opts);
  throw std::runtime_error(cfg_path.string() + ": unknown architecture '" + arch +
                           "' (supported: LlamaForCausalLM and its Granite/OLMo/Exaone siblings)");
}

std::vector<std::string> model_presets() { return llama3::preset_names(); }

void make_model(const std::string& preset, const std::filesystem::path& out,
                const MakeModelOptions& opts) {
  if (llama3::has_preset(preset)) return llama3::write_preset(preset, out, opts);
  std::string names;
  for (const auto& n : model_presets()) names += (names.empty() ? "" : ", ") + n;
  throw std::runtime_error("make-model: unknown preset '" + preset + "' (known: " + names + ")");
}

}  // namespace clshard
