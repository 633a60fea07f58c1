// Continuous batching for one replica: requests join as others finish, each step is a ragged batch
// (runtime/step.h) of decode rows and prefill chunks within the batch limits, and KV pages are
// taken as requests grow and given back when they end. Host-side and model-agnostic: it never
// sees logits, only the tokens the engine sampled.
//
// The engine drives it, one step at a time:
//   while (auto step = scheduler.schedule()) {
//     outputs = model.forward(step->inputs);            // return_logits = LastToken: one per row
//     sampled = sample the rows with step->rows[i].needs_sample (skip the others' logits);
//     for each sampled token that hits a stop condition: scheduler.finish(handle, Stop);
//     scheduler.commit(*step, sampled);
//     for (auto& done : scheduler.take_finished()) write done;
//   }
// schedule() returns nullopt only when no request is waiting or running.
//
// Policy, in this order within a step:
//   1. decode rows: running requests with one token to feed (the last sampled one), oldest first;
//   2. running requests part-way through a (re)prefill, oldest first, each with a chunk of as many
//      tokens as the step's token budget still allows;
//   3. new requests, FIFO, while rows, tokens and free pages allow (the first chunk's pages must
//      be free: admission never preempts). Skipped in a step that preempted, so a request just
//      preempted is not re-admitted into the pages it has just given up.
// A row that needs a page when none is free preempts the newest running request (latest
// admitted) — possibly the row's own request — until the page is free. The victim's pages go back
// to the pool, it goes to the FRONT of the waiting queue with prompt + generated tokens so far, and
// it is later re-admitted and recomputed as a prefill of all of them; generation then continues
// where it stopped (nothing is re-sampled). The oldest running request is never preempted, so
// every step makes progress and no request is lost or duplicated.
// Everything is deterministic given the same sequence of calls.
#pragma once

#include <cstdint>
#include <deque>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "runtime/engine/kv_pages.h"
#include "runtime/step.h"

namespace clshard {

struct SchedulerLimits {
  uint32_t max_batch_size = 32;           // rows (requests) per step
  uint32_t max_batch_input_tokens = 2048; // new tokens per step, all rows together
  uint32_t page_size = 128;               // tokens per KV page
  uint32_t total_pages = 0;               // KV pages of the replica's cache (without the null page)
  // Cap on prompt + completion tokens of one request. A prompt of max_length tokens or more is an
  // error (no room for one new token); otherwise max_new_tokens is lowered to max_length - prompt,
  // and the request finishes with reason Length when it gets there.
  uint32_t max_length = 4096;
};

// Why a request ended. (Not batch_io.h's FinishReason, which names only what an output record can
// say: Stop and Length map onto it, Error becomes an error record.)
enum class EndReason { Stop, Length, Error };
const char* end_reason_name(EndReason r);  // "stop", "length", "error"

enum class RequestState { Waiting, Running, Finished };

struct FinishedRequest {
  uint64_t handle = 0;
  std::vector<int32_t> generated;  // completion tokens, including a stop token that ended it
  EndReason reason = EndReason::Length;
  std::string error;               // what went wrong, when reason == Error
  uint32_t prompt_tokens = 0;
  uint32_t preemptions = 0;        // times this request was preempted and recomputed
};

struct ScheduledRow {
  uint64_t handle = 0;
  // True when the row ends where a token must be sampled: decode rows and a prefill's last chunk.
  // False for an intermediate prefill chunk, whose logits the engine ignores.
  bool needs_sample = false;
  // Tokens the request had generated before this step: the index, within its completion, of the
  // token sampled from this row. A per-request seeded sampler keyed on (seed, index) gives the same
  // completion whatever else is in the batch and across preemptions.
  uint32_t num_generated = 0;
};

struct ScheduledStep {
  uint64_t step_index = 0;  // commit() checks it is the step schedule() handed out last
  // return_logits = LastToken: one logits row per scheduled row. lookup_table is
  // [rows, pages_per_row] with pages_per_row = the most pages any row of this step holds (so it
  // changes from step to step); each row lists exactly the pages its positions up to the end of
  // this step need, the rest is the null page.
  StepInputs inputs;
  std::vector<ScheduledRow> rows;  // [B], in the order of inputs' rows
  size_t num_samples() const;      // rows with needs_sample: the size commit() expects
};

class Scheduler {
 public:
  explicit Scheduler(const SchedulerLimits& limits);
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  const SchedulerLimits& limits() const { return limits_; }

