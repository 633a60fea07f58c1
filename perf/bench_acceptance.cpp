// Speculative-decoding acceptance (runtime/engine/acceptance.h) on the first OpenCL device: one launch
// for 16 requests x 5 verification rows (K = 4 drafts), at a small and a Llama-3-sized
// vocabulary, with every draft accepted (the most work: all 80 rows are read), next to
// sample_tokens over the same 80 rows (one work-item or, in the GPU shape, one work-group per row,
// so 5x the parallelism), in the device's own kernel shape.
// Usage: bench_acceptance [--quick]
#include <cstdio>
#include <random>
#include <vector>

#include "perf/bench_util.h"
#include "runtime/engine/acceptance.h"
#include "runtime/device_manager.h"
#include "runtime/engine/sampling.h"

using namespace clshard;
using namespace clshard::bench;

namespace {

constexpr uint32_t kRequests = 16, kDrafts = 4, kRows = kRequests * (kDrafts + 1);

struct Mode {
  const char* name;
  SamplingParams params;
  bool thinking;
};
const Mode kModes[] = {
    {"greedy", {.temperature = 0.0f}, false},
    {"T=1", {.temperature = 1.0f}, false},
    {"T=0.8 top_k=40 top_p=0.9", {.temperature = 0.8f, .top_k = 40, .top_p = 0.9f}, false},
    {"relaxed (thinking), greedy bonus", {.temperature = 0.0f}, true},
};

// One table row per mode at this vocabulary size.
void bench_vocab(Device& dev, uint32_t vocab, int reps) {
  const uint32_t B = kRequests, K = kDrafts, rows = kRows;
  std::mt19937 rng(vocab);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  std::vector<float> logits(size_t(rows) * vocab);
  for (float& x : logits) x = normal(rng);
  cl::Mem buf = dev.alloc(logits.size() * sizeof(float));
  dev.write(buf, logits.data(), logits.size() * sizeof(float));
  std::vector<uint32_t> logit_offsets(B + 1), draft_offsets(B + 1);
  for (uint32_t b = 0; b <= B; ++b) {
    logit_offsets[b] = b * (K + 1);
    draft_offsets[b] = b * K;
  }
  std::vector<uint64_t> seeds(B), row_seeds(rows);
  for (uint32_t b = 0; b < B; ++b) {
    seeds[b] = 1000 + 7919 * b;
    for (uint32_t i = 0; i <= K; ++i) row_seeds[b * (K + 1) + i] = seeds[b] + i;
  }
  for (const Mode& m : kModes) {
    // Drafts = what the rule accepts: plain sampling's draws at each position (the argmax for
    // the relaxed rows), so every request verifies all K drafts and draws the bonus.
    const std::vector<SamplingParams> row_params(
        rows, m.thinking ? SamplingParams{.temperature = 0.0f} : m.params);
    const auto plain = sample_tokens(dev, buf, rows, vocab, row_params, row_seeds);
    std::vector<int32_t> drafts(B * K);
    for (uint32_t b = 0; b < B; ++b)
      for (uint32_t i = 0; i < K; ++i) drafts[b * K + i] = plain[b * (K + 1) + i];
    const std::vector<SamplingParams> params(B, m.params);
    const std::vector<uint8_t> thinking(B, m.thinking ? 1 : 0);
    uint32_t accepted = 0;
    const double t_accept = median_time(reps, [&] {
      const auto r = accept_drafts(dev, buf, vocab, logit_offsets, drafts, draft_offsets, params,
                                   seeds, thinking);
      accepted = 0;
      for (uint32_t a : r.num_accepted) accepted += a;
    });
    const double t_sample =
        median_time(reps, [&] { sample_tokens(dev, buf, rows, vocab, row_params, row_seeds); });
    std::printf("%-34s %8u %14.3f %14.3f%s\n", m.name, vocab, t_accept * 1e3, t_sample * 1e3,
                accepted == B * K ? "" : "  (not all accepted!)");
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Speculative-decoding acceptance on the first OpenCL device: 16 requests x 5 "
               "verification rows at vocab 2048 and 128256, next to sampling the same rows",
               "bench_acceptance"};
  bool quick = false;
  app.add_flag("--quick", quick, "3 repeats instead of 9");
  parse_args(app, argc, argv);
  DeviceManager mgr(DeviceSelection{});
  Device& dev = mgr[0];
  print_device(dev);
  const int reps = quick ? 3 : 9;
  std::printf("\n%u requests x %u verification rows, all drafts accepted; median of %d\n",
              kRequests, kDrafts + 1, reps);
  std::printf("%-34s %8s %14s %14s\n", "mode", "vocab", "accept (ms)", "sample (ms)");
  for (uint32_t vocab : {2048u, 128256u}) bench_vocab(dev, vocab, reps);
  return 0;
}
