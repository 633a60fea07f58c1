// Llama 3 data parallelism on 2, 3 and 4 CPU sub-devices: replicas on their own devices give the
// single-device logits and greedy tokens; the engine spreads requests over replicas.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>

#include "parallel/data_parallel_lm.h"
#include "runtime/device.h"
#include "runtime/device_manager.h"
#include "runtime/engine.h"
#include "runtime/generation.h"
#include "tests/test_util.h"

namespace clshard {
namespace {

const std::filesystem::path& checkpoint() {
  static const auto p = test::reference_dir() / "ckpt" / "llama3-tiny-f32";
  return p;
}

std::unique_ptr<CausalLM> data_parallel(DeviceManager& mgr) {
  std::vector<std::unique_ptr<CausalLM>> replicas;
  for (Device* d : mgr.devices())
    replicas.push_back(load_model(checkpoint(), LoadOptions{{d}, std::nullopt}));
  return std::make_unique<parallel::DataParallelLM>(std::move(replicas));
}

std::vector<std::vector<int32_t>> sequences() {
  std::vector<std::vector<int32_t>> s;
  for (int i = 0; i < 5; ++i) {  // 5 sequences: uneven over 2, 3 and 4 replicas
    std::vector<int32_t> t;
    for (int j = 0; j < 4 + 9 * i; ++j) t.push_back((i * 53 + j * 17) % 511 + 1);
    s.push_back(t);
  }
  return s;
}

class DataParallelLlama : public ::testing::TestWithParam<int> {};

TEST_P(DataParallelLlama, LogitsAndGreedyEqualSingleDevice) {
  const int n = GetParam();
  auto single = load_model(checkpoint(), LoadOptions{{&test::default_device()}, std::nullopt});
  auto want = all_position_logits(*single, sequences(), 16);
  auto want_tokens = greedy_generate(*single, sequences(), 6, 16);

  DeviceManager mgr(DeviceSelection{.type = "cpu", .split = std::to_string(n)});
  ASSERT_EQ(mgr.size(), size_t(n));
  auto dp = data_parallel(mgr);
  EXPECT_EQ(dp->num_replicas(), uint32_t(n));
  auto got = all_position_logits(*dp, sequences(), 16);
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    ASSERT_EQ(got[i].size(), want[i].size());
    float worst = 0;
    for (size_t j = 0; j < want[i].size(); ++j)
      worst = std::max(worst, std::abs(got[i][j] - want[i][j]));
    EXPECT_LE(worst, 1e-4f) << "sequence " << i << " on " << n << " replicas";
  }
  EXPECT_EQ(greedy_generate(*dp, sequences(), 6, 16), want_tokens);
  // A batch smaller than the number of replicas: some replicas get no rows.
  auto one = all_position_logits(*dp, {sequences()[2]}, 16);
  float worst = 0;
  for (size_t j = 0; j < want[2].size(); ++j) worst = std::max(worst, std::abs(one[0][j] - want[2][j]));
  EXPECT_LE(worst, 1e-4f);
}

TEST_P(DataParallelLlama, EngineSpreadsRequestsAndMatchesSingleDevice) {
  const int n = GetParam();
  DeviceManager mgr(DeviceSelection{.type = "cpu", .split = std::to_string(n)});
  auto dp = data_parallel(mgr);
  SchedulerLimits lim;
  lim.page_size = 16;
  lim.total_pages = 12;
  lim.max_batch_input_tokens = 48;
  dp->allocate_kv_cache(lim.total_pages, lim.page_size);
  Engine engine(*dp, nullptr, lim);
  std::vector<uint64_t> handles;
  for (const auto& s : sequences()) {
    GenerationRequest r;
    r.prompt = s;
    r.sampling.temperature = 0;
    r.max_tokens = 6;
    handles.push_back(engine.submit(r));
  }
  std::vector<size_t> per_replica(n);
  for (uint64_t h : handles) ++per_replica[engine.replica_of(h)];
  for (int r = 0; r < n; ++r) EXPECT_GE(per_replica[r], 1u) << "replica " << r << " got nothing";
  std::map<uint64_t, std::vector<int32_t>> out;
  while (engine.has_work())
    for (auto& res : engine.step()) out[res.handle] = res.token_ids;
  auto single = load_model(checkpoint(), LoadOptions{{&test::default_device()}, std::nullopt});
  auto want = greedy_generate(*single, sequences(), 6, 16);
  for (size_t i = 0; i < handles.size(); ++i) EXPECT_EQ(out.at(handles[i]), want[i]) << i;
}

INSTANTIATE_TEST_SUITE_P(Devices, DataParallelLlama, ::testing::Values(2, 3, 4));

}  // namespace
}  // namespace clshard
