// Where a Llama 3 decode step's time goes, kernel by kernel: the launches of
// Llama3Model::forward for one decode step (batch B, one token per row, a short cache), replayed
// with the checkpoint's own weights. Each stage (one kernel position in the layer) is timed over
// all layers chained in the in-order queue with one finish, so the figure is the kernel's own time
// plus its share of launch cost, without a per-launch synchronisation. The layers rotate through
// the weights, so the caches are as cold as in a real step. The whole step chained in one finish
// is timed too: the sum of the stages should come close to it.
// Both sequences are timed: the unfused launches (12 per layer) and the fused ones the model runs;
// and the fused ones without the CPU shape's next-tile weight prefetch
// (KernelTuning::weight_prefetch).
// --tuning-ab FIELD=VALUE[,FIELD=VALUE...] compares the fused sequence under the device's tuning
// and with those fields changed (weight_prefetch=0: the next-tile weight prefetch off), stage by
// stage, each of
// --ab-rounds repetitions timing both in turn (medians): the machine's bandwidth moves too much
// between tables for a 10-20% difference.
// --compute-dtype bf16 runs the fused sequence's GEMMs, and o_proj and down_proj in both, as
// model.compute_dtype: bf16 does (linear_bf16.cl: batches of 4 rows and more, and GEMVs where
// ops::bf16_gemv holds), and the attention in bf16 where ops::attention_bf16 holds.
// Usage: bench_decode_breakdown [MODEL_DIR] [--batch B] [--reps N] [--fused-only] [--rounds R]
//                               [--tuning-ab FIELD=VALUE[,...] [--ab-rounds N]]
//                               [--compute-dtype f32|bf16]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "models/llama3/config.h"
#include "models/llama3/weights.h"
#include "parallel/topology.h"
#include "perf/bench_util.h"
#include "runtime/device.h"
#include "runtime/device_manager.h"
#include "runtime/ops.h"
#include "runtime/safetensors.h"
#include "runtime/step_device.h"

using namespace clshard;
using namespace clshard::bench;

namespace {

struct Stage {
  std::string name;
  std::function<void(size_t layer)> run;  // enqueues the stage's launch(es) for one layer
  double bytes_per_layer = 0;             // weight bytes the stage streams
};

double weight_bytes(const Weight& w) { return double(w.dim(0)) * w.dim(1) * dtype_size(w.dtype); }

// Times each stage over all layers, then the whole sequence; prints the table.
void time_sequence(Device& dev, const char* title, const std::vector<Stage>& stages, size_t layers,
                   const std::function<void()>& head, double head_bytes, int reps) {
  std::printf("\n%s: %zu stages per layer\n", title, stages.size());
  std::printf("  %-28s %10s %10s %9s %8s\n", "stage (x layers)", "ms/step", "us/launch", "GB/s",
              "share");
  std::vector<double> t(stages.size());
  for (size_t s = 0; s < stages.size(); ++s)
    t[s] = median_time(reps, [&] {
      for (size_t l = 0; l < layers; ++l) stages[s].run(l);
      dev.finish();
    });
  const double t_head = median_time(reps, [&] {
    head();
    dev.finish();
  });
  double bytes = head_bytes;
  for (const auto& st : stages) bytes += st.bytes_per_layer * layers;
  // The whole step in rounds in turn with a pass of the read loop (bench_util.h), whose
  // bandwidth moves within seconds on a shared machine.
  const RooflineInTurn roof = roofline_in_turn(dev, std::max(reps, 3), bytes, [&] {
    const auto t0 = std::chrono::steady_clock::now();
    for (size_t l = 0; l < layers; ++l)
      for (const auto& st : stages) st.run(l);
    head();
    dev.finish();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  });
  const double t_step = roof.t_median;
  double sum = t_head;
  for (double x : t) sum += x;
  auto row = [&](const std::string& name, double secs, double launches, double bytes) {
    std::printf("  %-28s %10.3f %10.1f %9s %7.1f%%\n", name.c_str(), secs * 1e3,
                secs / launches * 1e6,
                bytes > 0 ? std::to_string(int(bytes / secs / 1e9)).c_str() : "-",
                100 * secs / sum);
  };
  for (size_t s = 0; s < stages.size(); ++s)
    row(stages[s].name, t[s], double(layers), stages[s].bytes_per_layer * layers);
  row("final norm + lm_head", t_head, 1, head_bytes);
  std::printf(
      "  sum of stages %.2f ms; whole step chained %.2f ms = %.2f tok/s; %.2f GB of "
      "weights -> %.0f%% of the %.1f GB/s roofline (medians of %d rounds in turn with "
      "the read loop; the rounds' own fractions %.0f-%.0f%%)\n",
      sum * 1e3, t_step * 1e3, 1 / t_step, bytes / 1e9, 100 * roof.fraction_median, roof.gbs_median,
      roof.rounds, 100 * roof.fraction_low, 100 * roof.fraction_high);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Where a Llama 3 decode step's time goes, kernel by kernel, unfused and fused",
               "bench_decode_breakdown"};
  std::string dir_arg = ".cache/models/llama3-1b-bf16";
  uint32_t B = 1;
  int reps = 7, rounds = 2;
  bool fused_only = false;
  app.add_option("MODEL_DIR", dir_arg, "checkpoint directory (the llama3-1b bf16 preset is written "
                                       "there when missing)")
      ->capture_default_str();
  app.add_option("--batch", B, "decode rows B")->capture_default_str();
  app.add_option("--reps", reps, "timed repeats per figure")->capture_default_str();
  app.add_option("--rounds", rounds, "interleaved rounds of the tables (the machine's load moves)")->capture_default_str();
  app.add_flag("--fused-only", fused_only, "time only the fused launches the model runs");
  std::string compute_arg = "f32";
  app.add_option("--compute-dtype", compute_arg,
                 "model.compute_dtype of the fused sequence's GEMMs and of o_proj and down_proj "
                 "(bf16: bf16 activations in linear_bf16.cl, from 4 rows, and in GEMVs where the "
                 "host has vdpbf16ps)")
      ->check(CLI::IsMember({"f32", "bf16"}))
      ->capture_default_str();
  TuningABOptions ab_opts;
  add_tuning_ab_options(app, ab_opts);
  parse_args(app, argc, argv);
  const std::optional<TuningAB> ab = ab_opts.parse();
  const ComputeDType cdt = compute_arg == "bf16" ? ComputeDType::BF16 : ComputeDType::F32;
  const std::filesystem::path dir = dir_arg;
  ensure_preset("llama3-1b", "bf16", dir);
  DeviceManager mgr(DeviceSelection{});
  Device& dev = mgr[0];
  print_device(dev);

