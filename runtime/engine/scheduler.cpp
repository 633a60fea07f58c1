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

uint64_t Scheduler::add(std::vector<int32_t> prompt_tokens, uint32_t max_new_tokens) {
  const uint64_t handle = next_handle_++;
  Request& req = requests_.try_emplace(handle, handle, pool_, limits_.page_size).first->second;
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
  // positions. A request that needs more pages than the whole pool could never finish: preempting
  // everyone else would still not make room, so it fails now instead of cycling.
  const uint64_t max_positions = uint64_t(req.prompt_len) + req.max_new_tokens - 1;
  const uint32_t pages_needed = KvPageTable::pages_for(max_positions, limits_.page_size);
  if (pages_needed > pool_.total_pages()) {
    finish_now(req, EndReason::Error,
               "request needs " + std::to_string(pages_needed) + " KV pages (prompt " +
                   std::to_string(req.prompt_len) + " + max_new_tokens " +
                   std::to_string(req.max_new_tokens) + " tokens at page_size " +
                   std::to_string(limits_.page_size) + ") but the KV cache has only " +
                   std::to_string(pool_.total_pages()) + " pages");
    return handle;
  }
  waiting_.push_back(handle);
  return handle;
}

void Scheduler::finish_now(Request& r, EndReason reason, std::string message) {
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
    plan.tokens -= it->num_tokens;
    plan.rows.erase(it);
  }
  r.pages.release();
  r.computed = 0;  // its whole sequence (prompt + generated) is prefilled again on re-admission
  ++r.preemptions;
  ++preemptions_;
  plan.preempted = true;
  running_.erase(std::find(running_.begin(), running_.end(), handle));
  waiting_.push_front(handle);
}

// Gives r the pages for a row of num_tokens, preempting the newest running requests while the pool
// is short. Returns false when r itself was preempted (or failed) and has no row this step.
bool Scheduler::place(Request& r, uint32_t num_tokens, Plan& plan) {
  const uint64_t end = uint64_t(r.computed) + num_tokens;
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
  // 2. Running requests in the middle of a chunked (re)prefill: the next chunk each.
  for (uint64_t h : running_at_start) {
    if (!rows_left() || tokens_left() == 0) break;
    if (!still_running(h)) continue;
    Request& r = request(h);
    if (r.pending() > 1) place(r, std::min(r.pending(), tokens_left()), plan);
  }
  // 3. Admission, FIFO: the front request waits (and so do those behind it) until the pages of its
  // first chunk are free. A preempted request sits at the front with its whole sequence pending.
  while (!plan.preempted && !waiting_.empty() && rows_left() && tokens_left() > 0) {
    Request& r = request(waiting_.front());
    const uint32_t chunk = std::min(r.pending(), tokens_left());
    if (!r.pages.ensure_capacity(chunk)) break;
    waiting_.pop_front();
    running_.push_back(r.handle);
    plan.rows.push_back({r.handle, chunk});
    plan.tokens += chunk;
  }
  return plan;
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

  uint32_t pages_per_row = 1;
  for (const PlannedRow& p : plan.rows)
    pages_per_row = std::max(pages_per_row, request(p.handle).pages.num_pages());
  in.pages_per_row = pages_per_row;
  in.lookup_table.assign(plan.rows.size() * size_t(pages_per_row), pool_.null_page());

  for (size_t b = 0; b < plan.rows.size(); ++b) {
    Request& r = request(plan.rows[b].handle);
    const uint32_t n = plan.rows[b].num_tokens;
    in.tokens.insert(in.tokens.end(), r.tokens.begin() + r.computed,
                     r.tokens.begin() + r.computed + n);
    in.input_row_offsets.push_back(uint32_t(in.tokens.size()));
    in.cache_lengths.push_back(r.computed);
    std::copy(r.pages.pages().begin(), r.pages.pages().end(),
              in.lookup_table.begin() + b * pages_per_row);
    step.rows.push_back({r.handle, r.computed + n == r.tokens.size(), r.generated()});
    r.in_flight = true;
  }
  outstanding_step_ = step.step_index;
  return step;
}

void Scheduler::commit(const ScheduledStep& step, const std::vector<int32_t>& sampled) {
  if (!outstanding_step_ || *outstanding_step_ != step.step_index)
    throw std::logic_error("Scheduler::commit: step " + std::to_string(step.step_index) +
                           " is not the step awaiting commit");
  if (sampled.size() != step.num_samples())
    throw std::invalid_argument("Scheduler::commit: " + std::to_string(sampled.size()) +
                                " sampled tokens for " + std::to_string(step.num_samples()) +
                                " rows that need one");
  outstanding_step_.reset();
  size_t next_sample = 0;
  for (size_t b = 0; b < step.rows.size(); ++b) {
    const ScheduledRow& row = step.rows[b];
    Request& r = request(row.handle);
    r.in_flight = false;
    r.computed += step.inputs.row_length(b);
    if (row.needs_sample) r.tokens.push_back(sampled[next_sample++]);
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
