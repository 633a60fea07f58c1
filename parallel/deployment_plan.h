// Memory of a deployment per device, from a checkpoint's plan (models/plan.h: config.json alone)
// and the parallel layout: weights after the data/tensor/expert split, KV pages in what is left,
// activations, expert-parallel exchange buffers and signal buffers. `clshard plan` prints it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace clshard::parallel {

struct DeploymentShape {
  size_t devices = 1;
  size_t data = 1, tensor = 1, expert = 1;
  uint64_t device_memory_bytes = 0;  // per device
  double memory_fraction = 0.9;
  uint32_t page_size = 128;
  uint32_t max_batch_input_tokens = 2048;
};

struct DeviceMemory {
  size_t device = 0, replica = 0;
  uint32_t experts = 0;             // routed experts this device holds (MoE models)
  uint64_t weights = 0;
  uint64_t activations = 0;
  uint64_t ep_buffers = 0;          // dispatch + combine rows in flight
  uint64_t signal_buffers = 0;
  uint64_t kv_bytes_per_page = 0;
  uint64_t kv_pages = 0;            // what fits in the rest
  uint64_t kv_bytes = 0;
  bool fits = true;                 // weights + activations + buffers within memory_fraction
};

// `checkpoint` is plan_checkpoint()'s JSON. Throws naming the parallel key that does not fit the
// devices.
std::vector<DeviceMemory> plan_devices(const nlohmann::json& checkpoint, const DeploymentShape& s);
std::string format_device_plan(const std::vector<DeviceMemory>& rows, const DeploymentShape& s);

}  // namespace clshard::parallel
