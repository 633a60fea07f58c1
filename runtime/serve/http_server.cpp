#include "runtime/serve/http_server.h"

#include <sys/socket.h>

#include <condition_variable>
#include <ctime>
#include <deque>
#include <functional>
#include <iostream>
#include <list>
#include <mutex>

#include <httplib.h>

#include "runtime/engine/deployment.h"
#include "runtime/serve/engine_worker.h"
#include "runtime/serve/openai_api.h"
#include "runtime/text/chat_template.h"

namespace clshard::serve {

using ordered_json = nlohmann::ordered_json;

namespace {

// One thread per connection, started as connections come and kept for the next ones, up to
// `max` (httplib's own pool has a fixed size, so a few slow streams would queue everything else,
// /health included, behind them).
class ConnectionThreads : public httplib::TaskQueue {
 public:
  explicit ConnectionThreads(size_t max) : max_(max) {}
  void enqueue(std::function<void()> fn) override {
    {
      std::lock_guard lk(mu_);
      jobs_.push_back(std::move(fn));
      if (idle_ < jobs_.size() && threads_.size() < max_)
        threads_.emplace_back([this] { work(); });
    }
    cv_.notify_one();
  }
  void shutdown() override {
    {
      std::lock_guard lk(mu_);
      shutdown_ = true;
    }
    cv_.notify_all();
    for (auto& t : threads_) t.join();
  }

 private:
  void work() {
    for (;;) {
      std::function<void()> fn;
      {
        std::unique_lock lk(mu_);
        ++idle_;
        cv_.wait(lk, [&] { return shutdown_ || !jobs_.empty(); });
        --idle_;
        if (jobs_.empty()) return;
        fn = std::move(jobs_.front());
        jobs_.pop_front();
      }
      fn();
    }
  }
  const size_t max_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> jobs_;
  std::list<std::thread> threads_;
  size_t idle_ = 0;
  bool shutdown_ = false;
};

// httplib's listen backlog is 5 (fixed in Debian's compiled library); a burst of clients
// connecting at once would see SYN retries of a second. Listening again on the bound socket sets
// the backlog (Linux).
class Listener : public httplib::Server {
 public:
  void widen_backlog() { ::listen(svr_sock_, SOMAXCONN); }
};

std::string json_text(const ordered_json& j) {
  return j.dump(-1, ' ', false, ordered_json::error_handler_t::replace);
}

void send_error(httplib::Response& res, const ApiError& e) {
  res.status = e.status;
  if (e.status == 429) res.set_header("Retry-After", "1");
  res.set_content(json_text(e.body()), "application/json");
}

// The longest suffix of `text` that begins one of the stop strings: held back from a stream until
// the next tokens show whether the stop string follows (the engine cuts the text before it).
size_t stop_holdback(const std::string& text, const std::vector<std::string>& stop) {
  size_t hold = 0;
  for (const std::string& s : stop)
    for (size_t n = std::min(s.size() - 1, text.size()); n > hold; --n)
      if (text.compare(text.size() - n, n, s, 0, n) == 0) {
        hold = n;
        break;
      }
  return hold;
}

const char* rejection_reason(const ApiError& e) {
  if (e.status == 401) return "unauthorized";
  if (e.status == 404) return "model_not_found";
  if (e.status == 429) return "queue_full";
  if (e.status == 503) return "not_ready";
  return "invalid";
}

ApiError cancelled_error(CancelCause cause) {
  if (cause == CancelCause::Deadline)
    return ApiError(504, "timeout_error", "the request ran past serve.request_deadline_s", {},
                    "request_deadline_exceeded");
  return ApiError(503, "service_unavailable",
                  "the server is shutting down; the request was cancelled", {}, "shutting_down");
}

}  // namespace

class OpenAiServer::Http {
 public:
  explicit Http(OpenAiServer& s) : s_(s) {}
  Listener server;