  auto cfg = llama3::Llama3Config::from_dir(dir);
  WeightStore store(dir);
  cfg.finalize(store);
  parallel::Topology topo(parallel::Layout::TensorParallelReplicas, parallel::ParallelDegrees{}, 1);
  const auto range = llama3::shard_range(cfg, topo, 0);
  const auto w = llama3::load_weights(cfg, store, dev, range);
  const uint32_t H = uint32_t(cfg.hidden_size), hd = uint32_t(cfg.head_dim);
  const uint32_t nh = uint32_t(cfg.num_attention_heads), nkv = uint32_t(cfg.num_key_value_heads);
  const uint32_t F = uint32_t(cfg.intermediate_size), V = uint32_t(cfg.vocab_size);
  const uint32_t qkv_w = (nh + 2 * nkv) * hd, L = uint32_t(cfg.num_hidden_layers);
  const float eps = float(cfg.rms_norm_eps);
  std::printf("%s: %u layers, hidden %u, heads %u/%u, ffn %u, vocab %u; decode batch %u\n",
              dir.c_str(), L, H, nh, nkv, F, V, B);

  // A decode step: B rows, each with 32 tokens cached, one new token.
  const uint32_t page_size = 128, cached = 32;
  StepInputs in;
  in.input_row_offsets.push_back(0);
  for (uint32_t b = 0; b < B; ++b) {
    in.tokens.push_back(int32_t(1000 + 17 * b));
    in.input_row_offsets.push_back(b + 1);
    in.cache_lengths.push_back(cached);
    in.lookup_table.push_back(b);
  }
  in.pages_per_row = 1;
  DeviceStep st = upload_step(dev, in, page_size, B, V);
  std::vector<cl::Mem> kv;
  const size_t layer_bytes = size_t(B + 1) * 2 * page_size * nkv * hd * 4;
  for (uint32_t l = 0; l < L; ++l) {
    kv.push_back(dev.alloc(layer_bytes));
    dev.fill_zero(kv.back(), layer_bytes);
  }
  auto inv = cfg.rope_inv_freqs();
  cl::Mem inv_freq = dev.alloc(inv.size() * 4);
  dev.write(inv_freq, inv.data(), inv.size() * 4);
  cl::Mem h = dev.alloc(size_t(B) * H * 4), xn = dev.alloc(size_t(B) * H * 4);
  cl::Mem qkv = dev.alloc(size_t(B) * qkv_w * 4), att = dev.alloc(size_t(B) * nh * hd * 4);
  cl::Mem gu = dev.alloc(size_t(B) * 2 * F * 4), xs = dev.alloc(size_t(B) * H * 4);
  // silu(gate) * up goes to a buffer of its own: written in place, the stage's repeats would
  // compound it (each multiplies by up again) down to f32 denormals, and the down_proj reading
  // them ran 25-30x slower (microcode assists), a figure of this program, not of a model.
  cl::Mem act = dev.alloc(size_t(B) * F * 4);
  cl::Mem logits = dev.alloc(size_t(B) * V * 4);
  ops::embedding(dev, st.token_ids, B, w.embed, h, 1.0f);
  dev.finish();
  const float scale = float(cfg.attention_scale());

