// DeepSeek-V3 end to end on the first OpenCL device: prefill and decode tokens/s of the dsv3-mini
// preset (bf16 and fp8), with the decode figure set against the roofline of the bytes one decode
// token must stream — the active weights only (attention, the dense layer, the top-k routed and the
// shared experts of each MoE layer, the router, lm_head; models/deepseek_v3/plan.h) plus the MLA
// cache rows it attends to — at the memory bandwidth measured here, in the same program.
//
// The batch-1 decode is timed in rounds in turn with a pass of a native STREAM-style read loop
// (bench_util.h's roofline_in_turn; the device's own probe on a GPU): the decode figure, the
// bandwidth and the fraction of the roofline are the rounds' medians, each round's fraction
// against its own pass, since on a shared machine the bandwidth moves within seconds. Both read
// loops (OpenCL and native, over fresh memory) are printed once more after every decode run, for
// the record: fresh buffers measured before a decode had slowed its next steps on the VM here for
// seconds (the first of 48 steps 170 ms, falling to 25-30 ms by the 30th). A batched decode
// figure follows each dtype: B requests of C tokens each, one token per request per step (no
// roofline: the experts B tokens touch depend on the routing).
//
// On a shared machine the wall time moves with the neighbours' load; the CPU time the process
// spends per decode token (every thread, PoCL's workers included) moves much less and is printed
// beside it.
//
// Usage: bench_deepseek [--dir D] [--dtypes bf16,fp8] [--prompt P] [--context C] [--decode N]
//                       [--batch B] [--roofline-rounds R]
//                       [--tuning-ab FIELD=VALUE[,...] [--ab-rounds R]]
//   D: where the checkpoints live (written with make-model's preset writer when missing;
//      default $TMPDIR/clshard-bench), P: prefill length (512), C: context before decoding (128),
//   N: decode steps timed (32), B: requests of the batched decode figure (8; 0: none).
//   --tuning-ab: the batch-1 decode, and the batched one with B > 0, also timed with one or more
//   tuning fields changed, the two in turn R times (bench_util.h's TuningAB): what a tuning entry
//   gives the whole step.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "models/deepseek_v3/config.h"
#include "models/deepseek_v3/model.h"
#include "models/deepseek_v3/plan.h"
#include "models/registry.h"
#include "perf/bench_util.h"
#include "runtime/device.h"
#include "runtime/device_manager.h"
#include "runtime/engine/generation.h"
#include "runtime/model.h"

using namespace clshard;
using namespace clshard::bench;

