// Speculative-decoding acceptance (runtime/engine/acceptance.h) on the test device: exact greedy prefixes,
// the committed tokens' distribution against the target's (chi-square, as the sampler tests), the
// bonus against sample_tokens, relaxed acceptance, the bitmask, the host reference, bad input.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "runtime/engine/acceptance.h"
#include "runtime/device.h"
#include "runtime/engine/sampling.h"
#include "tests/test_util.h"

namespace clshard {
namespace {

Device& dev() { return test::default_device(); }

using test::expect_matches_distribution;
using test::random_logits;
using test::seeds_from;

const SamplingParams kGreedy{.temperature = 0.0f};

// The host inputs of one accept_drafts call, built request by request.
struct Batch {
  uint32_t vocab;
  std::vector<float> logits;
  std::vector<uint32_t> logit_offsets{0};
  std::vector<int32_t> drafts;
  std::vector<uint32_t> draft_offsets{0};
  std::vector<SamplingParams> params;
  std::vector<uint64_t> seeds;
  std::vector<uint8_t> thinking;
  std::vector<uint32_t> bitmask;  // empty: none

  explicit Batch(uint32_t v) : vocab(v) {}

  // A request verifying `d` against `rows` (drafts.size() + 1 rows of `vocab` logits).
  void add(const std::vector<float>& rows, const std::vector<int32_t>& d, const SamplingParams& p,
           uint64_t seed, bool think = false) {
    EXPECT_EQ(rows.size(), (d.size() + 1) * vocab);
    logits.insert(logits.end(), rows.begin(), rows.end());
    logit_offsets.push_back(logit_offsets.back() + uint32_t(d.size()) + 1);
    drafts.insert(drafts.end(), d.begin(), d.end());
    draft_offsets.push_back(uint32_t(drafts.size()));
    params.push_back(p);
    seeds.push_back(seed);
    thinking.push_back(think ? 1 : 0);
  }
  size_t size() const { return params.size(); }
  int32_t draft(size_t b, uint32_t i) const { return drafts[draft_offsets[b] + i]; }
  const float* row(size_t b, uint32_t i) const {
    return &logits[size_t(logit_offsets[b] + i) * vocab];
  }
  const uint32_t* mask_row(size_t b, uint32_t i) const {
    return bitmask.empty() ? nullptr
                           : &bitmask[size_t(logit_offsets[b] + i) * bitmask_words(vocab)];
  }

