#include "parallel/data_parallel_lm.h"

#include <stdexcept>

#include "runtime/device.h"

namespace clshard::parallel {

DataParallelLM::DataParallelLM(std::vector<std::unique_ptr<CausalLM>> replicas)
    : replicas_(std::move(replicas)) {
  if (replicas_.empty()) throw std::invalid_argument("DataParallelLM: no replicas");
  for (const auto& r : replicas_)
    if (r->info().vocab_size != replicas_[0]->info().vocab_size ||
        r->kv_bytes_per_token() != replicas_[0]->kv_bytes_per_token())
      throw std::invalid_argument("DataParallelLM: replicas differ");
}

void DataParallelLM::allocate_kv_cache(uint32_t num_pages, uint32_t page_size) {
  for (auto& r : replicas_) r->allocate_kv_cache(num_pages, page_size);
}

std::vector<Device*> DataParallelLM::devices() const {
  std::vector<Device*> d;
  for (const auto& r : replicas_)
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
  // devices that run concurrently overlap.
  std::vector<StepOutputs> outs;
  for (size_t r = 0; r < R; ++r) outs.push_back(replicas_[r]->forward(step.replica_step(r)));

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

}  // namespace clshard::parallel
