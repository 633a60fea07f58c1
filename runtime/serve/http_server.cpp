#include "runtime/serve/http_server.h"

#include <dirent.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>

#include <algorithm>
#include <condition_variable>
#include <cstdio>
#include <ctime>
#include <deque>
#include <functional>
#include <iostream>
#include <list>
#include <mutex>

#include <httplib.h>

#include "runtime/engine/deployment.h"
#include "runtime/engine/warm_up.h"
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

// httplib 0.11 (Debian's) tells a handler neither its connection nor whether the client is still
// there, and a non-streaming handler writes nothing until the answer is ready. So the handler
// finds its connection's socket once: the descriptor of this process whose local port, peer port
// and peer address are the request's (Linux: /proc/self/fd). The connection belongs to the
// handler's thread while the handler runs, so no other request can hold that descriptor. -1 when
// none matches (the request then runs to its end whatever the client does).
std::string numeric_host(const sockaddr_storage& a, socklen_t len, int* port) {
  char host[NI_MAXHOST], serv[NI_MAXSERV];
  if (getnameinfo(reinterpret_cast<const sockaddr*>(&a), len, host, sizeof host, serv,
                  sizeof serv, NI_NUMERICHOST | NI_NUMERICSERV) != 0)
    return {};
  *port = std::atoi(serv);
  return host;
}

int connection_socket(const httplib::Request& req) {
  DIR* dir = ::opendir("/proc/self/fd");
  if (!dir) return -1;
  int found = -1;
  while (dirent* e = ::readdir(dir)) {
    if (e->d_name[0] < '0' || e->d_name[0] > '9') continue;
    const int fd = std::atoi(e->d_name);
    struct stat st;
    if (::fstat(fd, &st) != 0 || !S_ISSOCK(st.st_mode)) continue;
    sockaddr_storage local{}, peer{};
    socklen_t local_len = sizeof local, peer_len = sizeof peer;
    if (::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &local_len) != 0 ||
        ::getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &peer_len) != 0)
      continue;
    int local_port = -1, peer_port = -1;
    numeric_host(local, local_len, &local_port);
    const std::string peer_host = numeric_host(peer, peer_len, &peer_port);
    if (peer_port == req.remote_port && peer_host == req.remote_addr &&
        (req.local_port < 0 || local_port == req.local_port)) {
      found = fd;
      break;
    }
  }
  ::closedir(dir);
  return found;
}