  AcceptanceResult run(const RelaxedAcceptance& relaxed = {}) const {
    const cl::Mem buf = test::upload(dev(), logits);
    const cl::Mem mask = bitmask.empty() ? cl::Mem() : test::upload(dev(), bitmask);
    return accept_drafts(dev(), buf, vocab, logit_offsets, drafts, draft_offsets, params, seeds,
                         thinking, relaxed, bitmask.empty() ? nullptr : &mask);
  }
  AcceptanceResult reference(const RelaxedAcceptance& relaxed = {}) const {
    return accept_drafts_reference(logits, vocab, logit_offsets, drafts, draft_offsets, params,
                                   seeds, thinking, relaxed, bitmask);
  }
  // The first token request b commits: its first draft when accepted, else the next token.
  int32_t first_committed(const AcceptanceResult& r, size_t b) const {
    return r.num_accepted[b] > 0 ? draft(b, 0) : r.next_token[b];
  }
};

// `n` copies of `row`.
std::vector<float> repeat(const std::vector<float>& row, uint32_t n) {
  std::vector<float> out;
  for (uint32_t i = 0; i < n; ++i) out.insert(out.end(), row.begin(), row.end());
  return out;
}

// A row of `vocab` zeros with `hi` at the given ids (the argmax is the lowest of them).
std::vector<float> peaked(uint32_t vocab, std::vector<uint32_t> ids, float hi = 5.0f) {
  std::vector<float> row(vocab, 0.0f);
  for (uint32_t id : ids) row[id] = hi;
  return row;
}

std::vector<float> concat(const std::vector<std::vector<float>>& rows) {
  std::vector<float> out;
  for (const auto& r : rows) out.insert(out.end(), r.begin(), r.end());
  return out;
}

int32_t host_argmax(const float* row, uint32_t vocab) {
  return int32_t(std::max_element(row, row + vocab) - row);
}

// ---- greedy -------------------------------------------------------------------------------------

TEST(AcceptanceGreedy, PrefixLengthsAndNextTokensOnHandMadeLogits) {
  const uint32_t V = 8;
  Batch batch(V);
  // (drafts, argmax ids per row (several = a tie), expected accepted, expected next token)
  struct Case {
    std::vector<int32_t> drafts;
    std::vector<std::vector<uint32_t>> peaks;
    uint32_t accepted;
    int32_t next;
  };
  const std::vector<Case> cases = {
      {{}, {{3}}, 0, 3},                                // no drafts: plain greedy
      {{2}, {{2}, {5}}, 1, 5},                          // K=1, accepted, bonus 5
      {{4}, {{1}, {5}}, 0, 1},                          // K=1, rejected
      {{4, 1}, {{4}, {6}, {0}}, 1, 6},                  // K=2, second rejected
      {{1, 1, 1}, {{0}, {1}, {1}, {1}}, 0, 0},          // K=3, first rejected
      {{7, 0, 3}, {{7}, {0}, {3}, {2}}, 3, 2},          // K=3, all accepted
      {{7, 0, 3, 3}, {{7}, {0}, {3}, {3}, {6}}, 4, 6},  // K=4, all accepted
      {{7, 0, 3, 3}, {{7}, {0}, {3}, {5}, {6}}, 3, 5},  // K=4, last rejected
      {{6, 0}, {{2, 6}, {0}, {1}}, 0, 2},               // tie 2/6: argmax 2, draft 6 loses
      {{1, 7}, {{1, 4}, {0, 7}, {3}}, 1, 0},            // tie accepted, then tie 0/7 -> 0
      {{5, 5}, {{5, 6, 7}, {2, 5}, {4}}, 1, 2},         // ties at both positions
  };
  for (size_t c = 0; c < cases.size(); ++c) {
    std::vector<std::vector<float>> rows;
    for (const auto& ids : cases[c].peaks) rows.push_back(peaked(V, ids));
    batch.add(concat(rows), cases[c].drafts, kGreedy, 100 + c);
  }
  // top_k = 1 at temperature 1 is greedy too.
  batch.add(concat({peaked(V, {3}), peaked(V, {4}), peaked(V, {1, 2})}), {3, 4},
            SamplingParams{.temperature = 1.0f, .top_k = 1}, 7);

  const auto got = batch.run();
  ASSERT_EQ(got.num_accepted.size(), cases.size() + 1);
  for (size_t c = 0; c < cases.size(); ++c) {
    EXPECT_EQ(got.num_accepted[c], cases[c].accepted) << "case " << c;
    EXPECT_EQ(got.next_token[c], cases[c].next) << "case " << c;
  }
  EXPECT_EQ(got.num_accepted.back(), 2u);
  EXPECT_EQ(got.next_token.back(), 1);
  const auto ref = batch.reference();
  EXPECT_EQ(ref.num_accepted, got.num_accepted);
  EXPECT_EQ(ref.next_token, got.next_token);
}

TEST(AcceptanceGreedy, RandomRowsAcceptUpToTheFirstNonArgmaxDraft) {
  const uint32_t V = 1000;
  std::mt19937 rng(3);
  Batch batch(V);
  std::vector<uint32_t> want_accepted;
  std::vector<int32_t> want_next;
  for (uint32_t b = 0; b < 40; ++b) {
    const uint32_t k = 1 + b % 4;
    const uint32_t accept = rng() % (k + 1);  // 0..K drafts right
    const auto rows = random_logits(k + 1, V, 1000 + b);
    std::vector<int32_t> d(k);
    for (uint32_t i = 0; i < k; ++i) {
      const int32_t best = host_argmax(&rows[size_t(i) * V], V);
      d[i] = i < accept ? best : int32_t((best + 1 + rng() % (V - 1)) % V);
      if (i > accept) d[i] = int32_t(rng() % V);  // after the rejection: anything
    }
    batch.add(rows, d, kGreedy, b);
    want_accepted.push_back(accept);
    want_next.push_back(host_argmax(&rows[size_t(accept) * V], V));
  }
  const auto got = batch.run();
  EXPECT_EQ(got.num_accepted, want_accepted);
  EXPECT_EQ(got.next_token, want_next);
}

TEST(AcceptanceGreedy, RowsWithoutDraftsArePlainSampling) {
  // K = 0 everywhere, mixed parameters: next token == sample_tokens with the same seed.
  const uint32_t V = 3001, B = 24;
  const auto logits = random_logits(B, V, 17, 1.0f);
  const auto seeds = seeds_from(5, B);
  Batch batch(V);
  for (uint32_t b = 0; b < B; ++b) {
    SamplingParams p;
    p.temperature = b % 3 == 0 ? 0.0f : 0.8f;
    p.top_k = b % 4 == 1 ? 40 : -1;
    p.top_p = b % 5 == 2 ? 0.9f : 1.0f;
    batch.add({logits.begin() + b * V, logits.begin() + (b + 1) * V}, {}, p, seeds[b]);
  }
  const auto got = batch.run();
  const auto plain =
      sample_tokens(dev(), test::upload(dev(), logits), B, V, batch.params, batch.seeds);
  EXPECT_EQ(got.next_token, plain);
  EXPECT_EQ(got.num_accepted, std::vector<uint32_t>(B, 0));
}

// ---- stochastic ---------------------------------------------------------------------------------

// A 40-token row with an uneven distribution that every filter below cuts.
std::vector<float> target_row() { return random_logits(1, 40, 2718, 1.5f); }

struct Setting {
  const char* name;
  SamplingParams params;
};
const Setting kSettings[] = {
    {"T=0.8 top_k=10", {.temperature = 0.8f, .top_k = 10}},
    {"top_p=0.7", {.temperature = 1.0f, .top_p = 0.7f}},
    {"T=1.5 min_p=0.05 top_p=0.9", {.temperature = 1.5f, .top_p = 0.9f, .min_p = 0.05f}},
    {"T=1.2 top_k=20 min_p=0.02 top_p=0.95",
     {.temperature = 1.2f, .top_k = 20, .top_p = 0.95f, .min_p = 0.02f}},
};

TEST(AcceptanceStochastic, FirstCommittedTokenFollowsTheTargetDistribution) {
  const auto row = target_row();
  const uint32_t V = uint32_t(row.size()), N = 20000;
  uint64_t seed = 11;
  for (const Setting& s : kSettings) {
    const auto p = sampling_distribution(row.data(), V, s.params);
    // Drafts: right (the most likely token), wrong (the least likely kept token), outside the
    // kept set, and random (uniform over the vocabulary, a new one per trial).
    uint32_t best = 0, worst = 0, outside = V;
    for (uint32_t i = 0; i < V; ++i) {
      if (p[i] > p[best]) best = i;
      if (p[i] > 0.0f && (p[worst] == 0.0f || p[i] < p[worst])) worst = i;
      if (p[i] == 0.0f && outside == V) outside = i;
    }
    ASSERT_LT(outside, V) << s.name << " keeps every token";
    ASSERT_LT(p[worst], 0.25f * p[best]) << s.name;
    struct Draft {
      const char* name;
      int32_t token;  // -1: random
    };
    for (const Draft d : {Draft{"right", int32_t(best)}, Draft{"wrong", int32_t(worst)},
                          Draft{"outside", int32_t(outside)}, Draft{"random", -1}}) {
      const std::string what = std::string(s.name) + ", " + d.name + " draft";
      SCOPED_TRACE(what);
      std::mt19937 rng{uint32_t(seed)};
      Batch batch(V);
      const auto rows = repeat(row, 2);  // the verified position and the bonus
      for (uint32_t t = 0; t < N; ++t)
        batch.add(rows, {d.token >= 0 ? d.token : int32_t(rng() % V)}, s.params,
                  seed + t * 0x9E3779B97F4A7C15ull);
      seed += 1'000'003;
      const auto got = batch.run();
      std::vector<int32_t> first(N), recovered;
      double accepted = 0.0, expected_rate = 0.0;
      uint32_t recovered_draft = 0;
      for (uint32_t t = 0; t < N; ++t) {
        first[t] = batch.first_committed(got, t);
        accepted += got.num_accepted[t];
        expected_rate += p[batch.draft(t, 0)] / N;
        if (got.num_accepted[t] == 0) {
          recovered_draft += got.next_token[t] == batch.draft(t, 0);
          recovered.push_back(got.next_token[t]);
        }
      }
      EXPECT_EQ(recovered_draft, 0u) << "a rejected draft came back as the recovered token";
      expect_matches_distribution(first, p, what.c_str());
      // Accepted with probability p(d).
      EXPECT_NEAR(accepted / N, expected_rate, 0.015);
      if (d.token == int32_t(outside)) {
        EXPECT_EQ(accepted, 0.0);
      }
      // A rejected draft is replaced from p with d removed and renormalised.
      if (d.token >= 0) {
        auto residual = p;
        residual[d.token] = 0.0f;
        const double rest = 1.0 - p[d.token];
        for (float& x : residual) x = float(x / rest);
        expect_matches_distribution(recovered, residual, (what + ", recovered").c_str());
      }
    }
  }
}

TEST(AcceptanceStochastic, TwoPositionsCommitTheProductOfTheTargetDistributions) {
  // Two positions with their own rows; the draft is right at 0 (often accepted) and random at 1.
  // When position 0 rejects, the second token comes from the next step: plain sampling of row 1
  // with seed + 1 (a request with no drafts).
  const uint32_t V = 10, N = 20000;
  const auto rows = random_logits(3, V, 99, 1.2f);
  const std::vector<float> row0(rows.begin(), rows.begin() + V),
      row1(rows.begin() + V, rows.begin() + 2 * V);
  const SamplingParams params{.temperature = 0.9f, .top_k = 6};
  const auto p0 = sampling_distribution(row0.data(), V, params);
  const auto p1 = sampling_distribution(row1.data(), V, params);
  const int32_t d0 = host_argmax(row0.data(), V);

  std::mt19937 rng(4);
  Batch batch(V);
  for (uint32_t t = 0; t < N; ++t)
    batch.add(rows, {d0, int32_t(rng() % V)}, params, 77 + t * 0x9E3779B97F4A7C15ull);
  const auto got = batch.run();
  Batch next_step(V);
  std::vector<uint32_t> rejected_at_0;
  for (uint32_t t = 0; t < N; ++t) {
    if (got.num_accepted[t] > 0) continue;
    rejected_at_0.push_back(t);
    next_step.add(row1, {}, params, batch.seeds[t] + 1);
  }
  const auto second = next_step.run();

  std::vector<int32_t> pairs(N);
  uint32_t both_accepted = 0;
  for (uint32_t t = 0, j = 0; t < N; ++t) {
    const uint32_t a = got.num_accepted[t];
    const int32_t t0 = a > 0 ? d0 : got.next_token[t];
    const int32_t t1 = a >= 2   ? batch.draft(t, 1)
                       : a == 1 ? got.next_token[t]
                                : second.next_token[j++];
    both_accepted += a == 2;
    pairs[t] = t0 * int32_t(V) + t1;
  }
  std::vector<float> joint(V * V);
  for (uint32_t i = 0; i < V; ++i)
    for (uint32_t j = 0; j < V; ++j) joint[i * V + j] = p0[i] * p1[j];
  expect_matches_distribution(pairs, joint, "two positions");
  EXPECT_GT(rejected_at_0.size(), N / 10);  // both paths are exercised
  EXPECT_GT(both_accepted, 0u);
}

TEST(AcceptanceStochastic, CommittedTokensAreSampleTokensDrawsForTheSameSeeds) {
  // Drafts that plain sampling would draw (so all are accepted) and drafts that differ from it at
  // one position: the bonus, and the recovered token, equal sample_tokens at that row and seed.
  for (uint32_t V : {1000u, 32001u}) {
    SCOPED_TRACE(V);
    const uint32_t B = 48;
    std::mt19937 rng(V);
    Batch batch(V);
    std::vector<uint32_t> want_accepted;
    std::vector<int32_t> want_next;
    for (uint32_t b = 0; b < B; ++b) {
      const uint32_t k = b % 5;
      const auto rows = random_logits(k + 1, V, V + b, 1.0f);
      SamplingParams p{.temperature = 0.7f + 0.1f * (b % 4)};
      if (b % 3 == 1) p.top_k = b % 2 ? 50 : 300;  // heap and radix top-k
      if (b % 4 == 2) p.top_p = 0.8f;
      if (b % 6 == 5) p.min_p = 0.01f;
      const uint64_t seed = 12345 + b * 0x9E3779B97F4A7C15ull;
      // What plain sampling draws at each position.
      std::vector<uint64_t> position_seeds(k + 1);
      for (uint32_t i = 0; i <= k; ++i) position_seeds[i] = seed + i;
      const auto plain = sample_tokens(dev(), test::upload(dev(), rows), k + 1, V,
                                       std::vector<SamplingParams>(k + 1, p), position_seeds);
      const uint32_t reject_at = b % 2 ? k : uint32_t(rng() % (k + 1));  // k: all accepted
      std::vector<int32_t> d(plain.begin(), plain.begin() + k);
      if (reject_at < k) d[reject_at] = (plain[reject_at] + 1) % int32_t(V);
      batch.add(rows, d, p, seed);
      want_accepted.push_back(reject_at);
      want_next.push_back(plain[reject_at]);
    }
    const auto got = batch.run();
    EXPECT_EQ(got.num_accepted, want_accepted);
    EXPECT_EQ(got.next_token, want_next);
  }
}

// ---- relaxed ------------------------------------------------------------------------------------

// Untempered probabilities by rank; rank r sits at token id kIds[r] (shuffled, so ids do not
// follow rank). The logits are log(p) + 3 (softmax ignores the shift).
const float kProbs[16] = {0.396f, 0.25f,  0.12f,  0.08f,  0.05f,  0.03f,  0.02f,  0.015f,
                          0.01f,  0.008f, 0.006f, 0.005f, 0.004f, 0.003f, 0.002f, 0.001f};
const uint32_t kIds[16] = {9, 2, 14, 0, 7, 11, 5, 3, 15, 1, 12, 8, 6, 13, 10, 4};

std::vector<float> relaxed_row() {
  std::vector<float> row(16);
  for (uint32_t r = 0; r < 16; ++r) row[kIds[r]] = std::log(kProbs[r]) + 3.0f;
  return row;
}

TEST(AcceptanceRelaxed, AcceptsExactlyWhatTheRuleSays) {
  const auto row = relaxed_row();
  const uint32_t V = 16;
  // top_k 3, delta 0.2: ranks 0 and 1 (0.25 >= 0.196); rank 2 fails delta (0.12 < 0.196).
  // top_k 3, delta 0.35: ranks 0..2 (>= 0.046); rank 3 (0.08) passes delta but is 4th.
  // The defaults (10, 0.6): ranks 0..9 (delta never binds); rank 10 is 11th.
  struct Case {
    RelaxedAcceptance relaxed;
    uint32_t accepted_ranks;
  };
  // Both kernel shapes: the GPU shape counts the tokens above the draft and sums the row's mass
  // with the work-group (accept_rows_wg).
  for (const KernelShape shape : {KernelShape::Chunks, KernelShape::WorkGroups})
  for (const Case c : {Case{{3, 0.2f}, 2}, Case{{3, 0.35f}, 3}, Case{{}, 10}}) {
    test::ShapeScope scope(dev(), shape);
    SCOPED_TRACE(testing::Message() << "top_k " << c.relaxed.top_k << " delta " << c.relaxed.delta
                                    << (shape == KernelShape::Chunks ? ", CPU shape" : ", GPU shape"));
    Batch batch(V);
    // One request per rank, thinking, at a temperature the relaxed rule ignores; then the same
    // requests without thinking at temperature 0 (strict: only the argmax passes).
    for (uint32_t r = 0; r < 16; ++r)
      batch.add(repeat(row, 2), {int32_t(kIds[r])}, {.temperature = 0.3f}, 50 + r, true);
    for (uint32_t r = 0; r < 16; ++r) batch.add(repeat(row, 2), {int32_t(kIds[r])}, kGreedy, r);
    const auto got = batch.run(c.relaxed);
    // What plain sampling draws at the bonus row (position 1) of each thinking request.
    std::vector<uint64_t> bonus_seeds(16);
    for (uint32_t r = 0; r < 16; ++r) bonus_seeds[r] = 50 + r + 1;
    const auto bonus =
        sample_tokens(dev(), test::upload(dev(), repeat(row, 16)), 16, V,
                      std::vector<SamplingParams>(16, {.temperature = 0.3f}), bonus_seeds);
    for (uint32_t r = 0; r < 16; ++r) {
      const bool accept = r < c.accepted_ranks;
      EXPECT_EQ(got.num_accepted[r], accept ? 1u : 0u) << "rank " << r;
      if (!accept) {
        EXPECT_EQ(got.next_token[r], int32_t(kIds[0])) << "rank " << r;
      }
      // Without thinking: the strict greedy rule.
      EXPECT_EQ(got.num_accepted[16 + r], r == 0 ? 1u : 0u) << "strict rank " << r;
      EXPECT_EQ(got.next_token[16 + r], int32_t(kIds[0])) << "strict rank " << r;
    }
    // The bonus after a relaxed acceptance is plain sampling's draw at the bonus row.
    for (uint32_t r = 0; r < c.accepted_ranks; ++r)
      EXPECT_EQ(got.next_token[r], bonus[r]) << "rank " << r;
    const auto ref = batch.reference(c.relaxed);
    EXPECT_EQ(ref.num_accepted, got.num_accepted);
    EXPECT_EQ(ref.next_token, got.next_token);
  }
}

TEST(AcceptanceRelaxed, StopsAtTheFirstRelaxedRejectionAndMixesWithStrictRows) {
  const auto row = relaxed_row();
  const uint32_t V = 16;
  const RelaxedAcceptance relaxed{3, 0.35f};
  std::vector<float> rows = repeat(row, 4);
  rows[3 * V + 6] = 20.0f;  // the bonus row's argmax is token 6
  for (const KernelShape shape : {KernelShape::Chunks, KernelShape::WorkGroups}) {
  test::ShapeScope scope(dev(), shape);
  SCOPED_TRACE(shape == KernelShape::Chunks ? "CPU shape" : "GPU shape");
  Batch batch(V);
  // Ranks 1, 2 pass, rank 5 does not: 2 accepted, next = the argmax of row 2.
  batch.add(rows, {int32_t(kIds[1]), int32_t(kIds[2]), int32_t(kIds[5])}, kGreedy, 1, true);
  // Ranks 0, 2, 1 all pass: the bonus, greedy -> token 6.
  batch.add(rows, {int32_t(kIds[0]), int32_t(kIds[2]), int32_t(kIds[1])}, kGreedy, 2, true);
  // The same without thinking: rank 1 is not the argmax.
  batch.add(rows, {int32_t(kIds[1]), int32_t(kIds[2]), int32_t(kIds[5])}, kGreedy, 3, false);
  const auto got = batch.run(relaxed);
  EXPECT_EQ(got.num_accepted, (std::vector<uint32_t>{2, 3, 0}));
  EXPECT_EQ(got.next_token, (std::vector<int32_t>{int32_t(kIds[0]), 6, int32_t(kIds[0])}));
  }
}

// ---- bitmask ------------------------------------------------------------------------------------

TEST(AcceptanceBitmask, DisallowedDraftsAreRejectedAndDrawsRespectTheMask) {
  const uint32_t V = 64, W = bitmask_words(V), B = 600;
  std::mt19937 rng(8);
  Batch batch(V);
  const SamplingParams hot{.temperature = 2.0f};
  for (uint32_t b = 0; b < B; ++b) {
    const auto rows = random_logits(3, V, 500 + b);
    // Every row disallows its own argmax and about half of the rest.
    for (uint32_t i = 0; i < 3; ++i) {
      const uint32_t best = uint32_t(host_argmax(&rows[size_t(i) * V], V));
      for (uint32_t w = 0; w < W; ++w)
        batch.bitmask.push_back(uint32_t(rng()) | 1u << ((w + b) % 32));
      uint32_t* m = &batch.bitmask[batch.bitmask.size() - W];
      m[best / 32] &= ~(1u << (best % 32));
    }
    const uint32_t kind = b % 3;
    const int32_t best0 = host_argmax(rows.data(), V);
    if (kind == 0) {
      // Greedy, the draft is the unmasked argmax: rejected, the next token is the best allowed.
      batch.add(rows, {best0, 0}, kGreedy, b);
    } else if (kind == 1) {
      // Hot sampling, the draft is the (disallowed) argmax: always rejected.
      batch.add(rows, {best0, 0}, hot, b * 7919);
    } else {
      // Hot sampling, the drafts are the masked draws, so all are accepted; then the bonus.
      batch.add(rows, {0, 0}, hot, b * 7919);
      for (uint32_t i = 0; i < 2; ++i)
        batch.drafts[batch.draft_offsets[b] + i] =
            sample_reference(batch.row(b, i), V, hot, batch.seeds[b] + i, batch.mask_row(b, i));
    }
  }
  const auto got = batch.run();
  auto allowed = [&](uint32_t b, uint32_t i, int32_t t) {
    return (batch.mask_row(b, i)[t / 32] >> (t % 32)) & 1u;
  };
  for (uint32_t b = 0; b < B; ++b) {
    const uint32_t at = got.num_accepted[b];
    ASSERT_LE(at, 2u);
    EXPECT_TRUE(allowed(b, at, got.next_token[b])) << "request " << b;
    if (b % 3 == 2) {
      EXPECT_EQ(at, 2u) << "request " << b;
      continue;
    }
    EXPECT_EQ(at, 0u) << "request " << b;
    if (b % 3 == 0) {
      int32_t best = -1;
      for (uint32_t t = 0; t < V; ++t)
        if (allowed(b, 0, int32_t(t)) && (best < 0 || batch.row(b, 0)[t] > batch.row(b, 0)[best]))
          best = int32_t(t);
      EXPECT_EQ(got.next_token[b], best) << "request " << b;
    }
  }
  const auto ref = batch.reference();
  EXPECT_EQ(ref.num_accepted, got.num_accepted);
  EXPECT_EQ(ref.next_token, got.next_token);

  // The masked distribution, over many trials of one row with a disallowed draft: the committed
  // token is distributed as plain sampling's masked distribution.
  const auto row = random_logits(2, V, 31, 1.0f);
  std::vector<uint32_t> mask(2 * W, 0x5A5A5A5Au);
  const int32_t banned = 1;  // allowed by the pattern (0x5A = 0b01011010) until cleared
  mask[0] &= ~(1u << banned);
  Batch many(V);
  for (uint32_t t = 0; t < 10000; ++t) {
    many.add(row, {banned}, hot, 900 + t * 0x9E3779B97F4A7C15ull);
    many.bitmask.insert(many.bitmask.end(), mask.begin(), mask.end());
  }
  const auto res = many.run();
  std::vector<int32_t> first(10000);
  for (uint32_t t = 0; t < 10000; ++t) {
    ASSERT_EQ(res.num_accepted[t], 0u);
    first[t] = res.next_token[t];
  }
  expect_matches_distribution(first, sampling_distribution(row.data(), V, hot, mask.data()),
                              "masked, disallowed draft");
}

TEST(AcceptanceBitmask, RelaxedRowsRejectADisallowedDraft) {
  const auto row = relaxed_row();
  const uint32_t V = 16;
  Batch batch(V);
  batch.add(repeat(row, 2), {int32_t(kIds[0])}, kGreedy, 1, true);  // top-1 but disallowed
  batch.add(repeat(row, 2), {int32_t(kIds[2])}, kGreedy, 2, true);  // allowed, accepted
  // Row 0 of each request bans kIds[0]; the bonus rows allow everything.
  const uint32_t ban = ~(1u << kIds[0]);
  batch.bitmask = {ban, ~0u, ban, ~0u};
  const auto got = batch.run();
  EXPECT_EQ(got.num_accepted, (std::vector<uint32_t>{0, 1}));
  EXPECT_EQ(got.next_token, (std::vector<int32_t>{int32_t(kIds[1]), int32_t(kIds[0])}));
}

// ---- the host reference -------------------------------------------------------------------------

const SamplingParams kMixedParams[] = {
    kGreedy,
    {.temperature = 1.0f},
    {.temperature = 0.7f, .top_k = 17},
    {.temperature = 1.0f, .top_k = 300},  // radix top-k
    {.temperature = 1.3f, .top_p = 0.9f},
    {.temperature = 0.8f, .top_k = 40, .top_p = 0.8f, .min_p = 0.02f},
    {.temperature = 1.0f, .min_p = 0.05f},
};

// B requests over a vocabulary of V: request b verifies b % 5 drafts with kMixedParams[b % 7],
// every fourth relaxed (thinking), random bitmasks; the drafts mostly what the target would commit
// (so runs of acceptances), sometimes random.
Batch random_batch(uint32_t V, uint32_t B) {
  const uint32_t W = bitmask_words(V);
  std::mt19937 rng(21);
  Batch batch(V);
  for (uint32_t b = 0; b < B; ++b) {
    const uint32_t k = b % 5;
    const auto& p = kMixedParams[b % 7];
    const bool think = b % 4 == 3;
    std::vector<int32_t> d(k, 0);
    batch.add(random_logits(k + 1, V, 7000 + b, 2.0f), d, p, rng(), think);
    for (uint32_t i = 0; i <= k; ++i)
      for (uint32_t w = 0; w < W; ++w) batch.bitmask.push_back(uint32_t(rng()) | uint32_t(rng()));
    // Drafts: mostly what the target would commit (so runs of acceptances), sometimes random.
    for (uint32_t i = 0; i < k; ++i) {
      const int32_t likely =
          think ? sample_reference(batch.row(b, i), V, kGreedy, 0, batch.mask_row(b, i))
                : sample_reference(batch.row(b, i), V, p, batch.seeds[b] + i, batch.mask_row(b, i));
      batch.drafts[batch.draft_offsets[b] + i] = rng() % 4 ? likely : int32_t(rng() % V);
    }
  }
  return batch;
}

TEST(AcceptanceReference, KernelMatchesTheHostReferenceOnRandomLogits) {
  const uint32_t V = 1000, B = 300;
  const Batch batch = random_batch(V, B);
  const auto got = batch.run();
  const auto ref = batch.reference();
  int mismatches = 0;
  uint32_t accepted = 0, all_accepted = 0;
  for (uint32_t b = 0; b < B; ++b) {
    mismatches +=
        got.num_accepted[b] != ref.num_accepted[b] || got.next_token[b] != ref.next_token[b];
    accepted += got.num_accepted[b];
    all_accepted += got.num_accepted[b] == b % 5;
  }
  EXPECT_LE(mismatches, 1);  // only an ulp of exp() right at a boundary can split them
  EXPECT_GT(accepted, 150u);
  EXPECT_GT(all_accepted, 100u);

  // A few requests at a real vocabulary size.
  const uint32_t big = 128256;
  Batch large(big);
  for (uint32_t b = 0; b < 4; ++b) {
    const auto rows = random_logits(3, big, 40 + b, 2.0f);
    const SamplingParams& p = kMixedParams[(b * 2 + 1) % 7];
    large.add(rows, {0, 0}, p, 1000 + b, b == 3);
    for (uint32_t i = 0; i < 2; ++i)
      large.drafts[large.draft_offsets[b] + i] =
          sample_reference(large.row(b, i), big, b == 3 ? kGreedy : p, large.seeds[b] + i);
  }
  const auto got_large = large.run();
  const auto ref_large = large.reference();
  EXPECT_EQ(got_large.num_accepted, ref_large.num_accepted);
  EXPECT_EQ(got_large.next_token, ref_large.next_token);
  EXPECT_EQ(got_large.num_accepted, (std::vector<uint32_t>{2, 2, 2, 2}));
}

// The GPU shape (sampling_wg.cl's accept_rows_wg, a work-group per request; forced on PoCL) gives
// the CPU shape's (accepted, next token) pairs exactly, over random_batch's strict, relaxed and
// masked requests and 4 requests at a 128256-token vocabulary.
TEST(AcceptanceShapes, GpuShapeGivesTheCpuShapesPairs) {
  auto both = [](const Batch& batch) {
    AcceptanceResult cpu, gpu;
    {
      test::ShapeScope scope(dev(), KernelShape::Chunks);
      cpu = batch.run();
    }
    {
      test::ShapeScope scope(dev(), KernelShape::WorkGroups);
      gpu = batch.run();
    }
    EXPECT_EQ(gpu.num_accepted, cpu.num_accepted);
    EXPECT_EQ(gpu.next_token, cpu.next_token);
    return cpu;
  };
  const AcceptanceResult small = both(random_batch(1000, 120));
  uint32_t accepted = 0;
  for (uint32_t n : small.num_accepted) accepted += n;
  EXPECT_GT(accepted, 60u);  // runs of acceptances, not only first-position rejections
  const uint32_t big = 128256;
  Batch large(big);
  for (uint32_t b = 0; b < 4; ++b) {
    const SamplingParams& p = kMixedParams[(b * 2 + 1) % 7];
    large.add(random_logits(3, big, 80 + b, 2.0f), {0, 0}, p, 500 + b, b == 3);
    for (uint32_t i = 0; i < 2; ++i)
      large.drafts[large.draft_offsets[b] + i] =
          sample_reference(large.row(b, i), big, b == 3 ? kGreedy : p, large.seeds[b] + i);
  }
  EXPECT_EQ(both(large).num_accepted, (std::vector<uint32_t>{2, 2, 2, 2}));
}

// ---- bad input ----------------------------------------------------------------------------------

TEST(AcceptanceErrors, BadSizesAndFieldsAreNamed) {
  const uint32_t V = 10;
  Batch good(V);
  good.add(random_logits(2, V, 1), {3}, SamplingParams{}, 1);
  good.add(random_logits(3, V, 2), {4, 5}, SamplingParams{}, 2);
  ASSERT_NO_THROW(good.run());

  auto expect_invalid = [&](const Batch& b, const std::string& needle,
                            const RelaxedAcceptance& relaxed = {}) {
    for (bool device : {true, false}) {
      try {
        device ? b.run(relaxed) : b.reference(relaxed);
        ADD_FAILURE() << "no error mentioning '" << needle << "'" << (device ? "" : " (reference)");
      } catch (const std::invalid_argument& e) {
        const std::string what = e.what();
        EXPECT_NE(what.find("accept_drafts"), std::string::npos) << what;
        EXPECT_NE(what.find(needle), std::string::npos) << what;
      }
    }
  };
  Batch b = good;
  b.seeds.pop_back();
  expect_invalid(b, "1 step_seeds for 2 requests");
  b = good;
  b.thinking = {1};
  expect_invalid(b, "thinking");
  b = good;
  b.logit_offsets.pop_back();
  expect_invalid(b, "logit_offsets has 2 entries");
  b = good;
  b.draft_offsets.push_back(3);
  expect_invalid(b, "draft_offsets has 4 entries");
  b = good;
  b.logit_offsets[2] = 4;  // request 1: 2 rows for 2 drafts
  expect_invalid(b, "request 1: logit_offsets give 2 verification rows for 2 drafts");
  b = good;
  b.draft_offsets = {0, 1, 0};
  expect_invalid(b, "request 1: draft_offsets decrease");
  b = good;
  b.drafts.push_back(1);
  expect_invalid(b, "draft_offsets end at 3 but drafts has 4");
  b = good;
  b.drafts[2] = 10;
  expect_invalid(b, "drafts[2] = 10 is outside the vocabulary");
  b = good;
  b.drafts[0] = -1;
  expect_invalid(b, "drafts[0] = -1");
  b = good;
  b.params[1].top_p = 0.0f;
  expect_invalid(b, "request 1: top_p");
  b = good;
  b.params[0].temperature = -1.0f;
  expect_invalid(b, "request 0: temperature");
  expect_invalid(good, "relaxed.top_k", {0, 0.6f});
  expect_invalid(good, "relaxed.delta", {10, -0.1f});
  expect_invalid(good, "relaxed.delta", {10, std::nanf("")});
  b = good;
  b.bitmask = {~0u, ~0u, ~0u};  // 3 of 5 rows
  expect_invalid(b, "bitmask");

  // Buffers on the device.
  const cl::Mem small = test::upload(dev(), std::vector<float>(4 * V));
  try {
    accept_drafts(dev(), small, V, good.logit_offsets, good.drafts, good.draft_offsets, good.params,
                  good.seeds);
    ADD_FAILURE() << "no error for a small logits buffer";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("logits buffer holds fewer than 5 x 10"),
              std::string::npos)
        << e.what();
  }
  b = good;
  try {
    accept_drafts(dev(), test::upload(dev(), good.logits), 0, good.logit_offsets, good.drafts,
                  good.draft_offsets, good.params, good.seeds);
    ADD_FAILURE() << "no error for vocab 0";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("vocab is 0"), std::string::npos) << e.what();
  }

  // A row that allows nothing, once the request reaches it.
  const float ninf = -std::numeric_limits<float>::infinity();
  b = good;
  std::fill(b.logits.begin() + 2 * V, b.logits.begin() + 3 * V, ninf);  // request 1, row 0
  for (bool device : {true, false}) {
    try {
      device ? b.run() : b.reference();
      ADD_FAILURE() << "no error for a row without allowed tokens";
    } catch (const std::runtime_error& e) {
      EXPECT_NE(std::string(e.what()).find("request 1: verification row 0"), std::string::npos)
          << e.what();
    }
  }

  // An empty batch.
  const auto none = accept_drafts(dev(), test::upload(dev(), good.logits), V, {0}, {}, {0}, {}, {});
  EXPECT_TRUE(none.num_accepted.empty());
  EXPECT_TRUE(none.next_token.empty());
}

}  // namespace
}  // namespace clshard
