// LoRA adapters on Llama 3 (runtime/ops_lora.h): PEFT adapters of q/k/v/o_proj and
// gate/up/down_proj, checked against this model's shapes and stacked per layer and target on the
// model's device. One device only (tensor parallelism would need the stacks sharded like the
// weights: an error for now).
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include "models/llama3/config.h"
#include "models/load_options.h"
#include "runtime/ops_lora.h"

namespace clshard {
class Device;
}

namespace clshard::llama3 {

enum LoraTarget { kLoraQ, kLoraK, kLoraV, kLoraO, kLoraGate, kLoraUp, kLoraDown, kLoraTargets };

// The module names PEFT gives the targets, in LoraTarget order.
const std::vector<std::string>& lora_module_names();

struct LlamaLora {
  std::vector<std::array<LoraStack, kLoraTargets>> layers;  // [num_hidden_layers]
  uint32_t adapters = 0;  // loaded adapters: StepInputs::adapter_ids 1 .. adapters
  uint32_t max_rank = 0;
  uint64_t device_bytes = 0;
};

// Reads opts.lora_adapters (at most opts.lora_max_loaded of them) and checks every tensor against
// the model: a module of another layer count or shape is an error naming the adapter, the tensor,
// its shape and the base model's (an adapter made for another base model).
LlamaLora load_llama_lora(const Llama3Config& cfg, const LoadOptions& opts, Device& dev);

}  // namespace clshard::llama3
