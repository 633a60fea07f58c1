// Memory of a deployment per device, from a checkpoint's plan (plan_checkpoint: config.json alone)
// and the deployment's topology: weights after the data/tensor/expert split, KV pages in what is
// left, activations, expert-parallel exchange buffers and signal buffers. `clshard plan` prints it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace clshard::parallel {

class Topology;

// What the plan needs besides the topology.
struct DeploymentShape {
  uint64_t device_memory_bytes = 0;  // per device
  double memory_fraction = 0.9;
  uint32_t page_size = 128;
  uint32_t max_batch_input_tokens = 2048;
  // A speculative draft (plan_draft's figures): its replicated weights on every device, its routed
  // experts split like the target's, and its one-layer cache in every KV page.
  uint64_t draft_weight_bytes = 0, draft_routed_expert_bytes = 0, draft_kv_bytes_per_token = 0;
  // LoRA adapters (lora_stack_bytes): their stacked A and B, on every device (not split).
  uint64_t lora_bytes = 0;
};

struct DeviceMemory {
  size_t device = 0, replica = 0;
  uint32_t experts = 0;             // routed experts this device holds (MoE models)
  uint64_t weights = 0;             // the draft's included
  uint64_t draft_weights = 0;
  uint64_t lora = 0;                // LoRA adapters (in weights too)
  uint64_t activations = 0;
  uint64_t ep_buffers = 0;          // dispatch + combine rows in flight
  uint64_t signal_buffers = 0;
  uint64_t kv_bytes_per_page = 0;
  uint64_t kv_pages = 0;            // what fits in the rest
  uint64_t kv_bytes = 0;
  bool fits = true;                 // weights + activations + buffers within memory_fraction
};

// `checkpoint` is plan_checkpoint()'s JSON; `topology` the deployment's (the one the model would
// load with, so degrees that do not fit were already errors naming the key), without
// balanced_experts: a plan is made without the devices, so its expert blocks are even.
std::vector<DeviceMemory> plan_devices(const nlohmann::json& checkpoint, const Topology& topology,
                                       const DeploymentShape& s);
std::string format_device_plan(const std::vector<DeviceMemory>& rows, const DeploymentShape& s);

}  // namespace clshard::parallel
