// The server's throughput next to the batch job's for the same requests: requests/s and output
// tokens/s at 1, 8, 32 and 64 concurrent streaming clients on a make-model preset (--preset, default llama3-tiny; random
// weights; every request runs max_tokens tokens with ignore_eos). The batch job runs the same
// requests with max_batch_size = the number of clients; the server's engine has the same limit
// and each client streams its requests one after another (POST /v1/completions, stream: true).
// The difference is what the HTTP layer costs: parsing, the engine thread's hand-over, SSE.
//
// Each figure is the median of --repeat runs (default 3); the load average is printed beside them
// (other work on the machine moves these figures a lot). The batch job fdatasyncs every record
// (its durability), which the server does not do.
//
// usage: bench_server [--requests-per-client N] [--max-tokens N] [--repeat N] [--out DIR]
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <httplib.h>

#include <nlohmann/json.hpp>

#include "models/registry.h"
#include "perf/bench_util.h"
#include "runtime/engine/batch_job.h"
#include "runtime/engine/deployment.h"
#include "runtime/serve/http_server.h"

namespace {

using namespace clshard;
namespace fs = std::filesystem;
using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

DeployConfig config(const fs::path& model, uint32_t clients) {
  const std::string batch = std::to_string(clients);
  return parse_deploy_config("model: {path: " + model.string() +
                                 "}\n"
                                 "devices: {type: cpu}\n"
                                 "kv_cache: {page_size: 16, pages: 1024}\n"
                                 "batch: {max_batch_size: " + batch +
                                 ", max_batch_input_tokens: 2048}\n"
                                 "sampling: {temperature: 1.0, max_tokens: 16}\n"
                                 "serve: {port: 0, max_waiting: 256}\n",
                             "bench-server.yaml");
}

// The make-model preset under test (--preset), also the model name the server answers to.
std::string g_preset = "llama3-tiny";

json request_body(size_t i, int max_tokens) {
  return {{"model", g_preset}, {"prompt", "request " + std::to_string(i) + " says"},
          {"max_tokens", max_tokens},  {"seed", i},
          {"ignore_eos", true},        {"temperature", 1.0}};
}

struct Figures {
  double wall_s = 0;
  uint64_t requests = 0, tokens = 0;
};

// The run of median wall time.
Figures median(std::vector<Figures> runs) {
  std::sort(runs.begin(), runs.end(),
            [](const Figures& a, const Figures& b) { return a.wall_s < b.wall_s; });
  return runs[runs.size() / 2];
}

Figures run_batch(const fs::path& model, const fs::path& dir, uint32_t clients, size_t n,
                  int max_tokens) {
  DeployConfig cfg = config(model, clients);
  cfg.job.input = dir / "in.jsonl";
  cfg.job.output = dir / "out.jsonl";
  {
    std::ofstream in(cfg.job.input);
    for (size_t i = 0; i < n; ++i) {
      json line = request_body(i, max_tokens);
      line.erase("model");
      line["id"] = i;
      in << line.dump() << "\n";
    }
  }
  fs::remove(cfg.job.output);
  Deployment d = Deployment::open(cfg);
  std::ostringstream log;
  const auto t0 = Clock::now();
  const BatchJobSummary s = run_batch_job(d, log);
  Figures f;
  f.wall_s = seconds_since(t0);
  f.requests = s.requests - s.errors;
  f.tokens = s.completion_tokens;
  return f;
}

Figures run_server(const fs::path& model, uint32_t clients, size_t n, int max_tokens) {
  DeployConfig cfg = config(model, clients);
  std::vector<std::string> adapters;
  serve::OpenAiServer server(cfg.serve, g_preset, cfg.sampling, adapters);
  const int port = server.bind();
  server.start();
  server.attach(std::make_unique<Deployment>(Deployment::open(cfg)));
  std::atomic<size_t> next{0};
  std::atomic<uint64_t> tokens{0}, ok{0};
  const auto t0 = Clock::now();
  std::vector<std::thread> threads;
  for (uint32_t c = 0; c < clients; ++c)
    threads.emplace_back([&] {
      httplib::Client cli("127.0.0.1", port);
      cli.set_read_timeout(300, 0);
      for (size_t i; (i = next++) < n;) {
        json body = request_body(i, max_tokens);
        body["stream"] = true;
        body["stream_options"] = {{"include_usage", true}};
        std::string all;
        httplib::Request req;
        req.method = "POST";
        req.path = "/v1/completions";
        req.body = body.dump();
        req.set_header("Content-Type", "application/json");
        req.content_receiver = [&](const char* data, size_t len, uint64_t, uint64_t) {
          all.append(data, len);
          return true;
        };
        auto r = cli.send(req);
        if (!r || r->status != 200) continue;
        // The usage chunk is the last before [DONE].
        const size_t at = all.rfind("\"usage\":{");
        if (at == std::string::npos) continue;
        const size_t start = all.rfind("data: ", at) + 6;
        const json usage = json::parse(all.substr(start, all.find('\n', start) - start))["usage"];
        tokens += usage["completion_tokens"].get<uint64_t>();
        ++ok;
      }
    });
  for (auto& t : threads) t.join();
  Figures f;
  f.wall_s = seconds_since(t0);
  f.requests = ok;
  f.tokens = tokens;
  server.shutdown(std::chrono::seconds(5));
  return f;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"The server's throughput next to the batch job's for the same requests at 1, 8, 32 "
               "and 64 concurrent streaming clients on a make-model preset (random weights)",
               "bench_server"};
  size_t per_client = 2;
  int max_tokens = 32;
  int repeat = 3;
  std::string out_arg = (fs::temp_directory_path() / "clshard-bench-server").string();
  app.add_option("--requests-per-client", per_client, "requests each client streams")
      ->capture_default_str();
  app.add_option("--max-tokens", max_tokens, "output tokens per request")->capture_default_str();
  app.add_option("--repeat", repeat, "runs per figure (the median is printed; at least 1)")
      ->capture_default_str();
  app.add_option("--out", out_arg, "working directory (checkpoint, batch files)")
      ->capture_default_str();
  app.add_option("--preset", g_preset, "make-model preset (llama3-tiny|llama-100m)")
      ->capture_default_str();
  bench::parse_args(app, argc, argv);
  repeat = std::max(1, repeat);
  const fs::path out = out_arg;
  fs::create_directories(out);
  const fs::path model = out / g_preset;
  if (!fs::exists(model / "config.json")) make_model(g_preset, model, MakeModelOptions{});
  std::printf("%s (random weights) on the CPU device, %zu requests per client, "
              "%d output tokens each, streaming clients on loopback\n",
              g_preset.c_str(), per_client, max_tokens);
  std::printf("%8s %9s | %10s %12s | %10s %12s | %9s\n", "clients", "requests", "batch req/s",
              "batch tok/s", "serve req/s", "serve tok/s", "HTTP cost");
  // A warm-up run builds the kernels (cached for the rest).
  run_batch(model, out, 1, 1, 4);
  for (uint32_t clients : {1u, 8u, 32u, 64u}) {
    const size_t n = clients * per_client;
    std::vector<Figures> bs, ss;
    // Kernels are built per batch shape: one unmeasured run at this size builds them first.
    run_batch(model, out, clients, clients, 2);
    for (int r = 0; r < repeat; ++r) {
      bs.push_back(run_batch(model, out, clients, n, max_tokens));
      ss.push_back(run_server(model, clients, n, max_tokens));
    }
    const Figures b = median(bs), s = median(ss);
    const double btok = double(b.tokens) / b.wall_s, stok = double(s.tokens) / s.wall_s;
    std::printf("%8u %9zu | %10.2f %12.1f | %10.2f %12.1f | %8.1f%%%s\n", clients, n,
                double(b.requests) / b.wall_s, btok, double(s.requests) / s.wall_s, stok,
                100.0 * (1.0 - stok / btok),
                s.requests == n && b.requests == n ? "" : "  (some requests failed)");
  }
  double load[3] = {0, 0, 0};
  if (getloadavg(load, 3) == 3) std::printf("load average %.2f %.2f %.2f\n", load[0], load[1], load[2]);
  return 0;
}
