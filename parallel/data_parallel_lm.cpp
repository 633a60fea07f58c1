#include "parallel/data_parallel_lm.h"

#include <algorithm>
#include <stdexcept>

#include "runtime/device.h"
#include "runtime/step_device.h"

namespace clshard::parallel {

DataParallelLM::DataParallelLM(std::vector<std::unique_ptr<CausalLM>> replicas)
    : replicas_(std::move(replicas)) {
  if (replicas_.empty()) throw std::invalid_argument("DataParallelLM: no replicas");
  for (const auto& r : replicas_)
    if (!r) throw std::invalid_argument("DataParallelLM: a replica is missing");
  for (const auto& r : replicas_)
    if (r->info().vocab_size != replicas_[0]->info().vocab_size ||
        r->kv_bytes_per_token() != replicas_[0]->kv_bytes_per_token())
      throw std::invalid_argument("DataParallelLM: replicas differ");
}

DataParallelLM::DataParallelLM(std::vector<std::unique_ptr<CausalLM>> replicas,
                               const Topology& topology, std::unique_ptr<Communicator> comm)
    : replicas_(std::move(replicas)), comm_(std::move(comm)) {
  if (replicas_.size() != topology.replicas())
    throw std::invalid_argument("DataParallelLM: " + std::to_string(replicas_.size()) +
                                " replicas, the topology " +
                                std::to_string(topology.replicas()));
  if (!comm_ || comm_->size() != topology.devices())
    throw std::invalid_argument("DataParallelLM: over MPI the communicator spans every device");
  while (first_ < replicas_.size() && !replicas_[first_]) ++first_;
  if (first_ == replicas_.size())
    throw std::invalid_argument("DataParallelLM: no replica in this process");
  for (const auto& r : replicas_)
    if (r && (r->info().vocab_size != first().info().vocab_size ||
              r->kv_bytes_per_token() != first().kv_bytes_per_token()))
      throw std::invalid_argument("DataParallelLM: replicas differ");
  for (size_t r = 0; r < replicas_.size(); ++r)
    logits_rank_.push_back(topology.devices_of_replica(r).front());
  gather_rank_ = topology.logits_device();
}

DataParallelLM::~DataParallelLM() = default;

void DataParallelLM::allocate_kv_cache(uint32_t num_pages, uint32_t page_size) {
  for (auto& r : replicas_)
    if (r) r->allocate_kv_cache(num_pages, page_size);
}

std::vector<Device*> DataParallelLM::devices() const {
  std::vector<Device*> d;
  for (const auto& r : replicas_)
    if (r)
      for (Device* x : r->devices()) d.push_back(x);
  return d;
}

StepOutputs DataParallelLM::forward(const StepInputs& step) {
  const size_t R = replicas_.size();
  if (step.num_replicas() != R)
    throw std::invalid_argument("step has " + std::to_string(step.num_replicas()) +
                                " replica(s), the model " + std::to_string(R) +
                                " (data_parallel_splits)");
  // Every replica's kernels are enqueued (and flushed) before any is waited for, so replicas on
  // devices that run concurrently overlap. Over MPI a replica of another process contributes its
  // rows' shape only.
  std::vector<StepOutputs> outs(R);
  for (size_t r = 0; r < R; ++r) {
    if (replicas_[r]) {
      outs[r] = replicas_[r]->forward(step.replica_step(r));
    } else {
      const DeviceStep st = host_step(step.replica_step(r));
      outs[r].rows = uint32_t(st.logit_token_indices.size());
      outs[r].logit_offsets = st.logit_offsets;
    }
  }
  if (comm_) return gather_over_mpi(step, outs);

  Device& dev0 = *replicas_[0]->devices()[0];
  StepOutputs out;
  out.device = &dev0;
  out.vocab = info().vocab_size;
  out.logit_offsets = {0};
  for (const auto& o : outs) {
    for (size_t b = 1; b < o.logit_offsets.size(); ++b)
      out.logit_offsets.push_back(out.rows + o.logit_offsets[b]);
    out.rows += o.rows;
  }
  const size_t row_bytes = size_t(out.vocab) * sizeof(float);
  if (size_t(out.rows) * out.vocab > logits_capacity_) {
    logits_capacity_ = size_t(out.rows) * out.vocab;
    logits_ = dev0.alloc(logits_capacity_ * sizeof(float));
  }
  out.logits = logits_;
  // Gather the logits rows on device 0, in replica order.
  size_t row = 0;
  std::vector<float> staging;
  for (const auto& o : outs) {
    if (o.rows == 0) continue;
    const size_t bytes = o.rows * row_bytes;
    o.device->finish();
    if (o.device->context() == dev0.context()) {
      cl::check(clEnqueueCopyBuffer(dev0.queue(), o.logits.get(), logits_.get(), 0,
                                    row * row_bytes, bytes, 0, nullptr, nullptr),
                "gathering replica logits on " + dev0.label());
    } else {  // devices of different platforms: through host memory
      staging.resize(bytes / sizeof(float));
      o.device->read(o.logits, staging.data(), bytes);
      dev0.write(logits_, staging.data(), bytes, row * row_bytes);
    }
    row += o.rows;
  }
  return out;
}

StepOutputs DataParallelLM::gather_over_mpi(const StepInputs&, std::vector<StepOutputs>& outs) {
  const size_t R = replicas_.size(), N = comm_->size();
  StepOutputs out;
  out.vocab = info().vocab_size;
  out.logit_offsets = {0};
  for (const auto& o : outs) {
    for (size_t b = 1; b < o.logit_offsets.size(); ++b)
      out.logit_offsets.push_back(out.rows + o.logit_offsets[b]);
    out.rows += o.rows;
  }
  // The logits device when this process drives it, else this process's first replica's.
  Device& dev = comm_->is_local(gather_rank_) ? comm_->device(gather_rank_) : *outs[first_].device;
  out.device = &dev;
  const size_t V = out.vocab;
  if (std::max<size_t>(out.rows, 1) * V > logits_capacity_) {
    logits_capacity_ = std::max<size_t>(out.rows, 1) * V;
    logits_ = dev.alloc(logits_capacity_ * sizeof(float));
  }
  out.logits = logits_;
  if (out.rows == 0) return out;
  // Replica r's rows travel from its logits device to the gather device; they arrive in source
  // rank order, which is replica order (replicas hold consecutive devices).
  std::vector<std::vector<DeviceSpan>> send(N, std::vector<DeviceSpan>(N));
  std::vector<DeviceSpan> recv(N);
  for (size_t r = 0; r < R; ++r)
    send[logits_rank_[r]][gather_rank_] = {replicas_[r] ? outs[r].logits : cl::Mem(), 0,
                                           size_t(outs[r].rows) * V};
  recv[gather_rank_] = {comm_->is_local(gather_rank_) ? logits_ : cl::Mem(), 0,
                        size_t(out.rows) * V};
  comm_->all_to_all_rows(send, recv, V, "logits gather");
  dev.flush();
  return out;
}

}  // namespace clshard::parallel
