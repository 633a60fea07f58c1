// The memory and parameter plan of a Llama 3 checkpoint from its config.json alone (`clshard
// plan`): its tensors in torch_dtype, the f32 paged KV cache as Llama3Model keeps it, and the f32
// step scratch of a batch of tokens.
#pragma once

#include <cstdint>

#include <nlohmann/json.hpp>

#include "models/llama3/config.h"

namespace clshard::llama3 {

// bytes_per_param: 4 for float32 checkpoints, 2 otherwise.
nlohmann::json plan_memory(const Llama3Config& cfg, uint64_t bytes_per_param);

}  // namespace clshard::llama3
