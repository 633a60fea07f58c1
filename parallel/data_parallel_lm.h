// Data-parallel replicas of a model whose replicas do not talk to each other (Llama 3): replica r
// holds a full copy of the weights on its device group and its own KV pages; a step's rows are
// split by data_parallel_splits, each replica runs its rows, and the logits are gathered on
// device 0 in row order (where sampling runs), as MAX's DataParallelLlama does.
//
// Over MPI (cluster.transport: mpi) a process holds only the replicas whose devices it drives
// (the others are null here): every process runs the same steps, each its own replicas' rows, and
// the rows' logits travel to the logits device (Topology::logits_device) through `comm`, a
// Communicator over every device of the world (transport rank = device). The other processes'
// returned logits buffer has the step's rows but holds only their own replicas' rows.
#pragma once

#include <memory>
#include <vector>

#include "parallel/collectives.h"
#include "parallel/topology.h"
#include "runtime/model.h"

namespace clshard::parallel {

class DataParallelLM : public CausalLM {
 public:
  // Replicas must be alike (same architecture, vocabulary, KV layout).
  explicit DataParallelLM(std::vector<std::unique_ptr<CausalLM>> replicas);
  // Over MPI: replicas[r] null where another process runs replica r; `topology` places them.
  DataParallelLM(std::vector<std::unique_ptr<CausalLM>> replicas, const Topology& topology,
                 std::unique_ptr<Communicator> comm);
  ~DataParallelLM() override;

  const ModelInfo& info() const override { return first().info(); }
  uint64_t kv_bytes_per_token() const override { return first().kv_bytes_per_token(); }
  void allocate_kv_cache(uint32_t num_pages, uint32_t page_size) override;
  uint32_t kv_num_pages() const override { return first().kv_num_pages(); }
  uint32_t kv_page_size() const override { return first().kv_page_size(); }
  StepOutputs forward(const StepInputs& step) override;
  std::vector<Device*> devices() const override;
  uint32_t num_replicas() const override { return uint32_t(replicas_.size()); }
  uint32_t num_lora_adapters() const override { return replicas_.front()->num_lora_adapters(); }
  uint32_t max_loaded_lora_adapters() const override {
    return replicas_.front()->max_loaded_lora_adapters();
  }

 private:
  CausalLM& first() const { return *replicas_[first_]; }  // this process's first replica
  StepOutputs gather_over_mpi(const StepInputs& step, std::vector<StepOutputs>& outs);

  std::vector<std::unique_ptr<CausalLM>> replicas_;
  size_t first_ = 0;
  std::unique_ptr<Communicator> comm_;     // over MPI only
  std::vector<size_t> logits_rank_;        // over MPI: the device holding each replica's logits
  size_t gather_rank_ = 0;                 // over MPI: the logits device
  cl::Mem logits_;  // on device 0 (over MPI: this process's first replica's logits device)
  size_t logits_capacity_ = 0;
};

}  // namespace clshard::parallel
