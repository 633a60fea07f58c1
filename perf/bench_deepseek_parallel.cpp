// DeepSeek-V3 data-parallel attention + expert-parallel MoE (MAX's DP_EP mode) on CPU
// sub-devices: batched decode tokens/s of the dsv3-mini preset on 1 sub-device vs 2 (the CPU split
// in two, one core each; the single-device run uses the first of the two, so both runs get one core
// per device), the 2-device speed-up and its efficiency (speed-up / 2), and the time the host spent
// waiting in collectives per step (Communicator::stats().host_wait_seconds) as a share of the
// step, with the bytes the collectives moved per step.
//
// Decode steps run straight against a zero-filled MLA cache at `context` cached tokens per
// request: the cache's values do not change the work, so no prefill is needed to time decode.
//
// Usage: bench_deepseek_parallel [--dir D] [--dtype bf16] [--batches 16,64] [--context C]
//                                [--steps N]
//   D: where dsv3-mini-<dtype> lives (written with make-model's preset writer when missing;
//      default .cache/models), C: cached tokens per request (64), N: timed decode steps (4).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <limits>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "models/deepseek_v3/model.h"
#include "models/registry.h"
#include "parallel/collectives.h"
#include "perf/bench_util.h"
#include "runtime/device.h"
#include "runtime/device_manager.h"
#include "runtime/model.h"

using namespace clshard;
using namespace clshard::bench;

namespace {

struct Result {
  double step_s = 0, tokens_per_s = 0, wait_share = 0, bytes_per_step = 0, phases_per_step = 0;
};

Result run(deepseek_v3::DeepseekV3Model& model, uint32_t batch, uint32_t context, uint32_t steps) {
  const uint32_t R = model.num_replicas(), page = 64;
  const uint32_t ppr = (context + steps + 2 + page - 1) / page;
  const uint32_t per_replica = (batch + R - 1) / R;
  model.allocate_kv_cache(per_replica * ppr, page);
  std::mt19937 rng(7);
  const uint32_t V = model.info().vocab_size;
  // Warm-up: kernel builds for these shapes, buffer pools.
  model.forward(replica_decode_step(batch, R, context, ppr, model.kv_num_pages(), V, rng))
      .read_logits();
  const parallel::Communicator* comm = model.communicator();
  const auto before = comm ? comm->stats() : parallel::Communicator::Stats{};
  const auto t0 = Clock::now();
  for (uint32_t i = 0; i < steps; ++i)
    model.forward(replica_decode_step(batch, R, context + 1 + i, ppr, model.kv_num_pages(), V, rng))
        .read_logits();
  const double t = seconds_since(t0);
  Result res;
  res.step_s = t / steps;
  res.tokens_per_s = double(batch) * steps / t;
  if (comm) {
    const auto& after = comm->stats();
    res.wait_share = (after.host_wait_seconds - before.host_wait_seconds) / t;
    res.bytes_per_step = double(after.bytes_moved - before.bytes_moved) / steps;
    res.phases_per_step = double(after.phases - before.phases) / steps;
  }
  return res;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"DeepSeek-V3 DP attention + EP MoE on CPU sub-devices: dsv3-mini batched decode "
               "tokens/s on 1 vs 2 sub-devices, speed-up and collective time per step",
               "bench_deepseek_parallel"};
  std::string root_arg = ".cache/models";
  std::string dtype = "bf16";
  std::vector<uint32_t> sizes = {16, 64};
  uint32_t context = 64, steps = 4;
  app.add_option("--dir", root_arg, "where dsv3-mini-<dtype> lives (written when missing)")
      ->capture_default_str();
  app.add_option("--dtype", dtype, "checkpoint dtype")->capture_default_str();
  app.add_option("--batches", sizes, "comma-separated batch sizes")
      ->delimiter(',')
      ->capture_default_str();
  app.add_option("--context", context, "cached tokens per request")->capture_default_str();
  app.add_option("--steps", steps, "timed decode steps")
      ->capture_default_str()
      ->check(CLI::Range(uint32_t(1), std::numeric_limits<uint32_t>::max()));
  parse_args(app, argc, argv);
  const std::filesystem::path root = root_arg;
  const auto dir = ensure_preset("dsv3-mini", dtype, root / ("dsv3-mini-" + dtype));
  DeviceSelection sel;
  sel.type = "cpu";
  sel.split = "2";
  DeviceManager mgr(sel);
  std::printf("devices: 2 sub-devices of %s, %u compute unit(s) each\n",
              mgr[0].info().name.c_str(), mgr[0].info().compute_units);
  std::printf("dsv3-mini %s, decode at context %u, %u timed steps per figure\n", dtype.c_str(),
              context, steps);

  LoadOptions one;
  one.devices = {&mgr[0]};
  LoadOptions two;
  two.devices = mgr.devices();
  two.data_parallel_degree = two.expert_parallel_degree = 2;
  std::vector<Result> r1, r2;
  {
    deepseek_v3::DeepseekV3Model m(dir, one);
    for (uint32_t b : sizes) r1.push_back(run(m, b, context, steps));
  }
  {
    deepseek_v3::DeepseekV3Model m(dir, two);
    for (uint32_t b : sizes) r2.push_back(run(m, b, context, steps));
  }
  std::printf("%6s %12s %12s %12s %12s %9s %11s %12s %10s\n", "batch", "1 dev tok/s",
              "2 dev tok/s", "1 dev ms", "2 dev ms", "speed-up", "efficiency", "coll. wait",
              "coll. MB");
  std::printf("%6s %12s %12s %12s %12s %9s %11s %12s %10s\n", "", "", "", "per step",
              "per step", "", "", "% of step", "per step");
  for (size_t i = 0; i < sizes.size(); ++i) {
    const double s = r2[i].tokens_per_s / r1[i].tokens_per_s;
    std::printf("%6u %12.2f %12.2f %12.1f %12.1f %8.2fx %10.0f%% %11.1f%% %10.2f\n", sizes[i],
                r1[i].tokens_per_s, r2[i].tokens_per_s, r1[i].step_s * 1e3, r2[i].step_s * 1e3,
                s, 100.0 * s / 2, 100.0 * r2[i].wait_share, r2[i].bytes_per_step / 1e6);
  }
  std::printf("(collectives per 2-device step: %.0f phases; the wait is host time blocked on "
              "peers' signals, which includes a peer still computing)\n",
              r2.empty() ? 0.0 : r2.back().phases_per_step);
  return 0;
}
