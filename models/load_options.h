// What a model loader is given: the deployment's devices and the settings of the deployment file
// that shape the model (its parallel layout, its length, how FP8 activations run).
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "parallel/topology.h"
#include "runtime/dtype.h"
#include "runtime/ops_lora.h"
#include "runtime/safetensors.h"

namespace clshard {

class Device;

struct LoadOptions {
  std::vector<Device*> devices;        // every device of the deployment
  std::optional<uint32_t> max_length;  // caps max_position_embeddings
  uint32_t data_parallel_degree = 1;   // replicas (parallel.data)
  uint32_t tensor_parallel_degree = 1;  // shards per replica (parallel.tensor)
  uint32_t expert_parallel_degree = 1;  // ranks the experts are spread over (parallel.expert)
  bool balanced_experts = false;        // parallel.placement: balanced
  // FP8 checkpoints: false (default) keeps activations in f32 and dequantizes weights in the
  // kernels; true fake-quantizes activations to fp8 per token per 128 columns before each FP8
  // linear, as MAX and DeepSeek's reference code do (model.fp8_activations: fp8).
  bool quantize_fp8_activations = false;
  // kv_cache.dtype: the element type of the KV caches (F32, the default, BF16 or F8_E4M3: stores
  // round to nearest even, attention reads the narrower type). Half the cache memory at bf16, a
  // quarter at fp8.
  DType kv_cache_dtype = DType::F32;
  // What the linear layers multiply in (model.compute_dtype): f32, or bf16 activations with f32
  // sums in the GEMMs (4+ rows) of bf16 and FP8 weights (runtime/ops.h, ops_mla.h).
  ComputeDType compute_dtype = ComputeDType::F32;
  // model.mmap: the checkpoint's weights read where the files are mapped (true, the default), or
  // from a copy read into memory at load (false; runtime/file_mapping.h's copy_checkpoint_file).
  WeightMemory weight_memory = WeightMemory::Mapped;
  // Told how far a copy has read (weight_memory: Copied), per checkpoint directory; may be empty.
  LoadProgress load_progress;
  // cluster.transport: mpi — the deployment's devices are spread over mpi_ranks processes, each
  // driving devices.size() of them; this process is mpi_rank and drives `devices` (the topology's
  // devices mpi_rank * devices.size() ..). 0: every device is in this process.
  uint32_t mpi_ranks = 0, mpi_rank = 0;
  // The ranks (devices) the topology spreads the model over, and the processes they are in.
  size_t ranks() const { return mpi_ranks ? size_t(mpi_ranks) * devices.size() : devices.size(); }
  size_t processes() const { return mpi_ranks ? mpi_ranks : 1; }
  size_t process() const { return mpi_ranks ? mpi_rank : 0; }
  // LoRA (the deployment's lora: section): PEFT adapter directories by name, in the order that
  // gives their ids (StepInputs::adapter_ids: 1 + the index here), the largest rank allowed and
  // how many may be resident on a device at once (the others are uploaded when a step needs them).
  using LoraSpec = clshard::LoraSpec;
  std::vector<LoraSpec> lora_adapters;
  uint32_t lora_max_rank = 64;
  uint32_t lora_max_loaded = 8;

  // The parallel settings, as parallel::Topology takes them.
  parallel::ParallelDegrees degrees() const {
    return {data_parallel_degree, tensor_parallel_degree, expert_parallel_degree,
            balanced_experts};
  }
};

}  // namespace clshard
