#include "runtime/cli/serve_command.h"

#include <pthread.h>
#include <signal.h>

#include <CLI/CLI.hpp>

#include <atomic>
#include <condition_variable>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <mutex>
#include <thread>

#include "runtime/cli/commands.h"
#include "runtime/engine/deployment.h"
#include "runtime/serve/http_server.h"

namespace clshard::cli {

namespace {

struct ServeFlags {
  std::string deploy;
  std::string host;
  int port = -1;
  std::string port_file;
};

// The name clients give as `model`: serve.model_name, else the checkpoint folder's name.
std::string served_model_name(const DeployConfig& cfg) {
  if (!cfg.serve.model_name.empty()) return cfg.serve.model_name;
  std::filesystem::path p = cfg.model.path.lexically_normal();
  if (p.filename().empty()) p = p.parent_path();
  return p.filename().string();
}

void write_port_file(const std::string& path, int port) {
  // Written whole, then renamed: a reader polling for the file never sees it half-written.
  const std::string tmp = path + ".tmp";
  std::ofstream(tmp) << port << "\n";
  std::filesystem::rename(tmp, path);
}

void run_server(const ServeFlags& flags) {
  DeployConfig cfg = load_deploy_config(flags.deploy);
  if (cfg.cluster.transport == ClusterTransport::Mpi)
    throw std::runtime_error(cfg.where("cluster.transport") +
                             ": mpi: `serve` does not run over MPI yet (`logits` and `run` do)");
  if (!flags.host.empty()) cfg.serve.host = flags.host;
  if (flags.port >= 0) {
    if (flags.port > 65535) throw std::runtime_error("--port: expected 0 to 65535");
    cfg.serve.port = flags.port;
  }
  // SIGINT and SIGTERM go to one thread (sigtimedwait below): blocked here, before any other
  // thread starts, so that every thread inherits the mask. A write to a closed connection must
  // fail with EPIPE, not end the process.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
  signal(SIGPIPE, SIG_IGN);

  std::mutex mu;
  std::condition_variable cv;
  int stop_signal = 0;
  std::atomic<bool> done{false};
  std::thread signals([&] {
    const timespec poll{0, 200 * 1000 * 1000};
    while (!done) {
      const int sig = sigtimedwait(&stop_signals, nullptr, &poll);
      if (sig <= 0) continue;
      std::lock_guard lk(mu);
      if (stop_signal == 0) {
        stop_signal = sig;
        cv.notify_all();
      } else {
        std::cerr << "clshard serve: already stopping; requests still running are cancelled at "
                     "the shutdown deadline\n";
      }
    }
  });
  struct JoinOnExit {
    std::atomic<bool>& done;
    std::thread& t;
    ~JoinOnExit() {
      done = true;
      t.join();
    }
  } join_signals{done, signals};

  const std::string name = served_model_name(cfg);
  std::vector<std::string> adapters;
  for (const auto& [adapter, dir] : cfg.lora.adapters) adapters.push_back(adapter);
  serve::OpenAiServer server(cfg.serve, name, cfg.sampling, adapters);
  const int port = server.bind();
  server.start();
  std::cerr << "clshard serve: listening on http://" << cfg.serve.host << ":" << port
            << " (model `" << name << "` loading; /health answers 503 until it is ready)\n";
  if (!flags.port_file.empty()) write_port_file(flags.port_file, port);

  auto deployment = std::make_unique<Deployment>(Deployment::open(cfg, stderr_load_progress()));
  server.attach(std::move(deployment),
                [](const std::string& line) { std::cerr << "clshard serve: " << line << "\n"; });
  std::cerr << "clshard serve: ready: POST /v1/completions, /v1/chat/completions; GET /v1/models, "
               "/health, /metrics\n";

  int sig = 0;
  {
    std::unique_lock lk(mu);
    cv.wait(lk, [&] { return stop_signal != 0; });
    sig = stop_signal;
  }
  std::cerr << "clshard serve: " << (sig == SIGINT ? "SIGINT" : "SIGTERM")
            << ": stopping; running requests have " << cfg.serve.shutdown_deadline_s
            << " s (serve.shutdown_deadline_s)\n";
  const size_t cancelled =
      server.shutdown(std::chrono::duration<double>(cfg.serve.shutdown_deadline_s));
  std::cerr << "clshard serve: stopped (" << cancelled
            << " request(s) cancelled at the deadline)\n";
}

}  // namespace

void add_serve_command(CLI::App& app) {
  auto* sv = app.add_subcommand("serve", "Serve a deployment over OpenAI's HTTP API");
  auto flags = std::make_shared<ServeFlags>();
  sv->add_option("deploy", flags->deploy, "deployment YAML (its serve: section)")->required();
  sv->add_option("--host", flags->host, "address to bind (overrides serve.host)");
  sv->add_option("--port", flags->port, "TCP port (overrides serve.port; 0: any free port)");
  sv->add_option("--port-file", flags->port_file,
                 "write the port to this file once listening (with --port 0)");
  sv->callback([flags] { run_server(*flags); });
}

}  // namespace clshard::cli
