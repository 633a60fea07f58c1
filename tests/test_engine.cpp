// The generation loop: continuous batching with preemption gives what one-at-a-time gives, seeded
// sampling does not depend on the batch, stop tokens and lengths end requests.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <numeric>

#include "models/registry.h"
#include "runtime/device.h"
#include "runtime/engine/deploy_config.h"
#include "runtime/engine/deployment.h"
#include "runtime/engine/engine.h"
#include "runtime/engine/generation.h"
#include "runtime/step_device.h"
#include "tests/reference_cases.h"
#include "tests/test_util.h"

namespace clshard {
namespace {

std::unique_ptr<CausalLM> tiny_model() {
  return load_model(test::reference_dir() / "ckpt" / "llama3-tiny-f32",
                    LoadOptions{{&test::default_device()}, std::nullopt});
}

std::vector<std::vector<int32_t>> prompts() {
  std::vector<std::vector<int32_t>> p;
  for (int i = 0; i < 10; ++i) {
    std::vector<int32_t> t;
    for (int j = 0; j < 3 + i * 7; ++j) t.push_back((i * 37 + j * 11) % 500 + 1);
    p.push_back(t);
  }
  return p;
}

std::vector<GenerationResult> run_all(CausalLM& model, const SchedulerLimits& lim,
                                      std::vector<GenerationRequest> reqs, EngineStats* stats) {
  model.allocate_kv_cache(lim.total_pages, lim.page_size);
  Engine engine(model, nullptr, lim);
  std::vector<uint64_t> handles;
  for (auto& r : reqs) handles.push_back(engine.submit(r));
  std::map<uint64_t, GenerationResult> by;
  while (engine.has_work())
    for (auto& r : engine.step()) by[r.handle] = r;
  if (stats) *stats = engine.stats();
  std::vector<GenerationResult> out;
  for (uint64_t h : handles) out.push_back(by.at(h));
  return out;
}

GenerationRequest greedy(const std::vector<int32_t>& prompt, uint32_t n) {
  GenerationRequest r;
  r.prompt = prompt;
  r.sampling.temperature = 0;
  r.max_tokens = n;
  return r;
}

TEST(Engine, BatchedWithPreemptionEqualsOneAtATime) {
  auto model = tiny_model();
  const uint32_t n_new = 12;
  std::vector<GenerationRequest> reqs;
  for (const auto& p : prompts()) reqs.push_back(greedy(p, n_new));
  // Each request alone, with room to spare.
  std::vector<std::vector<int32_t>> alone;
  for (const auto& p : prompts()) alone.push_back(greedy_generate(*model, {p}, n_new, 16)[0]);
  // Together, with 14 pages of 16 tokens for requests of up to 78 tokens each: preemption must
  // happen, and chunked prefill (max 40 tokens a step).
  SchedulerLimits lim;
  lim.max_batch_size = 6;
  lim.max_batch_input_tokens = 40;
  lim.page_size = 16;
  lim.total_pages = 14;
  lim.max_length = 4096;
  EngineStats stats;
  auto together = run_all(*model, lim, reqs, &stats);
  EXPECT_GT(stats.preemptions, 0u) << "the KV budget was meant to force preemption";
  for (size_t i = 0; i < reqs.size(); ++i) {
    EXPECT_EQ(together[i].reason, EndReason::Length);
    EXPECT_EQ(together[i].token_ids, alone[i]) << "request " << i;
    EXPECT_EQ(together[i].prompt_tokens, reqs[i].prompt.size());
  }
}

TEST(Engine, SeededSamplingDoesNotDependOnTheBatch) {
  auto model = tiny_model();
  SchedulerLimits lim;
  lim.page_size = 16;
  lim.total_pages = 64;
  GenerationRequest a = greedy(prompts()[3], 16);
  a.sampling.temperature = 0.9f;
  a.sampling.top_p = 0.95f;
  a.sampling.seed = 1234;
  auto solo = run_all(*model, lim, {a}, nullptr);
  std::vector<GenerationRequest> crowd = {greedy(prompts()[0], 5), a, greedy(prompts()[7], 9)};
  crowd[0].sampling.temperature = 1.5f;
  crowd[0].sampling.seed = 9;
  auto mixed = run_all(*model, lim, crowd, nullptr);
  EXPECT_EQ(mixed[1].token_ids, solo[0].token_ids);
  auto again = run_all(*model, lim, {a}, nullptr);
  EXPECT_EQ(again[0].token_ids, solo[0].token_ids);
  GenerationRequest b = a;
  b.sampling.seed = 4321;
  auto other = run_all(*model, lim, {b}, nullptr);
  EXPECT_NE(other[0].token_ids, solo[0].token_ids) << "a different seed should sample differently";
}

// The whole model in the GPU kernel shape (forced on PoCL: the sampler and log-probabilities of
// sampling_wg.cl, every other op in its work-group variant): greedy and seeded requests with
// log-probabilities give the CPU shape's tokens, and log-probabilities within 1e-4 of the CPU
// shape's. The two shapes' logits differ by ~1e-6 (the linear layers sum in other orders), so a
// draw flips only if it falls within ~1e-6 of a CDF boundary; the test is deterministic.
TEST(Engine, GpuShapeGivesTheCpuShapesTokensAndLogprobs) {
  auto model = tiny_model();
  SchedulerLimits lim;
  lim.page_size = 16;
  lim.total_pages = 64;
  std::vector<GenerationRequest> reqs = {greedy(prompts()[1], 8), greedy(prompts()[4], 12),
                                         greedy(prompts()[6], 12)};
  reqs[0].sampling.logprobs = true;
  reqs[0].sampling.top_logprobs = 3;
  reqs[1].sampling.temperature = 0.9f;
  reqs[1].sampling.top_p = 0.95f;
  reqs[1].sampling.seed = 77;
  reqs[1].sampling.logprobs = true;
  reqs[1].sampling.top_logprobs = 5;
  reqs[2].sampling.temperature = 1.2f;
  reqs[2].sampling.top_k = 20;
  reqs[2].sampling.min_p = 0.02f;
  reqs[2].sampling.seed = 5;
  Device& dev = test::default_device();
  test::ShapeScope scope(dev, dev.kernel_shape());
  std::vector<GenerationResult> got[2];
  for (int shape = 0; shape < 2; ++shape) {
    dev.set_kernel_shape(shape ? KernelShape::WorkGroups : KernelShape::Chunks);
    got[shape] = run_all(*model, lim, reqs, nullptr);
  }
  for (size_t r = 0; r < reqs.size(); ++r) {
    SCOPED_TRACE(r);
    const GenerationResult &c = got[0][r], &g = got[1][r];
    ASSERT_EQ(c.token_ids.size(), reqs[r].max_tokens);
    EXPECT_EQ(g.token_ids, c.token_ids);
    ASSERT_EQ(g.logprobs.size(), c.logprobs.size());
    EXPECT_EQ(c.logprobs.size(), reqs[r].sampling.logprobs ? c.token_ids.size() : 0u);
    for (size_t i = 0; i < c.logprobs.size(); ++i) {
      EXPECT_EQ(g.logprobs[i].token, c.logprobs[i].token) << i;
      EXPECT_NEAR(g.logprobs[i].logprob, c.logprobs[i].logprob, 1e-4) << i;
      ASSERT_EQ(g.logprobs[i].top.size(), size_t(reqs[r].sampling.top_logprobs)) << i;
      ASSERT_EQ(c.logprobs[i].top.size(), g.logprobs[i].top.size()) << i;
      for (size_t k = 0; k < c.logprobs[i].top.size(); ++k) {
        EXPECT_EQ(g.logprobs[i].top[k].token, c.logprobs[i].top[k].token) << i << " top " << k;
        EXPECT_NEAR(g.logprobs[i].top[k].logprob, c.logprobs[i].top[k].logprob, 1e-4)
            << i << " top " << k;
      }
    }
  }
}

TEST(Engine, StopTokenEndsTheRequestAndIsNotReturned) {
  auto model = tiny_model();
  SchedulerLimits lim;
  lim.page_size = 16;
  lim.total_pages = 32;
  auto free_run = run_all(*model, lim, {greedy(prompts()[2], 10)}, nullptr);
  ASSERT_EQ(free_run[0].token_ids.size(), 10u);
  // Stop at the first occurrence of the fourth token.
  const int32_t stop = free_run[0].token_ids[3];
  size_t first = 0;
  while (free_run[0].token_ids[first] != stop) ++first;
  GenerationRequest r = greedy(prompts()[2], 10);
  r.stop_token_ids = {stop};
  auto stopped = run_all(*model, lim, {r}, nullptr);
  EXPECT_EQ(stopped[0].reason, EndReason::Stop);
  EXPECT_EQ(stopped[0].token_ids, std::vector<int32_t>(free_run[0].token_ids.begin(),
                                                       free_run[0].token_ids.begin() + first));
}

TEST(Engine, BadRequestsAreRefusedOrFailClearly) {
  auto model = tiny_model();
  SchedulerLimits lim;
  lim.page_size = 16;
  lim.total_pages = 4;  // 64 tokens at most
  model->allocate_kv_cache(lim.total_pages, lim.page_size);
  Engine engine(*model, nullptr, lim);
  EXPECT_THROW(engine.submit(greedy({1, 2, 600}, 3)), std::invalid_argument);
  GenerationRequest bad_p = greedy({1, 2}, 3);
  bad_p.sampling.top_p = 0;
  EXPECT_THROW(engine.submit(bad_p), std::invalid_argument);
  GenerationRequest strings = greedy({1, 2}, 3);
  strings.stop = {"x"};
  EXPECT_THROW(engine.submit(strings), std::invalid_argument);  // no tokenizer
  std::vector<int32_t> long_prompt(100, 7);
  engine.submit(greedy(long_prompt, 3));
  engine.submit(greedy({1, 2, 3}, 3));
  std::vector<GenerationResult> done;
  while (engine.has_work())
    for (auto& r : engine.step()) done.push_back(r);
  ASSERT_EQ(done.size(), 2u);
  std::sort(done.begin(), done.end(), [](auto& a, auto& b) { return a.handle < b.handle; });
  EXPECT_EQ(done[0].reason, EndReason::Error);
  EXPECT_NE(done[0].error.find("pages"), std::string::npos) << done[0].error;
  EXPECT_EQ(done[1].reason, EndReason::Length);
  EXPECT_EQ(done[1].token_ids.size(), 3u);
}


// A KV pool the device refuses at its first use (discrete GPUs reserve a buffer's memory then:
// NVIDIA's OpenCL refused 118 GB of an H200's reported 150 GB so) fails at load time with an
// error naming the key that sized it, not at the first step. CPU devices never refuse, so
// CLSHARD_TEST_REFUSE_KV_BYTES stands in for the device (runtime/engine/deployment.cpp); a pool
// under its limit loads and generates what a deployment without it does.
class KvPoolRefused : public ::testing::Test {
 protected:
  void TearDown() override { unsetenv("CLSHARD_TEST_REFUSE_KV_BYTES"); }
  static DeployConfig config(const std::string& kv_cache) {
    return parse_deploy_config("model: {path: " +
                                   (test::reference_dir() / "ckpt" / "llama3-tiny-f32").string() +
                                   "}\ndevices: {type: cpu}\nbatch: {max_batch_size: 4}\n"
                                   "kv_cache: {page_size: 16" + kv_cache + "}\n",
                               "deploy.yaml");
  }
  static std::string open_error(const std::string& kv_cache) {
    try {
      Deployment::open(config(kv_cache));
    } catch (const std::exception& e) {
      return e.what();
    }
    return "no error";
  }
};

TEST_F(KvPoolRefused, ARefusedPoolIsALoadErrorNamingItsKey) {
  const std::vector<std::vector<int32_t>> ps = {{5, 6, 7}, {9, 10, 11, 12, 13}};
  Deployment full = Deployment::open(config(""));
  const uint32_t pages = full.limits.total_pages;
  const uint64_t pool = uint64_t(full.model->kv_bytes_per_token()) * 16 * pages;
  const auto want = test::run_greedy_requests(*full.make_engine(), ps, 12);

  setenv("CLSHARD_TEST_REFUSE_KV_BYTES", std::to_string(pool).c_str(), 1);  // fits exactly
  Deployment fits = Deployment::open(config(""));
  EXPECT_EQ(fits.limits.total_pages, pages);
  EXPECT_EQ(test::run_greedy_requests(*fits.make_engine(), ps, 12), want);

  setenv("CLSHARD_TEST_REFUSE_KV_BYTES", std::to_string(pool - 1).c_str(), 1);
  EXPECT_EQ(open_error(""), "deploy.yaml: kv_cache.memory_fraction: the device refused " +
                                std::to_string(pages) + " KV pages per replica (" +
                                std::to_string(pool / 1000000) +
                                " MB) at their first use (OpenCL error CL_OUT_OF_RESOURCES (-5) "
                                "while reserving the KV pool (CLSHARD_TEST_REFUSE_KV_BYTES)); "
                                "set a smaller kv_cache.memory_fraction (now 0.9) or "
                                "kv_cache.pages");
  setenv("CLSHARD_TEST_REFUSE_KV_BYTES", "1", 1);
  const std::string set = open_error(", pages: 64");
  EXPECT_NE(set.find("deploy.yaml:4: kv_cache.pages: the device refused 64 KV pages per replica"),
            std::string::npos)
      << set;
}

// A WriteBatch's writes have all completed when it goes out of scope without wait(): the sources
// are overwritten right after (a 32 MB write, long enough that an unfinished one would read the
// zeros), and both buffers hold what was written. An empty write queues nothing.
TEST(WriteBatch, SourcesMayGoWhenTheBatchDoes) {
  Device& dev = test::default_device();
  std::vector<uint32_t> a(size_t(8) << 20), b(1000);
  std::iota(a.begin(), a.end(), 1u);
  std::iota(b.begin(), b.end(), 7u);
  const std::vector<uint32_t> a0 = a, b0 = b;
  cl::Mem ma = dev.alloc(a.size() * 4), mb = dev.alloc(b.size() * 4);
  {
    WriteBatch batch(dev);
    batch.write(ma, a.data(), a.size() * 4);
    batch.write(mb, b.data(), b.size() * 4);
    batch.write(mb, nullptr, 0);
  }
  std::fill(a.begin(), a.end(), 0u);
  std::fill(b.begin(), b.end(), 0u);
  std::vector<uint32_t> ga(a.size()), gb(b.size());
  dev.read(ma, ga.data(), ga.size() * 4);
  dev.read(mb, gb.data(), gb.size() * 4);
  EXPECT_EQ(ga, a0);
  EXPECT_EQ(gb, b0);
}

// upload_step queues one write of its five arrays and does not wait for it: each view holds the
// step for whatever the queue runs after it, also where the caller's inputs changed right after
// the call (two rows, one a 3-token prefill chunk after 5 cached tokens, one a decode token
// after 17). The views are sub-buffers of one buffer, each at the device's base-address alignment
// and none overlapping the next.
TEST(UploadStep, EveryViewHoldsTheStepForWhatIsQueuedAfterIt) {
  Device& dev = test::default_device();
  StepInputs in;
  in.tokens = {11, 12, 13, 40};
  in.input_row_offsets = {0, 3, 4};
  in.cache_lengths = {5, 17};
  in.pages_per_row = 3;
  in.lookup_table = {4, 9, 0, 2, 7, 8};
  const DeviceStep st = upload_step(dev, in, 8, 10, 100);
  const std::vector<uint32_t> lookup = in.lookup_table;
  in.tokens.assign(4, 99);  // the write reads its own copy
  in.lookup_table.assign(6, 99);
  const size_t align = cl::device_value<cl_uint>(dev.id(), CL_DEVICE_MEM_BASE_ADDR_ALIGN) / 8;
  const cl::Mem* views[5] = {&st.token_ids, &st.tokens.token_row, &st.tokens.token_pos,
                             &st.tokens.lookup, &st.logit_rows};
  const size_t counts[5] = {4, 4, 4, 6, 2};
  size_t end = 0;
  for (int i = 0; i < 5; ++i) {
    size_t offset = 0, size = 0;
    cl_mem parent = nullptr;
    ASSERT_EQ(clGetMemObjectInfo(views[i]->get(), CL_MEM_OFFSET, sizeof offset, &offset, nullptr),
              CL_SUCCESS);
    ASSERT_EQ(clGetMemObjectInfo(views[i]->get(), CL_MEM_SIZE, sizeof size, &size, nullptr),
              CL_SUCCESS);
    ASSERT_EQ(clGetMemObjectInfo(views[i]->get(), CL_MEM_ASSOCIATED_MEMOBJECT, sizeof parent,
                                 &parent, nullptr),
              CL_SUCCESS);
    EXPECT_EQ(parent, st.inputs_buf.mem().get()) << "view " << i;
    EXPECT_EQ(offset % align, 0u) << "view " << i;
    EXPECT_GE(offset, end) << "view " << i;
    EXPECT_GE(size, counts[i] * 4) << "view " << i;
    end = offset + size;
  }
  auto u32 = [&](const cl::Mem& m, size_t n) {
    std::vector<uint32_t> v(n);
    dev.read(m, v.data(), n * 4);
    return v;
  };
  EXPECT_EQ(u32(st.token_ids, 4), (std::vector<uint32_t>{11, 12, 13, 40}));
  EXPECT_EQ(u32(st.tokens.token_row, 4), (std::vector<uint32_t>{0, 0, 0, 1}));
  EXPECT_EQ(u32(st.tokens.token_pos, 4), (std::vector<uint32_t>{5, 6, 7, 17}));
  EXPECT_EQ(u32(st.tokens.lookup, 6), lookup);
  EXPECT_EQ(u32(st.logit_rows, 2), (std::vector<uint32_t>{2, 3}));  // each row's last token
  EXPECT_EQ(st.tokens.T, 4u);
  EXPECT_EQ(st.tokens.max_query_len, 3u);
}

}  // namespace
}  // namespace clshard
