// LoRA adapters: Hugging Face PEFT directories read and checked on the host, stacked per layer
// target on the device, and the segmented low-rank op (kernels_cl/lora.cl) that applies every
// adapter of a batch in one launch (a shrink / expand pair past rank 64), row by row (Punica /
// S-LoRA). The base weights are never
// touched: a target's output gets y += alpha * (lora_alpha / r) * B (A x) for the tokens whose
// request names an adapter. Model-agnostic: a model says which modules it supports and their
// shapes.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "runtime/cl.h"
#include "runtime/device.h"
#include "runtime/step.h"

namespace clshard {

// One PEFT adapter on the host.
struct LoraAdapter {
  std::string name;
  std::filesystem::path dir;
  uint32_t rank = 0;    // adapter_config.json "r"
  double alpha = 0;     // "lora_alpha"
  double scale = 0;     // alpha / r (alpha / sqrt(r) with "use_rslora": true)
  struct Module {
    std::string a_name, b_name;  // the tensors' names in adapter_model.safetensors
    int64_t in = 0, out = 0;     // A is [rank, in], B [out, rank]
    std::vector<float> A, B;     // f32, row-major
  };
  // By module path without PEFT's prefix: "model.layers.0.self_attn.q_proj".
  std::map<std::string, Module> modules;
};

// Reads DIR/adapter_config.json (r, lora_alpha, target_modules: a list of module names, one name,
// or "all-linear"; use_rslora) and DIR/adapter_model.safetensors (base_model.model.<module>.lora_A
// / lora_B .weight, f32, bf16 or f16). Errors name the adapter, the file and the field: a missing
// or malformed file or field, r above max_rank, a target module (in the config or in a tensor
// name) outside `supported` ("q_proj", ...: the last part of a module path; empty: any), A and B
// shapes that disagree with r or with each other, or no LoRA tensor at all. A module named in
// `unsupported` says why it is not supported.
LoraAdapter read_peft_adapter(const std::string& name, const std::filesystem::path& dir,
                              uint32_t max_rank, const std::vector<std::string>& supported,
                              const std::map<std::string, std::string>& unsupported = {});

// The adapters of one module on one device, in slots padded to max_rank (zeros past an
// adapter's rank; a slot whose adapter does not target this module has rank 0).
struct LoraStack {
  cl::Mem A, B;      // [slots, max_rank, in], [slots, out, max_rank] f32
  cl::Mem rank;      // [slots] uint
  cl::Mem scale;     // [slots] float
  uint32_t slots = 0, max_rank = 0, in = 0, out = 0;
  bool empty() const { return slots == 0; }
  uint64_t bytes() const { return uint64_t(slots) * max_rank * (uint64_t(in) + out) * 4; }
};

// A module of the base model an adapter may target, as the model applies it.
struct LoraModule {
  std::string path;  // "model.layers.0.self_attn.q_proj" (PEFT's name without base_model.model.)
  uint32_t in = 0, out = 0;
};

// What a model offers adapters: written once per model, checked here for every adapter.
struct LoraTargets {
  std::vector<LoraModule> modules;  // every module the model can apply an adapter to
  // The module names (the last part of a path) the model accepts in target_modules, and those it
  // has but cannot take, each with why (both for the errors).
  std::vector<std::string> supported;
  std::map<std::string, std::string> unsupported;
  // Why an adapter's module path is not one of `modules` (another layer count, a module the
  // model cannot take there): the model's words, after the adapter and tensor names.
  std::function<std::string(const std::string& path)> explain;
};

struct LoraSpec {
  std::string name;
  std::filesystem::path dir;
};

// Reads every adapter (read_peft_adapter) and checks each of its modules against the model's:
// a path outside targets.modules is an error naming the adapter, the tensor and
// targets.explain(path); another shape names both tensors' shapes and the base model's.
std::vector<LoraAdapter> read_lora_adapters(const std::vector<LoraSpec>& specs, uint32_t max_rank,
                                            const LoraTargets& targets);

// The adapters of a deployment on one device: every declared adapter is read and checked at
// load (and kept on the host), at most `max_loaded` of them are resident on the device at once.
// A step binds its rows' adapters: one that is not resident is uploaded into a free slot, or into
// the slot of the least recently used adapter no row of the step runs (the scheduler keeps the
// adapters of the running requests within max_loaded, SchedulerLimits::max_loaded_adapters).
class LoraAdapters {
 public:
  LoraAdapters() = default;
  LoraAdapters(Device& dev, std::shared_ptr<const std::vector<LoraAdapter>> adapters,
               const std::vector<LoraModule>& modules, uint32_t max_loaded);

