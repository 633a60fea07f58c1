// `clshard bench`: the deployment's throughput and latency over a grid of batch sizes and
// lengths (runtime/engine/bench.h); a table on stdout, progress on stderr, records in --json.
#include "runtime/cli/bench_command.h"

#include <algorithm>
#include <chrono>
#include <fstream>
#include <iostream>
#include <memory>
#include <thread>

#include <nlohmann/json.hpp>

#include "git_commit.h"  // generated at build time (cmake/git_commit.cmake): CLSHARD_GIT_COMMIT
#include "runtime/cli/commands.h"
#include "runtime/device.h"
#include "runtime/engine/bench.h"
#include "runtime/engine/deployment.h"
#include "runtime/engine/mpi_steps.h"

namespace clshard::cli {

namespace {

struct BenchFlags {
  std::string deploy, model_dir, device_type = "any", platform;
  int device_id = 0;
  std::string batches = "1", prompt_lens = "128", gen_lens = "32";
  uint64_t seed = 0;
  bool no_warmup = false;
  std::string json_out;
  bool roofline = false;
  size_t roofline_mib = 512;
};

void run_bench_command(const BenchFlags& f) {
  BenchOptions opts;
  opts.batches = parse_size_list(f.batches, "--batch");
  opts.prompt_lens = parse_size_list(f.prompt_lens, "--prompt-len");
  opts.gen_lens = parse_size_list(f.gen_lens, "--gen-len");
  opts.seed = f.seed;
  opts.warmup = !f.no_warmup;
  if (f.deploy.empty() == f.model_dir.empty())
    throw std::runtime_error("bench: name the model with a deployment file or with --model DIR "
                             "(one of the two)");
  DeployConfig cfg;
  if (!f.deploy.empty()) {
    cfg = load_deploy_config(f.deploy);
  } else {
    cfg.source = "--model";
    cfg.model.path = f.model_dir;
    cfg.devices.platform = f.platform;
    cfg.devices.type = f.device_type;
    cfg.devices.ids = {f.device_id};
    // The KV cache sized for the longest request of the grid rather than the checkpoint's
    // context (which for Llama 3 would be 128k tokens per request).
    const uint32_t longest =
        *std::max_element(opts.prompt_lens.begin(), opts.prompt_lens.end()) +
        *std::max_element(opts.gen_lens.begin(), opts.gen_lens.end());
    cfg.model.max_length = longest;
  }
  // Start-up: reading the configs and tokenizer, mapping and uploading the weights, building (or
  // loading from the kernel cache) every program — until the deployment can take a request.
  const auto open_start = std::chrono::steady_clock::now();
  Deployment d = Deployment::open(cfg, stderr_load_progress());
  const double open_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - open_start).count();
  // Over MPI rank 0 runs the bench and hands each step to the others (runtime/engine/mpi_steps.h),
  // as `clshard run` does.
  if (d.mpi_ranks > 0 && d.mpi_rank != 0) {
    serve_steps(*d.model);
    return;
  }
  if (d.mpi_ranks > 0) d.model = std::make_unique<StepLeader>(std::move(d.model));

