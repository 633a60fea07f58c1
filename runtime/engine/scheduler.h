// Continuous batching for one replica: requests join as others finish, each step is a ragged batch
// (runtime/step.h) of decode rows and prefill chunks within the batch limits, and KV pages are
// taken as requests grow and given back when they end. Host-side and model-agnostic: it never
// sees logits, only the tokens the engine sampled (and the drafts a draft model proposed).
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
// Speculative decoding (limits.num_speculative_tokens = K > 0) is the same loop with three changes:
//   - a decode row feeds the pending token followed by the drafts set_drafts() gave for it, and
//     inputs.logits_per_row asks num_drafts + 1 logits of each row with needs_sample (0 of an
//     intermediate prefill chunk);
//   - the engine verifies the drafts and commits, per row with needs_sample, the accepted drafts
//     then the next token (commit(step, vector<vector<int32_t>>)), cut after a stop token;
//   - after commit it runs the draft model over the step (same rows, same lookup table: each row
//     with needs_sample has pages for K - 1 positions past its last token, where the draft writes
//     its cache; following_token gives an intermediate chunk's next token) and calls set_drafts()
//     for every row with needs_sample whose request is still Running.
// With K = 0 the scheduler behaves exactly as without speculation: no drafts, no lookahead pages,
// logits_per_row empty.
//
// Policy, in this order within a step:
//   1. decode rows: running requests with one token to feed (the last sampled one), oldest first;
//      each with that one token (and, when K > 0, its lookahead pages; see below);
//   1b. drafts (K > 0): each decode row of pass 1, oldest first, gets as many of its request's
//      drafts as the token budget still allows and as can ever be kept (remaining_tokens - 1) —
//      possibly none, never at the cost of a row. Their pages are taken after pass 2 and only from
//      free pages: a row whose draft positions need pages that are not free gets fewer drafts
//      (drafts never preempt anything). The schedule() that gives a request its row consumes its
//      drafts: those the row does not feed are dropped;
//   2. running requests part-way through a (re)prefill, oldest first, each with a chunk of as many
//      tokens as the step's token budget still allows;
//   3. new requests, FIFO, while rows, tokens and free pages allow (the first chunk's pages must
//      be free: admission never preempts). Skipped in a step that preempted, so a request just
//      preempted is not re-admitted into the pages it has just given up.
// Lookahead (K > 0): a row with needs_sample holds pages for every position < cache_length +
// num_tokens + K - 1, since the draft later writes its cache up to K - 1 positions past the
// accepted ones; they are taken like the row's own positions (preempting as below when short).
// A row that needs a page when none is free preempts the newest running request (latest
// admitted) — possibly the row's own request — until the page is free. The victim's pages go back
// to the pool, its drafts are dropped, it goes to the FRONT of the waiting queue with prompt +
// generated tokens so far, and it is later re-admitted and recomputed as a prefill of all of them;
// generation then continues where it stopped (nothing is re-sampled). The oldest running request
// is never preempted, so every step makes progress and no request is lost or duplicated.
// Everything is deterministic given the same sequence of calls.
//
// Prefix caching (limits.prefix_caching): a request's full pages are identified by the hash chain
// of its tokens and adapter (kv_pages.h). When a request is admitted with nothing computed (new, or
// preempted), it takes every leading page of its sequence that the pool has published, keeping at
// least one token to compute so the step yields logits, and starts its cache_length after them.
// Pages are published at commit once every position in them is computed — with K > 0, once the
// draft's cache holds them too: the engine runs the draft over a row after commit unless the
// request ended there, so the pages a request computes in the step that ends it stay private.
// Writes go only to positions >= a row's cache_length, which lie past every page the request
// shares, so a shared page is never written. Admission also waits (the FIFO front, and the queue
// behind it) while the next page the front request would compute is being computed by a running
// request: one step later it can take it instead of computing it again. A preempted request's
// published pages stay cached, and it takes them back on re-admission unless they were evicted.
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
  // K: drafts a decode row may carry (see set_drafts()); rows that sample also hold K - 1
  // lookahead positions for the draft model's cache. 0 = no speculation.
  uint32_t num_speculative_tokens = 0;
  // Reuse published full pages of equal prefixes (see above). Off: every page is private and
  // freed when its request ends, as before prefix caching.
  bool prefix_caching = false;
  // LoRA: the distinct adapters the running requests may use at once (the model's resident
  // slots, lora.max_loaded); a request with another adapter waits at the front until one of them
  // has no running request left. 0: no limit.
  uint32_t max_loaded_adapters = 0;
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
  uint32_t cached_tokens = 0;      // positions taken from the prefix cache, over its admissions
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
  // Drafts at the end of this row: its tokens are the request's pending tokens then num_drafts
  // drafts (always 0 when K = 0 and for prefill chunks).
  uint32_t num_drafts = 0;
  // Position of the row's first token (inputs.cache_lengths of this row).
  uint32_t cache_length = 0;
  // Tokens in the row, drafts included (inputs.row_length of this row).
  uint32_t num_tokens = 0;
  // For an intermediate prefill chunk (needs_sample false): the token at position cache_length +
  // num_tokens, i.e. the next prompt (or recomputed) token, which a draft model reads as "the token
  // after" the chunk's last position. -1 for rows with needs_sample.
  int32_t following_token = -1;
};