namespace {



}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"DeepSeek-V3 end to end on the first OpenCL device: dsv3-mini prefill and decode "
               "tokens/s (bf16, fp8) against the roofline of the active weights",
               "bench_deepseek"};
  std::string root_arg = (std::filesystem::temp_directory_path() / "clshard-bench").string();
  std::vector<std::string> dtypes = {"bf16", "fp8"};
  uint32_t prompt = 512, context = 128, n_decode = 32, batch = 8;
  app.add_option("--dir", root_arg, "where the checkpoints live (written when missing)")
      ->capture_default_str();
  app.add_option("--dtypes", dtypes, "comma-separated checkpoint dtypes")
      ->delimiter(',')
      ->capture_default_str();
  app.add_option("--prompt", prompt, "prefill length")->capture_default_str();
  app.add_option("--context", context, "context before decoding")->capture_default_str();
  app.add_option("--decode", n_decode, "decode steps timed")->capture_default_str();
  app.add_option("--batch", batch, "requests of the batched decode figure (0: none)")
      ->capture_default_str();
  std::string compute_dtype = "f32";
  add_compute_dtype_option(app, compute_dtype);
  bool no_mmap = false;
  add_no_mmap_flag(app, no_mmap);
  int mmap_ab_rounds = 0;
  app.add_option("--mmap-ab", mmap_ab_rounds,
                 "also load each checkpoint the other way (mapped / read into memory) and time "
                 "the batch-1 decode of the two models in turn for this many rounds")
      ->check(CLI::Range(0, 1000));
  int roofline_rounds = 7;
  add_roofline_rounds_option(app, roofline_rounds);
  TuningABOptions ab_opts;
  add_tuning_ab_options(app, ab_opts);
  parse_args(app, argc, argv);
  std::optional<TuningAB> ab = ab_opts.parse();
  const int ab_rounds = ab_opts.rounds;
  LoadOptions opts{{nullptr}, std::nullopt};
  opts.compute_dtype = compute_dtype == "bf16" ? ComputeDType::BF16 : ComputeDType::F32;
  if (no_mmap) opts.weight_memory = WeightMemory::Copied;
  const std::filesystem::path root = root_arg;
  DeviceManager mgr(DeviceSelection{});
  Device& dev = mgr[0];
  std::printf("device: %s (%s), %u compute units; compute dtype %s\n", dev.info().name.c_str(),
              dev.info().platform.c_str(), dev.info().compute_units, compute_dtype.c_str());
  // On a shared machine the bandwidth moves with the neighbours' load: each decode figure is
  // taken in turn with the read loop (roofline_in_turn), so its fraction compares like with like.
  std::printf("%-5s %10s %12s %12s %14s %10s %12s %9s\n", "dtype", "prefill", "decode",
              "decode ms", "bytes/token", "bandwidth", "roofline", "of roof");
  std::printf("%-5s %10s %12s %12s %14s %10s %12s %9s\n", "", "tok/s", "tok/s", "per token",
              "(active)", "GB/s", "tok/s", "");
  // One row per dtype, printed once the roofline is measured after them all.
  struct Row {
    std::string dtype;
    double prefill_tok_s, t_prefill, t_alone, cpu_token, bytes, t_step;
    RooflineInTurn roof;
    std::string paths;
    double weight_gb, active_m, load_s;
    std::filesystem::path dir;
    double fp8_bytes;  // of `bytes`, the FP8 weights' (the rest: bf16 lm_head, routers, cache rows)
  };
  std::vector<Row> results;
  for (const auto& dt : dtypes) {
    const auto dir = ensure_preset("dsv3-mini", dt, root / ("dsv3-mini-" + dt));
    opts.devices = {&dev};
    const auto t_load = std::chrono::steady_clock::now();
    deepseek_v3::DeepseekV3Model model(dir, opts);
    const double load_s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t_load).count();
    const auto plan = deepseek_v3::plan_memory(model.config());
    const uint32_t V = model.info().vocab_size;
    std::mt19937 rng(5);

    // Prefill: one request of `prompt` tokens, 128-token pages (decompressed MLA path).
    uint32_t ppr = 0;
    const uint32_t rows = std::max<uint32_t>(batch, 1);
    auto table = plan_static_pages(
        model, std::vector<uint32_t>(rows, std::max(prompt, context + n_decode + 1)), 128, &ppr);
    const StepInputs pre = random_step(table, ppr, 1, 0, prompt, V, rng);
    const double t_prefill = median_time(2, [&] { model.forward(pre).read_logits(); });
    const auto prefill_path = model.last_mla_path();

    // Decode: a `context`-token request, then one token per step (absorbed MLA path), the first
    // step run once more before the timing as a warm-up (kernel builds for one-row shapes).
    auto decode_steps = [&](CausalLM& m, const auto& tbl, uint32_t pages, std::mt19937& r) {
      m.forward(random_step(tbl, pages, 1, 0, context, V, r)).read_logits();
      std::vector<StepInputs> ss;
      for (uint32_t i = 0; i < n_decode; ++i)
        ss.push_back(random_step(tbl, pages, 1, context + i, 1, V, r));
      m.forward(ss[0]).read_logits();
      return ss;
    };
    auto time_decode = [&](CausalLM& m, const std::vector<StepInputs>& ss) {
      const auto ts = Clock::now();
      for (const auto& s : ss) m.forward(s).read_logits();
      return seconds_since(ts) / n_decode;
    };
    const std::vector<StepInputs> steps = decode_steps(model, table, ppr, rng);
    const double c0 = cpu_seconds();
    const double t_alone = time_decode(model, steps);
    const double cpu_token = (cpu_seconds() - c0) / n_decode;
    // Bytes one decode token streams: active weights + the cache rows it reads (mid-run context).
    const double bytes = double(plan.active_weight_bytes_per_token) +
                         double(context + n_decode / 2) * double(model.kv_bytes_per_token());
    // The decode figure and its roofline, in turn with the read loop (bench_util.h).
    const RooflineInTurn roof =
        roofline_in_turn(dev, roofline_rounds, bytes, [&] { return time_decode(model, steps); });
    const auto decode_path = model.last_mla_path();
    if (ab) {
      run_tuning_ab(dev, *ab, ab_rounds, [&] { return time_decode(model, steps); });
      print_tuning_ab(dt + " decode", *ab, ab_rounds, 1e3, "ms per token");
    }
    if (mmap_ab_rounds > 0) {
      // The same decode steps on a second copy of the model whose weights live the other way, the
      // two in turn (each round's first alternating), so the minute's speed cancels out.
      LoadOptions other_opts = opts;
      other_opts.weight_memory = no_mmap ? WeightMemory::Mapped : WeightMemory::Copied;
      deepseek_v3::DeepseekV3Model other(dir, other_opts);
      uint32_t oppr = 0;
      auto otable = plan_static_pages(
          other, std::vector<uint32_t>(rows, std::max(prompt, context + n_decode + 1)), 128, &oppr);
      std::mt19937 orng(5);
      const std::vector<StepInputs> osteps = decode_steps(other, otable, oppr, orng);
      CausalLM& mapped = no_mmap ? static_cast<CausalLM&>(other) : model;
      CausalLM& copied = no_mmap ? static_cast<CausalLM&>(model) : other;
      const auto& mapped_steps = no_mmap ? osteps : steps;
      const auto& copied_steps = no_mmap ? steps : osteps;
      const InTurn t = time_in_turn(
          mmap_ab_rounds, [&] { return time_decode(mapped, mapped_steps); },
          [&] { return time_decode(copied, copied_steps); });
      std::printf(
          "%s decode, mapped against read into memory, %d rounds in turn: %.2f -> %.2f ms "
          "per token, mapped/copied median %.3f [%.3f, %.3f]\n",
          dt.c_str(), mmap_ab_rounds, t.a_median * 1e3, t.b_median * 1e3, t.ratio_median,
          t.ratio_low, t.ratio_high);
    }

    double t_step = 0;  // the batched decode's, when asked for
    if (batch > 0) {
      // `batch` requests of `context` tokens (one prefill step), then one token per request per
      // step; the pages are row b's of the same table.
      StepInputs ctx = random_step(table, ppr, batch, 0, context, V, rng);
      model.forward(ctx).read_logits();
      std::vector<StepInputs> bsteps;
      for (uint32_t i = 0; i < n_decode; ++i)
        bsteps.push_back(random_step(table, ppr, batch, context + i, 1, V, rng));
      model.forward(bsteps[0]).read_logits();  // warm-up (kernel builds for this batch's shapes)
      const auto tb = Clock::now();
      for (const auto& st : bsteps) model.forward(st).read_logits();
      t_step = seconds_since(tb) / n_decode;
      if (ab) {
        run_tuning_ab(dev, *ab, ab_rounds, [&] {
          const auto ts = Clock::now();
          for (const auto& st : bsteps) model.forward(st).read_logits();
          return seconds_since(ts) / n_decode;
        });
        print_tuning_ab(dt + " batch " + std::to_string(batch) + " decode", *ab, ab_rounds, 1e3,
                        "ms per step");
      }
    }
    const std::string path_note = std::string(ops::mla_path_name(prefill_path)) +
                                  " path; decode at context " + std::to_string(context) +
                                  " on the " + ops::mla_path_name(decode_path);
    // The token's weights that are not FP8 in an FP8 checkpoint: lm_head and the routers (bf16),
    // read whole every token; the norms' few KB are counted with the FP8 bytes.
    auto bytes_of = [](const Weight& w) {
      if (w.dtype == DType::F8_E4M3) return 0.0;
      double n = double(dtype_size(w.dtype));
      for (const int64_t d : w.shape) n *= double(d);
      return n;
    };
    const deepseek_v3::DeepseekV3Weights& weights = model.weights();
    double other_weights = bytes_of(weights.lm_head);
    for (const auto& layer : weights.layers)
      if (layer.is_moe) other_weights += bytes_of(layer.moe.router);
    const double fp8_bytes =
        dt == "fp8" ? double(plan.active_weight_bytes_per_token) - other_weights : 0.0;
    results.push_back({dt, prompt / t_prefill, t_prefill, t_alone, cpu_token, bytes, t_step, roof,
                       path_note, double(model.info().weight_bytes) / 1e9,
                       double(plan.params.active_per_token - plan.params.embedding) / 1e6, load_s,
                       dir, fp8_bytes});
    std::fprintf(stderr, "%s: decode %.2f ms per token\n", dt.c_str(), roof.t_median * 1e3);
  }
  // Both read loops once more, for the record (the rows' figures are their own rounds').
  const Roofline end = measure_roofline(dev, 5);
  // What the FP8 GEMV's instructions stream natively, beside the STREAM loop just measured.
  const bool any_fp8 =
      std::any_of(results.begin(), results.end(), [](const Row& r) { return r.fp8_bytes > 0; });
  const double e4m3 = any_fp8 && dev.is_cpu() ? e4m3_decode_gbs(5) : 0.0;
  if (e4m3 > 0)
    std::printf(
        "native e4m3 decode loop (the FP8 tile's instructions, %u threads): %.1f GB/s, "
        "%.0f%% of the STREAM loop\n",
        std::max(1u, std::thread::hardware_concurrency()), e4m3, 100.0 * e4m3 / end.stream_gbs);
  for (const Row& r : results) {
    std::printf("%-5s %10.1f %12.2f %12.2f %11.1f MB %10.1f %12.1f %8.0f%%\n", r.dtype.c_str(),
                r.prefill_tok_s, 1.0 / r.roof.t_median, r.roof.t_median * 1e3, r.bytes / 1e6,
                r.roof.gbs_median, r.roof.gbs_median * 1e9 / r.bytes,
                100.0 * r.roof.fraction_median);
    std::printf(
        "      (decode and bandwidth: medians of %d rounds in turn with a pass of the %s; the "
        "rounds' own fractions of the roofline %.0f-%.0f%%; timed alone before them %.2f ms "
        "per token)\n",
        r.roof.rounds, dev.is_cpu() ? "native read loop" : "device's read probe",
        100.0 * r.roof.fraction_low, 100.0 * r.roof.fraction_high, r.t_alone * 1e3);
    std::printf(
        "      (prefill %u tokens in %.2f s on the %s path, CPU time %.2f ms per token; "
        "weights %.2f GB on disk, %s in %.2f s, %.1f M parameters active per token)\n",
        prompt, r.t_prefill, r.paths.c_str(), r.cpu_token * 1e3, r.weight_gb,
        no_mmap ? "read into memory" : "mapped", r.load_s, r.active_m);
    if (r.fp8_bytes > 0 && e4m3 > 0) {
      // The rounds' median STREAM rate, and the FP8 bytes at the decode loop's share of it.
      const double fp8_gbs = r.roof.gbs_median * e4m3 / end.stream_gbs;
      const double t_roof =
          r.fp8_bytes / (fp8_gbs * 1e9) + (r.bytes - r.fp8_bytes) / (r.roof.gbs_median * 1e9);
      std::printf(
          "      with its %.1f MB of FP8 weights at the e4m3 decode loop's rate (%.1f GB/s) and "
          "the rest at STREAM's: a roofline of %.1f tok/s, decode at %.0f%% of it\n",
          r.fp8_bytes / 1e6, fp8_gbs, 1.0 / t_roof, 100.0 * t_roof / r.roof.t_median);
    }
    if (batch > 0)
      std::printf("      decode batch %u: %.2f ms per step = %.1f tok/s (%.2fx batch 1)\n", batch,
                  r.t_step * 1e3, batch / r.t_step, batch / r.t_step * r.roof.t_median);
    if (!no_mmap && dev.is_cpu()) {
      // The roofline above reads fresh memory; the decode read the checkpoint's mapped pages.
      const double own = mapped_weights_gbs(r.dir);
      std::printf(
          "      the native loop over this checkpoint's mapped weights: %.1f GB/s -> "
          "decode at %.0f%% of a roofline there\n",
          own, 100.0 * r.bytes / r.roof.t_median / (own * 1e9));
    }
  }
  return 0;
}
