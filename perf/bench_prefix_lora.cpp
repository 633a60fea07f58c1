// Prefix caching and LoRA through the engine (issue 13):
//   1. a batch of N requests sharing a P-token prefix (each + 8 tokens of its own, 8 output tokens),
//      with prefix caching off and on: wall time, prefill positions computed, hit rate;
//   2. decode throughput at batch 32 with 0, 1 and 4 LoRA adapters of rank 16 on all seven Llama
//      targets (random weights, written under .cache/lora-bench), the requests spread evenly.
// Each figure is the median of --repeat runs (3), each run printed with the 1-minute load average
// before it (the machine may be shared).
// Usage: bench_prefix_lora [MODEL_DIR] [--preset NAME] [--requests N] [--prefix P] [--repeat R]
//        [--skip-prefix] [--skip-lora] [--attention-only (adapters on q/k/v/o only)]
//        (default: the llama3-1b preset in bf16, 64 requests, 512-token prefix)
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <tuple>
#include <random>
#include <string>

#include <nlohmann/json.hpp>

#include "models/registry.h"
#include "perf/bench_util.h"
#include "runtime/device.h"
#include "runtime/device_manager.h"
#include "runtime/engine/engine.h"
#include "runtime/model.h"
#include "runtime/safetensors.h"

using namespace clshard;
using namespace clshard::bench;
namespace fs = std::filesystem;

namespace {

// A rank-16 adapter on every Llama target of every layer (q/k/v/o only with attention_only),
// random weights.
void write_adapter(const fs::path& dir, const nlohmann::json& cfg, uint32_t seed,
                   bool attention_only) {
  if (fs::exists(dir / "adapter_model.safetensors")) return;
  fs::create_directories(dir);
  const int r = 16;
  std::ofstream(dir / "adapter_config.json")
      << nlohmann::json{{"r", r},
                        {"lora_alpha", 32},
                        {"target_modules",
                         attention_only
                             ? nlohmann::json{"q_proj", "k_proj", "v_proj", "o_proj"}
                             : nlohmann::json{"q_proj", "k_proj", "v_proj", "o_proj",
                                              "gate_proj", "up_proj", "down_proj"}}}
             .dump();
  const int64_t H = cfg["hidden_size"], F = cfg["intermediate_size"];
  const int64_t hd = cfg.contains("head_dim") ? cfg["head_dim"].get<int64_t>()
                                              : H / cfg["num_attention_heads"].get<int64_t>();
  const int64_t q = cfg["num_attention_heads"].get<int64_t>() * hd;
  const int64_t kv = cfg["num_key_value_heads"].get<int64_t>() * hd;
  std::vector<std::tuple<std::string, int64_t, int64_t>> mods = {
      {"self_attn.q_proj", H, q},  {"self_attn.k_proj", H, kv}, {"self_attn.v_proj", H, kv},
      {"self_attn.o_proj", q, H},  {"mlp.gate_proj", H, F},     {"mlp.up_proj", H, F},
      {"mlp.down_proj", F, H}};
  if (attention_only) mods.resize(4);
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-0.01f, 0.01f);
  std::vector<TensorToWrite> t;
  auto random_bytes = [&](size_t n) {
    std::vector<float> v(n);
    for (float& x : v) x = u(rng);
    std::vector<uint8_t> b(n * 4);
    std::memcpy(b.data(), v.data(), b.size());
    return b;
  };
  for (int64_t l = 0; l < cfg["num_hidden_layers"].get<int64_t>(); ++l)
    for (const auto& [m, in, out] : mods) {
      const std::string name = "base_model.model.model.layers." + std::to_string(l) + "." + m;
      t.push_back({name + ".lora_A.weight", DType::F32, {r, in}, random_bytes(size_t(r * in))});
      t.push_back({name + ".lora_B.weight", DType::F32, {out, r}, random_bytes(size_t(out * r))});
    }
  write_safetensors(dir / "adapter_model.safetensors", t);
}