struct ScheduledStep {
  uint64_t step_index = 0;  // commit() checks it is the step schedule() handed out last
  // return_logits = LastToken: one logits row per scheduled row; when K > 0, logits_per_row
  // overrides it with num_drafts + 1 for rows with needs_sample and 0 for intermediate chunks.
  // lookup_table is [rows, pages_per_row] with pages_per_row = the most pages any row of this step
  // needs (so it changes from step to step); each row lists exactly the pages its positions up to
  // the end of this step need — with K > 0, a row with needs_sample also its K - 1 lookahead
  // positions — and the rest is the null page. (With K > 0 a request may hold more pages than its
  // row lists, left from an earlier step with more drafts; they are not listed.)
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
  // pool holds (prompt + max_new_tokens - 1 after the max_length cap, + K - 1 lookahead positions
  // when K > 0: the most any of its rows can need, since drafts are cut to what can still be kept)
  // — is finished at once with reason Error and a message saying why; max_new_tokens == 0
  // finishes at once with reason Length and no tokens. Either way it is reported by
  // take_finished() like any other.
  // adapter_id (0: the base model) is part of the prefix-cache key: KV computed under one LoRA
  // adapter is never reused under another.
  uint64_t add(std::vector<int32_t> prompt_tokens, uint32_t max_new_tokens,
               uint32_t adapter_id = 0);

  // The next step, or nullopt when nothing is waiting or running. The previous step must have been
  // committed (std::logic_error otherwise): a request's cache length only advances at commit.
  std::optional<ScheduledStep> schedule();

  // Applies a step's results: committed[i] is what the i-th row with needs_sample (in row order)
  // keeps: its accepted drafts then the next token, 1 .. num_drafts + 1 tokens (fewer when a stop
  // token ended the request: the tokens up to and including it). An intermediate chunk's cache
  // length advances by its num_tokens; a row with needs_sample's by (num_tokens - num_drafts) +
  // (committed[i].size() - 1): its pending tokens and the accepted drafts (the positions of
  // rejected drafts are overwritten later). The tokens are appended, capped at max_new_tokens
  // (the rest dropped), then the requests that reached max_new_tokens finish (Length) and those
  // finish()ed during the step finish with the reason given.
  // std::logic_error for a step other than the outstanding one, std::invalid_argument when
  // committed has the wrong size or a row keeps 0 or more than num_drafts + 1 tokens (nothing is
  // changed then).
  void commit(const ScheduledStep& step, const std::vector<std::vector<int32_t>>& committed);
  // The same with one token per row: sampled[i] for the i-th row with needs_sample (no draft kept).
  void commit(const ScheduledStep& step, const std::vector<int32_t>& sampled);

  // Drafts (at most K, std::invalid_argument beyond) for the request's next decode row, which
  // feeds its pending token (at position cache_length) then the drafts (at the positions after).
  // Valid only for a Running request whose one pending token is its last sampled token and that
  // is not in an uncommitted step — i.e. after commit() for a row with needs_sample whose request
  // did not finish there; std::logic_error otherwise. Replaces drafts set before. Dropped when
  // the request is preempted or finishes; consumed by the next schedule() that gives the request a
  // row (which may feed only some of them, see the policy above).
  void set_drafts(uint64_t handle, std::vector<int32_t> drafts);

