#include "runtime/ops_lora.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "runtime/device.h"
#include "runtime/safetensors.h"

namespace clshard {

namespace {

std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "" : ", ") + x;
  return s;
}

std::vector<float> to_f32(const TensorView& t, const std::string& where) {
  std::vector<float> out(size_t(t.numel()));
  switch (t.dtype) {
    case DType::F32:
      std::copy_n(reinterpret_cast<const float*>(t.data), out.size(), out.data());
      break;
    case DType::BF16:
      for (size_t i = 0; i < out.size(); ++i)
        out[i] = bf16_to_f32(reinterpret_cast<const uint16_t*>(t.data)[i]);
      break;
    case DType::F16:
      for (size_t i = 0; i < out.size(); ++i)
        out[i] = f16_to_f32(reinterpret_cast<const uint16_t*>(t.data)[i]);
      break;
    default:
      throw std::runtime_error(where + ": " + t.describe() + ": expected F32, BF16 or F16");
  }
  return out;
}

}  // namespace

LoraAdapter read_peft_adapter(const std::string& name, const std::filesystem::path& dir,
                              uint32_t max_rank, const std::vector<std::string>& supported) {
  LoraAdapter a;
  a.name = name;
  a.dir = dir;
  const std::string who = "LoRA adapter '" + name + "'";
  const auto config_path = dir / "adapter_config.json";
  if (!std::filesystem::exists(config_path))
    throw std::runtime_error(who + ": " + config_path.string() + " does not exist");
  nlohmann::json cfg;
  try {
    cfg = read_json_file(config_path);
  } catch (const std::exception& e) {
    throw std::runtime_error(who + ": " + e.what());
  }
  const std::string at = who + ": " + config_path.string() + ": ";
  if (!cfg.is_object()) throw std::runtime_error(at + "expected a JSON object");
  if (!cfg.contains("r") || !cfg["r"].is_number_integer() || cfg["r"].get<int64_t>() <= 0)
    throw std::runtime_error(at + "\"r\": expected a positive integer" +
                             (cfg.contains("r") ? ", got " + cfg["r"].dump() : " (missing)"));
  a.rank = uint32_t(cfg["r"].get<int64_t>());
  if (a.rank > max_rank)
    throw std::runtime_error(at + "\"r\": rank " + std::to_string(a.rank) +
                             " is above lora.max_rank " + std::to_string(max_rank));
  if (!cfg.contains("lora_alpha") || !cfg["lora_alpha"].is_number())
    throw std::runtime_error(at + "\"lora_alpha\": expected a number" +
                             (cfg.contains("lora_alpha") ? ", got " + cfg["lora_alpha"].dump()
                                                         : " (missing)"));
  a.alpha = cfg["lora_alpha"].get<double>();
  const bool rslora = cfg.contains("use_rslora") && cfg["use_rslora"].is_boolean() &&
                      cfg["use_rslora"].get<bool>();
  a.scale = rslora ? a.alpha / std::sqrt(double(a.rank)) : a.alpha / double(a.rank);
  // target_modules: the modules PEFT wrapped. Every one must be a module we can apply.
  std::vector<std::string> targets;
  const auto& tm = cfg.contains("target_modules") ? cfg["target_modules"] : nlohmann::json();
  if (tm.is_string()) {
    if (tm.get<std::string>() == "all-linear") targets = supported;
    else targets = {tm.get<std::string>()};
  } else if (tm.is_array() && !tm.empty()) {
    for (const auto& m : tm) {
      if (!m.is_string())
        throw std::runtime_error(at + "\"target_modules\": expected module names, got " +
                                 m.dump());
      targets.push_back(m.get<std::string>());
    }
  } else {
    throw std::runtime_error(at + "\"target_modules\": expected a list of module names" +
                             (cfg.contains("target_modules") ? ", got " + tm.dump()
                                                             : " (missing)"));
  }
  const bool any_module = supported.empty();
  for (const auto& t : targets)
    if (!any_module && std::find(supported.begin(), supported.end(), t) == supported.end())
      throw std::runtime_error(at + "\"target_modules\": module '" + t +
                               "' is not supported (supported: " + join(supported) + ")");

  const auto weights_path = dir / "adapter_model.safetensors";
  if (!std::filesystem::exists(weights_path))
    throw std::runtime_error(who + ": " + weights_path.string() + " does not exist");
  SafetensorsFile file(weights_path);
  const std::string prefix = "base_model.model.";
  for (const auto& [tname, view] : file.tensors()) {
    const std::string wat = who + ": " + weights_path.string() + ": " + tname;
    const bool is_a = tname.ends_with(".lora_A.weight"), is_b = tname.ends_with(".lora_B.weight");
    if (!tname.starts_with(prefix) || (!is_a && !is_b))
      throw std::runtime_error(wat + ": not a LoRA tensor (expected " + prefix +
                               "<module>.lora_A.weight or .lora_B.weight)");
    const size_t suffix = std::string(".lora_A.weight").size();
    const std::string path = tname.substr(prefix.size(), tname.size() - prefix.size() - suffix);
    const std::string module = path.substr(path.rfind('.') + 1);
    if (!any_module && std::find(supported.begin(), supported.end(), module) == supported.end())
      throw std::runtime_error(wat + ": module '" + module + "' is not supported (supported: " +
                               join(supported) + ")");
    if (view.shape.size() != 2)
      throw std::runtime_error(wat + ": expected a 2-D tensor, got " + view.describe());
    LoraAdapter::Module& m = a.modules[path];
    if (is_a) {
      if (view.dim(0) != a.rank)
        throw std::runtime_error(wat + ": " + view.describe() + ": expected [r = " +
                                 std::to_string(a.rank) + ", in]");
      m.a_name = tname;
      m.in = view.dim(1);
      m.A = to_f32(view, wat);
    } else {
      if (view.dim(1) != a.rank)
        throw std::runtime_error(wat + ": " + view.describe() + ": expected [out, r = " +
                                 std::to_string(a.rank) + "]");
      m.b_name = tname;
      m.out = view.dim(0);
      m.B = to_f32(view, wat);
    }
  }
  if (a.modules.empty())
    throw std::runtime_error(who + ": " + weights_path.string() + " holds no LoRA tensor");
  for (const auto& [path, m] : a.modules)
    if (m.a_name.empty() || m.b_name.empty())
      throw std::runtime_error(who + ": " + weights_path.string() + ": module " + path +
                               " has " + (m.a_name.empty() ? "lora_B but no lora_A" :
                                                              "lora_A but no lora_B"));
  return a;
}

