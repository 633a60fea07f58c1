// Data-parallel replicas of a model whose replicas do not talk to each other (Llama 3): replica r
// holds a full copy of the weights on its device group and its own KV pages; a step's rows are
// split by data_parallel_splits, each replica runs its rows, and the logits are gathered on
// device 0 in row order (where sampling runs), as MAX's DataParallelLlama does.
#pragma once

#include <memory>
#include <vector>

#include "runtime/model.h"

namespace clshard::parallel {

class DataParallelLM : public CausalLM {
 public:
  // Replicas must be alike (same architecture, vocabulary, KV layout).
  explicit DataParallelLM(std::vector<std::unique_ptr<CausalLM>> replicas);

  const ModelInfo& info() const override { return replicas_[0]->info(); }
  uint64_t kv_bytes_per_token() const override { return replicas_[0]->kv_bytes_per_token(); }
  void allocate_kv_cache(uint32_t num_pages, uint32_t page_size) override;
  uint32_t kv_num_pages() const override { return replicas_[0]->kv_num_pages(); }
  uint32_t kv_page_size() const override { return replicas_[0]->kv_page_size(); }
  StepOutputs forward(const StepInputs& step) override;
  std::vector<Device*> devices() const override;
  uint32_t num_replicas() const override { return uint32_t(replicas_.size()); }
  uint32_t num_lora_adapters() const override { return replicas_.front()->num_lora_adapters(); }

 private:
  std::vector<std::unique_ptr<CausalLM>> replicas_;
  cl::Mem logits_;  // on device 0
  size_t logits_capacity_ = 0;
};

}  // namespace clshard::parallel