// The client closed its end (or reset it): its answer can no longer be delivered. A client that
// only half-closes after sending its request counts as gone too (HTTP clients keep both halves
// open while they wait).
bool client_gone(int fd) {
  if (fd < 0) return false;
  pollfd p{fd, POLLRDHUP, 0};
  return ::poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0;
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
    // A stream writes one small chunk per token: with Nagle's algorithm a chunk written while the
    // previous one waits for its (delayed) ACK sits in the kernel for up to 40 ms.
    server.set_tcp_nodelay(true);
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
      // The base model, then every LoRA adapter a request may name (vLLM's shape: "parent" is
      // the base model an adapter runs on).
      ordered_json data = ordered_json::array();
      data.push_back({{"id", s_.model_name_},
                      {"object", "model"},
                      {"created", s_.started_at_},
                      {"owned_by", "clshard"},
                      {"root", s_.model_name_},
                      {"parent", nullptr}});
      for (const std::string& a : s_.adapters_)
        data.push_back({{"id", a},
                        {"object", "model"},
                        {"created", s_.started_at_},
                        {"owned_by", "clshard"},
                        {"root", a},
                        {"parent", s_.model_name_}});
      res.set_content(json_text({{"object", "list"}, {"data", data}}), "application/json");
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
      status = s_.warming_up_ ? "warming_up" : "loading";
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

  // The engine's requests (one per choice) from the API's, with the checks the engine would fail
  // later made now (a stream has sent its 200 by then). The fields map to the engine as the
  // batch job's do (Deployment::generation_request).
  std::vector<GenerationRequest> generation_requests(const ApiRequest& r) {
    const Deployment& d = *s_.deployment_;
    std::vector<int32_t> prompt;
    const std::string field = r.messages ? "messages" : "prompt";
    try {
      if (r.messages) {
        if (!d.tokenizer)
          throw std::runtime_error("chat needs the checkpoint's tokenizer.json");
        prompt = d.tokenizer->encode(apply_chat_template_json(*d.tokenizer, *r.messages, true),
                                     false);
      } else {
        prompt = d.prompt_ids(r.prompt, r.prompt_token_ids, std::nullopt);
      }
    } catch (const std::exception& e) {
      throw bad_field(field, e.what());
    }
    const uint32_t vocab = d.model->info().vocab_size;
    for (size_t i = 0; i < prompt.size(); ++i)
      if (prompt[i] < 0 || uint32_t(prompt[i]) >= vocab)
        throw bad_field(field + "[" + std::to_string(i) + "]",
                        "token " + std::to_string(prompt[i]) +
                            " is outside the vocabulary of " + std::to_string(vocab));
    if (prompt.empty()) throw bad_field(field, "is empty (a prompt needs at least one token)");
    const SchedulerLimits& lim = d.limits;
    if (prompt.size() >= lim.max_length)
      throw ApiError(400, "invalid_request_error",
                     field + ": " + std::to_string(prompt.size()) +
                         " tokens leave no room for a completion within the model's max_length " +
                         std::to_string(lim.max_length),
                     field, "context_length_exceeded");
    RequestFormat format;
    if (r.response_format) format.response_format = &*r.response_format;
    if (r.regex) format.regex = &*r.regex;
    const std::optional<std::string> lora =
        r.model == s_.model_name_ ? std::nullopt : std::optional<std::string>(r.model);
    GenerationRequest g;
    try {
      g = d.generation_request(std::move(prompt), r.sampling, lora, format);
      validate_sampling_params(g.sampling);
    } catch (const std::invalid_argument& e) {
      // A bad response_format or regex (the message begins with the field and the JSON path in
      // it), or sampling parameters the sampler refuses.
      const std::string what = e.what();
      const std::string param = what.rfind("regex", 0) == 0             ? "regex"
                                : what.rfind("response_format", 0) == 0 ? "response_format"
                                                                        : "";
      throw ApiError(400, "invalid_request_error", what, param);
    }
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
    return Deployment::choice_requests(g, r.sampling.n);
  }

  bool serves(const std::string& model) const {
    return model == s_.model_name_ ||
           std::find(s_.adapters_.begin(), s_.adapters_.end(), model) != s_.adapters_.end();
  }

  std::string served_names() const {
    std::string names = "`" + s_.model_name_ + "`";
    for (const std::string& a : s_.adapters_) names += ", `" + a + "`";
    return names;
  }

  void completion(Endpoint endpoint, const httplib::Request& hreq, httplib::Response& res) {
    const auto arrival = Clock::now();
    try {
      auto req = std::make_shared<ApiRequest>(
          parse_api_request(endpoint, hreq.body, s_.defaults_));
      if (!serves(req->model))
        throw ApiError(404, "invalid_request_error",
                       "The model `" + req->model + "` does not exist (this server serves " +
                           served_names() + ").",
                       "model", "model_not_found");
      if (!s_.ready_)
        throw ApiError(503, "service_unavailable",
                       s_.warming_up_ ? "the model is warming up (its kernels are being built)"
                                      : "the model is still loading",
                       {}, "model_loading");
      if (s_.draining_)
        throw ApiError(503, "service_unavailable", "the server is shutting down", {},
                       "shutting_down");
      std::vector<GenerationRequest> gs = generation_requests(*req);
      Admission admission;
      auto chs = s_.worker_->submit(std::move(gs), arrival, &admission);
      if (chs.empty() && admission == Admission::QueueFull)
        throw ApiError(429, "rate_limit_exceeded",
                       "too many requests waiting (serve.max_waiting " +
                           std::to_string(s_.settings_.max_waiting) + "); retry later",
                       {}, "rate_limit_exceeded");
      if (chs.empty()) {
        auto f = s_.worker_->failure();
        throw ApiError(503, "service_unavailable",
                       f ? "the engine failed: " + *f : "the server is shutting down", {},
                       f ? "engine_failed" : "shutting_down");
      }
      ResponseMeta meta{new_response_id(endpoint), int64_t(std::time(nullptr)), req->model};
      if (req->stream)
        stream(req, meta, std::move(chs), res);
      else
        whole(*req, meta, chs, connection_socket(hreq), res);
    } catch (const ApiError& e) {
      s_.metrics_.request_rejected(rejection_reason(e));
      send_error(res, e);
    }
  }

  std::optional<std::vector<RecordLogprobs>> logprobs_of(const ApiRequest& req,
                                                         const std::vector<TokenLogprobs>& lps) {
    if (!req.sampling.logprobs) return std::nullopt;
    return s_.deployment_->logprobs_text(lps);
  }

  // Waits for every choice; a client that closes its connection meanwhile (`socket`, checked
  // every 100 ms) cancels them, which frees their pages.
  void whole(const ApiRequest& req, const ResponseMeta& meta,
             const std::vector<std::shared_ptr<RequestChannel>>& chs, int socket,
             httplib::Response& res) {
    std::vector<std::optional<GenerationResult>> results(chs.size());
    std::vector<TokenEvent> events;
    bool cancelled = false;
    for (;;) {
      std::vector<std::shared_ptr<RequestChannel>> live;
      for (size_t i = 0; i < chs.size(); ++i)
        if (!results[i]) live.push_back(chs[i]);
      if (live.empty()) break;
      RequestChannel::wait_any(live, std::chrono::milliseconds(100));
      for (size_t i = 0; i < chs.size(); ++i)
        if (!results[i]) {
          results[i] = chs[i]->wait(events, Clock::duration::zero());
          events.clear();
        }
      if (!cancelled && client_gone(socket)) {
        cancelled = true;
        for (size_t i = 0; i < chs.size(); ++i)
          if (!results[i]) s_.worker_->cancel(chs[i], CancelCause::ClientGone);
      }
    }
    for (size_t i = 0; i < chs.size(); ++i) {
      const GenerationResult& r = *results[i];
      if (r.reason != EndReason::Error) continue;
      const CancelCause cause = chs[i]->cancel_cause();
      send_error(res, cause != CancelCause::None
                          ? cancelled_error(cause)
                          : ApiError(400, "invalid_request_error", r.error));
      return;
    }
    std::vector<ChoiceOutput> choices;
    Usage u{results[0]->prompt_tokens, 0};
    for (auto& r : results) {
      u.completion_tokens += r->token_ids.size();
      choices.push_back({r->text, r->token_ids, r->reason, logprobs_of(req, r->logprobs)});
    }
    res.set_content(json_text(response_json(req, meta, choices, u)), "application/json");
  }

  // One choice of a stream.
  struct ChoiceStream {
    std::shared_ptr<RequestChannel> ch;
    std::string text;             // every piece so far
    size_t text_sent = 0;
    std::vector<int32_t> tokens;  // every token so far
    std::vector<TokenLogprobs> logprobs;  // per token, when asked
    size_t tokens_sent = 0;
    size_t logprob_offset = 0;  // bytes of the tokens whose logprobs were sent (text_offset)
    bool first = true;
    std::optional<GenerationResult> result;  // once it has ended
    bool finished = false;                   // its finish chunk was sent
  };
  struct StreamState {
    std::shared_ptr<const ApiRequest> req;
    ResponseMeta meta;
    std::vector<ChoiceStream> choices;
    bool ended = false;  // [DONE] written
    std::vector<std::shared_ptr<RequestChannel>> channels() const {
      std::vector<std::shared_ptr<RequestChannel>> out;
      for (const ChoiceStream& c : choices) out.push_back(c.ch);
      return out;
    }
  };

  void stream(std::shared_ptr<const ApiRequest> req, const ResponseMeta& meta,
              std::vector<std::shared_ptr<RequestChannel>> chs, httplib::Response& res) {
    auto st = std::make_shared<StreamState>();
    st->req = std::move(req);
    st->meta = meta;
    for (auto& ch : chs) {
      st->choices.emplace_back();
      st->choices.back().ch = std::move(ch);
    }
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
          for (ChoiceStream& c : st->choices)
            if (!st->ended || !c.result) s_.worker_->cancel(c.ch, CancelCause::ClientGone);
          --s_.open_streams_;
        });
  }

  // The chunk of choice `index` with the text and tokens up to `tokens_end`.
  std::string chunk(StreamState& st, uint32_t index, const std::string& text, size_t tokens_end,
                    std::optional<EndReason> fin) {
    ChoiceStream& c = st.choices[index];
    const ApiRequest& req = *st.req;
    const size_t from = std::min(c.tokens_sent, tokens_end);
    std::vector<int32_t> ids(c.tokens.begin() + from, c.tokens.begin() + tokens_end);
    std::optional<std::vector<RecordLogprobs>> lps;
    size_t offset = c.logprob_offset;
    if (req.sampling.logprobs) {
      const size_t lp_end = std::min(tokens_end, c.logprobs.size());
      lps = s_.deployment_->logprobs_text(std::vector<TokenLogprobs>(
          c.logprobs.begin() + std::min(from, lp_end), c.logprobs.begin() + lp_end));
      for (const RecordLogprobs& e : *lps)
        c.logprob_offset += e.chosen.bytes.empty() ? e.chosen.token.size() : e.chosen.bytes.size();
    }
    const std::string out = sse_event(stream_chunk(req, st.meta, index, text, ids, c.first, fin,
                                                   lps ? &*lps : nullptr, offset));
    c.first = false;
    c.tokens_sent = std::max(c.tokens_sent, tokens_end);
    return out;
  }

  // The events to write next: new tokens (one chunk per choice that has some), the ends, or a
  // keep-alive comment after a second of silence (writing is how a closed connection shows).
  std::string next_events(StreamState& st) {
    std::vector<std::shared_ptr<RequestChannel>> live;
    for (const ChoiceStream& c : st.choices)
      if (!c.result) live.push_back(c.ch);
    RequestChannel::wait_any(live, std::chrono::seconds(1));
    const ApiRequest& req = *st.req;
    std::string out;
    for (uint32_t i = 0; i < st.choices.size(); ++i) {
      ChoiceStream& c = st.choices[i];
      if (c.result) continue;
      std::vector<TokenEvent> events;
      c.result = c.ch->wait(events, Clock::duration::zero());
      for (TokenEvent& e : events) {
        c.text += e.text;
        c.tokens.push_back(e.token);
        if (e.logprobs) c.logprobs.push_back(std::move(*e.logprobs));
      }
      if (c.result && c.result->reason == EndReason::Error) {
        // The request failed or was cancelled: the error ends the whole stream, and the other
        // choices are cancelled.
        const CancelCause cause = c.ch->cancel_cause();
        ApiError e = cause != CancelCause::None ? cancelled_error(cause)
                                                : ApiError(500, "server_error", c.result->error);
        for (ChoiceStream& other : st.choices)
          if (!other.result) s_.worker_->cancel(other.ch, CancelCause::ClientGone);
        st.ended = true;
        return out + sse_event(e.body()) + sse_done();
      }
      if (!c.result) {
        const size_t safe = c.text.size() - stop_holdback(c.text, req.sampling.stop);
        const bool new_ids = (req.return_token_ids || req.sampling.logprobs) &&
                             c.tokens.size() > c.tokens_sent;
        if (safe > c.text_sent || new_ids) {
          out += chunk(st, i, c.text.substr(c.text_sent, safe - c.text_sent), c.tokens.size(),
                       std::nullopt);
          c.text_sent = safe;
        }
        continue;
      }
      // The engine's text is the completion: the rest of it (text held back, a UTF-8 tail
      // flushed), then the finish chunk.
      c.tokens = c.result->token_ids;
      c.logprobs = c.result->logprobs;
      const std::string& text = c.result->text;
      const std::string rest = c.text_sent < text.size() ? text.substr(c.text_sent) : "";
      if (!rest.empty() || ((req.return_token_ids || req.sampling.logprobs) &&
                            c.tokens.size() > c.tokens_sent))
        out += chunk(st, i, rest, c.tokens.size(), std::nullopt);
      out += chunk(st, i, "", c.tokens.size(), c.result->reason);
      c.finished = true;
    }
    bool all_done = true;
    for (const ChoiceStream& c : st.choices) all_done = all_done && c.finished;
    if (!all_done) return out.empty() ? ": keep-alive\n\n" : out;
    st.ended = true;
    if (req.include_usage) {
      Usage u{st.choices[0].result->prompt_tokens, 0};
      for (const ChoiceStream& c : st.choices) u.completion_tokens += c.result->token_ids.size();
      out += sse_event(usage_chunk(req, st.meta, u));
    }
    out += sse_done();
    return out;
  }

  OpenAiServer& s_;
};