LoraStack upload_lora_stack(Device& dev, const std::vector<const LoraAdapter*>& adapters,
                            const std::string& path, uint32_t in, uint32_t out,
                            uint32_t max_rank) {
  LoraStack s;
  s.slots = uint32_t(adapters.size());
  s.max_rank = max_rank;
  s.in = in;
  s.out = out;
  if (s.slots == 0 || max_rank == 0) return LoraStack{};
  std::vector<float> A(size_t(s.slots) * max_rank * in, 0.0f), B(size_t(s.slots) * out * max_rank,
                                                                   0.0f);
  std::vector<uint32_t> rank(s.slots, 0);
  std::vector<float> scale(s.slots, 0.0f);
  bool any = false;
  for (uint32_t slot = 0; slot < s.slots; ++slot) {
    const LoraAdapter* a = adapters[slot];
    if (!a) continue;
    auto it = a->modules.find(path);
    if (it == a->modules.end()) continue;
    const auto& m = it->second;
    any = true;
    rank[slot] = a->rank;
    scale[slot] = float(a->scale);
    for (uint32_t j = 0; j < a->rank; ++j)
      std::copy_n(m.A.begin() + size_t(j) * in, in,
                  A.begin() + (size_t(slot) * max_rank + j) * in);
    for (uint32_t n = 0; n < out; ++n)
      std::copy_n(m.B.begin() + size_t(n) * a->rank, a->rank,
                  B.begin() + (size_t(slot) * out + n) * max_rank);
  }
  if (!any) return LoraStack{};
  s.A = dev.alloc(A.size() * 4, CL_MEM_READ_ONLY);
  dev.write(s.A, A.data(), A.size() * 4);
  s.B = dev.alloc(B.size() * 4, CL_MEM_READ_ONLY);
  dev.write(s.B, B.data(), B.size() * 4);
  s.rank = dev.alloc(rank.size() * 4, CL_MEM_READ_ONLY);
  dev.write(s.rank, rank.data(), rank.size() * 4);
  s.scale = dev.alloc(scale.size() * 4, CL_MEM_READ_ONLY);
  dev.write(s.scale, scale.data(), scale.size() * 4);
  return s;
}

uint64_t lora_stack_bytes(const std::vector<std::filesystem::path>& dirs, uint32_t max_rank,
                          const std::vector<std::string>& supported) {
  std::map<std::string, int64_t> width;  // module path -> in + out
  uint32_t rank = 0;
  for (const auto& dir : dirs) {
    const LoraAdapter a = read_peft_adapter(dir.filename().string(), dir, max_rank, supported);
    rank = std::max(rank, a.rank);
    for (const auto& [path, m] : a.modules) width[path] = m.in + m.out;
  }
  uint64_t bytes = 0;
  for (const auto& [path, w] : width) bytes += uint64_t(dirs.size()) * rank * uint64_t(w) * 4;
  return bytes;
}

namespace ops {

void lora(Device& dev, const cl::Mem& x, uint32_t x_off, uint32_t ldx, const LoraStack& stack,
          const cl::Mem& token_slot, const cl::Mem& v, const cl::Mem& y, uint32_t y_off,
          uint32_t ldy, uint32_t T, float alpha) {
  if (stack.empty() || T == 0) return;
  constexpr uint32_t chunk = 64;  // CHUNK in lora.cl
  cl::Kernel shrink = dev.kernel("lora.cl", "lora_shrink");
  cl::set_args(shrink, x, x_off, ldx, stack.A, token_slot, stack.rank, stack.max_rank, stack.in,
               v);
  dev.launch(shrink, {T, stack.max_rank, 1}, 2);
  cl::Kernel expand = dev.kernel("lora.cl", "lora_expand");
  cl::set_args(expand, v, stack.B, token_slot, stack.rank, stack.scale, stack.max_rank, stack.out,
               alpha, y, y_off, ldy);
  dev.launch(expand, {T, (stack.out + chunk - 1) / chunk, 1}, 2);
}

}  // namespace ops
}  // namespace clshard
