// The one place that maps a checkpoint's architecture (config.json) to its model class, and a
// preset name to its checkpoint writer.
#include <stdexcept>

#include "models/deepseek_v3/model.h"
#include "models/deepseek_v3/plan.h"
#include "models/deepseek_v3/presets.h"
#include "models/llama3/model.h"
#include "models/llama3/presets.h"
#include "models/registry.h"
#include "parallel/data_parallel_lm.h"
#include "parallel/topology.h"
#include "runtime/model.h"
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

bool is_llama3(const std::string& arch) {
  return arch == "LlamaForCausalLM" || arch == "llama" || arch == "GraniteForCausalLM" ||
         arch == "OlmoForCausalLM" || arch == "ExaoneForCausalLM" || arch == "MistralForCausalLM";
}

bool is_deepseek_v3(const std::string& arch) {
  return arch == "DeepseekV3ForCausalLM" || arch == "deepseek_v3";
}

}  // namespace

std::unique_ptr<CausalLM> load_model(const std::filesystem::path& dir, const LoadOptions& opts) {
  const auto cfg_path = dir / "config.json";
  if (!std::filesystem::is_directory(dir))
    throw std::runtime_error(dir.string() + ": model directory not found");
  auto cfg = read_json_file(cfg_path);
  const std::string arch = architecture_name(cfg);
  if (is_llama3(arch)) {
    // Replicas of tensor-parallel groups, as the topology gives them; one group needs no
    // data-parallel wrapper.
    const parallel::Topology topology(parallel::Layout::TensorParallelReplicas, opts.degrees(),
                                      opts.devices.size(), "Llama 3");
    std::vector<std::unique_ptr<CausalLM>> replicas;
    for (size_t r = 0; r < topology.replicas(); ++r)
      replicas.push_back(std::make_unique<llama3::Llama3Model>(dir, opts, topology, r));
    if (replicas.size() == 1) return std::move(replicas[0]);
    return std::make_unique<parallel::DataParallelLM>(std::move(replicas));
  }
  if (arch == "DeepseekV3ForCausalLM" || arch == "deepseek_v3")
    // One model over every device (DP attention + EP experts, MAX's DP_EP).
    return std::make_unique<deepseek_v3::DeepseekV3Model>(
        dir, opts,
        parallel::Topology(deepseek_v3::DeepseekV3Model::kLayout, opts.degrees(),
                           opts.devices.size(), deepseek_v3::DeepseekV3Model::kName));
  throw std::runtime_error(cfg_path.string() + ": unknown architecture '" + arch +
                           "' (supported: LlamaForCausalLM and its Granite/OLMo/Exaone siblings, "
                           "DeepseekV3ForCausalLM)");
}

std::vector<std::string> model_presets() {
  std::vector<std::string> names = llama3::preset_names();
  for (const auto& n : deepseek_v3::preset_names()) names.push_back(n);
  return names;
}

void make_model(const std::string& preset, const std::filesystem::path& out,
                const MakeModelOptions& opts) {
  if (llama3::has_preset(preset)) return llama3::write_preset(preset, out, opts);
  if (deepseek_v3::has_preset(preset)) return deepseek_v3::write_preset(preset, out, opts);
  std::string names;
  for (const auto& n : model_presets()) names += (names.empty() ? "" : ", ") + n;
  throw std::runtime_error("make-model: unknown preset '" + preset + "' (known: " + names + ")");
}

namespace {

// Llama 3's plan: its tensors in torch_dtype, an f32 paged KV cache as Llama3Model keeps it.
nlohmann::json plan_llama3(const llama3::Llama3Config& c, uint64_t bytes_per_param) {
  const uint64_t H = c.hidden_size, V = c.vocab_size, hd = c.head_dim, I = c.intermediate_size;
  const uint64_t nq = c.num_attention_heads * hd, nkv = c.num_key_value_heads * hd;
  const uint64_t per_layer = 2 * H + nq * H + 2 * nkv * H + H * nq + 3 * H * I +
                             (c.attention_bias ? nq + 2 * nkv : 0);
  const uint64_t params = V * H + uint64_t(c.num_hidden_layers) * per_layer + H +
                          (c.tie_word_embeddings ? 0 : V * H);
  const uint64_t kv_per_token = uint64_t(c.num_hidden_layers) * 2 * nkv * sizeof(float);
  const uint64_t page_size = 128, max_batch_tokens = 8192;
  const uint64_t per_token = 2 * H + nq + 2 * nkv + nq + 2 * I;  // f32 step scratch
  nlohmann::ordered_json j;
  j["architecture"] = c.architecture;
  j["parameters"] = {{"total", params}, {"active_per_token", params}};
  j["weights"] = {{"bytes_total", params * bytes_per_param},
                  {"active_bytes_per_token", (params - V * H + H) * bytes_per_param}};
  j["kv_cache"] = {{"layout", "K and V per layer per kv head"},
                   {"dtype_bytes", sizeof(float)},
                   {"bytes_per_token", kv_per_token},
                   {"page_size", page_size},
                   {"bytes_per_page", kv_per_token * page_size}};
  j["activations"] = {{"bytes", 4 * max_batch_tokens * per_token},
                      {"max_batch_tokens", max_batch_tokens}};
  return j;
}

}  // namespace

namespace {
std::filesystem::path config_json(const std::filesystem::path& dir_or_config_json) {
  return std::filesystem::is_directory(dir_or_config_json) ? dir_or_config_json / "config.json"
                                                          : dir_or_config_json;
}
}  // namespace

parallel::Topology checkpoint_topology(const std::filesystem::path& dir_or_config_json,
                                       const parallel::ParallelDegrees& degrees, size_t devices) {
  const auto path = config_json(dir_or_config_json);
  const std::string arch = architecture_name(read_json_file(path));
  if (is_deepseek_v3(arch))
    return parallel::Topology(deepseek_v3::DeepseekV3Model::kLayout, degrees, devices,
                              deepseek_v3::DeepseekV3Model::kName);
  return parallel::Topology(parallel::Layout::TensorParallelReplicas, degrees, devices, "Llama 3");
}

nlohmann::json plan_checkpoint(const std::filesystem::path& dir_or_config_json) {
  const auto path = config_json(dir_or_config_json);
  const auto cfg = read_json_file(path);
  const std::string arch = architecture_name(cfg);
  nlohmann::json j;
  if (is_deepseek_v3(arch))
    j = deepseek_v3::to_json(
        deepseek_v3::plan_memory(deepseek_v3::DeepseekV3Config::from_json(cfg, path.string())));
  else if (is_llama3(arch))
    j = plan_llama3(llama3::Llama3Config::from_json(cfg, path.string()),
                    cfg.contains("torch_dtype") && cfg["torch_dtype"] == "float32" ? 4 : 2);
  else
    throw std::runtime_error(path.string() + ": unknown architecture '" + arch +
                             "' (plan knows Llama 3 and DeepseekV3ForCausalLM)");
  j["config"] = path.string();
  return j;
}

}  // namespace clshard
