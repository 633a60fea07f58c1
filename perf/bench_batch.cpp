// Batch throughput of the engine (continuous batching, sampling on the device) on the llama3-1b
// preset: output tokens/s at 1, 8, 32 and 64 concurrent requests, and the scheduler's own host
// time per step next to the device time.
// Usage: bench_batch [MODEL_DIR] [--quick]
#include <chrono>
#include <cstdio>
#include <filesystem>

#include "models/registry.h"
#include "perf/bench_util.h"
#include "runtime/device.h"
#include "runtime/device_manager.h"
#include "runtime/engine/engine.h"
#include "runtime/model.h"

using namespace clshard;
using namespace clshard::bench;

int main(int argc, char** argv) {
  CLI::App app{"Batch throughput of the engine on the llama3-1b preset: output tokens/s at 1, 8, "
               "32 and 64 concurrent requests, host vs device time per step",
               "bench_batch"};
  std::string dir_arg = ".cache/models/llama3-1b-bf16";
  bool quick = false;
  app.add_option("MODEL_DIR", dir_arg, "checkpoint directory (the llama3-1b bf16 preset is written "
                                       "there when missing)")
      ->capture_default_str();
  app.add_flag("--quick", quick, "8 output tokens per request instead of 32");
  parse_args(app, argc, argv);
  const std::filesystem::path dir = dir_arg;
  ensure_preset("llama3-1b", "bf16", dir);
  DeviceManager mgr(DeviceSelection{});
  auto model = load_model(dir, LoadOptions{{&mgr[0]}, std::nullopt});
  const uint32_t prompt_len = 32, gen = quick ? 8 : 32;
  std::printf("%s on %s: prompts of %u tokens, %u output tokens each, sampling T=0.8 top_p=0.95\n",
              dir.c_str(), mgr[0].info().name.c_str(), prompt_len, gen);
  std::printf("%8s %12s %12s %10s %14s %14s %12s\n", "requests", "output tok/s", "decode tok/s",
              "steps", "device ms/step", "host us/step", "wall s");
  for (uint32_t n : {1u, 8u, 32u, 64u}) {
    SchedulerLimits lim;
    lim.max_batch_size = n;
    lim.max_batch_input_tokens = 2048;
    lim.page_size = 128;
    lim.total_pages = n + 1;
    lim.max_length = 4096;
    model->allocate_kv_cache(lim.total_pages, lim.page_size);
    Engine engine(*model, nullptr, lim);
    for (uint32_t r = 0; r < n; ++r) {
      GenerationRequest req;
      for (uint32_t i = 0; i < prompt_len; ++i) req.prompt.push_back(int32_t(1000 + r * 97 + i * 13));
      req.max_tokens = gen;
      req.sampling.temperature = 0.8f;
      req.sampling.top_p = 0.95f;
      req.sampling.seed = r;
      engine.submit(std::move(req));
    }
    auto t0 = Clock::now();
    // The first step prefills every prompt (n x 32 tokens fit one step's budget) and samples each
    // request's first token; the rest are decode steps of n rows.
    engine.step();
    const double prefill = std::chrono::duration<double>(Clock::now() - t0).count();
    while (engine.has_work()) engine.step();
    const double wall = std::chrono::duration<double>(Clock::now() - t0).count();
    const auto& s = engine.stats();
    std::printf("%8u %12.1f %12.1f %10llu %14.2f %14.1f %12.2f\n", n, s.output_tokens / wall,
                (s.output_tokens - n) / (wall - prefill), (unsigned long long)s.steps,
                1e3 * s.device_s / s.steps, 1e6 * s.host_s / s.steps, wall);
  }
  return 0;
}
