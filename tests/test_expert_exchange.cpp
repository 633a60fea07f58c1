// parallel::plan_expert_exchange: the offsets and permutations of one expert-parallel dispatch and
// combine, checked on the host against a direct walk of every (source, expert) row.
#include <gtest/gtest.h>

#include <numeric>
#include <random>
#include <tuple>
#include <vector>

#include "parallel/expert_exchange.h"

namespace clshard::parallel {
namespace {

// Source r's rows grouped by expert: expert e has rows[r][e] of them.
std::vector<std::vector<uint32_t>> offsets_of(const std::vector<std::vector<uint32_t>>& rows) {
  std::vector<std::vector<uint32_t>> offs;
  for (const auto& per_expert : rows) {
    std::vector<uint32_t> o(per_expert.size() + 1, 0);
    std::partial_sum(per_expert.begin(), per_expert.end(), o.begin() + 1);
    offs.push_back(o);
  }
  return offs;
}

TEST(ExpertExchange, TwoRanksByHand) {
  // 4 experts, 2 per rank. Source 0 routes rows to experts {0: 2, 1: 0, 2: 1, 3: 1}, source 1 to
  // {0: 1, 1: 1, 2: 0, 3: 2}.
  const auto place = place_experts_even(4, 2);
  const auto p = plan_expert_exchange(offsets_of({{2, 0, 1, 1}, {1, 1, 0, 2}}), place);
  ASSERT_EQ(p.ranks(), 2u);
  EXPECT_EQ(p.send_off[0], (std::vector<uint32_t>{0, 2, 4}));
  EXPECT_EQ(p.send_off[1], (std::vector<uint32_t>{0, 2, 4}));
  EXPECT_EQ(p.recv_off[0], (std::vector<uint32_t>{0, 2, 4}));
  EXPECT_EQ(p.recv_off[1], (std::vector<uint32_t>{0, 2, 4}));
  // Rank 0 receives [s0 e0, s0 e0, s1 e0, s1 e1]: expert 0 has three rows, expert 1 one, and
  // they are already in expert order, but two sources sent rows, so it regroups (identity here).
  EXPECT_EQ(p.expert_rows[0], (std::vector<uint32_t>{0, 3, 4}));
  EXPECT_EQ(p.perm[0], (std::vector<uint32_t>{0, 1, 2, 3}));
  EXPECT_TRUE(p.regroup[0]);
  // Rank 1 receives [s0 e2, s0 e3, s1 e3, s1 e3]: expert 2 has row 0, expert 3 rows 1, 2, 3.
  EXPECT_EQ(p.expert_rows[1], (std::vector<uint32_t>{0, 1, 4}));
  EXPECT_EQ(p.perm[1], (std::vector<uint32_t>{0, 1, 2, 3}));
}

TEST(ExpertExchange, RegroupsBySourceWithinEachExpert) {
  // 3 experts on 2 ranks: blocks [0, 2) and [2, 3). Both sources send one row to each of experts
  // 0 and 1, so rank 0 receives [s0 e0, s0 e1, s1 e0, s1 e1] and regroups them to
  // [s0 e0, s1 e0, s0 e1, s1 e1].
  const auto place = place_experts_even(3, 2);
  ASSERT_EQ(place.first_expert, (std::vector<uint32_t>{0, 2, 3}));
  const auto p = plan_expert_exchange(offsets_of({{1, 1, 2}, {1, 1, 1}}), place);
  EXPECT_EQ(p.send_off[0], (std::vector<uint32_t>{0, 2, 4}));
  EXPECT_EQ(p.send_off[1], (std::vector<uint32_t>{0, 2, 3}));
  EXPECT_EQ(p.recv_off[0], (std::vector<uint32_t>{0, 2, 4}));
  EXPECT_EQ(p.recv_off[1], (std::vector<uint32_t>{0, 2, 3}));
  EXPECT_TRUE(p.regroup[0]);
  EXPECT_EQ(p.perm[0], (std::vector<uint32_t>{0, 2, 1, 3}));
  EXPECT_EQ(p.inv[0], (std::vector<uint32_t>{0, 2, 1, 3}));
  EXPECT_EQ(p.expert_rows[0], (std::vector<uint32_t>{0, 2, 4}));
  EXPECT_EQ(p.expert_rows[1], (std::vector<uint32_t>{0, 3}));
}

TEST(ExpertExchange, OneSenderNeedsNoRegroup) {
  const auto place = place_experts_even(4, 2);
  const auto p = plan_expert_exchange(offsets_of({{1, 2, 0, 0}, {0, 0, 3, 1}}), place);
  EXPECT_FALSE(p.regroup[0]);  // only source 0 sends to rank 0
  EXPECT_FALSE(p.regroup[1]);  // only source 1 sends to rank 1
  EXPECT_EQ(p.rows_sent(0), 3u);
  EXPECT_EQ(p.rows_received(1), 4u);
  EXPECT_EQ(p.expert_rows[1], (std::vector<uint32_t>{0, 3, 4}));
}

// Every (source, expert, i) row: where its source sends it, where its rank receives it, and
// where regrouping puts it must agree, for random routings over uneven and empty blocks.
TEST(ExpertExchange, RandomRoutingsAgreeWithADirectWalk) {
  std::mt19937 rng(7);
  for (auto [E, N] : {std::tuple{16u, 3u}, std::tuple{3u, 5u}, std::tuple{8u, 1u},
                      std::tuple{64u, 4u}}) {
    const auto place = place_experts_even(E, N);
    std::vector<std::vector<uint32_t>> rows(N, std::vector<uint32_t>(E));
    for (auto& per_expert : rows)
      for (auto& n : per_expert) n = rng() % 4;
    const auto offs = offsets_of(rows);
    const auto p = plan_expert_exchange(offs, place);
    for (uint32_t d = 0; d < N; ++d) {
      ASSERT_EQ(p.inv[d].size(), p.perm[d].size());
      ASSERT_EQ(p.perm[d].size(), p.rows_received(d));
      for (uint32_t i = 0; i < p.perm[d].size(); ++i) EXPECT_EQ(p.inv[d][p.perm[d][i]], i);
      EXPECT_EQ(p.expert_rows[d].size(), place.count(d) + 1u);
    }
    for (uint32_t r = 0; r < N; ++r)
      for (uint32_t e = 0; e < E; ++e) {
        const uint32_t d = place.rank_of(e), local = place.local_index(e);
        for (uint32_t i = 0; i < rows[r][e]; ++i) {
          const uint32_t sent = offs[r][e] + i;  // in source r's send order
          ASSERT_GE(sent, p.send_off[r][d]);
          ASSERT_LT(sent, p.send_off[r][d + 1]);
          const uint32_t received = p.recv_off[d][r] + (sent - p.send_off[r][d]);
          const uint32_t grouped = p.inv[d][received];
          EXPECT_GE(grouped, p.expert_rows[d][local]);
          EXPECT_LT(grouped, p.expert_rows[d][local + 1]);
        }
      }
  }
}

TEST(ExpertExchange, CountsThatDoNotMatchAreErrors) {
  const auto place = place_experts_even(4, 2);
  EXPECT_THROW(plan_expert_exchange(offsets_of({{1, 1, 1, 1}}), place), std::invalid_argument);
  EXPECT_THROW(plan_expert_exchange(offsets_of({{1, 1, 1}, {1, 1, 1}}), place),
               std::invalid_argument);
}

}  // namespace
}  // namespace clshard::parallel