  nlohmann::ordered_json env = bench_environment(d, CLSHARD_GIT_COMMIT);
  env["bench"] = {{"prompts", "uniform random token ids (EOS excluded), seeded"},
                  {"seed", opts.seed},
                  {"warmup", opts.warmup ? "one run per batch size, not measured" : "none"},
                  {"eos", "ignored: every request generates gen_len tokens"}};
  env["startup_s"] = open_s;
  std::cerr << "bench: " << env["model"]["architecture"].get<std::string>() << " ("
            << cfg.model.path.string() << ") on " << d.devices->size() << " device(s): "
            << d.devices->devices().at(0)->label() << ", ready in " << open_s << " s\n";
  const std::vector<BenchResult> results = run_bench(d, opts, std::cerr);
  if (d.mpi_ranks > 0) stop_followers();
  // The roofline after the measured runs: measured before them, its buffers slowed the first
  // decode steps after it for seconds on the VM here (perf/bench_deepseek.cpp).
  Device& first = *d.devices->devices().at(0);
  if (f.roofline && !first.is_cpu()) {
    // A GPU's roofline is its own memory: the device probe in its kernel shape.
    const DeviceReadBandwidth bw = measure_device_read_bandwidth(first, f.roofline_mib << 20);
    env["read_bandwidth"] = {{"gb_s", bw.gb_s},
                             {"device", first.label()},
                             {"bytes", bw.bytes},
                             {"method", std::string("OpenCL read kernel (kernels_cl/bandwidth.cl, ") +
                                            kernel_shape_name(bw.shape) +
                                            " shape), median of 7"}};
    std::cerr << "bench: " << first.label() << " read bandwidth " << bw.gb_s << " GB/s\n";
  } else if (f.roofline) {
    const unsigned threads = std::max(1u, std::thread::hardware_concurrency());
    const HostReadBandwidth bw = measure_read_bandwidth(threads, f.roofline_mib << 20);
    const double gbs = bw.gb_s;
    env["read_bandwidth"] = {
        {"gb_s", gbs},
        {"threads", threads},
        {"bytes", bw.bytes},
        {"method", std::string("native STREAM-style read loop (sum, ") +
                       (bw.avx512 ? "AVX-512" : "16-byte vectors") + "), best of 5"}};
    std::cerr << "bench: host read bandwidth " << gbs << " GB/s (" << threads << " threads)\n";
    if (cfg.model.mmap) {
      // The same loop over the pages the weights were read from, which on a VM can be slower
      // than fresh memory (runtime/file_mapping.h; model.mmap: false then helps).
      const HostReadBandwidth own = measure_checkpoint_read_bandwidth(cfg.model.path, threads);
      env["checkpoint_read_bandwidth"] = {
          {"gb_s", own.gb_s},
          {"bytes", own.bytes},
          {"method",
           "the same loop over the checkpoint's mapped weights (model.path), best of 3 "
           "per file"}};
      std::cerr << "bench: the checkpoint's mapped weights read " << own.gb_s << " GB/s\n";
    }
  }

  std::cout << format_bench_table(results) << std::flush;
  if (!f.json_out.empty()) {
    nlohmann::ordered_json out;
    out["environment"] = env;
    out["records"] = nlohmann::ordered_json::array();
    for (const BenchResult& r : results) out["records"].push_back(bench_record(r));
    std::ofstream file(f.json_out);
    if (!file) throw std::runtime_error("bench: --json " + f.json_out + ": cannot write");
    file << out.dump(2) << "\n";
    if (!file) throw std::runtime_error("bench: --json " + f.json_out + ": write failed");
    std::cerr << "bench: wrote " << results.size() << " record(s) to " << f.json_out << "\n";
  }
}

}  // namespace

void add_bench_command(CLI::App& app) {
  auto flags = std::make_shared<BenchFlags>();
  auto* b = app.add_subcommand(
      "bench",
      "Throughput and latency of a deployment: prefill and decode tokens/s, time to first token "
      "and inter-token latency (p50/p90/p99), host time per step, speculative acceptance. Each "
      "configuration submits `batch` requests of `prompt-len` random token ids together through "
      "the engine (continuous batching, replicas, speculation), each generating exactly "
      "`gen-len` tokens. A warm-up run per batch size (shortest prompt, at most 4 tokens) comes "
      "first and is excluded from every figure (--no-warmup skips it).");
  BenchFlags& f = *flags;
  b->add_option("deploy", f.deploy, "deployment YAML (instead of --model)");
  b->add_option("--model", f.model_dir, "Hugging Face checkpoint directory");
  b->add_option("--device-type", f.device_type, "with --model: cpu | gpu | accelerator | any")
      ->capture_default_str();
  b->add_option("--platform", f.platform, "with --model: substring of the OpenCL platform name");
  b->add_option("--device", f.device_id, "with --model: index among the matching devices")
      ->capture_default_str();
  b->add_option("--batch", f.batches, "requests per configuration, a list: 1,8,32")
      ->capture_default_str();
  b->add_option("--prompt-len", f.prompt_lens, "prompt tokens, a list: 128,512")
      ->capture_default_str();
  b->add_option("--gen-len", f.gen_lens, "generated tokens per request, a list")
      ->capture_default_str();
  b->add_option("--seed", f.seed, "seed of the random prompts")->capture_default_str();
  b->add_flag("--no-warmup", f.no_warmup, "skip the warm-up runs");
  b->add_option("--json", f.json_out,
                "write {environment, records: one per configuration} to this file");
  b->add_flag("--roofline", f.roofline,
              "measure the read bandwidth into the environment record: the host's (native "
              "multi-threaded STREAM-style loop, over fresh memory and over the checkpoint's "
              "mapped weights) on a CPU device, the device's own OpenCL probe on a GPU");
  b->add_option("--roofline-mib", f.roofline_mib, "buffer size of --roofline, MiB")
      ->capture_default_str();
  b->callback([flags] { run_bench_command(*flags); });
}

}  // namespace clshard::cli