  void routes() {
    const size_t max_connections = size_t(s_.settings_.max_connections);
    server.new_task_queue = [max_connections] { return new ConnectionThreads(max_connections); };
    server.set_payload_max_length(64u << 20);
    server.set_keep_alive_timeout(5);
    server.set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
      if (s_.settings_.api_key.empty() || req.path.rfind("/v1/", 0) != 0)
        return httplib::Server::HandlerResponse::Unhandled;
      const std::string expected = "Bearer " + s_.settings_.api_key;
      if (req.get_header_value("Authorization") == expected)
        return httplib::Server::HandlerResponse::Unhandled;
      s_.metrics_.request_rejected("unauthorized");
      send_error(res, ApiError(401, "invalid_request_error",
                               req.has_header("Authorization")
                                   ? "Incorrect API key provided."
                                   : "Missing API key: send the header "
                                     "'Authorization: Bearer <key>'.",
                               {}, "invalid_api_key"));
      return httplib::Server::HandlerResponse::Handled;
    });
    server.set_error_handler([](const httplib::Request& req, httplib::Response& res) {
      if (!res.body.empty()) return;
      const int status = res.status;
      send_error(res, ApiError(status, "invalid_request_error",
                               status == 404 ? "no route " + req.method + " " + req.path
                                             : "HTTP error " + std::to_string(status),
                               {}, status == 404 ? "not_found" : ""));
    });
    server.set_exception_handler(
        [](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
          std::string what = "unknown error";
          try {
            std::rethrow_exception(ep);
          } catch (const std::exception& e) {
            what = e.what();
          } catch (...) {
          }
          send_error(res, ApiError(500, "server_error", what));
        });
    server.Get("/health", [this](const httplib::Request&, httplib::Response& res) { health(res); });
    server.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
      res.set_content(s_.metrics_.render(), "text/plain; version=0.0.4; charset=utf-8");
    });
    server.Get("/v1/models", [this](const httplib::Request&, httplib::Response& res) {
      ordered_json m = {{"id", s_.model_name_},
                        {"object", "model"},
                        {"created", s_.started_at_},
                        {"owned_by", "clshard"}};
      res.set_content(json_text({{"object", "list"}, {"data", ordered_json::array({m})}}),
                      "application/json");
    });
    server.Post("/v1/completions", [this](const httplib::Request& req, httplib::Response& res) {
      completion(Endpoint::Completions, req, res);
    });
    server.Post("/v1/chat/completions",
                [this](const httplib::Request& req, httplib::Response& res) {
                  completion(Endpoint::ChatCompletions, req, res);
                });
  }

 private:
  void health(httplib::Response& res) {
    std::string status = "ok";
    std::string detail;
    if (!s_.ready_) {
      status = "loading";
    } else if (auto f = s_.worker_->failure()) {
      status = "failed";
      detail = *f;
    } else if (s_.draining_) {
      status = "shutting_down";
    }
    res.status = status == "ok" ? 200 : 503;
    ordered_json j = {{"status", status}};
    if (!detail.empty()) j["error"] = detail;
    res.set_content(json_text(j), "application/json");
  }

  // The engine's request from the API's, with the checks the engine would fail later made now
  // (a stream has sent its 200 by then).
  GenerationRequest generation_request(const ApiRequest& r) {
    const Deployment& d = *s_.deployment_;
    GenerationRequest g;
    const std::string field = r.messages ? "messages" : "prompt";
    try {
      if (r.messages) {
        if (!d.tokenizer)
          throw std::runtime_error("chat needs the checkpoint's tokenizer.json");
        g.prompt = d.tokenizer->encode(apply_chat_template_json(*d.tokenizer, *r.messages, true),
                                       false);
      } else {
        g.prompt = d.prompt_ids(r.prompt, r.prompt_token_ids, std::nullopt);
      }
    } catch (const std::exception& e) {
      throw bad_field(field, e.what());
    }
    const uint32_t vocab = d.model->info().vocab_size;
    for (size_t i = 0; i < g.prompt.size(); ++i)
      if (g.prompt[i] < 0 || uint32_t(g.prompt[i]) >= vocab)
        throw bad_field(field + "[" + std::to_string(i) + "]",
                        "token " + std::to_string(g.prompt[i]) +
                            " is outside the vocabulary of " + std::to_string(vocab));
    if (g.prompt.empty()) throw bad_field(field, "is empty (a prompt needs at least one token)");
    const SchedulerLimits& lim = d.limits;
    if (g.prompt.size() >= lim.max_length)
      throw ApiError(400, "invalid_request_error",
                     field + ": " + std::to_string(g.prompt.size()) +
                         " tokens leave no room for a completion within the model's max_length " +
                         std::to_string(lim.max_length),
                     field, "context_length_exceeded");
    const SamplingDefaults& s = r.sampling;
    g.sampling = Deployment::sampling_params(s);
    g.max_tokens = uint32_t(s.max_tokens);
    g.stop = s.stop;
    g.stop_token_ids = s.stop_token_ids;
    g.ignore_eos = r.ignore_eos;
    // What the scheduler would refuse: more positions than the whole KV cache.
    const uint64_t new_tokens = std::min<uint64_t>(g.max_tokens, lim.max_length - g.prompt.size());
    const uint64_t lookahead = lim.num_speculative_tokens ? lim.num_speculative_tokens - 1 : 0;
    const uint64_t positions = g.prompt.size() + new_tokens - 1 + lookahead;
    const uint64_t pages = (positions + lim.page_size - 1) / lim.page_size;
    if (pages > lim.total_pages)
      throw ApiError(400, "invalid_request_error",
                     "max_tokens: the prompt's " + std::to_string(g.prompt.size()) +
                         " tokens and max_tokens " + std::to_string(g.max_tokens) + " need " +
                         std::to_string(pages) + " KV pages; the cache has " +
                         std::to_string(lim.total_pages) + " (lower max_tokens)",
                     "max_tokens", "context_length_exceeded");
    return g;
  }

  void completion(Endpoint endpoint, const httplib::Request& hreq, httplib::Response& res) {
    const auto arrival = Clock::now();
    try {
      auto req = std::make_shared<ApiRequest>(
          parse_api_request(endpoint, hreq.body, s_.defaults_));
      if (req->model != s_.model_name_)
        throw ApiError(404, "invalid_request_error",
                       "The model `" + req->model + "` does not exist (this server serves `" +
                           s_.model_name_ + "`).",
                       "model", "model_not_found");
      if (!s_.ready_)
        throw ApiError(503, "service_unavailable", "the model is still loading", {},
                       "model_loading");
      if (s_.draining_)
        throw ApiError(503, "service_unavailable", "the server is shutting down", {},
                       "shutting_down");
      GenerationRequest g = generation_request(*req);
      Admission admission;
      auto ch = s_.worker_->submit(std::move(g), arrival, &admission);
      if (!ch && admission == Admission::QueueFull)
        throw ApiError(429, "rate_limit_exceeded",
                       "too many requests waiting (serve.max_waiting " +
                           std::to_string(s_.settings_.max_waiting) + "); retry later",
                       {}, "rate_limit_exceeded");
      if (!ch) {
        auto f = s_.worker_->failure();
        throw ApiError(503, "service_unavailable",
                       f ? "the engine failed: " + *f : "the server is shutting down", {},
                       f ? "engine_failed" : "shutting_down");
      }
      ResponseMeta meta{new_response_id(endpoint), int64_t(std::time(nullptr)), s_.model_name_};
      if (req->stream)
        stream(req, meta, ch, res);
      else
        whole(*req, meta, *ch, res);
    } catch (const ApiError& e) {
      s_.metrics_.request_rejected(rejection_reason(e));
      send_error(res, e);
    }
  }

  void whole(const ApiRequest& req, const ResponseMeta& meta, RequestChannel& ch,
             httplib::Response& res) {
    std::vector<TokenEvent> events;
    std::optional<GenerationResult> result;
    while (!(result = ch.wait(events, std::chrono::milliseconds(200)))) events.clear();
    if (result->reason == EndReason::Error) {
      const CancelCause cause = ch.cancel_cause();
      send_error(res, cause != CancelCause::None
                          ? cancelled_error(cause)
                          : ApiError(400, "invalid_request_error", result->error));
      return;
    }
    ChoiceOutput c{result->text, result->token_ids, result->reason};
    Usage u{result->prompt_tokens, result->token_ids.size()};
    res.set_content(json_text(response_json(req, meta, {c}, u)), "application/json");
  }

  struct StreamState {
    std::shared_ptr<const ApiRequest> req;
    ResponseMeta meta;
    std::shared_ptr<RequestChannel> ch;
    std::string text;             // every piece so far
    size_t text_sent = 0;
    std::vector<int32_t> tokens;  // every token so far
    size_t tokens_sent = 0;
    bool first = true;
    bool ended = false;
  };

  void stream(std::shared_ptr<const ApiRequest> req, const ResponseMeta& meta,
              std::shared_ptr<RequestChannel> ch, httplib::Response& res) {
    auto st = std::make_shared<StreamState>();
    st->req = std::move(req);
    st->meta = meta;
    st->ch = std::move(ch);
    ++s_.open_streams_;
    res.set_header("Cache-Control", "no-cache");
    res.set_chunked_content_provider(
        "text/event-stream",
        [this, st](size_t, httplib::DataSink& sink) {
          std::string out = next_events(*st);
          if (!out.empty() && !sink.write(out.data(), out.size())) return false;
          if (st->ended) sink.done();
          return true;
        },
        [this, st](bool) {
          // The stream ended before the request did: the client went away (or the write failed).
          if (!st->ended) s_.worker_->cancel(st->ch, CancelCause::ClientGone);
          --s_.open_streams_;
        });
  }

  // The events to write next: new tokens (one chunk), or the end, or a keep-alive comment after a
  // second of silence (writing is how a closed connection shows).
  std::string next_events(StreamState& st) {
    std::vector<TokenEvent> events;
    std::optional<GenerationResult> result = st.ch->wait(events, std::chrono::seconds(1));
    for (TokenEvent& e : events) {
      st.text += e.text;
      st.tokens.push_back(e.token);
    }
    const ApiRequest& req = *st.req;
    std::string out;
    auto emit = [&](const std::string& text, size_t tokens_end, std::optional<EndReason> fin) {
      std::vector<int32_t> ids(st.tokens.begin() + std::min(st.tokens_sent, tokens_end),
                               st.tokens.begin() + tokens_end);
      out += sse_event(stream_chunk(req, st.meta, 0, text, ids, st.first, fin));
      st.first = false;
      st.tokens_sent = std::max(st.tokens_sent, tokens_end);
    };
    if (!result) {
      const size_t safe = st.text.size() - stop_holdback(st.text, req.sampling.stop);
      const bool new_ids = req.return_token_ids && st.tokens.size() > st.tokens_sent;
      if (safe > st.text_sent || new_ids) {
        emit(st.text.substr(st.text_sent, safe - st.text_sent), st.tokens.size(), std::nullopt);
        st.text_sent = safe;
      } else if (events.empty()) {
        out = ": keep-alive\n\n";
      }
      return out;
    }
    st.ended = true;
    if (result->reason == EndReason::Error) {
      const CancelCause cause = st.ch->cancel_cause();
      ApiError e = cause != CancelCause::None
                       ? cancelled_error(cause)
                       : ApiError(500, "server_error", result->error);
      out += sse_event(e.body());
      out += sse_done();
      return out;
    }
    // The engine's text is the completion: the rest of it (text held back, a UTF-8 tail flushed).
    st.tokens = result->token_ids;
    const std::string& text = result->text;
    const std::string rest = st.text_sent < text.size() ? text.substr(st.text_sent) : "";
    if (!rest.empty() || (req.return_token_ids && st.tokens.size() > st.tokens_sent))
      emit(rest, st.tokens.size(), std::nullopt);
    emit("", st.tokens.size(), result->reason);
    if (req.include_usage)
      out += sse_event(
          usage_chunk(req, st.meta, Usage{result->prompt_tokens, result->token_ids.size()}));
    out += sse_done();
    return out;
  }

  OpenAiServer& s_;
};

