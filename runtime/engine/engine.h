// The generation loop of one replica: the scheduler's ragged steps through the model, sampling on
// the device, stop tokens and stop strings, streamed text. Model-agnostic (a CausalLM).
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "runtime/engine/sampling.h"
#include "runtime/engine/scheduler.h"
#include "runtime/model.h"
#include "runtime/text/tokenizer.h"

namespace clshard {

struct GenerationRequest {
  std::vector<int32_t> prompt;
  SamplingParams sampling;
  uint32_t max_tokens = 256;
  std::vector<int32_t> stop_token_ids;  // besides the model's EOS ids
  std::vector<std::string> stop;        // stop strings (needs a tokenizer)
};

struct GenerationResult {
  uint64_t handle = 0;
  // Completion tokens; a stop or EOS token that ended the request is not among them, and the text
  // ends before a stop string.
  std::vector<int32_t> token_ids;
  std::string text;
  EndReason reason = EndReason::Length;
  std::string error;
  uint32_t prompt_tokens = 0;
  uint32_t preemptions = 0;
};

struct EngineStats {
  uint64_t steps = 0;
  uint64_t prompt_tokens = 0;  // of finished requests
  uint64_t output_tokens = 0;  // sampled tokens
  double host_s = 0;    // scheduling, bookkeeping, detokenizing
  double device_s = 0;  // forward passes and sampling (enqueue to the logits/tokens read)
  uint64_t preemptions = 0;
};

// How many KV pages a model gets on its device: `pages` when set, else memory_fraction of what the
// device has left after the weights, capped by the per-buffer allocation limit and by what
// max_batch_size requests of max_length tokens could ever use.
uint32_t plan_kv_pages(const CausalLM& model, uint32_t page_size, int64_t pages,
                       double memory_fraction, uint32_t max_batch_size, uint32_t max_length);

// One scheduler per data-parallel replica of the model; a new request goes to the least-loaded
// replica, and each step runs every replica's rows together (data_parallel_splits).
class Engine {
 public:
  // The model's KV cache must be allocated (allocate_kv_cache) with limits.total_pages pages (per
  // replica).
  Engine(CausalLM& model, const Tokenizer* tokenizer, const SchedulerLimits& limits);

  uint64_t submit(GenerationRequest request);
  // One step; returns the requests that finished in it.
  std::vector<GenerationResult> step();
  bool has_work() const;
  // Called for every token a request keeps, with the text it adds (UTF-8 complete; may be empty).
  void on_token(std::function<void(uint64_t handle, int32_t token, const std::string& text)> f) {
    on_token_ = std::move(f);
  }
  const EngineStats& stats() const { return stats_; }
  const Scheduler& scheduler(size_t replica = 0) const { return schedulers_.at(replica); }
  size_t replica_of(uint64_t handle) const { return live_.at(handle).replica; }

 private:
  struct Live {
    size_t replica = 0;
    uint64_t local = 0;  // the handle in the replica's scheduler
    GenerationRequest req;
    std::optional<StreamDecoder> decoder;
    std::string text;
    bool drop_last = false;  // the last token was a stop/EOS token: not part of the completion
  };
  void observe(uint64_t handle, Live& live, int32_t token);

  CausalLM& model_;
  const Tokenizer* tokenizer_;
  std::deque<Scheduler> schedulers_;  // a deque: schedulers are neither copied nor moved
  std::map<uint64_t, Live> live_;                       // by engine handle
  std::vector<std::map<uint64_t, uint64_t>> handle_of_;  // per replica: local -> engine handle
  uint64_t next_handle_ = 1;
  std::vector<int32_t> eos_ids_;
  std::function<void(uint64_t, int32_t, const std::string&)> on_token_;
  EngineStats stats_;
};

}  // namespace clshard
