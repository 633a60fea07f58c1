// The Llama 3 forward pass (MAX's Llama3 / TransformerBlock), on one device or tensor-parallel
// over several (MAX's DistributedLlama3: heads and MLP columns split, an allreduce after attention
// and after the MLP, vocabulary-parallel embedding and lm_head):
//   h = embed(tokens) * embedding_multiplier
//   per layer: h += m * o_proj(attention(rope(qkv(norm(h)))));  h += m * down(silu(gate) * up)
//   logits = lm_head(norm(h[rows])) / logits_scaling
// One device is the one-shard case of the same code.
#pragma once

#include <filesystem>
#include <memory>

#include "models/llama3/config.h"
#include "models/llama3/lora.h"
#include "models/llama3/weights.h"
#include "models/load_options.h"
#include "runtime/model.h"
#include "runtime/safetensors.h"

namespace clshard::parallel {
class Communicator;
class Topology;
}

namespace clshard::llama3 {

class Llama3Model : public CausalLM {
 public:
  // Replica `replica` of the topology: its device group (indices into opts.devices) are the
  // tensor-parallel ranks (one device: no parallelism), sharded as the topology says.
  Llama3Model(const std::filesystem::path& dir, const LoadOptions& opts,
              const parallel::Topology& topology, size_t replica);
  ~Llama3Model() override;

  const ModelInfo& info() const override { return info_; }
  uint64_t kv_bytes_per_token() const override;
  void allocate_kv_cache(uint32_t num_pages, uint32_t page_size) override;
  uint32_t kv_num_pages() const override { return num_pages_; }
  uint32_t kv_page_size() const override { return page_size_; }
  // The returned logits buffer is the model's and stays valid until the next forward.
  StepOutputs forward(const StepInputs& step) override;
  std::vector<Device*> devices() const override;
  uint32_t num_lora_adapters() const override { return lora_.count(); }
  uint32_t max_loaded_lora_adapters() const override { return lora_.slots(); }

  const Llama3Config& config() const { return cfg_; }

 private:
  // What one tensor-parallel rank holds.
  struct Shard {
    Device* dev = nullptr;
    ShardRange range;
    Llama3Weights w;
    cl::Mem inv_freq, inv_freq_long;
    std::vector<cl::Mem> kv;  // paged KV cache of this rank's kv heads (kv_dtype_), one per layer
  };

  Llama3Config cfg_;
  std::unique_ptr<WeightStore> store_;  // keeps the mapped files alive under the weights
  std::vector<Shard> shards_;  // this process's ranks of the replica (all of them in process)
  std::vector<size_t> tensor_ranks_;  // of each shard
  std::vector<uint32_t> vocab_cols_;  // logits columns of every tensor rank of the replica
  // With more than one tensor rank: in process, or over MPI when the group spans processes.
  std::unique_ptr<parallel::Communicator> comm_;
  ModelInfo info_;
  uint32_t long_from_ = 0xffffffffu;
  ComputeDType compute_ = ComputeDType::F32;  // model.compute_dtype, for every linear layer
  uint32_t num_pages_ = 0, page_size_ = 0;
  DType kv_dtype_ = DType::F32;  // the cache's elements (LoadOptions::kv_cache_dtype)
  cl::Mem logits_;  // on the first device; every rank writes its vocabulary columns
  size_t logits_capacity_ = 0;
  LoraAdapters lora_;  // LoRA adapters (one device only)
};

}  // namespace clshard::llama3
