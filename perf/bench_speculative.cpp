// Speculative decoding with the MTP draft:
//   1. on the trained checkpoint (configs/models/dsv3-mtp-trained, English prompts, greedy):
//      acceptance per draft position and output tokens/s for K = 0 (plain), 1..4, at batch 1
//      (the prompts one after another) and batch 16 (16 requests at once);
//   2. on the dsv3-mini-mtp preset (random weights, memory-bound like a real model, bf16): the cost
//      of one verify step of 1 + K tokens and of the K draft steps against one plain decode step
//      at context 128, batch 1, and the speed-up the acceptance measured in part 1 implies:
//      (1 + E[accepted]) * t_plain / (t_verify + t_draft).
// Usage: bench_speculative [--quick]
#include <cstdio>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "perf/bench_util.h"
#include "runtime/device.h"
#include "runtime/device_manager.h"
#include "runtime/engine/draft_step.h"
#include "runtime/engine/engine.h"
#include "runtime/engine/generation.h"
#include "models/registry.h"
#include "runtime/model.h"
#include "runtime/text/tokenizer.h"

using namespace clshard;
using namespace clshard::bench;

namespace {

const std::vector<std::string> kPrompts = {
    "In the beginning God created the heaven and the earth. And the earth was",
    "The LORD is my shepherd; I shall not want. He maketh me to lie down",
    "To install a package on a Debian system, use the command",
    "The GNU coding standards say that a program should",
    "In Python, a list is a mutable sequence that",
    "hacker: n. A person who enjoys exploring the details of",
    "A dictionary maps keys to values. To iterate over",
    "And it came to pass, when the men of the city",
};

struct RunFigures {
  double tokens_per_s = 0;
  double draft_share = 0;  // of the engine's device time
  SpeculativeStats spec;
};

RunFigures run(CausalLM& target, DraftModel* draft, const std::vector<std::vector<int32_t>>& ps,
               uint32_t K, uint32_t batch, uint32_t max_tokens) {
  SchedulerLimits lim;
  lim.max_batch_size = batch;
  lim.max_batch_input_tokens = 4096;
  lim.page_size = 16;
  lim.total_pages = batch * 16;
  lim.max_length = 256;
  lim.num_speculative_tokens = K;
  target.allocate_kv_cache(lim.total_pages, lim.page_size);
  if (draft) draft->allocate_kv_cache(lim.total_pages, lim.page_size);
  SpeculativeOptions spec;
  spec.num_tokens = K;
  Engine engine(target, nullptr, lim, K ? draft : nullptr, spec);
  uint64_t tokens = 0;
  const auto t0 = Clock::now();
  for (size_t next = 0; next < ps.size();) {
    for (uint32_t i = 0; i < batch && next < ps.size(); ++i, ++next) {
      GenerationRequest r;
      r.prompt = ps[next];
      r.sampling.temperature = 0;
      r.max_tokens = max_tokens;
      engine.submit(r);
    }
    while (engine.has_work())
      for (auto& res : engine.step()) tokens += res.token_ids.size();
  }
  RunFigures f;
  f.tokens_per_s = double(tokens) / seconds_since(t0);
  f.spec = engine.stats().speculative;
  f.draft_share = f.spec.draft_s / std::max(engine.stats().device_s, 1e-9);
  return f;
}

// One decode step of batch 1 at `context` cached tokens with `n` new tokens (a verify step with
// n - 1 drafts), timed to the logits read.
double verify_step_time(CausalLM& target, uint32_t context, uint32_t n, bool hidden) {
  StepInputs s;
  for (uint32_t i = 0; i < n; ++i) s.tokens.push_back(int32_t(100 + i));
  s.input_row_offsets = {0, n};
  s.cache_lengths = {context};
  s.pages_per_row = (context + n + 15) / 16;
  for (uint32_t p = 0; p < s.pages_per_row; ++p) s.lookup_table.push_back(p);
  s.logits_per_row = {n};
  if (hidden) s.return_hidden = ReturnHidden::AllNormalized;
  return median_time(7, [&] { target.forward(s).read_logits(); });
}

// The K draft steps after a verify step: step 0 over `accepted + 1` positions, then K - 1 steps of
// one token, each timed to its logits read.
double draft_steps_time(DraftModel& draft, Device& dev, uint32_t context, uint32_t K,
                        uint32_t accepted) {
  const uint32_t H = draft.info().hidden_size;
  cl::Mem hidden = dev.alloc(size_t(K + 1) * H * 4);
  dev.fill_zero(hidden, size_t(K + 1) * H * 4);
  const uint32_t pages = (context + 2 * K + 16) / 16;
  std::vector<uint32_t> table(pages);
  for (uint32_t p = 0; p < pages; ++p) table[p] = p;
  return median_time(7, [&] {
    DraftStep s0(1, pages);
    s0.add_row(0, std::vector<int32_t>(accepted + 1, 7), context, table.data(), 1, 0);
    std::vector<Scratch> keep;
    StepOutputs out = draft.forward(s0.in, s0.gather({{&dev, hidden, K + 1}}, H, keep), H);
    out.read_logits();
    for (uint32_t j = 1; j < K; ++j) {
      DraftStep s(1, pages);
      s.add_row(0, {7}, context + accepted + j, table.data(), 1, 0);
      std::vector<Scratch> hold;
      out = draft.forward(s.in, s.gather(out.hidden, H, hold), H);
      out.read_logits();
    }
  });
}

void step_costs(const std::filesystem::path& dir, const LoadOptions& opts, Device& dev,
                std::map<uint32_t, double>& mean_len) {
  auto big = load_model(dir, opts);
  auto big_draft = load_draft("mtp", dir, std::nullopt, opts);
  const uint32_t context = 128;
  big->allocate_kv_cache(64, 16);
  big_draft->allocate_kv_cache(64, 16);
  const double t_plain = verify_step_time(*big, context, 1, false);
  std::printf("\n%s, batch 1, context %u: plain decode step %.2f ms\n", dir.c_str(), context,
              1e3 * t_plain);
  std::printf("%3s %14s %14s %14s %22s\n", "K", "verify ms", "draft ms", "step ms",
              "implied speed-up");
  for (uint32_t K = 1; K <= 4; ++K) {
    const double t_verify = verify_step_time(*big, context, K + 1, true);
    // Draft step 0 covers the accepted positions + 1; take the mean accepted length of part 1.
    const uint32_t accepted = uint32_t(std::max(0.0, mean_len[K] - 1.0) + 0.5);
    const double t_draft = draft_steps_time(*big_draft, dev, context, K, accepted);
    const double speedup = mean_len[K] * t_plain / (t_verify + t_draft);
    std::printf("%3u %14.2f %14.2f %14.2f %12.2fx (mean len %.2f)\n", K, 1e3 * t_verify,
                1e3 * t_draft, 1e3 * (t_verify + t_draft), speedup, mean_len[K]);
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Speculative decoding with the MTP draft: acceptance and tokens/s on the trained "
               "checkpoint (configs/models/dsv3-mtp-trained), verify and draft step costs on "
               "dsv3-mini-mtp",
               "bench_speculative"};
  bool quick = false;
  app.add_flag("--quick", quick, "24 output tokens per request instead of 64");
  parse_args(app, argc, argv);
  DeviceManager mgr(DeviceSelection{});
  Device& dev = mgr[0];
  LoadOptions opts{{&dev}, std::nullopt};

  // 1. The trained checkpoint.
  const std::filesystem::path trained = "configs/models/dsv3-mtp-trained";
  if (!std::filesystem::is_regular_file(trained / "model.safetensors")) {
    std::fprintf(stderr,
                 "bench_speculative: %s is missing: run it from the repository root after "
                 "scripts/quickstart.sh, or make it with python3 scripts/bf16_checkpoint.py "
                 "../shared/models/dsv3-mtp-trained %s\n",
                 trained.c_str(), trained.c_str());
    return 1;
  }
  auto target = load_model(trained, opts);
  auto draft = load_draft("mtp", trained, std::nullopt, opts);
  const Tokenizer tok = Tokenizer::from_dir(trained);
  std::vector<std::vector<int32_t>> ps;
  for (const auto& p : kPrompts) ps.push_back(tok.encode(p, true));
  std::vector<std::vector<int32_t>> ps16;
  for (int rep = 0; rep < 2; ++rep) ps16.insert(ps16.end(), ps.begin(), ps.end());
  const uint32_t gen = quick ? 24 : 64;
  std::printf("%s on %s: %zu English prompts, %u greedy tokens each\n", trained.c_str(),
              dev.info().name.c_str(), ps.size(), gen);
  std::printf("%3s %12s %12s %9s %9s %7s  %s\n", "K", "tok/s b=1", "tok/s b=16", "accept",
              "mean len", "draft%", "acceptance by position");
  std::map<uint32_t, double> accept_rate;
  std::map<uint32_t, double> mean_len;
  double plain1 = 0, plain16 = 0;
  for (uint32_t K = 0; K <= 4; ++K) {
    const RunFigures b1 = run(*target, draft.get(), ps, K, 1, gen);
    const RunFigures b16 = run(*target, draft.get(), ps16, K, 16, gen);
    if (K == 0) {
      plain1 = b1.tokens_per_s;
      plain16 = b16.tokens_per_s;
    }
    std::string by_pos;
    char buf[64];
    for (size_t k = 0; k < b1.spec.drafted_at.size(); ++k) {
      std::snprintf(buf, sizeof buf, " %zu:%.0f%%", k + 1,
                    100.0 * double(b1.spec.accepted_at[k]) /
                        double(std::max<uint64_t>(b1.spec.drafted_at[k], 1)));
      by_pos += buf;
    }
    accept_rate[K] = b1.spec.acceptance_rate();
    mean_len[K] = b1.spec.mean_accepted_length();
    std::printf("%3u %7.1f %4.2fx %7.1f %4.2fx %8.1f%% %9.2f %6.0f%% %s\n", K, b1.tokens_per_s,
                b1.tokens_per_s / plain1, b16.tokens_per_s, b16.tokens_per_s / plain16,
                100.0 * b1.spec.acceptance_rate(), b1.spec.mean_accepted_length(),
                100.0 * b1.draft_share, by_pos.c_str());
  }

  // 2. Verify and draft cost against a plain decode step: on the memory-bound preset, and on the
  // trained checkpoint (tiny: its steps are launch-bound).
  const auto mini = ensure_preset("dsv3-mini-mtp", "bf16", ".cache/models/dsv3-mini-mtp-bf16");
  for (const std::filesystem::path& dir : {mini, trained})
    step_costs(dir, opts, dev, mean_len);
  return 0;
}