  auto rope = [&](size_t l) {
    ops::rope_store_kv(dev, qkv, qkv_w, nh, nkv, hd, inv_freq, inv_freq, 0xffffffffu, st.tokens,
                       kv[l]);
  };
  auto attention = [&](size_t l) {
    ops::paged_attention(dev, qkv, qkv_w, kv[l], st.tokens, nh, nkv, hd, scale, att, nh * hd,
                         DType::F32, cdt);
  };
  auto o_proj = [&](size_t l) {
    ops::linear(dev, att, 0, nh * hd, w.layers[l].o, nullptr, h, 0, H, B, 1.0f, true, cdt);
  };
  auto down = [&](size_t l) {
    ops::linear(dev, act, 0, F, w.layers[l].down, nullptr, h, 0, H, B, 1.0f, true, cdt);
  };
  auto lw = [&](size_t l) -> const llama3::LayerWeights& { return w.layers[l]; };
  const auto& L0 = w.layers[0];
  std::vector<Stage> unfused = {
      {"rmsnorm (attention)",
       [&](size_t l) {
         ops::rmsnorm(dev, h, 0, H, nullptr, lw(l).input_norm, xn, 0, H, B, H, eps);
       }},
      {"q_proj", [&](size_t l) { ops::linear(dev, xn, 0, H, lw(l).q, nullptr, qkv, 0, qkv_w, B); },
       weight_bytes(L0.q)},
      {"k_proj",
       [&](size_t l) { ops::linear(dev, xn, 0, H, lw(l).k, nullptr, qkv, nh * hd, qkv_w, B); },
       weight_bytes(L0.k)},
      {"v_proj",
       [&](size_t l) {
         ops::linear(dev, xn, 0, H, lw(l).v, nullptr, qkv, (nh + nkv) * hd, qkv_w, B);
       },
       weight_bytes(L0.v)},
      {"rope + kv store", rope},
      {"attention", attention},
      {"o_proj + residual", o_proj, weight_bytes(L0.o)},
      {"rmsnorm (mlp)",
       [&](size_t l) {
         ops::rmsnorm(dev, h, 0, H, nullptr, lw(l).post_attention_norm, xn, 0, H, B, H, eps);
       }},
      {"gate_proj",
       [&](size_t l) { ops::linear(dev, xn, 0, H, lw(l).gate, nullptr, gu, 0, 2 * F, B); },
       weight_bytes(L0.gate)},
      {"up_proj", [&](size_t l) { ops::linear(dev, xn, 0, H, lw(l).up, nullptr, gu, F, 2 * F, B); },
       weight_bytes(L0.up)},
      {"silu * up", [&](size_t) { ops::silu_mul(dev, gu, 0, 2 * F, gu, F, 2 * F, act, F, B, F); }},
      {"down_proj + residual", down, weight_bytes(L0.down)},
  };
  auto head = [&] {
    ops::rmsnorm(dev, h, 0, H, &st.logit_rows, w.final_norm, xs, 0, H, B, H, eps);
    ops::linear(dev, xs, 0, H, w.lm_head, nullptr, logits, 0, V, B);
  };
  const double head_bytes = weight_bytes(w.lm_head);
  std::vector<Stage> fused = {
      {"norm, q/k/v (one GEMV)",
       [&](size_t l) {
         ops::linear_fused(dev, h, 0, H, nullptr, &lw(l).input_norm, eps,
                           {&lw(l).q, &lw(l).k, &lw(l).v}, qkv, 0, qkv_w, B, 1.0f, false, cdt);
       },
       weight_bytes(L0.q) + weight_bytes(L0.k) + weight_bytes(L0.v)},
      {"rope + kv store", rope},
      {"attention", attention},
      {"o_proj + residual", o_proj, weight_bytes(L0.o)},
      {"norm, gate/up + silu",
       [&](size_t l) {
         ops::linear_swiglu(dev, h, 0, H, &lw(l).post_attention_norm, eps, lw(l).gate, lw(l).up,
                            gu, 0, F, B, cdt);
       },
       weight_bytes(L0.gate) + weight_bytes(L0.up)},
      {"down_proj + residual",
       [&](size_t l) {
         ops::linear(dev, gu, 0, F, w.layers[l].down, nullptr, h, 0, H, B, 1.0f, true, cdt);
       },
       weight_bytes(L0.down)},
  };
  auto fused_head = [&] {
    ops::linear_fused(dev, h, 0, H, &st.logit_rows, &w.final_norm, eps, {&w.lm_head}, logits, 0,
                      V, B, 1.0f, false, cdt);
  };
  if (ab) {
    // Per repetition: every stage (all layers) and the whole step, the device's tuning (A) then
    // the changed one (B) or B then A (alternating), so both see the same moment of the machine.
    const KernelTuning saved = dev.tuning();
    const KernelTuning changed = ab->applied_to(saved);
    const size_t S = fused.size();
    std::vector<std::vector<double>> t[2];  // [A, B][stage S = head, S + 1 = whole step]
    for (auto& v : t) v.assign(S + 2, {});
    auto time_once = [&](const std::function<void()>& f) {
      const auto t0 = std::chrono::steady_clock::now();
      f();
      dev.finish();
      return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    };
    for (int r = 0; r < ab_opts.rounds + 1; ++r)
      for (int k = 0; k < 2; ++k) {
        const int side_b = (r + k) % 2;
        dev.set_tuning(side_b ? changed : saved);
        std::vector<double> row;
        for (const auto& st : fused)
          row.push_back(time_once([&] { for (size_t l = 0; l < L; ++l) st.run(l); }));
        row.push_back(time_once(fused_head));
        row.push_back(time_once([&] {
          for (size_t l = 0; l < L; ++l)
            for (const auto& st : fused) st.run(l);
          fused_head();
        }));
        if (r == 0) continue;  // the first round builds the kernels
        for (size_t s = 0; s < row.size(); ++s) t[side_b][s].push_back(row[s]);
      }
    dev.set_tuning(saved);
    auto median = [](std::vector<double> v) {
      std::sort(v.begin(), v.end());
      return v[v.size() / 2];
    };
    std::printf(
        "\nthe device's tuning (A) against %s (B), in turn over %d repetitions "
        "(medians, ms per step)\n  %-28s %10s %10s %8s\n",
        ab->label().c_str(), ab_opts.rounds, "stage (x layers)", "A", "B", "A/B");
    for (size_t s = 0; s < S + 2; ++s) {
      const std::string name = s < S ? fused[s].name : s == S ? "final norm + lm_head" : "whole step chained";
      const double a = median(t[0][s]), b = median(t[1][s]);
      std::printf("  %-28s %10.3f %10.3f %8.3f\n", name.c_str(), a * 1e3, b * 1e3, a / b);
    }
    return 0;
  }
  // Interleaved, in turn forwards and backwards: the machine is shared and its bandwidth moves
  // between runs.
  for (int round = 0; round < rounds; ++round) {
    if (!fused_only) time_sequence(dev, "unfused", unfused, L, head, head_bytes, reps);
    auto fused_run = [&] {
      time_sequence(dev, "fused (what Llama3Model runs)", fused, L, fused_head, head_bytes, reps);
    };
    // The same launches without the next-tile weight prefetch (KernelTuning::weight_prefetch).
    auto no_prefetch_run = [&] {
      const KernelTuning saved = dev.tuning();
      KernelTuning t = saved;
      t.weight_prefetch = 0;
      dev.set_tuning(t);
      time_sequence(dev, "fused, next-tile weight prefetch off", fused, L, fused_head, head_bytes,
                    reps);
      dev.set_tuning(saved);
    };
    std::vector<std::function<void()>> tables = {fused_run, no_prefetch_run};
    if (round % 2 == 1) std::reverse(tables.begin(), tables.end());
    for (const auto& table : tables) table();
  }
  return 0;
}