OpenAiServer::OpenAiServer(const ServeSection& settings, std::string model_name,
                           const SamplingDefaults& defaults, std::vector<std::string> adapters)
    : settings_(settings),
      model_name_(std::move(model_name)),
      defaults_(defaults),
      adapters_(std::move(adapters)),
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

void OpenAiServer::attach(std::unique_ptr<Deployment> deployment,
                          const std::function<void(const std::string&)>& note) {
  deployment_ = std::move(deployment);
  std::unique_ptr<Engine> engine = deployment_->make_engine();
  const WarmUpPlan plan = plan_warm_up(engine->scheduler(0).limits());
  if (note) note("warming up: " + plan.describe() + " (kernels are built on first use)");
  warming_up_ = true;
  const WarmUpResult w = warm_up(*engine, plan);
  warming_up_ = false;
  if (note) {
    char took[32];
    std::snprintf(took, sizeof took, "%.2f", w.seconds);
    note("warmed up in " + std::string(took) + " s (" + std::to_string(w.requests) +
         " requests, " + std::to_string(w.steps) + " steps)");
  }
  worker_ = std::make_unique<EngineWorker>(std::move(engine), size_t(settings_.max_waiting),
                                           settings_.request_deadline_s, metrics_,
                                           deployment_->draft != nullptr);
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
