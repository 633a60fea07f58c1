// Llama 3 data parallelism on 2, 3 and 4 CPU sub-devices: replicas on their own devices give the
// single-device logits and greedy tokens; the engine spreads requests over replicas.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <tuple>

#include "models/registry.h"
#include "parallel/data_parallel_lm.h"
#include "runtime/device.h"
#include "runtime/device_manager.h"
#include "runtime/engine/engine.h"
#include "runtime/engine/generation.h"
#include "tests/reference_cases.h"
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
  std::vector<size_t> per_replica(n);
  auto got = test::run_greedy_requests(engine, sequences(), 6, &per_replica);
  for (int r = 0; r < n; ++r) EXPECT_GE(per_replica[r], 1u) << "replica " << r << " got nothing";
  auto single = load_model(checkpoint(), LoadOptions{{&test::default_device()}, std::nullopt});
  EXPECT_EQ(got, greedy_generate(*single, sequences(), 6, 16));
}

INSTANTIATE_TEST_SUITE_P(Devices, DataParallelLlama, ::testing::Values(2, 3, 4));

}  // namespace
}  // namespace clshard

namespace clshard {
namespace {

std::unique_ptr<CausalLM> load_parallel(const std::filesystem::path& dir, DeviceManager& mgr,
                                        uint32_t data, uint32_t tensor) {
  LoadOptions o;
  o.devices = mgr.devices();
  o.data_parallel_degree = data;
  o.tensor_parallel_degree = tensor;
  return load_model(dir, o);
}


// Tensor parallel over 2 sub-devices (heads, MLP columns and vocabulary split; allreduce after
// attention and MLP), and data parallel x tensor parallel over 4: the single-device logits.
TEST(TensorParallelLlama, LogitsAndGreedyEqualSingleDevice) {
  for (const char* ckpt : {"llama3-tiny-f32", "llama3-tiny-bf16"}) {
    const auto dir = test::reference_dir() / "ckpt" / ckpt;
    auto single = load_model(dir, LoadOptions{{&test::default_device()}, std::nullopt});
    auto want = all_position_logits(*single, sequences(), 16);
    auto want_tokens = greedy_generate(*single, sequences(), 6, 16);
    // 4-way: one query head per rank, each kv head replicated on two ranks.
    for (auto [n, data, tensor] :
         {std::tuple{2, 1, 2}, std::tuple{4, 1, 4}, std::tuple{4, 2, 2}}) {
      DeviceManager mgr(DeviceSelection{.type = "cpu", .split = std::to_string(n)});
      auto tp = load_parallel(dir, mgr, data, tensor);
      EXPECT_EQ(tp->num_replicas(), uint32_t(data));
      auto got = all_position_logits(*tp, sequences(), 16);
      EXPECT_LE(test::max_abs_diff(got, want), 1e-4f) << ckpt << " data " << data << " tensor " << tensor;
      EXPECT_EQ(greedy_generate(*tp, sequences(), 6, 16), want_tokens) << ckpt;
    }
  }
}

TEST(TensorParallelLlama, ShapesThatDoNotDivideAreClearErrors) {
  DeviceManager mgr(DeviceSelection{.type = "cpu", .split = "4"});
  try {
    DeviceManager three(DeviceSelection{.type = "cpu", .split = "3"});
    load_parallel(test::reference_dir() / "ckpt" / "llama3-tiny-f32", three, 1, 3);
    ADD_FAILURE() << "no error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("num_attention_heads (4) divisible"), std::string::npos)
        << e.what();
  }
  try {
    load_parallel(test::reference_dir() / "ckpt" / "llama3-tiny-f32", mgr, 3, 1);
    ADD_FAILURE() << "no error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("4"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace clshard
