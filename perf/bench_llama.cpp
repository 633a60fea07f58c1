// End-to-end Llama 3 speed on the first OpenCL device: decode tokens/s at batch 1 and prefill
// tokens/s for a 512-token prompt (median of 3), with decode as a fraction of the bandwidth
// roofline (weight bytes read per token / measured bandwidth) and prefill's GFLOP/s in the linear
// layers as a fraction of the CPU's register-only f32 FMA and bf16 dot-product peaks.
// Usage: bench_llama [MODEL_DIR] [--compute-dtype f32|bf16] [--prefill-only]
//   (MODEL_DIR default: .cache/models/llama3-1b-bf16, made if missing; --compute-dtype as the
//   deployment's model.compute_dtype, default f32)
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include "models/registry.h"
#include "perf/bench_util.h"
#include "runtime/device.h"
#include "runtime/device_manager.h"
#include "runtime/engine/generation.h"
#include "runtime/model.h"
#include "runtime/safetensors.h"

using namespace clshard;
using namespace clshard::bench;


int main(int argc, char** argv) {
  std::filesystem::path dir = ".cache/models/llama3-1b-bf16";
  LoadOptions opts;
  bool prefill_only = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--compute-dtype") == 0 && i + 1 < argc) {
      const std::string v = argv[++i];
      if (v != "f32" && v != "bf16") {
        std::fprintf(stderr, "--compute-dtype: expected f32 or bf16, got '%s'\n", v.c_str());
        return 2;
      }
      opts.compute_dtype = v == "bf16" ? ComputeDType::BF16 : ComputeDType::F32;
    } else if (std::strcmp(argv[i], "--prefill-only") == 0) {
      prefill_only = true;
    } else if (argv[i][0] == '-') {
      std::fprintf(stderr, "usage: bench_llama [MODEL_DIR] [--compute-dtype f32|bf16] "
                           "[--prefill-only]\n");
      return 2;
    } else {
      dir = argv[i];
    }
  }
  ensure_preset("llama3-1b", "bf16", dir);
  DeviceManager mgr(DeviceSelection{});
  Device& dev = mgr[0];
  opts.devices = {&dev};
  auto model = load_model(dir, opts);
  const auto& info = model->info();
  WeightStore store(dir);
  // Bytes a decode step reads: every weight once; the embedding table only for its lookup row
  // unless it doubles as the lm_head (tied), which reads it whole.
  const auto& emb = store.get("model.embed_tokens.weight");
  const bool tied = !store.has("lm_head.weight");
  const double bytes_per_token = double(store.total_bytes()) - (tied ? 0.0 : double(emb.bytes));
  std::printf("model %s: %u layers, hidden %u, vocab %u, %.2f GB of weights\n", dir.c_str(),
              info.num_layers, info.hidden_size, info.vocab_size, store.total_bytes() / 1e9);
  print_device(dev);
  std::printf("compute dtype: %s\n", compute_dtype_name(opts.compute_dtype));
  const ComputePeaks peaks = measure_compute_peaks();
  if (!prefill_only) {
    const double bw = measure_roofline(dev).best();

    // Decode at batch 1: prefill 16 tokens, then time 32 single-token steps.
    std::vector<int32_t> prompt(16);
    for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = int32_t(100 + i * 7);
    greedy_generate(*model, {prompt}, 4, 128);  // warm-up: kernel builds
    auto t0 = Clock::now();
    greedy_generate(*model, {prompt}, 1, 128);
    const double prefill16 = seconds_since(t0);
    t0 = Clock::now();
    const uint32_t n = 33;
    greedy_generate(*model, {prompt}, n, 128);
    const double per_token = (seconds_since(t0) - prefill16) / (n - 1);
    const double roofline_s = bytes_per_token / (bw * 1e9);
    std::printf("\ndecode, batch 1: %.1f ms/token, %.2f tokens/s; roofline %.1f ms/token "
                "(%.2f GB read per token) -> %.0f%% of roofline\n",
                per_token * 1e3, 1.0 / per_token, roofline_s * 1e3, bytes_per_token / 1e9,
                100.0 * roofline_s / per_token);
  }

  // Prefill of a 512-token prompt (one step, last-token logits), median of 3 after a warm-up.
  std::vector<int32_t> long_prompt(512);
  for (size_t i = 0; i < long_prompt.size(); ++i) long_prompt[i] = int32_t((i * 31) % 120000 + 5);
  const double tp = median_time(3, [&] { greedy_generate(*model, {long_prompt}, 1, 128); });
  // The linear layers' multiply-adds: every weight but the embedding table (tied: the lm_head,
  // run for the last token only, is left out of both).
  const double flops = 2.0 * 512 * (double(store.total_bytes()) / 2 - double(emb.numel()));
  const double gflops = flops / tp / 1e9;
  std::printf("prefill, 512 tokens: %.2f s, %.1f tokens/s, %.1f GFLOP/s in the linear layers",
              tp, 512 / tp, gflops);
  if (peaks.f32_fma_gflops > 0)
    std::printf(" = %.0f%% of the f32 FMA peak", 100 * gflops / peaks.f32_fma_gflops);
  if (peaks.bf16_dot_gflops > 0)
    std::printf(", %.0f%% of the bf16 dot-product peak", 100 * gflops / peaks.bf16_dot_gflops);
  std::printf("\n");
  return 0;
}
