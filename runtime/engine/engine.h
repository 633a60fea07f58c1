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
#include <string_view>
#include <type_traits>
#include <vector>

#include "runtime/device.h"
#include "runtime/engine/acceptance.h"
#include "runtime/engine/constraint.h"
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
  // Structured output (runtime/engine/constraint.h; compile_response_format builds one): every
  // sampled and every accepted draft token is one the constraint allows, EOS only where the
  // output can end, and the request ends (Stop) once the output is complete. The engine works
  // on its own clone(), so one compiled constraint may be submitted several times.
  std::shared_ptr<TokenConstraint> constraint;
  uint32_t adapter_id = 0;  // LoRA: 1 + the index of the model's adapter; 0: the base model
  bool ignore_eos = false;  // the model's EOS ids do not end it (stop_token_ids still do)
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
  uint32_t cached_tokens = 0;  // positions taken from the prefix cache instead of computed
  // One entry per token of token_ids when the request asked for sampling.logprobs (else empty).
  std::vector<TokenLogprobs> logprobs;
};

// What on_token reports for every token a request keeps.
struct TokenEvent {
  uint64_t handle = 0;
  int32_t token = -1;
  std::string_view text;                    // the text it adds (UTF-8 complete; may be empty)
  const TokenLogprobs* logprobs = nullptr;  // when the request asked for sampling.logprobs
};

// Speculative decoding figures: drafts proposed and accepted, in all and per draft position.
struct SpeculativeStats {
  uint64_t verify_rows = 0;  // rows that verified at least one draft
  uint64_t drafted = 0, accepted = 0;
  std::vector<uint64_t> drafted_at, accepted_at;  // [K]: position k of the drafts
  double draft_s = 0;  // time in the draft's steps (part of EngineStats::device_s)
  // Tokens a verifying row commits on average: accepted drafts + the token the target adds.
  double mean_accepted_length() const {
    return verify_rows ? double(accepted + verify_rows) / double(verify_rows) : 0.0;
  }
  double acceptance_rate() const { return drafted ? double(accepted) / double(drafted) : 0.0; }
  // "drafted 120, accepted 84 (70.0%), mean accepted length 2.40; by position: 1: 80.0% ..."
  std::string describe() const;
};

struct EngineStats {
  uint64_t steps = 0;
  uint64_t prompt_tokens = 0;  // of finished requests
  uint64_t output_tokens = 0;  // sampled tokens
  double host_s = 0;    // scheduling, bookkeeping, detokenizing
  double device_s = 0;  // forward passes and sampling (enqueue to the logits/tokens read)
  uint64_t preemptions = 0;
  // Prefix caching: positions requests took from the cache at admission, and positions prefill
  // rows computed (prompts, and the sequences of preempted requests recomputed), over every
  // replica.
  uint64_t cached_prompt_tokens = 0;
  uint64_t prefill_tokens = 0;
  // Share of the positions to prefill that came from the cache.
  double prefix_hit_rate() const {
    const uint64_t all = cached_prompt_tokens + prefill_tokens;
    return all ? double(cached_prompt_tokens) / double(all) : 0.0;
  }
  SpeculativeStats speculative;
};

// Speculative decoding in the engine: a draft (runtime/model.h's DraftModel) proposes K tokens per
// request, the target verifies them in the next step and keeps a prefix plus one token of its own
// (runtime/engine/acceptance.h): the same tokens as plain decoding at temperature 0, the same
// distribution above it.
struct SpeculativeOptions {
  uint32_t num_tokens = 0;        // K; the scheduler's limits must say the same
  bool relaxed_thinking = false;  // relaxed acceptance inside <think> ... </think>
  RelaxedAcceptance relaxed;
};

// How many KV pages a model gets on its device: `pages` when set, else memory_fraction of what the
// device has left after the weights, capped by the per-buffer allocation limit and by what
// max_batch_size requests of max_length tokens could ever use. A draft's cache shares the page
// ids, so its bytes per token count in a page.
uint32_t plan_kv_pages(const CausalLM& model, uint32_t page_size, int64_t pages,
                       double memory_fraction, uint32_t max_batch_size, uint32_t max_length,
                       const DraftModel* draft = nullptr);

// One scheduler per data-parallel replica of the model; a new request goes to the replica
// parallel::Topology::route_request picks (the longest cached prefix within a load margin, else the
// least loaded), and each step runs every replica's rows together (data_parallel_splits).
class Engine {
 public:
  // The model's KV cache must be allocated (allocate_kv_cache) with limits.total_pages pages (per
  // replica), and so must the draft's when there is one (then limits.num_speculative_tokens ==
  // spec.num_tokens >= 1).
  Engine(CausalLM& model, const Tokenizer* tokenizer, const SchedulerLimits& limits,
         DraftModel* draft = nullptr, const SpeculativeOptions& spec = {});