OpenAiServer::OpenAiServer(const ServeSection& settings, std::string model_name,
                           const SamplingDefaults& defaults)
    : settings_(settings),
      model_name_(std::move(model_name)),
      defaults_(defaults),
      http_(std::make_unique<Http>(*this)) {
  started_at_ = int64_t(std::time(nullptr));
  http_->routes();
}

OpenAiServer::~OpenAiServer() {
  if (!stopped_) shutdown(std::chrono::seconds(0));
}

int OpenAiServer::bind() {
  int port = settings_.port;
  bool ok = false;
  if (port == 0) {
    port = http_->server.bind_to_any_port(settings_.host);
    ok = port > 0;
  } else {
    ok = http_->server.bind_to_port(settings_.host, port);
  }
  if (!ok)
    throw std::runtime_error("serve: cannot listen on " + settings_.host + ":" +
                             std::to_string(settings_.port) +
                             " (address in use, or not an address of this machine?)");
  http_->server.widen_backlog();
  return port;
}

void OpenAiServer::start() {
  listen_thread_ = std::thread([this] { http_->server.listen_after_bind(); });
}

void OpenAiServer::attach(std::unique_ptr<Deployment> deployment) {
  deployment_ = std::move(deployment);
  worker_ = std::make_unique<EngineWorker>(
      deployment_->make_engine(), size_t(settings_.max_waiting), settings_.request_deadline_s,
      metrics_, deployment_->draft != nullptr);
  ready_ = true;
}

size_t OpenAiServer::shutdown(std::chrono::duration<double> grace) {
  if (stopped_.exchange(true)) return 0;
  draining_ = true;
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(grace);
  size_t cancelled = worker_ ? worker_->drain(deadline) : 0;
  // Every request has ended; let the streams write their last events before the connections
  // close (httplib ends a chunked response as soon as the server stops).
  const auto flush_deadline = Clock::now() + std::chrono::seconds(5);
  while (open_streams_.load() > 0 && Clock::now() < flush_deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  http_->server.stop();
  if (listen_thread_.joinable()) listen_thread_.join();
  worker_.reset();
  return cancelled;
}

}  // namespace clshard::serve