  // How many more tokens the request may generate: max_new_tokens (after the max_length cap)
  // minus generated. 0 for a finished request; std::logic_error for a handle never issued.
  uint32_t remaining_tokens(uint64_t handle) const;

  // Ends a request for a reason only the engine can see (stop token or stop string: Stop; a
  // cancelled or failed request: Error with a message). If the request is in the step that
  // schedule() handed out and is not yet committed, it ends at that commit, after the tokens
  // committed for it are appended (so a stop token is part of `generated` whether finish() comes
  // before or after commit()); otherwise it ends now, its pages are freed and its drafts dropped.
  // Returns false if it had already finished (e.g. by length at the same commit);
  // std::logic_error for a handle never issued.
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
  // The pages a waiting or running request holds, in position order (std::logic_error otherwise).
  const std::vector<uint32_t>& pages_of(uint64_t handle) const;
  // Prefix caching: positions taken from the cache at admission, over every admission; positions
  // computed by (re)prefill rows (prompt tokens, or a preempted request's whole sequence).
  uint64_t cached_tokens() const { return cached_tokens_; }
  uint64_t prefill_tokens() const { return prefill_tokens_; }
  // How many leading tokens of a request with these tokens and adapter this replica holds or will
  // hold: its published pages, and the prompt pages of the requests it is running or queuing
  // (which cache-aware routing counts as held, since they will be computed here). 0 without
  // prefix caching.
  uint64_t prefix_match_tokens(std::span<const int32_t> tokens, uint32_t adapter_id) const;

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
    std::vector<int32_t> drafts;  // set_drafts() for the next decode row
    std::optional<EndReason> finish_requested;  // finish() during the step: applied at commit
    std::string finish_message;
    // Prefix caching.
    uint32_t adapter_id = 0;
    std::vector<uint64_t> page_hashes;  // hash chain of the full pages of `tokens` (so far)
    uint32_t published = 0;             // leading pages published (or found already published)
    uint32_t prefill_end = 0;           // tokens.size() at admission: positions a prefill computes
    uint32_t cached_tokens = 0;

    uint32_t generated() const { return uint32_t(tokens.size()) - prompt_len; }
    uint32_t pending() const { return uint32_t(tokens.size()) - computed; }  // tokens to feed
    uint32_t remaining() const { return max_new_tokens - generated(); }
  };
  struct PlannedRow {
    uint64_t handle;
    uint32_t num_tokens;      // pending tokens of the request's sequence fed in this row
    uint32_t num_drafts = 0;  // drafts fed after them
  };
  struct Plan {
    std::vector<PlannedRow> rows;
    uint32_t tokens = 0;
    bool preempted = false;
  };

  Request& request(uint64_t handle);
  void finish_now(Request& r, EndReason reason, std::string message);
  Plan plan_step();
  // The positions [0, end) a row of `fed` pending tokens and `drafts` drafts needs pages for.
  uint64_t row_end(const Request& r, uint32_t fed, uint32_t drafts) const;
  bool place(Request& r, uint32_t num_tokens, Plan& plan);
  void fit_drafts(Plan& plan);
  // Whether a request with this adapter may run beside the running ones (max_loaded_adapters).
  bool adapter_fits(uint32_t adapter_id) const;
  void preempt(uint64_t handle, Plan& plan);
  ScheduledStep build_step(const Plan& plan);
  // Prefix caching.
  const std::vector<uint64_t>& hashes(Request& r, size_t pages);
  // Pages a request may take from the cache: its full pages but the one holding its last token.
  uint32_t reusable_pages(const Request& r) const;
  void take_cached_prefix(Request& r);
  bool next_page_in_progress(Request& r);
  void publish_computed(Request& r, uint32_t computed);
  void forget_live_hashes(Request& r);

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
  uint64_t cached_tokens_ = 0, prefill_tokens_ = 0;
  // Prompt-page hashes of the waiting and running requests, with their counts (routing).
  std::unordered_map<uint64_t, uint32_t> live_hashes_;
};

}  // namespace clshard