  // Queues a request; returns its handle (1, 2, 3, ... in call order). A request that can never
  // run — empty prompt, prompt of max_length tokens or more, or more KV positions than the whole
  // pool holds (prompt + max_new_tokens - 1 after the max_length cap) — is finished at once with
  // reason Error and a message saying why; max_new_tokens == 0 finishes at once with reason Length
  // and no tokens. Either way it is reported by take_finished() like any other.
  uint64_t add(std::vector<int32_t> prompt_tokens, uint32_t max_new_tokens);

  // The next step, or nullopt when nothing is waiting or running. The previous step must have been
  // committed (std::logic_error otherwise): a request's cache length only advances at commit.
  std::optional<ScheduledStep> schedule();

  // Applies a step's results: sampled[i] is the token sampled for the i-th row with needs_sample,
  // in row order. Advances every row's cache length, appends the sampled tokens and finishes the
  // requests that reached max_new_tokens (Length) or were finish()ed during the step.
  // std::logic_error for a step other than the outstanding one, std::invalid_argument when
  // sampled has the wrong size (nothing is changed then).
  void commit(const ScheduledStep& step, const std::vector<int32_t>& sampled);

  // Ends a request for a reason only the engine can see (stop token or stop string: Stop; a
  // cancelled or failed request: Error with a message). If the request is in the step that
  // schedule() handed out and is not yet committed, it ends at that commit, after its sampled token
  // is appended (so a stop token is part of `generated` whether finish() comes before or after
  // commit()); otherwise it ends now and its pages are freed. Returns false if it had already
  // finished (e.g. by length at the same commit); std::logic_error for a handle never issued.
  bool finish(uint64_t handle, EndReason reason, std::string message = {});

  // Requests finished since the last call, in the order they finished.
  std::vector<FinishedRequest> take_finished();

  RequestState state(uint64_t handle) const;  // std::logic_error for a handle never issued
  // Tokens generated so far by a waiting or running request (std::logic_error otherwise).
  std::span<const int32_t> generated_tokens(uint64_t handle) const;
  bool has_unfinished() const { return !running_.empty() || !waiting_.empty(); }

  // Counters, for tests and stats.
  uint64_t steps() const { return steps_; }               // steps handed out by schedule()
  uint64_t preemptions() const { return preemptions_; }
  uint32_t pages_in_use() const { return pool_.used_count(); }
  uint32_t free_pages() const { return pool_.free_count(); }
  size_t num_running() const { return running_.size(); }
  size_t num_waiting() const { return waiting_.size(); }
  const KvPagePool& pool() const { return pool_; }

 private:
  struct Request {
    Request(uint64_t h, KvPagePool& pool, uint32_t page_size) : handle(h), pages(pool, page_size) {}
    uint64_t handle = 0;
    std::vector<int32_t> tokens;  // prompt, then every generated token
    uint32_t prompt_len = 0;
    uint32_t max_new_tokens = 0;  // after the max_length cap
    uint32_t computed = 0;        // positions already in the KV cache
    KvPageTable pages;
    uint32_t preemptions = 0;
    bool in_flight = false;       // has a row in the uncommitted step
    std::optional<EndReason> finish_requested;  // finish() during the step: applied at commit
    std::string finish_message;

    uint32_t generated() const { return uint32_t(tokens.size()) - prompt_len; }
    uint32_t pending() const { return uint32_t(tokens.size()) - computed; }  // tokens to feed
  };
  struct PlannedRow {
    uint64_t handle;
    uint32_t num_tokens;
  };
  struct Plan {
    std::vector<PlannedRow> rows;
    uint32_t tokens = 0;
    bool preempted = false;
  };

  Request& request(uint64_t handle);
  void finish_now(Request& r, EndReason reason, std::string message);
  Plan plan_step();
  bool place(Request& r, uint32_t num_tokens, Plan& plan);
  void preempt(uint64_t handle, Plan& plan);
  ScheduledStep build_step(const Plan& plan);

  SchedulerLimits limits_;
  // Declared before requests_ so that it outlives every request's page table.
  KvPagePool pool_;
  std::unordered_map<uint64_t, Request> requests_;  // waiting and running requests, by handle
  std::deque<uint64_t> waiting_;                    // admission order: front first
  std::vector<uint64_t> running_;                   // admission order: back is the newest
  std::vector<FinishedRequest> finished_;
  uint64_t next_handle_ = 1;
  std::optional<uint64_t> outstanding_step_;        // handed out by schedule(), not yet committed
  uint64_t steps_ = 0;
  uint64_t preemptions_ = 0;
};

}  // namespace clshard
