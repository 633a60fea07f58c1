#include "runtime/ops_lora.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

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
                              uint32_t max_rank, const std::vector<std::string>& supported,
                              const std::map<std::string, std::string>& unsupported) {
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
  auto not_supported = [&](const std::string& module) {
    const auto why = unsupported.find(module);
    return "module '" + module + "' is not supported" +
           (why == unsupported.end() ? "" : ": " + why->second) + " (supported: " +
           join(supported) + ")";
  };
  for (const auto& t : targets)
    if (!any_module && std::find(supported.begin(), supported.end(), t) == supported.end())
      throw std::runtime_error(at + "\"target_modules\": " + not_supported(t));

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
      throw std::runtime_error(wat + ": " + not_supported(module));
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

std::vector<LoraAdapter> read_lora_adapters(const std::vector<LoraSpec>& specs, uint32_t max_rank,
                                            const LoraTargets& targets) {
  std::map<std::string, const LoraModule*> by_path;
  for (const auto& m : targets.modules) by_path[m.path] = &m;
  std::vector<LoraAdapter> adapters;
  for (const auto& spec : specs) {
    LoraAdapter a =
        read_peft_adapter(spec.name, spec.dir, max_rank, targets.supported, targets.unsupported);
    for (const auto& [path, m] : a.modules) {
      const std::string who = "LoRA adapter '" + a.name + "': ";
      const auto it = by_path.find(path);
      if (it == by_path.end())
        throw std::runtime_error(who + m.a_name + ": " +
                                 (targets.explain ? targets.explain(path)
                                                  : "not a module the base model can adapt"));
      const LoraModule& target = *it->second;
      if (m.in != target.in || m.out != target.out)
        throw std::runtime_error(who + m.a_name + " is [" + std::to_string(a.rank) + ", " +
                                 std::to_string(m.in) + "] and " + m.b_name + " [" +
                                 std::to_string(m.out) + ", " + std::to_string(a.rank) +
                                 "], but the base model's " + path.substr(path.rfind('.') + 1) +
                                 " takes " + std::to_string(target.in) + " inputs and gives " +
                                 std::to_string(target.out) +
                                 " outputs (an adapter for another base model?)");
    }
    adapters.push_back(std::move(a));
  }
  return adapters;
}

LoraAdapters::LoraAdapters(Device& dev, std::shared_ptr<const std::vector<LoraAdapter>> adapters,
                           const std::vector<LoraModule>& modules, uint32_t max_loaded)
    : dev_(&dev), adapters_(std::move(adapters)), modules_(modules) {
  if (!adapters_ || adapters_->empty()) return;
  if (max_loaded == 0) throw std::invalid_argument("lora.max_loaded: expected at least 1");
  for (const auto& a : *adapters_) max_rank_ = std::max(max_rank_, a.rank);
  const uint32_t slots = std::min<uint32_t>(uint32_t(adapters_->size()), max_loaded);
  slot_adapter_.assign(slots, 0);
  last_used_.assign(slots, 0);
  // A module gets a stack when some adapter targets it; every slot starts at rank 0.
  stacks_.resize(modules_.size());
  const std::vector<uint32_t> zero_rank(slots, 0);
  const std::vector<float> zero_scale(slots, 0.0f);
  for (size_t i = 0; i < modules_.size(); ++i) {
    const bool targeted = std::any_of(adapters_->begin(), adapters_->end(), [&](const auto& a) {
      return a.modules.count(modules_[i].path) > 0;
    });
    if (!targeted) continue;
    LoraStack& s = stacks_[i];
    s.slots = slots;
    s.max_rank = max_rank_;
    s.in = modules_[i].in;
    s.out = modules_[i].out;
    s.A = dev.alloc(size_t(slots) * max_rank_ * s.in * 4, CL_MEM_READ_ONLY);
    s.B = dev.alloc(size_t(slots) * s.out * max_rank_ * 4, CL_MEM_READ_ONLY);
    s.rank = dev.alloc(size_t(slots) * 4, CL_MEM_READ_ONLY);
    dev.write(s.rank, zero_rank.data(), size_t(slots) * 4);
    s.scale = dev.alloc(size_t(slots) * 4, CL_MEM_READ_ONLY);
    dev.write(s.scale, zero_scale.data(), size_t(slots) * 4);
  }
  // As many as fit are resident from the start, in declaration order.
  for (uint32_t slot = 0; slot < slots; ++slot) upload(slot, slot + 1);
}

uint64_t LoraAdapters::device_bytes() const {
  uint64_t bytes = 0;
  for (const auto& s : stacks_)
    if (!s.empty()) bytes += s.bytes();
  return bytes;
}

void LoraAdapters::upload(uint32_t slot, uint32_t adapter_id) {
  const LoraAdapter& a = adapters_->at(adapter_id - 1);
  for (size_t i = 0; i < modules_.size(); ++i) {
    const LoraStack& s = stacks_[i];
    if (s.empty()) continue;
    const auto it = a.modules.find(modules_[i].path);
    const uint32_t rank = it == a.modules.end() ? 0 : a.rank;
    const float scale = it == a.modules.end() ? 0.0f : float(a.scale);
    if (rank > 0) {
      // The slot's A rows [rank, in] and B [out, max_rank], zero-padded past the rank (the kernels
      // read only the first `rank` rows of A and columns of B).
      const auto& m = it->second;
      dev_->write(s.A, m.A.data(), m.A.size() * 4, size_t(slot) * s.max_rank * s.in * 4);
      std::vector<float> B(size_t(s.out) * s.max_rank, 0.0f);
      for (uint32_t n = 0; n < s.out; ++n)
        std::copy_n(m.B.begin() + size_t(n) * rank, rank, B.begin() + size_t(n) * s.max_rank);
      dev_->write(s.B, B.data(), B.size() * 4, size_t(slot) * s.out * s.max_rank * 4);
    }
    dev_->write(s.rank, &rank, 4, size_t(slot) * 4);
    dev_->write(s.scale, &scale, 4, size_t(slot) * 4);
  }
  slot_adapter_[slot] = adapter_id;
  ++uploads_;
}

LoraAdapters::Batch LoraAdapters::bind(const StepInputs& in) {
  Batch batch;
  const uint32_t T = uint32_t(in.num_tokens());
  if (count() == 0 || T == 0 ||
      std::none_of(in.adapter_ids.begin(), in.adapter_ids.end(), [](uint32_t a) { return a; }))
    return batch;
  ++binds_;
  // The step's adapters, in first-use order; those resident keep their slots.
  std::vector<uint32_t> wanted;
  for (uint32_t id : in.adapter_ids) {
    if (id > count())
      throw std::invalid_argument("step: LoRA adapter id " + std::to_string(id) +
                                  " but the model has " + std::to_string(count()) +
                                  " adapter(s)");
    if (id != 0 && std::find(wanted.begin(), wanted.end(), id) == wanted.end())
      wanted.push_back(id);
  }
  if (wanted.size() > slots())
    throw std::invalid_argument("step: " + std::to_string(wanted.size()) +
                                " LoRA adapters in one step, but lora.max_loaded is " +
                                std::to_string(slots()));
  std::map<uint32_t, int32_t> slot_of;
  for (uint32_t id : wanted)
    for (uint32_t s = 0; s < slots(); ++s)
      if (slot_adapter_[s] == id) slot_of[id] = int32_t(s);
  for (uint32_t id : wanted) {
    if (slot_of.count(id)) continue;
    // A free slot, else the least recently used one that no adapter of this step holds.
    int32_t victim = -1;
    for (uint32_t s = 0; s < slots(); ++s) {
      bool taken = false;
      for (const auto& [other, os] : slot_of) taken |= os == int32_t(s);
      if (taken) continue;
      if (slot_adapter_[s] == 0) {
        victim = int32_t(s);
        break;
      }
      if (victim < 0 || last_used_[s] < last_used_[size_t(victim)]) victim = int32_t(s);
    }
    upload(uint32_t(victim), id);
    slot_of[id] = victim;
  }
  std::vector<int32_t> slot(T, -1);
  for (size_t b = 0; b < in.num_rows(); ++b) {
    const uint32_t id = in.adapter_ids[b];
    if (id == 0) continue;
    last_used_[size_t(slot_of.at(id))] = binds_;
    for (uint32_t i = in.input_row_offsets[b]; i < in.input_row_offsets[b + 1]; ++i)
      slot[i] = slot_of.at(id);
  }
  batch.set_ = this;
  batch.T_ = T;
  batch.slot_ = Scratch(*dev_, size_t(T) * 4);
  dev_->write(batch.slot_.mem(), slot.data(), size_t(T) * 4);
  batch.v_ = Scratch(*dev_, size_t(T) * std::max<uint32_t>(max_rank_, 1) * 4);
  return batch;
}

void LoraAdapters::Batch::apply(size_t m, const cl::Mem& x, uint32_t x_off, uint32_t ldx,
                                const cl::Mem& y, uint32_t y_off, uint32_t ldy,
                                float alpha) const {
  if (!set_) return;
  ops::lora(*set_->dev_, x, x_off, ldx, set_->stacks_.at(m), slot_.mem(), v_.mem(), y, y_off,
            ldy, T_, alpha);
}

uint64_t lora_stack_bytes(const std::vector<std::filesystem::path>& dirs, uint32_t max_rank,
                          uint32_t max_loaded, const std::vector<std::string>& supported) {
  std::map<std::string, int64_t> width;  // module path -> in + out
  uint32_t rank = 0;
  for (const auto& dir : dirs) {
    const LoraAdapter a = read_peft_adapter(dir.filename().string(), dir, max_rank, supported);
    rank = std::max(rank, a.rank);
    for (const auto& [path, m] : a.modules) width[path] = m.in + m.out;
  }
  const uint64_t slots = std::min<uint64_t>(dirs.size(), max_loaded);
  uint64_t bytes = 0;
  for (const auto& [path, w] : width) bytes += slots * rank * uint64_t(w) * 4;
  return bytes;
}

namespace ops {

void lora(Device& dev, const cl::Mem& x, uint32_t x_off, uint32_t ldx, const LoraStack& stack,
          const cl::Mem& token_slot, const cl::Mem& v, const cl::Mem& y, uint32_t y_off,
          uint32_t ldy, uint32_t T, float alpha) {
  if (stack.empty() || T == 0) return;
  // One launch per module (lora_fused) while a token's partial sums fit a work-group's local
  // memory; the shrink / expand pair past that.
  constexpr uint32_t wg = 64;
  if (stack.max_rank <= wg) {
    cl::Kernel k = dev.kernel("lora.cl", "lora_fused",
                              "-DWG=" + std::to_string(wg) +
                                  " -DMAXR=" + std::to_string(stack.max_rank));
    cl::set_args(k, x, x_off, ldx, stack.A, stack.B, token_slot, stack.rank, stack.scale,
                 stack.in, stack.out, alpha, y, y_off, ldy);
    const size_t local[3] = {wg, 1, 1};
    dev.launch(k, {size_t(T) * wg, 1, 1}, 1, local);
    return;
  }
  if (dev.kernel_shape() == KernelShape::WorkGroups) {
    // A work-group per (token, rank row) for v, then per (token, wg outputs) for y (lora.cl).
    const std::string opts = "-DWG=" + std::to_string(wg);
    const size_t local[3] = {wg, 1, 1};
    cl::Kernel shrink = dev.kernel("lora.cl", "lora_shrink_wg", opts);
    cl::set_args(shrink, x, x_off, ldx, stack.A, token_slot, stack.rank, stack.max_rank, stack.in,
                 v);
    dev.launch(shrink, {size_t(T) * wg, stack.max_rank, 1}, 2, local);
    cl::Kernel expand = dev.kernel("lora.cl", "lora_expand_wg", opts);
    cl::set_args(expand, v, stack.B, token_slot, stack.rank, stack.scale, stack.max_rank, stack.out,
                 alpha, y, y_off, ldy);
    dev.launch(expand, {size_t(T) * wg, (stack.out + wg - 1) / wg, 1}, 2, local);
    return;
  }
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