  uint32_t count() const { return adapters_ ? uint32_t(adapters_->size()) : 0; }
  uint32_t slots() const { return uint32_t(slot_adapter_.size()); }
  uint32_t max_rank() const { return max_rank_; }
  uint64_t device_bytes() const;
  // Uploads so far (an adapter that has to come back after it was unloaded counts again).
  uint64_t uploads() const { return uploads_; }
  // Whether some adapter targets module m (else applying it is a no-op).
  bool targets(size_t m) const { return m < stacks_.size() && !stacks_[m].empty(); }
  // The adapter ids (1-based) resident now, by slot (0: a free slot).
  const std::vector<uint32_t>& resident() const { return slot_adapter_; }

  // One step's LoRA: each token's slot (-1: the base model) and the scratch of the low-rank
  // products; inactive when no row runs an adapter.
  class Batch {
   public:
    bool active() const { return set_ != nullptr; }
    // y[t, y_off + n] += alpha * (adapter's module m)(x[t]) for every token that runs an adapter
    // targeting module m (a no-op otherwise).
    void apply(size_t m, const cl::Mem& x, uint32_t x_off, uint32_t ldx, const cl::Mem& y,
               uint32_t y_off, uint32_t ldy, float alpha = 1.0f) const;

   private:
    friend class LoraAdapters;
    const LoraAdapters* set_ = nullptr;
    Scratch slot_, v_;
    uint32_t T_ = 0;
  };
  // The rows' adapters (StepInputs::adapter_ids, 1-based, 0 the base model) made resident, and
  // the tokens' slots uploaded. More distinct adapters than slots in one step is an error.
  Batch bind(const StepInputs& in);

 private:
  void upload(uint32_t slot, uint32_t adapter_id);

  Device* dev_ = nullptr;
  std::shared_ptr<const std::vector<LoraAdapter>> adapters_;
  std::vector<LoraModule> modules_;
  std::vector<LoraStack> stacks_;  // per module (empty: no adapter targets it)
  std::vector<uint32_t> slot_adapter_;  // per slot: the adapter id resident, 0 none
  std::vector<uint64_t> last_used_;     // per slot: the bind() call that last used it
  uint64_t binds_ = 0, uploads_ = 0;
  uint32_t max_rank_ = 0;
};

// The device bytes the adapters in `dirs` take once loaded: per module any of them targets,
// min(dirs, max_loaded) slots padded to the largest rank, from the files (checked as
// read_peft_adapter checks them; empty `supported`: any module).
uint64_t lora_stack_bytes(const std::vector<std::filesystem::path>& dirs, uint32_t max_rank,
                          uint32_t max_loaded, const std::vector<std::string>& supported);

namespace ops {

// y[t, y_off + n] += alpha * scale[s] * (B_s A_s x[t])[n] for t < T with s = token_slot[t] >= 0
// (int [T]); rows with -1 are left alone. v is scratch of T * stack.max_rank floats (used when
// max_rank is above 64: one launch per call up to that, a shrink and an expand past it, shaped
// for the device's kernel shape).
void lora(Device& dev, const cl::Mem& x, uint32_t x_off, uint32_t ldx, const LoraStack& stack,
          const cl::Mem& token_slot, const cl::Mem& v, const cl::Mem& y, uint32_t y_off,
          uint32_t ldy, uint32_t T, float alpha = 1.0f);

}  // namespace ops
}  // namespace clshard
