// Serving's warm-up (runtime/engine/warm_up.h): its plan within the limits, and that requests
// after it build no kernel and get what they get without it.
#include <gtest/gtest.h>

#include <map>

#include "runtime/engine/deploy_config.h"
#include "runtime/engine/deployment.h"
#include "runtime/engine/warm_up.h"
#include "tests/reference_cases.h"
#include "tests/test_util.h"

namespace clshard {
namespace {

using Sizes = std::vector<uint32_t>;

TEST(WarmUpPlan, TakesOneTwoThreeThenPowersOfTwoWithinTheLimits) {
  SchedulerLimits l;  // max_batch_size 32, 2048 input tokens, pages of 128, max_length 4096
  l.total_pages = 1000;
  WarmUpPlan p = plan_warm_up(l);
  EXPECT_EQ(p.prompt_lengths, (Sizes{1, 2, 3, 4, 8, 16, 32, 64, 128}));
  EXPECT_EQ(p.batch_sizes, (Sizes{2, 3, 4, 8, 16, 32}));
  EXPECT_EQ(p.new_tokens, 1u);
  EXPECT_EQ(p.describe(), "prompts of 1-128 tokens, batches of 2-32 requests");

  // Each limit cuts: max_length (a prompt of 32 + 1 token > 30), max_batch_size (5), pages.
  l.max_length = 30;
  l.max_batch_size = 5;
  l.page_size = 16;
  l.total_pages = 6;
  p = plan_warm_up(l);
  EXPECT_EQ(p.prompt_lengths, (Sizes{1, 2, 3, 4, 8, 16}));
  EXPECT_EQ(p.batch_sizes, (Sizes{2, 3, 4}));
  l.max_batch_size = 32;
  l.total_pages = 3;  // a one-token request takes a page: batches of up to 3
  EXPECT_EQ(plan_warm_up(l).batch_sizes, (Sizes{2, 3}));
  l.max_batch_input_tokens = 3;  // a step's tokens
  p = plan_warm_up(l);
  EXPECT_EQ(p.prompt_lengths, (Sizes{1, 2, 3}));
  EXPECT_EQ(p.describe(), "prompts of 1-3 tokens, batches of 2-3 requests");

  // A draft: each request keeps a second token (a verifying step) and holds K - 1 more positions.
  l = SchedulerLimits{};
  l.page_size = 16;
  l.total_pages = 1000;
  l.max_length = 20;
  l.num_speculative_tokens = 3;
  p = plan_warm_up(l);
  EXPECT_EQ(p.new_tokens, 2u);
  EXPECT_EQ(p.prompt_lengths, (Sizes{1, 2, 3, 4, 8, 16}));  // 16 + 2 <= 20

  l.max_length = 1;
  p = plan_warm_up(l);
  EXPECT_TRUE(p.prompt_lengths.empty());
  EXPECT_TRUE(p.batch_sizes.empty());
  EXPECT_EQ(p.describe(), "nothing (the limits admit no request)");
}

size_t kernels_built(const Deployment& d) {
  size_t n = 0;
  for (const Device* dev : d.model->devices()) n += dev->kernels_built();
  return n;
}

// Requests of every size the plan names and between them: prompts of 1-128 tokens one at a time
// and batches of 2-8, greedy and sampled with every feature.
std::vector<std::vector<int32_t>> run_spread(Engine& engine, uint32_t vocab) {
  std::vector<std::vector<int32_t>> out;
  auto prompt = [&](uint32_t n, uint32_t salt) {
    std::vector<int32_t> p;
    for (uint32_t i = 0; i < n; ++i) p.push_back(int32_t((salt * 31 + i * 7 + 3) % vocab));
    return p;
  };
  for (uint32_t n : {5u, 7u, 13u, 29u, 50u, 100u, 128u})
    for (auto& t : test::run_greedy_requests(engine, {prompt(n, n)}, 3)) out.push_back(t);
  for (uint32_t b : {7u, 3u}) {
    std::map<uint64_t, std::vector<int32_t>> done;
    std::vector<uint64_t> handles;
    for (uint32_t r = 0; r < b; ++r) {
      GenerationRequest g;
      g.prompt = prompt(2 + r, 100 + r);
      g.max_tokens = 4;
      g.sampling.seed = 7 + r;
      if (r % 2) {
        g.sampling.temperature = 0.9f;
        g.sampling.top_k = 20;
        g.sampling.top_p = 0.8f;
        g.sampling.presence_penalty = 0.3f;
        g.sampling.logprobs = true;
        g.sampling.top_logprobs = 3;
      }
      handles.push_back(engine.submit(g));
    }
    while (engine.has_work())
      for (auto& res : engine.step()) done[res.handle] = res.token_ids;
    for (uint64_t h : handles) out.push_back(done.at(h));
  }
  return out;
}

class WarmUp : public ::testing::TestWithParam<std::string> {};

TEST_P(WarmUp, LaterRequestsBuildNoKernelAndGetWhatTheyGotWithoutIt) {
  const std::string yaml = "model: {path: " +
                           (test::reference_dir() / "ckpt" / GetParam()).string() +
                           "}\ndevices: {type: cpu}\nbatch: {max_batch_size: 8}\n"
                           "kv_cache: {page_size: 16}\n";
  // Without the warm-up, on a deployment of its own (its devices' kernels counted apart).
  Deployment cold = Deployment::open(parse_deploy_config(yaml, "deploy.yaml"));
  const uint32_t vocab = cold.model->info().vocab_size;
  const auto want = run_spread(*cold.make_engine(), vocab);

  Deployment d = Deployment::open(parse_deploy_config(yaml, "deploy.yaml"));
  auto engine = d.make_engine();
  const size_t before = kernels_built(d);
  const WarmUpPlan plan = plan_warm_up(d.limits);
  EXPECT_EQ(plan.describe(), "prompts of 1-128 tokens, batches of 2-8 requests");
  const WarmUpResult w = warm_up(*engine, plan);
  EXPECT_EQ(w.requests, 9u + 2 + 3 + 4 + 8);
  EXPECT_GT(kernels_built(d), before);
  EXPECT_EQ(engine->stats().steps, 0u);  // the stats count clients' requests only
  EXPECT_EQ(engine->stats().output_tokens, 0u);
  const size_t warmed = kernels_built(d);
  EXPECT_EQ(run_spread(*engine, vocab), want);
  EXPECT_EQ(kernels_built(d), warmed) << "a request after the warm-up built a kernel";
}

INSTANTIATE_TEST_SUITE_P(Checkpoints, WarmUp,
                         ::testing::Values("llama3-tiny-bf16", "deepseek-v3-tiny-fp8"),
                         [](const auto& info) {
                           std::string s = info.param;
                           for (char& c : s)
                             if (c == '-') c = '_';
                           return s;
                         });

}  // namespace
}  // namespace clshard
