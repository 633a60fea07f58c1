// The per-step cost of penalties and logprobs (runtime/engine/sampling.h) on the first OpenCL
// device, at batch 32 (--rows) on a Llama-3-sized vocabulary (128256) and a small one: sample_tokens alone,
// apply_penalties in place and out of place (the copy the engine makes when a penalised row also
// wants raw logprobs), compute_logprobs with 0 and 20 top tokens, and the per-step count update.
// sample_tokens and compute_logprobs run in both kernel shapes: "cpu" (sampling.cl, a work-item per
// row) and "gpu" (sampling_wg.cl, a work-group per row; forced here on a CPU device, where it is
// expected to be slower).
// The A/B rows are interleaved (each repeat times every variant once) so machine load hits them
// alike. Usage: bench_sampling [--quick] [--rows N]
#include <algorithm>
#include <cstdio>
#include <functional>
#include <random>
#include <vector>

#include "perf/bench_util.h"
#include "runtime/device_manager.h"
#include "runtime/engine/sampling.h"

using namespace clshard;
using namespace clshard::bench;

namespace {

struct Variant {
  const char* name;
  std::function<void()> run;
  std::vector<double> times;
};

void bench_vocab(Device& dev, uint32_t vocab, uint32_t rows, int reps) {
  std::mt19937 rng(vocab);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  std::vector<float> logits(size_t(rows) * vocab);
  for (float& x : logits) x = normal(rng);
  const size_t bytes = logits.size() * sizeof(float);
  cl::Mem raw = dev.alloc(bytes), work = dev.alloc(bytes), copy = dev.alloc(bytes);
  dev.write(raw, logits.data(), bytes);

  // rows requests with a 512-token prompt and 256 generated tokens each.
  PenaltyCounts counts(dev, vocab);
  std::vector<PenaltyRow> penalty_rows;
  SamplingParams p;
  p.temperature = 0.8f;
  p.frequency_penalty = 0.5f;
  p.presence_penalty = 0.5f;
  p.repetition_penalty = 1.1f;
  for (uint32_t r = 0; r < rows; ++r) {
    std::vector<int32_t> prompt(512);
    for (auto& t : prompt) t = int32_t(rng() % vocab);
    const uint32_t slot = counts.acquire(prompt);
    std::vector<std::pair<uint32_t, int32_t>> gen;
    for (int i = 0; i < 256; ++i) gen.emplace_back(slot, int32_t(rng() % vocab));
    counts.add(gen);
    penalty_rows.push_back({r, slot, p, {}});
  }
  std::vector<std::pair<uint32_t, int32_t>> step_tokens;
  for (uint32_t r = 0; r < rows; ++r) step_tokens.emplace_back(penalty_rows[r].slot, int32_t(r));
  const std::vector<SamplingParams> params(rows, p);
  std::vector<uint64_t> seeds(rows);
  for (uint32_t r = 0; r < rows; ++r) seeds[r] = 1000 + 7919 * r;
  std::vector<LogprobRow> lp0, lp20;
  for (uint32_t r = 0; r < rows; ++r) {
    lp0.push_back({r, int32_t(r), 0, 1.0f, false});
    lp20.push_back({r, int32_t(r), 20, 1.0f, false});
  }
  auto restore = [&] {
    cl::check(clEnqueueCopyBuffer(dev.queue(), raw.get(), work.get(), 0, 0, bytes, 0, nullptr,
                                  nullptr),
              "clEnqueueCopyBuffer");
    dev.finish();
  };

  SamplingParams filtered = p;
  filtered.top_k = 50;
  filtered.top_p = 0.9f;
  const std::vector<SamplingParams> filtered_params(rows, filtered);
  // Runs f with the device in `shape`.
  auto in_shape = [&dev](KernelShape shape, std::function<void()> f) {
    return [&dev, shape, f] {
      const KernelShape saved = dev.kernel_shape();
      dev.set_kernel_shape(shape);
      f();
      dev.set_kernel_shape(saved);
    };
  };

  std::vector<Variant> v;
  for (KernelShape shape : {KernelShape::Chunks, KernelShape::WorkGroups}) {
    const bool gpu = shape == KernelShape::WorkGroups;
    v.push_back({gpu ? "sample_tokens T=0.8 [gpu]" : "sample_tokens T=0.8 [cpu]",
                 in_shape(shape, [&] { sample_tokens(dev, raw, rows, vocab, params, seeds); }),
                 {}});
    v.push_back({gpu ? "sample_tokens k50 p0.9 [gpu]" : "sample_tokens k50 p0.9 [cpu]",
                 in_shape(shape,
                          [&] { sample_tokens(dev, raw, rows, vocab, filtered_params, seeds); }),
                 {}});
    v.push_back({gpu ? "compute_logprobs top 20 [gpu]" : "compute_logprobs top 20 [cpu]",
                 in_shape(shape, [&] { compute_logprobs(dev, raw, vocab, lp20); }), {}});
  }
  v.push_back({"apply_penalties in place", [&] {
                 apply_penalties(counts, work, work, rows, penalty_rows);
                 dev.finish();
               }, {}});
  v.push_back({"apply_penalties to a copy", [&] {
                 apply_penalties(counts, raw, copy, rows, penalty_rows);
                 dev.finish();
               }, {}});
  v.push_back({"compute_logprobs top 0", [&] { compute_logprobs(dev, raw, vocab, lp0); }, {}});
  v.push_back({"counts add (a token a row)", [&] {
                 counts.add(step_tokens);
                 dev.finish();
               }, {}});
  for (auto& x : v) {  // warm-up, kernel builds (the first call of each kernel)
    const auto t0 = Clock::now();
    x.run();
    if (vocab == 2048u) std::printf("# first call of %-30s %8.3f s\n", x.name, seconds_since(t0));
  }
  for (int i = 0; i < reps; ++i)
    for (auto& x : v) {
      restore();  // in place keeps penalising the same logits, not its own output
      const auto t0 = Clock::now();
      x.run();
      x.times.push_back(seconds_since(t0));
    }
  for (auto& x : v) {
    std::sort(x.times.begin(), x.times.end());
    std::printf("%-32s %8u %12.3f\n", x.name, vocab, x.times[x.times.size() / 2] * 1e3);
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"The per-step cost of sampling, penalties and logprobs on the first OpenCL device "
               "at batch 32 (--rows), vocab 2048 and 128256, both kernel shapes",
               "bench_sampling"};
  bool quick = false;
  uint32_t rows = 32;
  app.add_flag("--quick", quick, "3 interleaved repeats instead of 9");
  app.add_option("--rows", rows, "rows (requests) per step")->capture_default_str()->check(
      CLI::Range(1u, 1024u));
  parse_args(app, argc, argv);
  DeviceManager mgr(DeviceSelection{});
  Device& dev = mgr[0];
  print_device(dev);
  const int reps = quick ? 3 : 9;
  std::printf("\nbatch %u rows; median of %d interleaved repeats\n", rows, reps);
  std::printf("%-32s %8s %12s\n", "step part", "vocab", "time (ms)");
  for (uint32_t vocab : {2048u, 128256u}) bench_vocab(dev, vocab, rows, reps);
  return 0;
}
