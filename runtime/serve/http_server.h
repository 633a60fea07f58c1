// `clshard serve`: the OpenAI-compatible HTTP/1.1 server (cpp-httplib) on the engine.
//   POST /v1/completions, POST /v1/chat/completions   (stream: true → server-sent events)
//   GET  /v1/models, GET /health (503 until the model has loaded), GET /metrics (Prometheus)
// HTTP threads read and check a request, hand it to the engine thread (engine_worker.h) and write
// its tokens as they are committed; a client that goes away cancels its request (mid-stream: the
// write fails; waiting for a whole answer: its socket shows the peer closed, see http_server.cpp).
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "runtime/engine/deploy_config.h"
#include "runtime/serve/metrics.h"

namespace clshard {
struct Deployment;
}

namespace clshard::serve {

class EngineWorker;

class OpenAiServer {
 public:
  // settings: the deployment's `serve:` section; model_name: what a request's `model` says for
  // the base model; defaults: the deployment's sampling defaults, which a request's fields
  // override; adapters: the names of the deployment's LoRA adapters (lora.adapters), which a
  // request's `model` may name instead to run on that adapter.
  OpenAiServer(const ServeSection& settings, std::string model_name,
               const SamplingDefaults& defaults, std::vector<std::string> adapters = {});
  ~OpenAiServer();  // shutdown(0) when still serving
  OpenAiServer(const OpenAiServer&) = delete;
  OpenAiServer& operator=(const OpenAiServer&) = delete;

  // Binds settings.host:settings.port (0: a free port) and returns the port; std::runtime_error
  // naming the address when it cannot.
  int bind();
  // Serves on threads of its own from now on; /health answers 503 until attach().
  void start();
  // The model has loaded: its engine runs the warm-up (runtime/engine/warm_up.h; /health answers
  // 503 "warming_up" meanwhile), then moves to the engine thread and requests run from then on.
  // `note` hears the warm-up's plan before it and what it took after.
  void attach(std::unique_ptr<Deployment> deployment,
              const std::function<void(const std::string&)>& note = {});
  bool ready() const { return ready_.load(); }

  // Graceful stop: new requests get 503 (and /health 503), running ones have until `grace`
  // from now to finish, the rest are cancelled (their clients get an error), the connections are
  // closed and the threads joined. Returns the number of requests cancelled.
  size_t shutdown(std::chrono::duration<double> grace);

  ServerMetrics& metrics() { return metrics_; }
  const std::string& model_name() const { return model_name_; }

 private:
  class Http;
  ServeSection settings_;
  std::string model_name_;
  SamplingDefaults defaults_;
  std::vector<std::string> adapters_;
  ServerMetrics metrics_;
  std::unique_ptr<Http> http_;
  std::thread listen_thread_;
  std::unique_ptr<Deployment> deployment_;
  std::unique_ptr<EngineWorker> worker_;
  std::atomic<bool> ready_{false}, warming_up_{false}, draining_{false}, stopped_{false};
  std::atomic<int> open_streams_{0};
  int64_t started_at_ = 0;  // unix time, for /v1/models
};

}  // namespace clshard::serve
