// LoRA adapters on Llama 3 (runtime/ops_lora.h): PEFT adapters of q/k/v/o_proj and
// gate/up/down_proj, checked against this model's shapes; runtime/ops_lora.h reads them, keeps at
// most lora.max_loaded resident on the model's device and applies them. One device only (tensor
// parallelism would need the stacks sharded like the weights: an error for now).
#pragma once

#include <cstdint>
#include <vector>

#include "models/llama3/config.h"
#include "models/load_options.h"
#include "runtime/ops_lora.h"

namespace clshard::llama3 {

enum LoraTarget { kLoraQ, kLoraK, kLoraV, kLoraO, kLoraGate, kLoraUp, kLoraDown, kLoraTargets };

// The module names PEFT gives the targets, in LoraTarget order.
const std::vector<std::string>& lora_module_names();

// Every layer's targets: module l * kLoraTargets + t is layer l's target t.
LoraTargets lora_targets(const Llama3Config& cfg);
inline size_t lora_module(size_t layer, LoraTarget t) { return layer * kLoraTargets + t; }

// Reads opts.lora_adapters and checks every tensor against the model: a module of another layer
// count or shape is an error naming the adapter, the tensor, its shape and the base model's (an
// adapter made for another base model). Empty when none is declared.
LoraAdapters load_llama_lora(const Llama3Config& cfg, const LoadOptions& opts, Device& dev);

}  // namespace clshard::llama3
