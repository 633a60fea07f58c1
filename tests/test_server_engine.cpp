// Engine::cancel, which the server uses when a client goes away: the request's pages go back to
// the pool at once, the others carry on with exactly their own tokens.
#include <gtest/gtest.h>

#include <map>

#include "models/registry.h"
#include "runtime/engine/engine.h"
#include "tests/test_util.h"

namespace clshard {
namespace {

std::unique_ptr<CausalLM> tiny_model() {
  return load_model(test::reference_dir() / "ckpt" / "llama3-tiny-f32",
                    LoadOptions{{&test::default_device()}, std::nullopt});
}

GenerationRequest greedy(std::vector<int32_t> prompt, uint32_t n) {
  GenerationRequest r;
  r.prompt = std::move(prompt);
  r.sampling.temperature = 0;
  r.max_tokens = n;
  return r;
}

TEST(EngineCancel, FreesPagesAtOnceAndLeavesTheOthersUnchanged) {
  auto model = tiny_model();
  SchedulerLimits lim;
  lim.max_batch_size = 4;
  lim.max_batch_input_tokens = 256;
  lim.page_size = 16;
  lim.total_pages = 32;
  model->allocate_kv_cache(lim.total_pages, lim.page_size);
  const std::vector<int32_t> a = {5, 17, 99, 3, 250, 41, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17};
  const std::vector<int32_t> b = {300, 2, 71, 44};

  // b alone, for reference.
  std::vector<int32_t> b_alone;
  {
    Engine e(*model, nullptr, lim);
    e.submit(greedy(b, 20));
    while (e.has_work())
      for (auto& r : e.step()) b_alone = r.token_ids;
  }

  Engine engine(*model, nullptr, lim);
  const uint64_t ha = engine.submit(greedy(a, 40));
  const uint64_t hb = engine.submit(greedy(b, 20));
  std::map<uint64_t, std::vector<int32_t>> streamed;
  engine.on_token([&](uint64_t h, int32_t t, const std::string&) { streamed[h].push_back(t); });
  for (int i = 0; i < 5; ++i) EXPECT_TRUE(engine.step().empty());
  ASSERT_EQ(engine.state(ha), RequestState::Running);
  // a holds 17 + 4 = 21 positions so far: 2 pages; b holds 4 + 4: 1 page.
  EXPECT_EQ(engine.kv_pages_in_use(), 3u);
  EXPECT_EQ(engine.num_running(), 2u);

  EXPECT_TRUE(engine.cancel(ha, "cancelled: test"));
  EXPECT_EQ(engine.kv_pages_in_use(), 1u) << "a's pages go back at once, before the next step";
  EXPECT_EQ(engine.state(ha), RequestState::Finished);
  EXPECT_EQ(engine.num_running(), 1u);
  EXPECT_FALSE(engine.cancel(ha, "again")) << "a second cancel changes nothing";

  std::map<uint64_t, GenerationResult> done;
  while (engine.has_work())
    for (auto& r : engine.step()) done[r.handle] = r;
  // take the last report (a's came with the first step after the cancel)
  ASSERT_EQ(done.count(ha), 1u);
  EXPECT_EQ(done[ha].reason, EndReason::Error);
  EXPECT_EQ(done[ha].error, "cancelled: test");
  EXPECT_EQ(done[ha].token_ids, streamed[ha]) << "the tokens it kept before the cancel";
  EXPECT_EQ(done[ha].token_ids.size(), 5u);
  ASSERT_EQ(done.count(hb), 1u);
  EXPECT_EQ(done[hb].reason, EndReason::Length);
  EXPECT_EQ(done[hb].token_ids, b_alone);
  EXPECT_EQ(engine.kv_pages_in_use(), 0u);
  EXPECT_FALSE(engine.cancel(hb)) << "a finished request";
  EXPECT_FALSE(engine.cancel(12345)) << "a handle never issued";
}

TEST(EngineCancel, AWaitingRequestLeavesTheQueue) {
  auto model = tiny_model();
  SchedulerLimits lim;
  lim.max_batch_size = 1;  // the second request waits
  lim.max_batch_input_tokens = 256;
  lim.page_size = 16;
  lim.total_pages = 8;
  model->allocate_kv_cache(lim.total_pages, lim.page_size);
  Engine engine(*model, nullptr, lim);
  const uint64_t h1 = engine.submit(greedy({1, 2, 3}, 6));
  const uint64_t h2 = engine.submit(greedy({4, 5, 6}, 6));
  engine.step();
  EXPECT_EQ(engine.state(h2), RequestState::Waiting);
  EXPECT_EQ(engine.num_waiting(), 1u);
  EXPECT_TRUE(engine.cancel(h2, "gone"));
  EXPECT_EQ(engine.num_waiting(), 0u);
  std::map<uint64_t, GenerationResult> done;
  while (engine.has_work())
    for (auto& r : engine.step()) done[r.handle] = r;
  ASSERT_EQ(done.size(), 2u);
  EXPECT_EQ(done[h2].reason, EndReason::Error);
  EXPECT_EQ(done[h2].error, "gone");
  EXPECT_TRUE(done[h2].token_ids.empty());
  EXPECT_EQ(done[h1].reason, EndReason::Length);
  EXPECT_EQ(done[h1].token_ids.size(), 6u);
  EXPECT_EQ(engine.kv_pages_in_use(), 0u);
}

// ignore_eos (vLLM's request field): the same tokens, the EOS kept, up to max_tokens.
TEST(EngineIgnoreEos, RunsPastTheEos) {
  auto model = tiny_model();
  SchedulerLimits lim;
  lim.page_size = 16;
  lim.total_pages = 64;
  model->allocate_kv_cache(lim.total_pages, lim.page_size);
  const auto& eos = model->info().eos_token_ids;
  ASSERT_FALSE(eos.empty());
  // Seeded draws until one request ends on an EOS.
  GenerationResult stopped;
  GenerationRequest req;
  for (uint64_t seed = 1; seed < 200 && stopped.reason != EndReason::Stop; ++seed) {
    req.prompt = {7, 8, 9};
    req.sampling.temperature = 1.5f;
    req.sampling.seed = seed;
    req.max_tokens = 48;
    Engine e(*model, nullptr, lim);
    e.submit(req);
    while (e.has_work())
      for (auto& r : e.step()) stopped = r;
  }
  ASSERT_EQ(stopped.reason, EndReason::Stop) << "no seed of 200 drew an EOS in 48 tokens";
  req.ignore_eos = true;
  Engine e(*model, nullptr, lim);
  e.submit(req);
  GenerationResult full;
  while (e.has_work())
    for (auto& r : e.step()) full = r;
  EXPECT_EQ(full.reason, EndReason::Length);
  ASSERT_EQ(full.token_ids.size(), 48u);
  const size_t k = stopped.token_ids.size();  // the EOS was the (k+1)-th token
  EXPECT_EQ(std::vector<int32_t>(full.token_ids.begin(), full.token_ids.begin() + k),
            stopped.token_ids);
  EXPECT_NE(std::find(eos.begin(), eos.end(), full.token_ids[k]), eos.end());
}

}  // namespace
}  // namespace clshard
