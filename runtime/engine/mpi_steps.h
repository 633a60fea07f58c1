// The engine over MPI (cluster.transport: mpi): rank 0 runs the engine on a StepLeader, which hands
// every call that changes the model's state (each step's StepInputs, KV cache allocations) to the
// other ranks before running it itself; the other ranks run serve_steps(), which makes the same
// calls on their own replica until the leader's stop_followers(). Every rank thus runs the same
// steps, and the collectives inside them meet. Rank 0 alone reads the job and writes the output.
//
// The messages are host broadcasts (MPI_Bcast) of a few hundred bytes per step; the followers wait
// for the next one without a deadline (an idle engine is not a fault), and a leader that dies ends
// the job through mpirun. Built with MPI only (CLSHARD_HAVE_MPI); elsewhere the calls throw.
#pragma once

#include <memory>

#include "runtime/model.h"

namespace clshard {

class StepLeader final : public CausalLM {
 public:
  explicit StepLeader(std::unique_ptr<CausalLM> model) : model_(std::move(model)) {}
  const ModelInfo& info() const override { return model_->info(); }
  uint64_t kv_bytes_per_token() const override { return model_->kv_bytes_per_token(); }
  void allocate_kv_cache(uint32_t num_pages, uint32_t page_size) override;
  uint32_t kv_num_pages() const override { return model_->kv_num_pages(); }
  uint32_t kv_page_size() const override { return model_->kv_page_size(); }
  StepOutputs forward(const StepInputs& step) override;
  std::vector<Device*> devices() const override { return model_->devices(); }
  uint32_t num_replicas() const override { return model_->num_replicas(); }

 private:
  std::unique_ptr<CausalLM> model_;
};

// On the ranks other than 0: runs the leader's calls on `model` until stop_followers().
void serve_steps(CausalLM& model);
// On rank 0, once the work is done: ends serve_steps() on the others.
void stop_followers();

// A step as bytes and back (the broadcast's payload; exposed for tests).
std::vector<char> serialize_step(const StepInputs& step);
StepInputs deserialize_step(const std::vector<char>& bytes);

}  // namespace clshard
