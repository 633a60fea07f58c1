// The engine on its own thread. HTTP threads hand requests over through a queue (bounded:
// max_waiting requests may wait for a batch row) and receive each request's tokens as the engine
// commits them, through the request's channel; a cancellation (client gone, deadline, shutdown)
// goes through the same queue and frees the request's pages before the next step.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "runtime/engine/engine.h"
#include "runtime/serve/metrics.h"

namespace clshard::serve {

using Clock = std::chrono::steady_clock;

struct TokenEvent {
  int32_t token = 0;
  std::string text;  // what the token adds to the completion (UTF-8 complete; may be empty)
  std::optional<TokenLogprobs> logprobs;  // when the request asked for sampling.logprobs
};

// The lock and the wake-up that the channels of one API request share (its n choices), so the
// HTTP thread can wait for news from any of them.
struct ChannelSync {
  std::mutex mu;
  std::condition_variable cv;
};

// Why the server ended a request before the engine did.
enum class CancelCause { None, ClientGone, Deadline, Shutdown };

// One request's tokens from the engine thread to the HTTP thread that serves it.
class RequestChannel {
 public:
  explicit RequestChannel(Clock::time_point arrival,
                          std::shared_ptr<ChannelSync> sync = std::make_shared<ChannelSync>())
      : arrival_(arrival), sync_(std::move(sync)) {}

  // HTTP side: waits up to `timeout` for tokens or the end; appends the tokens that arrived since
  // the last call to `events` and returns the result once the request has ended (after its last
  // token). The result's reason is Error when the engine refused the request (its error says why)
  // or the server cancelled it (cancel_cause() says why).
  std::optional<GenerationResult> wait(std::vector<TokenEvent>& events, Clock::duration timeout);
  // Waits up to `timeout` until one of `channels` (which share one ChannelSync) has tokens not yet
  // taken or has ended.
  static void wait_any(const std::vector<std::shared_ptr<RequestChannel>>& channels,
                       Clock::duration timeout);
  CancelCause cancel_cause() const { return cancel_cause_.load(); }
  Clock::time_point arrival() const { return arrival_; }

 private:
  friend class EngineWorker;
  void push(TokenEvent e);
  void finish(GenerationResult r);

  bool has_news() const { return !events_.empty() || result_.has_value(); }  // under sync_->mu

  const Clock::time_point arrival_;
  std::shared_ptr<ChannelSync> sync_;
  std::vector<TokenEvent> events_;
  std::optional<GenerationResult> result_;
  std::atomic<CancelCause> cancel_cause_{CancelCause::None};
  // Engine-thread bookkeeping.
  uint64_t handle_ = 0;
  bool started_ = false;  // left the waiting queue (counted out of waiting_)
  std::optional<Clock::time_point> last_token_at_;
  Clock::time_point deadline_ = Clock::time_point::max();
};

enum class Admission { Accepted, QueueFull, Stopping };

class EngineWorker {
 public:
  // max_waiting: requests accepted and not yet running, at most. request_deadline_s: a request
  // not finished that long after its arrival is cancelled (0: never).
  EngineWorker(std::unique_ptr<Engine> engine, size_t max_waiting, double request_deadline_s,
               ServerMetrics& metrics, bool speculative = false);
  ~EngineWorker();  // cancels whatever is left and joins the thread
  EngineWorker(const EngineWorker&) = delete;
  EngineWorker& operator=(const EngineWorker&) = delete;

  // Any thread. The channel of the queued request, or nullptr with why it was not taken.
  std::shared_ptr<RequestChannel> submit(GenerationRequest request, Clock::time_point arrival,
                                         Admission* admission);
  // The same for the engine requests of one API request (its choices), all or none: their
  // channels, in order, sharing one ChannelSync; empty with why they were not taken. They count
  // as that many waiting requests.
  std::vector<std::shared_ptr<RequestChannel>> submit(std::vector<GenerationRequest> requests,
                                                      Clock::time_point arrival,
                                                      Admission* admission);
  // Any thread; the request ends with reason Error and this cause (no effect once it has ended).
  void cancel(const std::shared_ptr<RequestChannel>& channel, CancelCause cause);
  // Graceful stop: takes no new request, waits until every request has ended or `deadline`, then
  // cancels the rest (cause Shutdown) and waits until they are reported. Returns the number
  // cancelled.
  size_t drain(Clock::time_point deadline);
  // Requests accepted and not yet reported ended.
  size_t in_flight() const { return in_flight_.load(); }
  size_t waiting() const { return waiting_.load(); }
  // Set when a step threw: every request then failed with that message, and so will new ones.
  std::optional<std::string> failure() const;

 private:
  struct Submission {
    GenerationRequest request;
    std::shared_ptr<RequestChannel> channel;
  };
  void run();
  void take_inbox(std::vector<Submission>& subs,
                  std::vector<std::pair<std::shared_ptr<RequestChannel>, CancelCause>>& cancels);
  void end(const std::shared_ptr<RequestChannel>& ch, GenerationResult r);
  void publish_gauges();

  std::unique_ptr<Engine> engine_;
  const size_t max_waiting_;
  const double request_deadline_s_;
  ServerMetrics& metrics_;
  const bool speculative_;

  mutable std::mutex mu_;
  std::condition_variable cv_;       // the engine thread waits for work here
  std::condition_variable idle_cv_;  // drain() waits here for in_flight_ to reach 0
  std::vector<Submission> inbox_;
  std::vector<std::pair<std::shared_ptr<RequestChannel>, CancelCause>> cancels_;
  bool stopping_ = false;  // no new submissions
  bool exit_ = false;      // the thread ends once nothing is live
  bool cancel_all_ = false;  // drain() ran out of time: cancel every live request
  std::optional<std::string> failure_;
  std::atomic<size_t> waiting_{0}, in_flight_{0};

  // Engine thread only.
  std::unordered_map<uint64_t, std::shared_ptr<RequestChannel>> live_;
  std::thread thread_;
};

}  // namespace clshard::serve
