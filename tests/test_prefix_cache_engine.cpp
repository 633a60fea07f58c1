// Prefix caching through the engine and the batch job: the same requests with caching on and off
// give the same tokens — greedy and seeded sampling, on 1 and 2 data-parallel replicas, under a
// page budget that forces preemption, with chunked prefill, and with MTP speculative decoding on
// the MLA (576-wide) cache, whose draft cache shares the pages — and the counted positions show
// the cache at work: 32 prompts sharing 200 tokens compute >= 80% fewer prefill positions, the
// job summary says how many, and cache-aware routing computes each of two prefixes once on 2
// replicas.
#include <gtest/gtest.h>

#include <fstream>
#include <map>
#include <regex>
#include <sstream>

#include "models/registry.h"
#include "parallel/data_parallel_lm.h"
#include "runtime/device.h"
#include "runtime/device_manager.h"
#include "runtime/engine/engine.h"
#include "tests/test_util.h"

namespace clshard {
namespace {

namespace fs = std::filesystem;

fs::path llama_tiny() { return test::reference_dir() / "ckpt" / "llama3-tiny-f32"; }

// A prompt tree: three roots of 20..52 tokens, branches of 0..19 more, tails of 1..5.
std::vector<std::vector<int32_t>> tree_prompts(size_t n, int32_t vocab) {
  std::vector<std::vector<int32_t>> roots;
  for (int r = 0; r < 3; ++r) {
    std::vector<int32_t> t;
    for (int j = 0; j < 20 + 16 * r; ++j) t.push_back((r * 97 + j * 31) % (vocab - 1) + 1);
    roots.push_back(t);
  }
  std::vector<std::vector<int32_t>> p;
  for (size_t i = 0; i < n; ++i) {
    auto t = roots[i % 3];
    for (size_t j = 0; j < (i * 7) % 20; ++j) t.push_back(int32_t((i / 3 * 13 + j * 5) % 50 + 1));
    for (size_t j = 0; j < 1 + i % 5; ++j)
      t.push_back(int32_t((i * 41 + j * 3) % (vocab - 1) + 1));
    p.push_back(t);
  }
  return p;
}

struct RunResult {
  std::vector<std::vector<int32_t>> tokens;  // per request, in submission order
  EngineStats stats;
};

RunResult run_engine(CausalLM& model, SchedulerLimits lim, const std::vector<std::vector<int32_t>>& prompts,
        float temperature, uint32_t max_tokens, DraftModel* draft = nullptr, uint32_t K = 0) {
  model.allocate_kv_cache(lim.total_pages, lim.page_size);
  SpeculativeOptions spec;
  if (draft) {
    draft->allocate_kv_cache(lim.total_pages, lim.page_size);
    spec.num_tokens = K;
    lim.num_speculative_tokens = K;
  }
  Engine engine(model, nullptr, lim, draft, spec);
  std::vector<uint64_t> handles;
  for (size_t i = 0; i < prompts.size(); ++i) {
    GenerationRequest r;
    r.prompt = prompts[i];
    r.sampling.temperature = temperature;
    r.sampling.top_p = 0.9f;
    r.sampling.seed = 1000 + i;
    r.max_tokens = max_tokens;
    handles.push_back(engine.submit(r));
  }
  std::map<uint64_t, std::vector<int32_t>> by;
  while (engine.has_work())
    for (auto& r : engine.step()) {
      EXPECT_NE(r.reason, EndReason::Error) << r.error;
      by[r.handle] = r.token_ids;
    }
  RunResult out;
  for (uint64_t h : handles) out.tokens.push_back(by.at(h));
  out.stats = engine.stats();
  return out;
}

SchedulerLimits small_budget(uint32_t pages, bool caching) {
  SchedulerLimits lim;
  lim.max_batch_size = 6;
  lim.max_batch_input_tokens = 40;  // chunked prefill of the longer prompts
  lim.page_size = 16;
  lim.total_pages = pages;
  lim.max_length = 512;
  lim.prefix_caching = caching;
  return lim;
}

class PrefixCacheEngine : public ::testing::TestWithParam<std::tuple<int, float>> {};

TEST_P(PrefixCacheEngine, CachingOnAndOffGiveTheSameTokens) {
  const auto [replicas, temperature] = GetParam();
  std::unique_ptr<DeviceManager> mgr;
  std::unique_ptr<CausalLM> model;
  if (replicas == 1) {
    model = load_model(llama_tiny(), LoadOptions{{&test::default_device()}, std::nullopt});
  } else {
    mgr = std::make_unique<DeviceManager>(test::cpu_devices(std::to_string(replicas)));
    std::vector<std::unique_ptr<CausalLM>> parts;
    for (Device* d : mgr->devices())
      parts.push_back(load_model(llama_tiny(), LoadOptions{{d}, std::nullopt}));
    model = std::make_unique<parallel::DataParallelLM>(std::move(parts));
  }
  const auto prompts = tree_prompts(12, 500);
  // 14 pages of 16 per replica for requests of up to 96 positions: preemption must happen.
  const RunResult off = run_engine(*model, small_budget(14, false), prompts, temperature, 10);
  const RunResult on = run_engine(*model, small_budget(14, true), prompts, temperature, 10);
  ASSERT_EQ(on.tokens.size(), off.tokens.size());
  for (size_t i = 0; i < prompts.size(); ++i) {
    EXPECT_FALSE(on.tokens[i].empty());
    EXPECT_EQ(on.tokens[i], off.tokens[i]) << "request " << i;
  }
  EXPECT_EQ(off.stats.cached_prompt_tokens, 0u);
  EXPECT_GT(on.stats.cached_prompt_tokens, 0u);
  EXPECT_LT(on.stats.prefill_tokens, off.stats.prefill_tokens);
  if (replicas == 1) {
    EXPECT_GT(off.stats.preemptions, 0u) << "the page budget was meant to force preemption";
    EXPECT_GT(on.stats.preemptions, 0u) << "the page budget was meant to force preemption";
  }
}

INSTANTIATE_TEST_SUITE_P(ReplicasAndSampling, PrefixCacheEngine,
                         ::testing::Values(std::tuple{1, 0.0f}, std::tuple{1, 0.8f},
                                           std::tuple{2, 0.0f}, std::tuple{2, 0.8f}),
                         [](const auto& info) {
                           return "dp" + std::to_string(std::get<0>(info.param)) +
                                  (std::get<1>(info.param) == 0 ? "_greedy" : "_seeded");
                         });

// MTP speculative decoding on the MLA cache: the same tokens with caching on and off, in a batch
// that preempts; and requests run one after another (so that each one's drafts depend only on its
// own caches) draft and accept exactly as many tokens with caching on as off — the draft's cache
// rows in the reused pages are the ones its own prefill would have written.
TEST(PrefixCacheSpeculative, MtpOnTheMlaCacheGivesTheSameTokensAndTheSameDrafts) {
  const fs::path dir = test::shared_dir() / "models" / "dsv3-mtp-trained";
  LoadOptions o{{&test::default_device()}, std::nullopt};
  auto target = load_model(dir, o);
  auto draft = load_draft("mtp", dir, std::nullopt, o);
  const uint32_t K = 2;
  const auto prompts = tree_prompts(9, 2048);
  for (float temperature : {0.0f, 0.8f}) {
    const RunResult off =
        run_engine(*target, small_budget(12, false), prompts, temperature, 12, draft.get(), K);
    const RunResult on =
        run_engine(*target, small_budget(12, true), prompts, temperature, 12, draft.get(), K);
    EXPECT_EQ(on.tokens, off.tokens) << "temperature " << temperature;
    EXPECT_GT(on.stats.cached_prompt_tokens, 0u);
    EXPECT_GT(on.stats.speculative.drafted, 0u);
    EXPECT_GT(off.stats.preemptions, 0u) << "the page budget was meant to force preemption";
  }
  // One at a time: a long shared prefix (prefilled in chunks of 40) then different tails.
  std::vector<int32_t> prefix;
  for (int j = 0; j < 100; ++j) prefix.push_back((j * 29 + 7) % 2000 + 1);
  auto sequential = [&](bool caching) {
    SchedulerLimits lim = small_budget(64, caching);
    lim.num_speculative_tokens = K;
    target->allocate_kv_cache(lim.total_pages, lim.page_size);
    draft->allocate_kv_cache(lim.total_pages, lim.page_size);
    SpeculativeOptions spec;
    spec.num_tokens = K;
    Engine engine(*target, nullptr, lim, draft.get(), spec);
    std::vector<std::vector<int32_t>> out;
    for (int i = 0; i < 3; ++i) {
      GenerationRequest r;
      r.prompt = prefix;
      for (int j = 0; j < 3 + i; ++j) r.prompt.push_back(300 + 17 * i + j);
      r.sampling.temperature = 0;
      r.max_tokens = 16;
      engine.submit(r);
      while (engine.has_work())
        for (auto& res : engine.step()) out.push_back(res.token_ids);
    }
    return std::pair{out, engine.stats()};
  };
  const auto [off_tokens, off_stats] = sequential(false);
  const auto [on_tokens, on_stats] = sequential(true);
  EXPECT_EQ(on_tokens, off_tokens);
  EXPECT_EQ(on_stats.cached_prompt_tokens, 2u * 96u);  // 6 pages for the 2nd and 3rd request
  EXPECT_EQ(on_stats.speculative.drafted, off_stats.speculative.drafted);
  EXPECT_EQ(on_stats.speculative.accepted, off_stats.speculative.accepted);
  EXPECT_EQ(on_stats.speculative.accepted_at, off_stats.speculative.accepted_at);
}

// ---- The batch job -----------------------------------------------------------------------------

std::string prompt_line(int i, const std::vector<int32_t>& ids) {
  std::ostringstream s;
  s << R"({"id": "r)" << i << R"(", "prompt_token_ids": [)";
  for (size_t j = 0; j < ids.size(); ++j) s << (j ? ", " : "") << ids[j];
  s << "]}";
  return s.str();
}

std::string slurp(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// Runs the job (prompt lines) with caching on or off; returns the completions file and stderr.
std::pair<std::string, std::string> run_job(const std::string& name,
                                            const std::vector<std::string>& lines, bool caching,
                                            const std::string& devices_yaml) {
  auto dir = test::temp_dir(name + (caching ? "_on" : "_off"));
  std::ofstream in(dir / "prompts.jsonl");
  for (const auto& l : lines) in << l << "\n";
  in.close();
  std::ofstream(dir / "deploy.yaml")
      << "model:\n  path: " << llama_tiny().string() << "\n" << devices_yaml
      << "kv_cache:\n  page_size: 16\n  pages: 512\n  prefix_caching: "
      << (caching ? "true" : "false") << "\n"
      << "batch:\n  max_batch_size: 32\n  max_batch_input_tokens: 2048\n"
      << "sampling:\n  temperature: 0.7\n  max_tokens: 4\n"
      << "job:\n  input: prompts.jsonl\n  output: out/completions.jsonl\n";
  std::string out, err;
  EXPECT_EQ(test::run_clshard({"run", (dir / "deploy.yaml").string()}, &out, &err), 0) << err;
  return {slurp(dir / "out" / "completions.jsonl"), err};
}

std::vector<int32_t> tokens_from(int32_t seed, size_t n) {
  std::vector<int32_t> v;
  for (size_t j = 0; j < n; ++j) v.push_back(int32_t((seed * 131 + j * 37) % 499 + 1));
  return v;
}

TEST(PrefixCacheJob, ThirtyTwoPromptsSharingTwoHundredTokensAndTheSummarySaysSo) {
  std::vector<std::string> lines;
  const auto prefix = tokens_from(1, 200);
  for (int i = 0; i < 32; ++i) {
    auto p = prefix;
    for (int32_t t : tokens_from(100 + i, 8)) p.push_back(t);
    lines.push_back(prompt_line(i, p));
  }
  const std::string one = "devices:\n  type: cpu\n";
  const auto [off_out, off_err] = run_job("prefix_job32", lines, false, one);
  const auto [on_out, on_err] = run_job("prefix_job32", lines, true, one);
  EXPECT_FALSE(off_out.empty());
  EXPECT_EQ(on_out, off_out);  // byte for byte
  // Off: every position of 32 prompts of 208; on: the first prompt whole, then 16 positions each
  // (12 pages of 16 = 192 positions taken from the cache): 89.4% fewer.
  EXPECT_NE(off_err.find("prefix cache: off, 6656 prompt tokens computed\n"), std::string::npos)
      << off_err;
  EXPECT_NE(on_err.find("prefix cache: 5952 prompt tokens cached, 704 computed (hit rate 89.4%)\n"),
            std::string::npos)
      << on_err;
  EXPECT_LE(704.0, 0.2 * 6656.0);
}

// Two prefixes in the order A A B B A A B B ... over 2 replicas: cache-aware routing sends each
// prefix's requests to one replica, so each prefix is computed once (least-loaded routing alone
// would alternate and compute both on both replicas).
TEST(PrefixCacheJob, CacheAwareRoutingComputesEachPrefixOnceOnTwoReplicas) {
  std::vector<std::string> lines;
  const auto a = tokens_from(1, 200), b = tokens_from(2, 200);
  for (int i = 0; i < 16; ++i) {
    auto p = (i / 2) % 2 == 0 ? a : b;
    for (int32_t t : tokens_from(100 + i, 8)) p.push_back(t);
    lines.push_back(prompt_line(i, p));
  }
  const std::string two = "devices:\n  type: cpu\n  split: 2\nparallel:\n  data: 2\n";
  const auto [off_out, off_err] = run_job("prefix_route", lines, false, two);
  const auto [on_out, on_err] = run_job("prefix_route", lines, true, two);
  EXPECT_FALSE(off_out.empty());
  EXPECT_EQ(on_out, off_out);
  // Each prefix computed once in full (208), the 14 others 16 positions each.
  EXPECT_NE(on_err.find("prefix cache: 2688 prompt tokens cached, 640 computed (hit rate 80.8%)\n"),
            std::string::npos)
      << on_err;
}

}  // namespace
}  // namespace clshard
