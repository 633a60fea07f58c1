// LoRA adapters: Hugging Face PEFT directories read and checked on the host, stacked per layer
// target on the device, and the segmented low-rank op (kernels_cl/lora.cl) that applies every
// adapter of a batch in one launch pair, row by row (Punica / S-LoRA). The base weights are never
// touched: a target's output gets y += alpha * (lora_alpha / r) * B (A x) for the tokens whose
// request names an adapter. Model-agnostic: a model says which modules it supports and their
// shapes.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "runtime/cl.h"

namespace clshard {

class Device;

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
// shapes that disagree with r or with each other, or no LoRA tensor at all.
LoraAdapter read_peft_adapter(const std::string& name, const std::filesystem::path& dir,
                              uint32_t max_rank, const std::vector<std::string>& supported);

// The adapters of one layer target on one device, in slots padded to max_rank (zeros past an
// adapter's rank; a slot whose adapter does not target this module has rank 0).
struct LoraStack {
  cl::Mem A, B;      // [slots, max_rank, in], [slots, out, max_rank] f32
  cl::Mem rank;      // [slots] uint
  cl::Mem scale;     // [slots] float
  uint32_t slots = 0, max_rank = 0, in = 0, out = 0;
  bool empty() const { return slots == 0; }
};

// Stacks module `path` of every adapter (slot s = adapters[s]; those without it get rank 0).
// Shapes must be [rank, in] and [out, rank] (checked by the caller, which knows the base model).
LoraStack upload_lora_stack(Device& dev, const std::vector<const LoraAdapter*>& adapters,
                            const std::string& path, uint32_t in, uint32_t out,
                            uint32_t max_rank);

// The device bytes the adapters in `dirs` take once loaded (upload_lora_stack per module: every
// adapter gets a slot padded to the largest rank), from the files' headers; the adapters are
// checked as read_peft_adapter checks them (empty `supported`: any module).
uint64_t lora_stack_bytes(const std::vector<std::filesystem::path>& dirs, uint32_t max_rank,
                          const std::vector<std::string>& supported);

namespace ops {

// y[t, y_off + n] += alpha * scale[s] * (B_s A_s x[t])[n] for t < T with s = token_slot[t] >= 0
// (int [T]); rows with -1 are left alone. v is scratch of T * stack.max_rank floats.
void lora(Device& dev, const cl::Mem& x, uint32_t x_off, uint32_t ldx, const LoraStack& stack,
          const cl::Mem& token_slot, const cl::Mem& v, const cl::Mem& y, uint32_t y_off,
          uint32_t ldy, uint32_t T, float alpha = 1.0f);

}  // namespace ops
}  // namespace clshard