// The 1-minute load average (/proc/loadavg), -1 where there is none.
double load_average() {
  std::ifstream f("/proc/loadavg");
  double l = -1;
  f >> l;
  return l;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Prefix caching and LoRA through the engine: N requests sharing a P-token prefix "
               "with caching off and on, and decode throughput with 0, 1 and 4 rank-16 adapters",
               "bench_prefix_lora"};
  std::string dir_arg;
  std::string preset = "llama3-1b";
  uint32_t n_requests = 64, prefix_len = 512, repeat = 3;
  bool skip_prefix = false, skip_lora = false, attention_only = false;
  app.add_option("MODEL_DIR", dir_arg, "checkpoint directory (default: the --preset in bf16 under "
                                       ".cache/models, written when missing)");
  app.add_option("--preset", preset, "make-model preset when no MODEL_DIR is given")
      ->capture_default_str();
  app.add_option("--requests", n_requests, "requests N")->capture_default_str();
  app.add_option("--prefix", prefix_len, "shared prefix length P in tokens")->capture_default_str();
  app.add_option("--repeat", repeat, "runs per figure (the median is printed)")
      ->capture_default_str();
  app.add_flag("--skip-prefix", skip_prefix, "skip the prefix-caching part");
  app.add_flag("--skip-lora", skip_lora, "skip the LoRA part");
  app.add_flag("--attention-only", attention_only, "adapters on q/k/v/o only");
  parse_args(app, argc, argv);
  fs::path dir = dir_arg;
  const bool do_prefix = !skip_prefix, do_lora = !skip_lora;
  if (dir.empty()) dir = ensure_preset(preset, "bf16", ".cache/models/" + preset + "-bf16");
  DeviceManager mgr(DeviceSelection{});
  Device& dev = mgr[0];

  if (do_prefix) {
    auto model = load_model(dir, LoadOptions{{&dev}, std::nullopt});
    std::printf("%s on %s: %u requests sharing a %u-token prefix (+8 tokens each), 8 output "
                "tokens, greedy\n",
                dir.c_str(), dev.info().name.c_str(), n_requests, prefix_len);
    std::printf("%8s %6s %6s %10s %16s %16s %10s\n", "caching", "run", "load", "wall s",
                "prefill computed", "cached", "hit rate");
    for (bool caching : {false, true}) {
      std::vector<double> walls;
      for (uint32_t run = 0; run < repeat; ++run) {
        SchedulerLimits lim;
        lim.max_batch_size = 32;
        lim.max_batch_input_tokens = 2048;
        lim.page_size = 128;
        lim.total_pages = 32 * ((prefix_len + 16 + 127) / 128 + 1);
        lim.prefix_caching = caching;
        model->allocate_kv_cache(lim.total_pages, lim.page_size);
        Engine engine(*model, nullptr, lim);
        for (uint32_t r = 0; r < n_requests; ++r) {
          GenerationRequest req;
          for (uint32_t i = 0; i < prefix_len; ++i) req.prompt.push_back(int32_t(1000 + i * 7));
          for (uint32_t i = 0; i < 8; ++i) req.prompt.push_back(int32_t(5000 + r * 31 + i));
          req.max_tokens = 8;
          req.sampling.temperature = 0;
          engine.submit(std::move(req));
        }
        const double load = load_average();
        const auto t0 = Clock::now();
        while (engine.has_work()) engine.step();
        const double wall = seconds_since(t0);
        walls.push_back(wall);
        const auto& s = engine.stats();
        std::printf("%8s %6u %6.2f %10.2f %16llu %16llu %9.1f%%\n", caching ? "on" : "off", run,
                    load, wall, (unsigned long long)s.prefill_tokens,
                    (unsigned long long)s.cached_prompt_tokens, 100.0 * s.prefix_hit_rate());
        std::fflush(stdout);
      }
      std::printf("%8s median wall %.2f s over %u runs\n", caching ? "on" : "off", median(walls),
                  repeat);
    }
  }

  if (do_lora) {
    const auto cfg = read_json_file(dir / "config.json");
    LoadOptions opts{{&dev}, std::nullopt};
    for (uint32_t a = 0; a < 4; ++a) {
      const fs::path adir = ".cache/lora-bench/" + preset + "-r16-" +
                            (attention_only ? "attn-" : "") + std::to_string(a);
      write_adapter(adir, cfg, a + 1, attention_only);
      opts.lora_adapters.push_back({"a" + std::to_string(a), adir});
    }
    opts.lora_max_rank = 16;
    auto model = load_model(dir, opts);
    const uint32_t batch = 32, gen = 16;
    std::printf("\ndecode at batch %u, prompts of 32 tokens, %u output tokens, rank-16 adapters on "
                "%s\n",
                batch, gen, attention_only ? "q/k/v/o" : "q/k/v/o/gate/up/down");
    std::printf("%9s %6s %6s %14s\n", "adapters", "run", "load", "decode tok/s");
    double base = 0;
    for (uint32_t adapters : {0u, 1u, 4u}) {
      std::vector<double> rates;
      for (uint32_t run = 0; run < repeat; ++run) {
        SchedulerLimits lim;
        lim.max_batch_size = batch;
        lim.page_size = 128;
        lim.total_pages = batch + 1;
        model->allocate_kv_cache(lim.total_pages, lim.page_size);
        Engine engine(*model, nullptr, lim);
        for (uint32_t r = 0; r < batch; ++r) {
          GenerationRequest req;
          for (uint32_t i = 0; i < 32; ++i) req.prompt.push_back(int32_t(1000 + r * 97 + i * 13));
          req.max_tokens = gen;
          req.sampling.temperature = 0;
          req.adapter_id = adapters ? 1 + r % adapters : 0;
          engine.submit(std::move(req));
        }
        engine.step();  // the prefill of every prompt
        const uint64_t tokens_before = engine.stats().output_tokens;
        const double load = load_average();
        const auto t0 = Clock::now();
        while (engine.has_work()) engine.step();
        const double tps = double(engine.stats().output_tokens - tokens_before) / seconds_since(t0);
        rates.push_back(tps);
        std::printf("%9u %6u %6.2f %14.1f\n", adapters, run, load, tps);
        std::fflush(stdout);
      }
      const double m = median(rates);
      if (adapters == 0) base = m;
      std::printf("%9u median %.1f tok/s over %u runs, %.1f%% of the base model's\n", adapters, m,
                  repeat, 100.0 * m / base);
      std::fflush(stdout);
    }
  }
  return 0;
}