  uint64_t submit(GenerationRequest request);
  // One step; returns the requests that finished in it.
  std::vector<GenerationResult> step();
  bool has_work() const;
  // Called for every token a request keeps: f(const TokenEvent&), or the older
  // f(uint64_t handle, int32_t token, const std::string& text).
  template <typename F>
  void on_token(F f) {
    if constexpr (std::is_invocable_v<F&, const TokenEvent&>) {
      on_token_ = std::move(f);
    } else {
      on_token_ = [g = std::move(f)](const TokenEvent& e) mutable {
        g(e.handle, e.token, std::string(e.text));
      };
    }
  }
  // Ends a waiting or running request early (a client that went away, a deadline): its KV pages go
  // back to the pool at once, and the next step() reports it with reason Error, `why` as its
  // error and the tokens it kept so far. Call it between steps, from the thread that steps the
  // engine (the engine is not thread-safe). False when the request has already finished or was
  // never submitted; nothing changes then.
  bool cancel(uint64_t handle, const std::string& why = "cancelled");
  // Waiting (no row yet, or preempted), Running, or Finished (also for handles never issued).
  RequestState state(uint64_t handle) const;
  // Over every replica: requests with a row / waiting for one, and KV pages in use.
  size_t num_running() const;
  size_t num_waiting() const;
  uint64_t kv_pages_in_use() const;
  uint64_t kv_pages_total() const;
  // Which distribution logprobs describe (sampling.h); raw by default.
  void set_logprobs_mode(LogprobsMode mode) { logprobs_mode_ = mode; }
  const EngineStats& stats() const { return stats_; }
  // Zeroes the stats (serving's warm-up: what a server reports counts clients' requests only).
  void reset_stats();
  size_t num_replicas() const { return schedulers_.size(); }
  uint32_t vocab_size() const { return model_.info().vocab_size; }
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
    bool thinking = false;   // inside <think> ... </think> (relaxed acceptance)
    std::unique_ptr<TokenConstraint> constraint;  // this request's copy, at its committed tokens
    std::optional<uint32_t> penalty_slot;  // its counts in penalty_counts_, once it sampled
    std::vector<TokenLogprobs> logprobs;   // per kept token, when asked
  };
  // One step's rows over every replica, merged in replica order.
  struct Batch {
    std::vector<std::optional<ScheduledStep>> plans;  // per replica
    StepInputs merged;
    std::vector<uint64_t> row_handle;           // engine handle of each merged row
    std::vector<const ScheduledRow*> row_info;  // the scheduler's row
    std::vector<size_t> row_replica;
  };
  // Schedules every replica; false when no replica has work.
  bool schedule(Batch& batch);
  void step_plain(Batch& batch);
  void step_speculative(Batch& batch);
  // Runs the draft over the rows the target just verified and hands each running request its next
  // drafts (runtime/speculative.cpp).
  void propose_drafts(const Batch& batch, const StepOutputs& target,
                      const std::vector<std::vector<int32_t>>& committed);
  // Packed bitmask rows (bitmask_words(vocab) words each) for a step's logits rows: all ones for
  // rows without a constraint (engine_constraints.cpp). `row_constraint[r]` is the constraint a row
  // samples under (null = none); true when any row has one.
  bool constraint_masks(const std::vector<const TokenConstraint*>& row_constraint, uint32_t vocab,
                        std::vector<uint32_t>& bits) const;
  // Writes one row of mask for constraint `c`: its allowed tokens, plus the EOS ids when the
  // output can end there.
  void constraint_row(const TokenConstraint& c, uint32_t vocab, uint32_t* row) const;
  // The same for a speculative step's verification rows [rows, words]: verifying request s
  // (constraints[s], null = none) samples its position i under its constraint advanced through
  // drafts d_0..d_{i-1}; rows past a draft the constraint refuses are never read (that draft is
  // rejected) and repeat the last mask, as do rows past an EOS draft (the EOS ends the request).
  bool draft_masks(const std::vector<const TokenConstraint*>& constraints,
                   const std::vector<uint32_t>& logit_offsets,
                   const std::vector<int32_t>& drafts, const std::vector<uint32_t>& draft_offsets,
                   uint32_t rows, uint32_t vocab, std::vector<uint32_t>& bits) const;
  // Records a kept token (stop tokens, stop strings, streaming); true when it ended the request.
  // `lp`: its log-probabilities when the request asked for them.
  bool observe(uint64_t handle, Live& live, int32_t token, const TokenLogprobs* lp = nullptr);
  void emit(uint64_t handle, int32_t token, std::string_view text, const TokenLogprobs* lp);
  // Penalties (sampling.h): the counts slot of a request that asks for them, acquired on its
  // first sampled row on the logits device; and the counts of the tokens a step committed.
  uint32_t penalty_slot(Device& dev, uint32_t vocab, Live& live);
  void count_committed(const std::vector<std::pair<uint64_t, std::vector<int32_t>>>& kept);
  // Applies the penalties of `rows` to the step's logits; returns the buffer to sample from: the
  // logits themselves (in place) or, when a penalised row also wants raw logprobs, a copy.
  const cl::Mem& penalised_logits(const StepOutputs& out, const std::vector<PenaltyRow>& rows,
                                  bool keep_raw, Scratch& copy);
  // The log-probabilities of the listed rows, from the raw or the sampled-from buffer.
  std::vector<TokenLogprobs> step_logprobs(const StepOutputs& out, const cl::Mem& sampled_from,
                                           std::vector<LogprobRow> rows,
                                           const std::vector<const SamplingParams*>& params);

  CausalLM& model_;
  const Tokenizer* tokenizer_;
  DraftModel* draft_ = nullptr;
  SpeculativeOptions spec_;
  std::optional<int32_t> think_start_, think_end_;
  std::deque<Scheduler> schedulers_;  // a deque: schedulers are neither copied nor moved
  std::map<uint64_t, Live> live_;                       // by engine handle
  std::vector<std::map<uint64_t, uint64_t>> handle_of_;  // per replica: local -> engine handle
  uint64_t next_handle_ = 1;
  std::vector<int32_t> eos_ids_;
  std::function<void(const TokenEvent&)> on_token_;
  EngineStats stats_;
  LogprobsMode logprobs_mode_ = LogprobsMode::Raw;
  std::optional<PenaltyCounts> penalty_counts_;
};

}  // namespace clshard
