// End-to-end Llama 3 speed on the first OpenCL device: decode tokens/s at batch 1 and prefill
// tokens/s for a 512-token prompt (median of 3), with decode as a fraction of the bandwidth
// roofline (weight bytes read per token / measured bandwidth) and prefill's GFLOP/s in the linear
// layers as a fraction of the CPU's register-only f32 FMA and bf16 dot-product peaks.
// The batch-1 decode is timed in rounds in turn with a pass of a native read loop
// (bench_util.h's roofline_in_turn): on a shared machine the bandwidth moves within seconds.
// Usage: bench_llama [MODEL_DIR] [--compute-dtype f32|bf16] [--prefill-only]
//                    [--roofline-rounds R] [--tuning-ab FIELD=VALUE[,...] [--ab-rounds R]]
//   (MODEL_DIR default: .cache/models/llama3-1b-bf16, made if missing; --compute-dtype as the
//   deployment's model.compute_dtype, default f32; --tuning-ab times the batch-1 decode, a batch
//   of 8 and the 512-token prefill also with one or more tuning fields changed, the two in turn R
//   times: bench_util.h's TuningAB)
#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <optional>
#include <vector>

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
  CLI::App app{"End-to-end Llama 3 speed on the first OpenCL device: decode tokens/s at batch 1 "
               "against the bandwidth roofline, prefill tokens/s and GFLOP/s for a 512-token prompt",
               "bench_llama"};
  std::string dir_arg = ".cache/models/llama3-1b-bf16";
  std::string compute_dtype = "f32", kv_dtype = "f32";
  bool prefill_only = false;
  uint32_t context = 0;  // --context N: the phase split also decodes after N cached positions
  app.add_option("MODEL_DIR", dir_arg, "checkpoint directory (the llama3-1b bf16 preset is written "
                                       "there when missing)")
      ->capture_default_str();
  add_compute_dtype_option(app, compute_dtype);
  app.add_flag("--prefill-only", prefill_only, "time prefill only");
  app.add_option("--kv-dtype", kv_dtype, "the KV cache's dtype")
      ->capture_default_str()
      ->check(CLI::IsMember({"f32", "bf16"}));
  app.add_option("--context", context, "the phase split also decodes after N cached positions")
      ->capture_default_str();
  bool no_mmap = false;
  add_no_mmap_flag(app, no_mmap);
  int roofline_rounds = 7;
  add_roofline_rounds_option(app, roofline_rounds);
  TuningABOptions ab_opts;
  add_tuning_ab_options(app, ab_opts);
  parse_args(app, argc, argv);
  std::optional<TuningAB> ab = ab_opts.parse();
  const int ab_rounds = ab_opts.rounds;
  const std::filesystem::path dir = dir_arg;
  LoadOptions opts;
  opts.compute_dtype = compute_dtype == "bf16" ? ComputeDType::BF16 : ComputeDType::F32;
  opts.kv_cache_dtype = kv_dtype == "bf16" ? DType::BF16 : DType::F32;
  if (no_mmap) opts.weight_memory = WeightMemory::Copied;
  ensure_preset("llama3-1b", "bf16", dir);
  DeviceManager mgr(DeviceSelection{});
  Device& dev = mgr[0];
  opts.devices = {&dev};
  auto t_load = Clock::now();
  auto model = load_model(dir, opts);
  const double load_s = seconds_since(t_load);
  const auto& info = model->info();
  // Bytes a decode step reads: every weight once; the embedding table only for its lookup row
  // unless it doubles as the lm_head (tied), which reads it whole. The store is closed at once:
  // a mapping of its own would count in the huge pages reported below.
  double weight_bytes = 0, bytes_per_token = 0, embedding_numel = 0;
  {
    WeightStore store(dir);
    const auto& emb = store.get("model.embed_tokens.weight");
    const bool tied = !store.has("lm_head.weight");
    weight_bytes = double(store.total_bytes());
    bytes_per_token = weight_bytes - (tied ? 0.0 : double(emb.bytes));
    embedding_numel = double(emb.numel());
  }
  std::printf("model %s: %u layers, hidden %u, vocab %u, %.2f GB of weights\n", dir.c_str(),
              info.num_layers, info.hidden_size, info.vocab_size, weight_bytes / 1e9);
  print_device(dev);
  std::printf("compute dtype: %s\n", compute_dtype_name(opts.compute_dtype));
  if (!prefill_only) {
    // Decode at batch 1: prefill 16 tokens, then time 32 single-token steps.
    std::vector<int32_t> prompt(16);
    for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = int32_t(100 + i * 7);
    // Start-up: the load above, then the first token of a 16-token prompt (kernels from the
    // cache, or built on a cold one; the weights' first touch).
    auto t0 = Clock::now();
    greedy_generate(*model, {prompt}, 1, 128);
    const double first_token_s = seconds_since(t0);
    std::printf(
        "start-up: load %.2f s, first token of a 16-token prompt %.2f s; ready to decode "
        "%.2f s after the load began; %.0f MB of file mappings in huge pages\n",
        load_s, first_token_s, load_s + first_token_s, file_huge_mapped_mb());
    greedy_generate(*model, {prompt}, 4, 128);  // warm-up
    t0 = Clock::now();
    greedy_generate(*model, {prompt}, 1, 128);
    const double prefill16 = seconds_since(t0);
    t0 = Clock::now();
    const uint32_t n = 33;
    greedy_generate(*model, {prompt}, n, 128);
    const double per_token = (seconds_since(t0) - prefill16) / (n - 1);
    if (ab) {
      // The same 33-token generation less the 16-token prefill timed above (prefill's tiles are
      // not one-row tiles; what a decode field changes is the decode).
      run_tuning_ab(dev, *ab, ab_rounds, [&] {
        const auto ts = Clock::now();
        greedy_generate(*model, {prompt}, n, 128);
        return (seconds_since(ts) - prefill16) / (n - 1);
      });
      print_tuning_ab("decode", *ab, ab_rounds, 1e3, "ms per token");
      // Eight requests of 16 tokens, 17 tokens each: one prefill step of 128 tokens and 16 decode
      // steps of 8 rows. The figure is the decode steps' time: the generation's less a prefill
      // alone (one token each) timed under the same tuning in the same round.
      const std::vector<std::vector<int32_t>> prompts(8, prompt);
      run_tuning_ab(dev, *ab, ab_rounds, [&] {
        auto ts = Clock::now();
        greedy_generate(*model, prompts, 1, 128);
        const double prefill = seconds_since(ts);
        ts = Clock::now();
        greedy_generate(*model, prompts, 17, 128);
        return (seconds_since(ts) - prefill) / 16;
      });
      print_tuning_ab("batch 8 decode (8 x 16-token prompts, 16 steps after the prefill)", *ab,
                      ab_rounds, 1e3, "ms per step");
    }

  // Where a decode step's wall time goes on the host side: the step driven by hand at batch 1
    // (the same inputs greedy_generate builds), split into forward() (uploads and kernel enqueues,
    // the host time), the wait for the queue, and the logits read plus argmax. After the 16-token
    // prompt, and with --context N after N cached positions.
    auto phases = [&](uint32_t cached) {
      const uint32_t page_size = 128, steps = 32;
      const uint32_t pages = (cached + uint32_t(prompt.size()) + steps + 1 + page_size - 1) / page_size;
      model->allocate_kv_cache(pages, page_size);
      StepInputs in;
      in.tokens = cached ? std::vector<int32_t>{prompt[0]} : prompt;
      in.input_row_offsets = {0, uint32_t(in.tokens.size())};
      in.cache_lengths = {cached};
      for (uint32_t p = 0; p < pages; ++p) in.lookup_table.push_back(p);
      in.pages_per_row = pages;
      std::vector<double> t_enqueue, t_wait, t_read;
      for (uint32_t s = 0; s < steps + 1; ++s) {
        auto t1 = Clock::now();
        StepOutputs out = model->forward(in);
        const double e = seconds_since(t1);
        t1 = Clock::now();
        out.device->finish();
        const double w = seconds_since(t1);
        t1 = Clock::now();
        const std::vector<float> logits = out.read_logits();
        const int32_t next = argmax(logits.data(), out.vocab);
        const double r = seconds_since(t1);
        in.cache_lengths[0] += uint32_t(in.tokens.size());
        in.tokens = {next};
        in.input_row_offsets = {0, 1};
        if (s == 0) continue;  // the prompt's (or first) step
        t_enqueue.push_back(e);
        t_wait.push_back(w);
        t_read.push_back(r);
      }
      auto median = [](std::vector<double> v) {
        std::sort(v.begin(), v.end());
        return v[v.size() / 2];
      };
      // The medians hide slow steps; the mean and the slowest show them.
      std::vector<double> whole;
      for (size_t i = 0; i < t_wait.size(); ++i)
        whole.push_back(t_enqueue[i] + t_wait[i] + t_read[i]);
      double mean = 0;
      for (double w : whole) mean += w / double(whole.size());
      return std::array<double, 6>{double(cached ? cached : uint32_t(prompt.size())),
                                   median(t_enqueue),
                                   median(t_wait),
                                   median(t_read),
                                   mean,
                                   *std::max_element(whole.begin(), whole.end())};
    };
    std::vector<std::array<double, 6>> split = {phases(0)};
    if (context > 0) split.push_back(phases(context));

    // The decode's figures are its rounds in turn with the read loop (bench_util.h's
    // roofline_in_turn), against which the phases too. Then both read loops over fresh memory,
    // for the record: measured before, fresh buffers slowed the next decode steps on the VM here
    // for seconds (bench_deepseek.cpp).
    const RooflineInTurn roof = roofline_in_turn(dev, roofline_rounds, bytes_per_token, [&] {
      const auto ts = Clock::now();
      greedy_generate(*model, {prompt}, n, 128);
      return (seconds_since(ts) - prefill16) / (n - 1);
    });
    measure_roofline(dev);
    const double roofline_s = bytes_per_token / (roof.gbs_median * 1e9);
    std::printf(
        "\ndecode, batch 1: %.1f ms/token, %.2f tokens/s; roofline %.1f ms/token "
        "(%.2f GB read per token at %.1f GB/s) -> %.0f%% of roofline (medians of %d "
        "rounds in turn with a pass of the %s; the rounds' own fractions %.0f-%.0f%%; "
        "timed alone before them %.1f ms/token)\n",
        roof.t_median * 1e3, 1.0 / roof.t_median, roofline_s * 1e3, bytes_per_token / 1e9,
        roof.gbs_median, 100.0 * roof.fraction_median, roof.rounds,
        dev.is_cpu() ? "native read loop" : "device's read probe", 100.0 * roof.fraction_low,
        100.0 * roof.fraction_high, per_token * 1e3);
    for (const auto& [cached, e, w, r, mean, slowest] : split)
      std::printf(
          "decode step phases at %u cached positions (median of 32): forward() host %.2f "
          "ms, queue wait %.2f ms, logits read + argmax %.2f ms; sum %.1f ms = %.2f tok/s "
          "= %.0f%% of roofline; whole steps: mean %.1f ms, slowest %.1f ms\n",
          uint32_t(cached), e * 1e3, w * 1e3, r * 1e3, (e + w + r) * 1e3, 1.0 / (e + w + r),
          100.0 * roofline_s / (e + w + r), mean * 1e3, slowest * 1e3);
    if (!no_mmap && dev.is_cpu()) {
      // The roofline above reads fresh memory; the decode read the checkpoint's mapped pages.
      const double own = mapped_weights_gbs(dir);
      std::printf(
          "the native loop over the checkpoint's mapped weights: %.1f GB/s -> decode at "
          "%.0f%% of a roofline there\n",
          own, 100.0 * bytes_per_token / roof.t_median / (own * 1e9));
    }
  }

  // Prefill of a 512-token prompt (one step, last-token logits), median of 3 after a warm-up.
  std::vector<int32_t> long_prompt(512);
  for (size_t i = 0; i < long_prompt.size(); ++i) long_prompt[i] = int32_t((i * 31) % 120000 + 5);
  const double tp = median_time(3, [&] { greedy_generate(*model, {long_prompt}, 1, 128); });
  const int ab_prefill_rounds = std::max(ab_rounds / 3, 3);
  if (ab)
    run_tuning_ab(dev, *ab, ab_prefill_rounds, [&] {
      const auto ts = Clock::now();
      greedy_generate(*model, {long_prompt}, 1, 128);
      return seconds_since(ts);
    });
  // The register-only peaks after the start-up, the decode and the prefills: what runs on the
  // device in the seconds after them runs slower. Between the load and the first token they had
  // made the first token 2.9 s against 0.22-0.27 s without them (2-core Xeon, 2026-12-01); just
  // before the prefill, llama3-1b's at bf16 compute ran 279.7 / 296.9 / 293.9 tok/s against
  // 302.1 / 311.2 / 312.2 with them after it (2-core Zen 5 EPYC, 2026-12-05, 3 pairs in turn).
  // On a CPU device only: the host's peaks do not bound a GPU's GEMMs.
  const ComputePeaks peaks = dev.is_cpu() ? measure_compute_peaks() : ComputePeaks{};
  // The linear layers' multiply-adds: every weight but the embedding table (tied: the lm_head,
  // run for the last token only, is left out of both).
  const double flops = 2.0 * 512 * (weight_bytes / 2 - embedding_numel);
  const double gflops = flops / tp / 1e9;
  std::printf("prefill, 512 tokens: %.2f s, %.1f tokens/s, %.1f GFLOP/s in the linear layers",
              tp, 512 / tp, gflops);
  if (peaks.f32_fma_gflops > 0)
    std::printf(" = %.0f%% of the f32 FMA peak", 100 * gflops / peaks.f32_fma_gflops);
  if (peaks.bf16_dot_gflops > 0)
    std::printf(", %.0f%% of the bf16 dot-product peak", 100 * gflops / peaks.bf16_dot_gflops);
  std::printf("\n");
  if (ab) print_tuning_ab("prefill, 512 tokens", *ab, ab_prefill_rounds, 1.0, "s");
  return 0;
}
