// DeepSeek-V3 with data-parallel MLA attention and expert-parallel MoE (MAX's DP_EP mode) on 2, 3
// and 4 CPU sub-devices: the same checkpoint and prompts give the single-device logits (1e-4) and
// greedy tokens, for the f32 and fp8 grouped reference checkpoints (16 experts: 8/8 on 2 devices,
// 6/5/5 on 3, 4/4/4/4 on 4), with batches smaller than the replica count; the engine on 2
// sub-devices; a balanced (uneven) placement changes the blocks, not the logits; bf16 compute on
// 2 sub-devices gives the single device's bf16-compute logits.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <iostream>
#include <map>
#include <tuple>
#include <vector>

#include "models/deepseek_v3/model.h"
#include "models/registry.h"
#include "parallel/collectives.h"
#include "parallel/placement.h"
#include "runtime/device.h"
#include "runtime/device_manager.h"
#include "runtime/engine/engine.h"
#include "runtime/engine/generation.h"
#include "tests/reference_cases.h"
#include "tests/test_util.h"

namespace clshard {
namespace {

constexpr float kTolerance = 1e-4f;

std::filesystem::path checkpoint(const std::string& dtype) {
  return test::reference_dir() / "ckpt" / ("deepseek-v3-tiny-grouped-" + dtype);
}

// n CPU sub-devices (tests/test_util.cpp lets PoCL make up to 4).
DeviceSelection cpu_split(int n) {
  DeviceSelection sel;
  sel.type = "cpu";
  sel.split = std::to_string(n);
  return sel;
}

LoadOptions dp_ep_options(DeviceManager& mgr) {
  LoadOptions o;
  o.devices = mgr.devices();
  o.data_parallel_degree = uint32_t(mgr.size());
  o.expert_parallel_degree = uint32_t(mgr.size());
  return o;
}

std::vector<std::vector<int32_t>> sequences() {
  std::vector<std::vector<int32_t>> s;
  for (int i = 0; i < 5; ++i) {  // 5 sequences: uneven over 2, 3 and 4 replicas
    std::vector<int32_t> t;
    for (int j = 0; j < 3 + 7 * i; ++j) t.push_back((i * 61 + j * 29) % 509 + 2);
    s.push_back(t);
  }
  return s;
}


// The single-device results, computed once per checkpoint.
struct Single {
  std::vector<std::vector<float>> logits;
  std::vector<std::vector<int32_t>> greedy;
};
const Single& single(const std::string& dtype) {
  static std::map<std::string, Single> cache;
  auto it = cache.find(dtype);
  if (it != cache.end()) return it->second;
  auto m = load_model(checkpoint(dtype), LoadOptions{{&test::default_device()}, std::nullopt});
  EXPECT_EQ(m->num_replicas(), 1u);
  Single s;
  s.logits = all_position_logits(*m, sequences(), 16);
  s.greedy = greedy_generate(*m, sequences(), 6, 16);
  return cache.emplace(dtype, std::move(s)).first->second;
}

class DeepseekV3DataExpertParallel
    : public ::testing::TestWithParam<std::tuple<std::string, int>> {};

TEST_P(DeepseekV3DataExpertParallel, LogitsAndGreedyEqualSingleDevice) {
  const auto [dtype, n] = GetParam();
  const Single& want = single(dtype);

  DeviceManager mgr(cpu_split(n));
  ASSERT_EQ(mgr.size(), size_t(n));
  auto model = load_model(checkpoint(dtype), dp_ep_options(mgr));  // through the registry
  auto* ds = dynamic_cast<deepseek_v3::DeepseekV3Model*>(model.get());
  ASSERT_NE(ds, nullptr);
  EXPECT_EQ(model->num_replicas(), uint32_t(n));
  EXPECT_EQ(model->devices().size(), size_t(n));
  const auto& p = ds->expert_placement();
  EXPECT_EQ(p.first_expert, parallel::place_experts_even(16, n).first_expert);
  if (n == 3) {  // 16 experts on 3 ranks: uneven blocks
    EXPECT_EQ(p.count(0), 6u);
    EXPECT_EQ(p.count(1), 5u);
    EXPECT_EQ(p.count(2), 5u);
  }
  // Each device holds exactly its block of routed experts.
  for (size_t l = 0; l < ds->weights().layers.size(); ++l) {
    if (ds->weights().layers[l].is_moe) {
      EXPECT_EQ(ds->weights().layers[l].moe.experts.size(), size_t(p.count(0)));
    }
  }

  const auto got = all_position_logits(*model, sequences(), 16);
  const float d = test::max_abs_diff(got, want.logits);
  std::cout << "[ dsv3 dp+ep ] " << dtype << " on " << n << " devices: max |logit diff| " << d
            << "\n";
  EXPECT_LE(d, kTolerance);
  EXPECT_EQ(greedy_generate(*model, sequences(), 6, 16), want.greedy);

  // A batch smaller than the number of replicas: the idle replicas still take part in every
  // dispatch and combine, with nothing to send.
  const auto one = all_position_logits(*model, {sequences()[3]}, 16);
  ASSERT_EQ(one.size(), 1u);
  EXPECT_LE(test::max_abs_diff(one[0], want.logits[3]), kTolerance);
  EXPECT_EQ(greedy_generate(*model, {sequences()[1]}, 6, 16),
            std::vector<std::vector<int32_t>>{want.greedy[1]});
  EXPECT_GT(ds->communicator()->stats().collectives, 0u);
}

INSTANTIATE_TEST_SUITE_P(
    Devices, DeepseekV3DataExpertParallel,
    ::testing::Combine(::testing::Values(std::string("f32"), std::string("fp8")),
                       ::testing::Values(2, 3, 4)),
    [](const auto& info) {
      return std::get<0>(info.param) + "_" + std::to_string(std::get<1>(info.param)) + "dev";
    });

// model.compute_dtype: bf16 on 2 sub-devices (data-parallel MLA, expert-parallel MoE) against one
// device at bf16 compute, FP8 checkpoint. Which rows a GEMM gets decides its path (bf16 GEMMs from
// 4 rows, FP8 ones from 16, grouped experts from 8 per expert), and each path rounds in its own
// places; these sequences keep every GEMM on the same path on one device and on each replica or
// rank (51 and 34 tokens per replica; the ranks run their experts grouped, as one device does), so
// the logits agree as the f32 ones do and the greedy tokens are equal. On a host with AMX the
// packed GEMM takes bf16 compute from gemm_bf16_amx_rows rows (8), one more boundary, which these
// sequences do not keep (max |diff| 0.0049 there, 0.0242 with it at 64; AMX's rows are their own
// bits at any M, GemmBf16Packed), so the test holds it at gemm_bf16_packed_rows (128) and turns
// the streaming AMX GEMM of decode batches off (gemm_bf16_amx_stream_rows 0) on every device:
// AMX then runs no GEMM here, as before the lower threshold. The grouped experts' packed GEMM
// (from moe_fp8_packed_rows rows per expert for these FP8 experts, moe_bf16_packed_rows for bf16
// ones: 32 in the EPYC's row) is one more such boundary (max |diff| 0.00024 with it at 32): both
// held at 128 too.
TEST(DeepseekV3DataExpertParallelBf16, TwoSubDevicesGiveSingleDeviceLogits) {
  auto amx_at_packed_rows = [](const Device& d) {
    KernelTuning t = d.tuning();
    t.gemm_bf16_amx_rows = t.gemm_bf16_packed_rows;
    t.moe_bf16_packed_rows = t.gemm_bf16_packed_rows;
    t.moe_fp8_packed_rows = t.gemm_bf16_packed_rows;
    t.gemm_bf16_amx_stream_rows = 0;
    return t;
  };
  test::TuningScope held(test::default_device(), amx_at_packed_rows(test::default_device()));
  LoadOptions one{{&test::default_device()}, std::nullopt};
  one.compute_dtype = ComputeDType::BF16;
  auto single_model = load_model(checkpoint("fp8"), one);
  const auto want = all_position_logits(*single_model, sequences(), 16);
  DeviceManager mgr(cpu_split(2));
  for (Device* d : mgr.devices()) d->set_tuning(amx_at_packed_rows(*d));  // they end with mgr
  LoadOptions o = dp_ep_options(mgr);
  o.compute_dtype = ComputeDType::BF16;
  auto model = load_model(checkpoint("fp8"), o);
  const auto got = all_position_logits(*model, sequences(), 16);
  const float d = test::max_abs_diff(got, want);
  std::cout << "[ dsv3 dp+ep bf16 compute ] fp8 on 2 devices: max |logit diff| " << d << "\n";
  EXPECT_LE(d, kTolerance);
  EXPECT_EQ(greedy_generate(*model, sequences(), 6, 16),
            greedy_generate(*single_model, sequences(), 6, 16));
  // bf16 compute ran: the logits are not the f32 ones.
  EXPECT_GT(test::max_abs_diff(got, single("fp8").logits), 100 * kTolerance);
}

TEST(DeepseekV3DataExpertParallelEngine, TwoSubDevicesGiveSingleDeviceGreedyTokens) {
  DeviceManager mgr(cpu_split(2));
  auto model = load_model(checkpoint("f32"), dp_ep_options(mgr));
  SchedulerLimits lim;
  lim.page_size = 16;
  lim.total_pages = 6;  // per replica: small enough that requests wait for pages
  lim.max_batch_input_tokens = 32;
  model->allocate_kv_cache(lim.total_pages, lim.page_size);
  Engine engine(*model, nullptr, lim);
  std::vector<size_t> per_replica(2);
  auto got = test::run_greedy_requests(engine, sequences(), 6, &per_replica);
  EXPECT_GE(per_replica[0], 1u);
  EXPECT_GE(per_replica[1], 1u);
  EXPECT_EQ(got, single("f32").greedy);
}

TEST(DeepseekV3DataExpertParallelPlacement, BalancedBlocksChangeNotTheLogits) {
  // With throughputs {1, 2} the blocks differ from the even 8/8, and the logits do not.
  const auto even = parallel::place_experts_even(16, 2);
  const auto skewed = parallel::place_experts_balanced(16, {1.0, 2.0});
  EXPECT_NE(skewed.first_expert, even.first_expert);
  EXPECT_LT(skewed.count(0), skewed.count(1));
  DeviceManager mgr(cpu_split(2));
  deepseek_v3::DeepseekV3Model pinned(checkpoint("f32"), dp_ep_options(mgr), skewed);
  EXPECT_EQ(pinned.expert_placement().first_expert, skewed.first_expert);
  const float d = test::max_abs_diff(all_position_logits(pinned, sequences(), 16), single("f32").logits);
  std::cout << "[ dsv3 dp+ep ] blocks " << skewed.count(0) << "/" << skewed.count(1)
            << ": max |logit diff| " << d << "\n";
  EXPECT_LE(d, kTolerance);

  // balanced_experts: the model measures its devices and places by those numbers (equal
  // sub-devices may measure equal, so only the placement's origin and the logits are checked).
  LoadOptions o = dp_ep_options(mgr);
  o.balanced_experts = true;
  ::testing::internal::CaptureStderr();
  deepseek_v3::DeepseekV3Model balanced(checkpoint("f32"), o);
  const std::string printed = ::testing::internal::GetCapturedStderr();
  ASSERT_EQ(balanced.measured_throughput().size(), 2u);
  const auto want = parallel::place_experts_balanced(16, balanced.measured_throughput());
  EXPECT_EQ(balanced.expert_placement().first_expert, want.first_expert);
  EXPECT_NE(printed.find(want.describe()), std::string::npos) << printed;
  EXPECT_LE(test::max_abs_diff(all_position_logits(balanced, sequences(), 16), single("f32").logits),
            kTolerance);
}

TEST(DeepseekV3DataExpertParallelPlacement, OtherLayoutsAreClearErrors) {
  DeviceManager mgr(cpu_split(2));
  LoadOptions o = dp_ep_options(mgr);
  o.expert_parallel_degree = 1;
  try {
    load_model(checkpoint("f32"), o);
    FAIL() << "expected an error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("parallel.expert must be 2"), std::string::npos)
        << e.what();
  }
  o = dp_ep_options(mgr);
  o.data_parallel_degree = 1;
  try {
    load_model(checkpoint("f32"), o);
    FAIL() << "expected an error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("parallel.data must be 2"), std::string::npos)
        << e.what();
  }
  // A step whose splits name another replica count.
  auto model = load_model(checkpoint("f32"), dp_ep_options(mgr));
  model->allocate_kv_cache(4, 16);
  StepInputs s;
  s.tokens = {5};
  s.input_row_offsets = {0, 1};
  s.cache_lengths = {0};
  s.lookup_table = {0};
  s.pages_per_row = 1;
  EXPECT_THROW(model->forward(s), std::invalid_argument);
}

}  // namespace
}  // namespace clshard
