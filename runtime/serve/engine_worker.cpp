#include "runtime/serve/engine_worker.h"

#include <iostream>

namespace clshard::serve {

namespace {

double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

const char* cancel_message(CancelCause c) {
  switch (c) {
    case CancelCause::ClientGone: return "cancelled: the client closed the connection";
    case CancelCause::Deadline: return "cancelled: the request ran past serve.request_deadline_s";
    case CancelCause::Shutdown: return "cancelled: the server is shutting down";
    case CancelCause::None: break;
  }
  return "cancelled";
}

}  // namespace

std::optional<GenerationResult> RequestChannel::wait(std::vector<TokenEvent>& events,
                                                     Clock::duration timeout) {
  std::unique_lock lk(sync_->mu);
  sync_->cv.wait_for(lk, timeout, [&] { return has_news(); });
  for (auto& e : events_) events.push_back(std::move(e));
  events_.clear();
  return result_;
}

void RequestChannel::wait_any(const std::vector<std::shared_ptr<RequestChannel>>& channels,
                              Clock::duration timeout) {
  if (channels.empty()) return;
  ChannelSync& sync = *channels.front()->sync_;
  std::unique_lock lk(sync.mu);
  sync.cv.wait_for(lk, timeout, [&] {
    for (const auto& ch : channels)
      if (ch->has_news()) return true;
    return false;
  });
}

void RequestChannel::push(TokenEvent e) {
  {
    std::lock_guard lk(sync_->mu);
    events_.push_back(std::move(e));
  }
  sync_->cv.notify_all();
}

void RequestChannel::finish(GenerationResult r) {
  {
    std::lock_guard lk(sync_->mu);
    result_ = std::move(r);
  }
  sync_->cv.notify_all();
}

EngineWorker::EngineWorker(std::unique_ptr<Engine> engine, size_t max_waiting,
                           double request_deadline_s, ServerMetrics& metrics, bool speculative)
    : engine_(std::move(engine)),
      max_waiting_(max_waiting),
      request_deadline_s_(request_deadline_s),
      metrics_(metrics),
      speculative_(speculative) {
  engine_->on_token([this](const clshard::TokenEvent& e) {
    auto it = live_.find(e.handle);
    if (it == live_.end()) return;
    RequestChannel& ch = *it->second;
    const auto now = Clock::now();
    if (!ch.last_token_at_)
      metrics_.observe_ttft(seconds(now - ch.arrival_));
    else
      metrics_.observe_inter_token(seconds(now - *ch.last_token_at_));
    ch.last_token_at_ = now;
    metrics_.add_generation_tokens(1);
    TokenEvent event{e.token, std::string(e.text), std::nullopt};
    if (e.logprobs) event.logprobs = *e.logprobs;
    ch.push(std::move(event));
  });
  publish_gauges();
  thread_ = std::thread([this] { run(); });
}

EngineWorker::~EngineWorker() {
  {
    std::lock_guard lk(mu_);
    stopping_ = exit_ = cancel_all_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

std::shared_ptr<RequestChannel> EngineWorker::submit(GenerationRequest request,
                                                     Clock::time_point arrival,
                                                     Admission* admission) {
  std::vector<GenerationRequest> one;
  one.push_back(std::move(request));
  auto chs = submit(std::move(one), arrival, admission);
  return chs.empty() ? nullptr : chs.front();
}

std::vector<std::shared_ptr<RequestChannel>> EngineWorker::submit(
    std::vector<GenerationRequest> requests, Clock::time_point arrival, Admission* admission) {
  auto sync = std::make_shared<ChannelSync>();
  std::vector<std::shared_ptr<RequestChannel>> chs;
  {
    std::lock_guard lk(mu_);
    if (stopping_ || failure_) {
      *admission = Admission::Stopping;
      return {};
    }
    // A group larger than the whole queue is taken when the queue is empty (else never).
    const size_t waiting = waiting_.load();
    if (waiting >= max_waiting_ || (waiting > 0 && waiting + requests.size() > max_waiting_)) {
      *admission = Admission::QueueFull;
      return {};
    }
    for (GenerationRequest& request : requests) {
      auto ch = std::make_shared<RequestChannel>(arrival, sync);
      ++waiting_;
      ++in_flight_;
      if (request_deadline_s_ > 0)
        ch->deadline_ = arrival + std::chrono::duration_cast<Clock::duration>(
                                      std::chrono::duration<double>(request_deadline_s_));
      inbox_.push_back({std::move(request), ch});
      chs.push_back(std::move(ch));
    }
  }
  *admission = Admission::Accepted;
  cv_.notify_all();
  return chs;
}

void EngineWorker::cancel(const std::shared_ptr<RequestChannel>& channel, CancelCause cause) {
  {
    std::lock_guard lk(mu_);
    cancels_.emplace_back(channel, cause);
  }
  cv_.notify_all();
}

size_t EngineWorker::drain(Clock::time_point deadline) {
  std::unique_lock lk(mu_);
  stopping_ = true;
  idle_cv_.wait_until(lk, deadline, [&] { return in_flight_.load() == 0; });
  const size_t left = in_flight_.load();
  if (left == 0) return 0;
  cancel_all_ = true;
  cv_.notify_all();
  // Cancelled requests are reported at the engine's next step; a step that never returns is a
  // device hang, which the device layer reports as an error, so this wait is bounded by it.
  idle_cv_.wait(lk, [&] { return in_flight_.load() == 0; });
  return left;
}

std::optional<std::string> EngineWorker::failure() const {
  std::lock_guard lk(mu_);
  return failure_;
}

void EngineWorker::end(const std::shared_ptr<RequestChannel>& ch, GenerationResult r) {
  if (!ch->started_) {
    ch->started_ = true;
    --waiting_;
  }
  const CancelCause cause = ch->cancel_cause();
  std::string outcome = cause == CancelCause::Deadline ? "deadline"
                        : cause != CancelCause::None   ? "cancelled"
                        : r.reason == EndReason::Error ? "error"
                                                       : end_reason_name(r.reason);
  metrics_.request_finished(outcome, seconds(Clock::now() - ch->arrival_));
  metrics_.add_prompt_tokens(r.prompt_tokens);
  ch->finish(std::move(r));
  {
    std::lock_guard lk(mu_);
    --in_flight_;
  }
  idle_cv_.notify_all();
}

void EngineWorker::publish_gauges() {
  EngineGauges g;
  g.running = engine_->num_running();
  g.waiting = waiting_.load();
  g.kv_pages_used = engine_->kv_pages_in_use();
  g.kv_pages_total = engine_->kv_pages_total();
  g.speculative = speculative_;
  g.drafted = engine_->stats().speculative.drafted;
  g.accepted = engine_->stats().speculative.accepted;
  g.steps = engine_->stats().steps;
  metrics_.set_gauges(g);
}

void EngineWorker::run() {
  std::vector<Submission> subs;
  std::vector<std::pair<std::shared_ptr<RequestChannel>, CancelCause>> cancels;
  for (;;) {
    bool cancel_all = false;
    {
      std::unique_lock lk(mu_);
      if (live_.empty())
        cv_.wait(lk, [&] { return !inbox_.empty() || !cancels_.empty() || exit_; });
      if (exit_ && live_.empty() && inbox_.empty()) break;
      subs.swap(inbox_);
      cancels.swap(cancels_);
      cancel_all = cancel_all_;
    }
    for (Submission& s : subs) {
      try {
        const uint64_t h = engine_->submit(std::move(s.request));
        s.channel->handle_ = h;
        live_[h] = s.channel;
      } catch (const std::exception& e) {
        GenerationResult r;
        r.reason = EndReason::Error;
        r.error = e.what();
        end(s.channel, std::move(r));
      }
    }
    subs.clear();
    auto cancel_one = [&](const std::shared_ptr<RequestChannel>& ch, CancelCause cause) {
      if (!ch->handle_ || !live_.count(ch->handle_)) return;
      CancelCause none = CancelCause::None;
      if (ch->cancel_cause_.compare_exchange_strong(none, cause))
        engine_->cancel(ch->handle_, cancel_message(cause));
    };
    for (auto& [ch, cause] : cancels) cancel_one(ch, cause);
    cancels.clear();
    const auto now = Clock::now();
    for (auto& [h, ch] : live_)
      if (cancel_all) cancel_one(ch, CancelCause::Shutdown);
      else if (now >= ch->deadline_) cancel_one(ch, CancelCause::Deadline);

    std::vector<GenerationResult> done;
    try {
      done = engine_->step();
    } catch (const std::exception& e) {
      // The engine's state is unknown after a failed step: every request fails, and so does
      // every later one (the server reports it on /health).
      std::cerr << "clshard serve: engine step failed: " << e.what() << "\n";
      {
        std::lock_guard lk(mu_);
        failure_ = e.what();
        stopping_ = true;
      }
      for (auto& [h, ch] : live_) {
        GenerationResult r;
        r.handle = h;
        r.reason = EndReason::Error;
        r.error = std::string("the engine failed: ") + e.what();
        end(ch, std::move(r));
      }
      live_.clear();
      publish_gauges();
      continue;
    }
    std::vector<std::pair<std::shared_ptr<RequestChannel>, GenerationResult>> ended;
    for (GenerationResult& r : done) {
      auto it = live_.find(r.handle);
      if (it == live_.end()) continue;
      ended.emplace_back(std::move(it->second), std::move(r));
      live_.erase(it);
    }
    for (auto& [h, ch] : live_)
      if (!ch->started_ && engine_->state(h) != RequestState::Waiting) {
        ch->started_ = true;
        --waiting_;
      }
    for (auto& [ch, r] : ended)
      if (!ch->started_) {
        ch->started_ = true;
        --waiting_;
      }
    // The figures first: a client that sees its request end then sees its pages freed.
    publish_gauges();
    for (auto& [ch, r] : ended) end(ch, std::move(r));
  }
}

}  // namespace clshard::serve
