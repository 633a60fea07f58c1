// parallel::Topology: replica groups, tensor-parallel ranges, expert blocks and the one set of
// rules (and messages) for the parallel degrees, for both layouts; no devices needed.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "parallel/topology.h"

namespace clshard::parallel {
namespace {

// The error a topology of these degrees gives, and the keys it names.
struct Failure {
  std::string what;
  std::vector<std::string> keys;
};
Failure failure(Layout layout, ParallelDegrees d, size_t devices) {
  try {
    Topology t(layout, d, devices, "DeepSeek-V3");
  } catch (const TopologyError& e) {
    return {e.what(), e.keys()};
  }
  return {"(no error)", {}};
}

constexpr Layout kDense = Layout::TensorParallelReplicas;
constexpr Layout kDpEp = Layout::DataParallelAttentionExpertParallel;

TEST(Topology, DenseReplicasOfTensorGroups) {
  const Topology t(kDense, {.data = 4, .tensor = 2}, 8);
  EXPECT_EQ(t.devices(), 8u);
  ASSERT_EQ(t.replicas(), 4u);
  EXPECT_EQ(t.devices_of_replica(0), (std::vector<size_t>{0, 1}));
  EXPECT_EQ(t.devices_of_replica(3), (std::vector<size_t>{6, 7}));
  EXPECT_EQ(t.replica_of_device(5), 2u);
  EXPECT_EQ(t.tensor_rank_of_device(5), 1u);
  EXPECT_EQ(t.tensor_rank_of_device(4), 0u);
  EXPECT_EQ(t.logits_device(), 0u);
  EXPECT_THROW(t.devices_of_replica(4), std::out_of_range);
  EXPECT_THROW(t.expert_ranks(), std::logic_error);  // a dense layout has no experts
}

TEST(Topology, TensorRanges) {
  const Topology four(kDense, {.tensor = 4}, 4);
  // Heads divide: 8 over 4 ranks.
  EXPECT_EQ(four.tensor_slice(3, 8, "num_attention_heads").begin, 6);
  EXPECT_EQ(four.tensor_slice(3, 8, "num_attention_heads").count, 2);
  try {
    four.tensor_slice(0, 6, "num_attention_heads");
    FAIL() << "expected an error";
  } catch (const std::runtime_error& e) {
    EXPECT_EQ(std::string(e.what()),
              "tensor parallelism over 4 devices needs num_attention_heads (6) divisible by it");
  }
  // Two kv heads over four ranks: each copied on two consecutive ranks.
  for (size_t r = 0; r < 4; ++r) {
    const auto kv = four.tensor_slice_or_copy(r, 2, "num_key_value_heads");
    EXPECT_EQ(kv.begin, int64_t(r / 2));
    EXPECT_EQ(kv.count, 1);
  }
  EXPECT_EQ(four.tensor_slice_or_copy(1, 8, "num_key_value_heads").begin, 2);
  EXPECT_THROW(four.tensor_slice_or_copy(0, 3, "num_key_value_heads"), std::runtime_error);
  // The vocabulary need not divide: 10 rows over 4 ranks are 3, 3, 2, 2.
  std::vector<int64_t> begins, counts;
  for (size_t r = 0; r < 4; ++r) {
    begins.push_back(four.tensor_rows(r, 10).begin);
    counts.push_back(four.tensor_rows(r, 10).count);
  }
  EXPECT_EQ(begins, (std::vector<int64_t>{0, 3, 6, 8}));
  EXPECT_EQ(counts, (std::vector<int64_t>{3, 3, 2, 2}));
  // One rank owns everything.
  const Topology one(kDense, {}, 1);
  EXPECT_EQ(one.tensor_slice(0, 6, "x").count, 6);
  EXPECT_EQ(one.tensor_slice_or_copy(0, 3, "x").count, 3);
}

TEST(Topology, DataParallelAttentionExpertParallel) {
  const Topology t(kDpEp, {.data = 3, .expert = 3}, 3);
  EXPECT_EQ(t.replicas(), 3u);
  EXPECT_EQ(t.devices_of_replica(2), (std::vector<size_t>{2}));
  EXPECT_EQ(t.expert_ranks(), 3u);
  EXPECT_EQ(t.expert_blocks(16).first_expert, place_experts_even(16, 3).first_expert);
  // Balanced blocks come from the throughputs given, one per rank.
  const Topology balanced(kDpEp, {.data = 2, .expert = 2, .balanced_experts = true}, 2);
  EXPECT_EQ(balanced.expert_blocks(16, {1.0, 2.0}).first_expert,
            place_experts_balanced(16, {1.0, 2.0}).first_expert);
  EXPECT_THROW(balanced.expert_blocks(16), std::invalid_argument);
}

TEST(Topology, DegreesTheLayoutCannotUseNameTheKey) {
  Failure f = failure(kDpEp, {.data = 2, .expert = 1}, 2);
  EXPECT_EQ(f.keys, (std::vector<std::string>{"parallel.expert"}));
  EXPECT_NE(f.what.find("parallel.expert must be 2, got 1"), std::string::npos) << f.what;
  f = failure(kDpEp, {.data = 1, .expert = 2}, 2);
  EXPECT_EQ(f.keys, (std::vector<std::string>{"parallel.data"}));
  EXPECT_NE(f.what.find("parallel.data must be 2, got 1"), std::string::npos) << f.what;
  f = failure(kDpEp, {.data = 1, .tensor = 2, .expert = 2}, 2);
  EXPECT_EQ(f.what,
            "parallel.tensor: DeepSeek-V3: parallel.tensor = 2 is not supported (attention runs "
            "data-parallel, experts expert-parallel; set parallel.tensor = 1)");
  // The rules every layout shares.
  f = failure(kDense, {.data = 3}, 4);
  EXPECT_EQ(f.keys, (std::vector<std::string>{"parallel.data", "parallel.tensor"}));
  EXPECT_EQ(f.what,
            "parallel: data (3) * tensor (1) must equal the number of devices, and the deployment "
            "has 4 devices");
  f = failure(kDense, {.data = 4, .expert = 3}, 4);
  EXPECT_EQ(f.what,
            "parallel.expert: 3 expert-parallel ranks must divide the number of devices (4 "
            "devices)");
  f = failure(kDense, {.data = 0}, 1);
  EXPECT_EQ(f.what, "parallel.data: must be at least 1, got 0");
  EXPECT_NO_THROW(check_degrees({.data = 2, .tensor = 2, .expert = 2}, 4));
}

}  // namespace
}  // namespace clshard::parallel
