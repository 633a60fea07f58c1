#include "runtime/engine/scheduler.h"

#include <algorithm>
#include <stdexcept>
#include <utility>

namespace clshard {

const char* end_reason_name(EndReason r) {
  switch (r) {
    case EndReason::Stop: return "stop";
    case EndReason::Length: return "length";
    case EndReason::Error: return "error";
  }
  return "?";
}

size_t ScheduledStep::num_samples() const {
  return size_t(std::count_if(rows.begin(), rows.end(),
                              [](const ScheduledRow& r) { return r.needs_sample; }));
}

Scheduler::Scheduler(const SchedulerLimits& limits) : limits_(limits), pool_(limits.total_pages) {
  auto require_positive = [](uint32_t v, const char* name) {
    if (v == 0) throw std::invalid_argument(std::string("Scheduler: ") + name + " must be positive");
  };
  require_positive(limits.max_batch_size, "max_batch_size");
  require_positive(limits.max_batch_input_tokens, "max_batch_input_tokens");
  require_positive(limits.page_size, "page_size");
  require_positive(limits.total_pages, "total_pages");
  require_positive(limits.max_length, "max_length");
}

Scheduler::Request& Scheduler::request(uint64_t handle) {
  auto it = requests_.find(handle);
  if (it == requests_.end())
    throw std::logic_error("Scheduler: request " + std::to_string(handle) +
                           " is not waiting or running");
  return it->second;
}

uint64_t Scheduler::add(std::vector<int32_t> prompt_tokens, uint32_t max_new_tokens,
                        uint32_t adapter_id) {
  const uint64_t handle = next_handle_++;
  Request& req = requests_.try_emplace(handle, handle, pool_, limits_.page_size).first->second;
  req.adapter_id = adapter_id;
  req.prompt_len = uint32_t(prompt_tokens.size());
  req.tokens = std::move(prompt_tokens);
  // Never more than max_length tokens in all; a prompt that leaves no room is an error below.
  req.max_new_tokens = req.prompt_len < limits_.max_length
                           ? std::min(max_new_tokens, limits_.max_length - req.prompt_len)
                           : 0;

  if (req.prompt_len == 0) {
    finish_now(req, EndReason::Error, "request has an empty prompt");
    return handle;
  }
  if (req.prompt_len >= limits_.max_length) {
    finish_now(req, EndReason::Error,
               "prompt of " + std::to_string(req.prompt_len) +
                   " tokens leaves no room for a completion within max_length " +
                   std::to_string(limits_.max_length));
    return handle;
  }
  if (req.max_new_tokens == 0) {
    finish_now(req, EndReason::Length, {});
    return handle;
  }
  // The last sampled token is never fed back, so the cache holds at most prompt + max_new - 1
  // positions. With K > 0 a row's drafts are cut so that they could all be kept (plan_step, 1b),
  // so a row never reaches past that either, and a row with needs_sample holds K - 1 lookahead
  // positions beyond its last token: prompt + max_new - 1 + K - 1 positions at most. A request
  // that needs more pages than the whole pool could never finish: preempting everyone else would
  // still not make room, so it fails now instead of cycling.
  const uint32_t K = limits_.num_speculative_tokens;
  const uint32_t lookahead = K > 0 ? K - 1 : 0;
  const uint64_t max_positions = uint64_t(req.prompt_len) + req.max_new_tokens - 1 + lookahead;
  const uint32_t pages_needed = KvPageTable::pages_for(max_positions, limits_.page_size);
  if (pages_needed > pool_.total_pages()) {
    const std::string positions =
        K == 0 ? " tokens"
               : " - 1 + num_speculative_tokens " + std::to_string(K) + " - 1 = " +
                     std::to_string(max_positions) + " positions";
    finish_now(req, EndReason::Error,
               "request needs " + std::to_string(pages_needed) + " KV pages (prompt " +
                   std::to_string(req.prompt_len) + " + max_new_tokens " +
                   std::to_string(req.max_new_tokens) + positions + " at page_size " +
                   std::to_string(limits_.page_size) + ") but the KV cache has only " +
                   std::to_string(pool_.total_pages()) + " pages");
    return handle;
  }
  if (limits_.prefix_caching)
    for (uint64_t h : hashes(req, req.prompt_len / limits_.page_size)) ++live_hashes_[h];
  waiting_.push_back(handle);
  return handle;
}

const std::vector<uint64_t>& Scheduler::hashes(Request& r, size_t pages) {
  if (r.page_hashes.size() < pages)
    extend_prefix_page_hashes(r.page_hashes,
                              std::span<const int32_t>(r.tokens).first(pages * limits_.page_size),
                              limits_.page_size, r.adapter_id);
  return r.page_hashes;
}

uint32_t Scheduler::reusable_pages(const Request& r) const {
  return (uint32_t(r.tokens.size()) - 1) / limits_.page_size;
}

// Takes the leading published pages of r's sequence (r has nothing computed and holds no page).
void Scheduler::take_cached_prefix(Request& r) {
  const uint32_t n = reusable_pages(r);
  const auto& h = hashes(r, n);
  for (uint32_t i = 0; i < n; ++i) {
    const auto page = pool_.find_cached(h[i]);
    if (!page) break;
    r.pages.append_cached(*page);
  }
  r.computed = r.pages.num_pages() * limits_.page_size;
  r.published = r.pages.num_pages();
}

// Whether the next page r would compute is one a running request has yet to compute (and then
// publishes): r does better to wait a step and take it.
bool Scheduler::next_page_in_progress(Request& r) {
  const uint32_t next = r.pages.num_pages();
  if (next >= reusable_pages(r)) return false;
  const uint64_t h = hashes(r, next + 1)[next];
  for (uint64_t other : running_) {
    Request& q = request(other);
    if (q.published > next || q.tokens.size() < size_t(next + 1) * limits_.page_size) continue;
    if (hashes(q, next + 1)[next] == h) return true;
  }
  return false;
}

// Publishes r's full pages below position `computed` (see the header for which positions count).
void Scheduler::publish_computed(Request& r, uint32_t computed) {
  const uint32_t full = std::min(computed / limits_.page_size, r.pages.num_pages());
  if (full <= r.published) return;
  const auto& h = hashes(r, full);
  for (uint32_t i = r.published; i < full; ++i) pool_.publish(r.pages.pages()[i], h[i]);
  r.published = full;
}

void Scheduler::forget_live_hashes(Request& r) {
  if (!limits_.prefix_caching) return;
  const uint32_t n = std::min<uint32_t>(r.prompt_len / limits_.page_size,
                                        uint32_t(r.page_hashes.size()));
  for (uint32_t i = 0; i < n; ++i) {
    auto it = live_hashes_.find(r.page_hashes[i]);
    if (it != live_hashes_.end() && --it->second == 0) live_hashes_.erase(it);
  }
}

uint64_t Scheduler::prefix_match_tokens(std::span<const int32_t> tokens,
                                        uint32_t adapter_id) const {
  if (!limits_.prefix_caching || tokens.empty()) return 0;
  std::vector<uint64_t> h;
  extend_prefix_page_hashes(h, tokens.first((tokens.size() - 1) / limits_.page_size *
                                            limits_.page_size),
                            limits_.page_size, adapter_id);
  uint64_t pages = 0;
  while (pages < h.size() &&
         (pool_.find_cached(h[pages]) || live_hashes_.contains(h[pages])))
    ++pages;
  return pages * limits_.page_size;
}

const std::vector<uint32_t>& Scheduler::pages_of(uint64_t handle) const {
  auto it = requests_.find(handle);
  if (it == requests_.end())
    throw std::logic_error("Scheduler::pages_of: request " + std::to_string(handle) +
                           " is not waiting or running");
  return it->second.pages.pages();
}

void Scheduler::finish_now(Request& r, EndReason reason, std::string message) {
  forget_live_hashes(r);
  r.pages.release();
  if (auto it = std::find(running_.begin(), running_.end(), r.handle); it != running_.end())
    running_.erase(it);
  if (auto it = std::find(waiting_.begin(), waiting_.end(), r.handle); it != waiting_.end())
    waiting_.erase(it);
  FinishedRequest done;
  done.handle = r.handle;
  done.generated.assign(r.tokens.begin() + r.prompt_len, r.tokens.end());
  done.reason = reason;
  done.error = std::move(message);
  done.prompt_tokens = r.prompt_len;
  done.preemptions = r.preemptions;
  done.cached_tokens = r.cached_tokens;
  finished_.push_back(std::move(done));
  requests_.erase(r.handle);  // r dangles from here on
}

void Scheduler::preempt(uint64_t handle, Plan& plan) {
  Request& r = request(handle);
  // With the passes as they are, a victim never has a row yet: it is newer than the row being
  // placed, and only the newest running request can be mid-prefill (an admission that leaves a
  // prompt partly prefilled uses up the step's token budget). Dropping its row anyway keeps place()
  // correct whatever the pass order.
  if (auto it = std::find_if(plan.rows.begin(), plan.rows.end(),
                             [&](const PlannedRow& p) { return p.handle == handle; });
      it != plan.rows.end()) {
    plan.tokens -= it->num_tokens + it->num_drafts;
    plan.rows.erase(it);
  }
  r.pages.release();
  r.drafts.clear();  // they continued a sequence that is recomputed from scratch
  r.computed = 0;  // its whole sequence (prompt + generated) is prefilled again on re-admission
  r.published = 0;  // its published pages stay cached (unless evicted) for its re-admission
  ++r.preemptions;
  ++preemptions_;
  plan.preempted = true;
  running_.erase(std::find(running_.begin(), running_.end(), handle));
  waiting_.push_front(handle);
}

uint64_t Scheduler::row_end(const Request& r, uint32_t fed, uint32_t drafts) const {
  const uint64_t end = uint64_t(r.computed) + fed + drafts;
  const bool samples = r.computed + fed == r.tokens.size();
  const uint32_t K = limits_.num_speculative_tokens;
  return samples && K > 0 ? end + K - 1 : end;  // the draft's lookahead
}

// Gives r the pages for a row of num_tokens (and its lookahead), preempting the newest running
// requests while the pool is short. Returns false when r itself was preempted (or failed) and has
// no row this step.
bool Scheduler::place(Request& r, uint32_t num_tokens, Plan& plan) {
  const uint64_t end = row_end(r, num_tokens, 0);
  while (r.pages.pages_missing(end) > pool_.free_count()) {
    const uint64_t victim = running_.back();
    if (victim == r.handle && running_.size() == 1) {
      // r holds every page in use and still lacks some: it needs more than the pool. add() rejects
      // such requests, so this is a guard against cycling forever, not an expected path.
      finish_now(r, EndReason::Error,
                 "request needs more KV pages than the cache's " +
                     std::to_string(pool_.total_pages()) + " pages");
      return false;
    }
    preempt(victim, plan);
    if (victim == r.handle) return false;
  }
  r.pages.ensure_capacity(end);
  plan.rows.push_back({r.handle, num_tokens});
  plan.tokens += num_tokens;
  return true;
}

std::optional<ScheduledStep> Scheduler::schedule() {
  if (outstanding_step_)
    throw std::logic_error("Scheduler::schedule: step " + std::to_string(*outstanding_step_) +
                           " has not been committed");
  while (has_unfinished()) {
    const size_t finished_before = finished_.size();
    Plan plan = plan_step();
    if (!plan.rows.empty()) return build_step(plan);
    // An empty plan with work left means place() failed a request that could not fit at all; the
    // others can be planned now. Anything else would be a scheduler bug, and looping on it would
    // hang the engine, so it is reported instead.
    if (finished_.size() == finished_before)
      throw std::logic_error("Scheduler: nothing schedulable with " +
                             std::to_string(running_.size()) + " running and " +
                             std::to_string(waiting_.size()) + " waiting requests");
  }
  return std::nullopt;
}

Scheduler::Plan Scheduler::plan_step() {
  Plan plan;
  auto rows_left = [&] { return plan.rows.size() < limits_.max_batch_size; };
  auto tokens_left = [&] { return limits_.max_batch_input_tokens - plan.tokens; };

  // Passes 1 and 2 walk the running requests as they were at the start of the step (admission
  // order); a request preempted on the way is no longer running and is skipped.
  const std::vector<uint64_t> running_at_start = running_;
  auto still_running = [&](uint64_t h) {
    return std::find(running_.begin(), running_.end(), h) != running_.end();
  };

  // 1. Decode rows: one token each (the last sampled one, or a prefill's single remaining token).
  for (uint64_t h : running_at_start) {
    if (!rows_left() || tokens_left() == 0) break;
    if (!still_running(h)) continue;
    Request& r = request(h);
    if (r.pending() == 1) place(r, 1, plan);
  }
  // 1b. Drafts, within the token budget the decode rows left (their pages come after pass 2).
  for (PlannedRow& p : plan.rows) {
    const Request& r = request(p.handle);
    const uint32_t keepable = r.remaining() - 1;  // the row's next token is always kept
    p.num_drafts = std::min({uint32_t(r.drafts.size()), keepable, tokens_left()});
    plan.tokens += p.num_drafts;
  }
  // 2. Running requests in the middle of a chunked (re)prefill: the next chunk each.
  for (uint64_t h : running_at_start) {
    if (!rows_left() || tokens_left() == 0) break;
    if (!still_running(h)) continue;
    Request& r = request(h);
    if (r.pending() > 1) place(r, std::min(r.pending(), tokens_left()), plan);
  }
  fit_drafts(plan);
  // 3. Admission, FIFO: the front request waits (and so do those behind it) until the pages of its
  // first chunk are free. A preempted request sits at the front with its whole sequence pending.
  // With a limit on resident LoRA adapters, a request whose adapter cannot join the running ones
  // lets those behind it whose adapters can go first (S-LoRA): they run while it waits.
  while (!plan.preempted && !waiting_.empty() && rows_left() && tokens_left() > 0) {
    const auto next = std::find_if(waiting_.begin(), waiting_.end(), [&](uint64_t h) {
      return adapter_fits(requests_.at(h).adapter_id);
    });
    if (next == waiting_.end()) break;
    Request& r = request(*next);
    if (limits_.prefix_caching) {
      take_cached_prefix(r);
      if (next_page_in_progress(r)) {
        r.pages.release();  // back to the cache, to be taken again next step
        r.computed = r.published = 0;
        break;
      }
    }
    const uint32_t chunk = std::min(r.pending(), tokens_left());
    if (!r.pages.ensure_capacity(row_end(r, chunk, 0))) {
      r.pages.release();
      r.computed = r.published = 0;
      break;
    }
    cached_tokens_ += r.computed;
    r.cached_tokens += r.computed;
    r.prefill_end = uint32_t(r.tokens.size());
    waiting_.erase(next);
    running_.push_back(r.handle);
    plan.rows.push_back({r.handle, chunk});
    plan.tokens += chunk;
  }
  return plan;
}

bool Scheduler::adapter_fits(uint32_t adapter_id) const {
  if (adapter_id == 0 || limits_.max_loaded_adapters == 0) return true;
  std::vector<uint32_t> in_use;
  for (uint64_t h : running_) {
    const uint32_t a = requests_.at(h).adapter_id;
    if (a == adapter_id) return true;
    if (a != 0 && std::find(in_use.begin(), in_use.end(), a) == in_use.end()) in_use.push_back(a);
  }
  return in_use.size() < limits_.max_loaded_adapters;
}

// The drafts' pages, from the free pages only: a row whose drafts need more than are free feeds
// fewer of them (the budget they leave goes to admission).
void Scheduler::fit_drafts(Plan& plan) {
  for (PlannedRow& p : plan.rows) {
    Request& r = request(p.handle);
    while (p.num_drafts > 0 && !r.pages.ensure_capacity(row_end(r, p.num_tokens, p.num_drafts))) {
      --p.num_drafts;
      --plan.tokens;
    }
  }
}

ScheduledStep Scheduler::build_step(const Plan& plan) {
  ScheduledStep step;
  step.step_index = steps_++;
  StepInputs& in = step.inputs;
  in.return_logits = ReturnLogits::LastToken;
  in.tokens.reserve(plan.tokens);
  in.input_row_offsets.reserve(plan.rows.size() + 1);
  in.input_row_offsets.push_back(0);
  in.cache_lengths.reserve(plan.rows.size());
  step.rows.reserve(plan.rows.size());

  // The pages each row lists: those its positions (and lookahead) need. With K = 0 that is every
  // page the request holds; with K > 0 it may hold more, left from a step with more drafts.
  std::vector<uint32_t> row_pages(plan.rows.size());
  uint32_t pages_per_row = 1;
  for (size_t b = 0; b < plan.rows.size(); ++b) {
    const PlannedRow& p = plan.rows[b];
    row_pages[b] = KvPageTable::pages_for(row_end(request(p.handle), p.num_tokens, p.num_drafts),
                                          limits_.page_size);
    pages_per_row = std::max(pages_per_row, row_pages[b]);
  }
  in.pages_per_row = pages_per_row;
  in.lookup_table.assign(plan.rows.size() * size_t(pages_per_row), pool_.null_page());
  const bool speculative = limits_.num_speculative_tokens > 0;
  if (speculative) in.logits_per_row.reserve(plan.rows.size());
  const bool adapters = std::any_of(plan.rows.begin(), plan.rows.end(), [&](const PlannedRow& p) {
    return request(p.handle).adapter_id != 0;
  });

  for (size_t b = 0; b < plan.rows.size(); ++b) {
    Request& r = request(plan.rows[b].handle);
    const uint32_t n = plan.rows[b].num_tokens, k = plan.rows[b].num_drafts;
    const bool needs_sample = r.computed + n == r.tokens.size();
    in.tokens.insert(in.tokens.end(), r.tokens.begin() + r.computed,
                     r.tokens.begin() + r.computed + n);
    in.tokens.insert(in.tokens.end(), r.drafts.begin(), r.drafts.begin() + k);
    r.drafts.clear();  // consumed, fed or not
    in.input_row_offsets.push_back(uint32_t(in.tokens.size()));
    in.cache_lengths.push_back(r.computed);
    if (r.computed < r.prefill_end) prefill_tokens_ += std::min(n, r.prefill_end - r.computed);
    std::copy_n(r.pages.pages().begin(), row_pages[b], in.lookup_table.begin() + b * pages_per_row);
    if (speculative) in.logits_per_row.push_back(needs_sample ? k + 1 : 0);
    if (adapters) in.adapter_ids.push_back(r.adapter_id);
    ScheduledRow& row = step.rows.emplace_back();
    row.handle = r.handle;
    row.needs_sample = needs_sample;
    row.num_generated = r.generated();
    row.num_drafts = k;
    row.cache_length = r.computed;
    row.num_tokens = n + k;
    row.following_token = needs_sample ? -1 : r.tokens[r.computed + n];
    r.in_flight = true;
  }
  outstanding_step_ = step.step_index;
  return step;
}

void Scheduler::commit(const ScheduledStep& step, const std::vector<int32_t>& sampled) {
  std::vector<std::vector<int32_t>> committed;
  committed.reserve(sampled.size());
  for (int32_t t : sampled) committed.push_back({t});
  commit(step, committed);
}

void Scheduler::commit(const ScheduledStep& step,
                       const std::vector<std::vector<int32_t>>& committed) {
  if (!outstanding_step_ || *outstanding_step_ != step.step_index)
    throw std::logic_error("Scheduler::commit: step " + std::to_string(step.step_index) +
                           " is not the step awaiting commit");
  if (committed.size() != step.num_samples())
    throw std::invalid_argument("Scheduler::commit: tokens for " +
                                std::to_string(committed.size()) + " rows, but " +
                                std::to_string(step.num_samples()) + " rows of step " +
                                std::to_string(step.step_index) + " need a sample");
  for (size_t b = 0, i = 0; b < step.rows.size(); ++b) {
    const ScheduledRow& row = step.rows[b];
    if (!row.needs_sample) continue;
    const size_t kept = committed[i++].size();
    if (kept == 0 || kept > row.num_drafts + 1)
      throw std::invalid_argument(
          "Scheduler::commit: row " + std::to_string(b) + " (request " +
          std::to_string(row.handle) + ") keeps " + std::to_string(kept) +
          " tokens; it must keep 1 .. num_drafts + 1 = " + std::to_string(row.num_drafts + 1));
  }
  outstanding_step_.reset();
  size_t next_sample = 0;
  for (const ScheduledRow& row : step.rows) {
    Request& r = request(row.handle);
    r.in_flight = false;
    if (!row.needs_sample) {
      r.computed += row.num_tokens;
    } else {
      const std::vector<int32_t>& kept = committed[next_sample++];
      // The pending tokens and the accepted drafts; the last kept token is the new pending one.
      r.computed += (row.num_tokens - row.num_drafts) + uint32_t(kept.size()) - 1;
      const size_t appended = std::min<size_t>(kept.size(), r.remaining());
      r.tokens.insert(r.tokens.end(), kept.begin(), kept.begin() + appended);
    }
    if (limits_.prefix_caching) {
      // With a draft (K > 0), the positions of the step that ends a request lack the draft's
      // cache rows (the engine drafts only for requests still running): publish up to the row.
      const bool ends = r.finish_requested || r.generated() >= r.max_new_tokens;
      publish_computed(r, limits_.num_speculative_tokens > 0 && ends ? row.cache_length
                                                                      : r.computed);
    }
    if (r.finish_requested)
      finish_now(r, *r.finish_requested, std::move(r.finish_message));
    else if (r.generated() >= r.max_new_tokens)
      finish_now(r, EndReason::Length, {});
  }
}

bool Scheduler::finish(uint64_t handle, EndReason reason, std::string message) {
  if (handle == 0 || handle >= next_handle_)
    throw std::logic_error("Scheduler::finish: unknown request " + std::to_string(handle));
  auto it = requests_.find(handle);
  if (it == requests_.end()) return false;
  Request& r = it->second;
  if (r.in_flight) {
    // The first reason wins if the engine reports twice during one step.
    if (!r.finish_requested) {
      r.finish_requested = reason;
      r.finish_message = std::move(message);
    }
    return true;
  }
  finish_now(r, reason, std::move(message));
  return true;
}

void Scheduler::set_drafts(uint64_t handle, std::vector<int32_t> drafts) {
  const uint32_t K = limits_.num_speculative_tokens;
  if (drafts.size() > K)
    throw std::invalid_argument("Scheduler::set_drafts: " + std::to_string(drafts.size()) +
                                " drafts for request " + std::to_string(handle) +
                                ", more than num_speculative_tokens " + std::to_string(K));
  const std::string which = "Scheduler::set_drafts: request " + std::to_string(handle);
  if (handle == 0 || handle >= next_handle_) throw std::logic_error(which + " was never added");
  auto it = requests_.find(handle);
  if (it == requests_.end()) throw std::logic_error(which + " has finished");
  Request& r = it->second;
  if (state(handle) != RequestState::Running) throw std::logic_error(which + " is not running");
  if (r.in_flight)
    throw std::logic_error(which + " is in step " + std::to_string(*outstanding_step_) +
                           ", which has not been committed");
  if (r.pending() != 1 || r.generated() == 0)
    throw std::logic_error(which + " has " + std::to_string(r.pending()) +
                           " tokens to feed and " + std::to_string(r.generated()) +
                           " generated; drafts follow only a last sampled token");
  r.drafts = std::move(drafts);
}

uint32_t Scheduler::remaining_tokens(uint64_t handle) const {
  if (handle == 0 || handle >= next_handle_)
    throw std::logic_error("Scheduler::remaining_tokens: unknown request " +
                           std::to_string(handle));
  auto it = requests_.find(handle);
  return it == requests_.end() ? 0 : it->second.remaining();
}

std::vector<FinishedRequest> Scheduler::take_finished() { return std::exchange(finished_, {}); }

RequestState Scheduler::state(uint64_t handle) const {
  if (handle == 0 || handle >= next_handle_)
    throw std::logic_error("Scheduler::state: unknown request " + std::to_string(handle));
  if (!requests_.contains(handle)) return RequestState::Finished;
  return std::find(running_.begin(), running_.end(), handle) != running_.end()
             ? RequestState::Running
             : RequestState::Waiting;
}

std::span<const int32_t> Scheduler::generated_tokens(uint64_t handle) const {
  auto it = requests_.find(handle);
  if (it == requests_.end())
    throw std::logic_error("Scheduler::generated_tokens: request " + std::to_string(handle) +
                           " is not waiting or running");
  const Request& r = it->second;
  return std::span<const int32_t>(r.tokens).subspan(r.prompt_len);
}

}  // namespace clshard
