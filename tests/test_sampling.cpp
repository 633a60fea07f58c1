// Batched device sampling (runtime/engine/sampling.h) on the test device: exact cases (greedy, ties,
// bitmask, seeds), frequency tests against the host reference distribution, and bad parameters.
#include "runtime/engine/sampling.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <stdexcept>
#include <vector>
#include <cstring>
#include <string>

#include "runtime/device.h"
#include "runtime/device_manager.h"

#include "tests/test_util.h"

namespace clshard {
namespace {

Device& dev() { return test::default_device(); }

cl::Mem upload(const std::vector<float>& v) { return test::upload(dev(), v); }
cl::Mem upload_bits(const std::vector<uint32_t>& v) { return test::upload(dev(), v); }

using test::expect_matches_distribution;
using test::random_logits;
using test::seeds_from;

int32_t host_argmax(const float* row, uint32_t vocab) {
  return int32_t(std::max_element(row, row + vocab) - row);
}

// A fixed 50-token row with a known, uneven distribution: logits from -4 to ~3 with a few near
// ties, so every filter below cuts through the middle of it.
std::vector<float> fixed_row() {
  std::vector<float> row(50);
  for (uint32_t i = 0; i < 50; ++i) row[i] = 3.0f * std::sin(0.37f * float(i) + 1.0f) - 0.02f * i;
  return row;
}

// Samples `draws` rows that all hold `row`, each with its own seed, in one call.
std::vector<int32_t> sample_many(const std::vector<float>& row, const SamplingParams& p,
                                 uint32_t draws, uint64_t first_seed) {
  const uint32_t vocab = uint32_t(row.size());
  std::vector<float> all(size_t(draws) * vocab);
  for (uint32_t r = 0; r < draws; ++r) std::copy(row.begin(), row.end(), all.begin() + r * vocab);
  return sample_tokens(dev(), upload(all), draws, vocab, std::vector<SamplingParams>(draws, p),
                       seeds_from(first_seed, draws));
}

size_t support_size(const std::vector<float>& d) {
  return size_t(std::count_if(d.begin(), d.end(), [](float p) { return p > 0.0f; }));
}

// Every DeviceSampling test runs in both kernel shapes: the CPU shape (kernels_cl/sampling.cl, one
// work-item per row) and the GPU shape (sampling_wg.cl, a work-group per row), forced on PoCL.
class DeviceSampling : public test::BothShapes {};
INSTANTIATE_TEST_SUITE_P(Shapes, DeviceSampling,
                         test::both_shapes(), test::ShapeParamName());

// Sets the test device's kernel shape for one scope.
struct ShapeScope : test::ShapeScope {
  explicit ShapeScope(KernelShape s) : test::ShapeScope(dev(), s) {}
};

TEST(DeviceSamplingShapes, SameDrawsAndLogprobsInBothShapes) {
  // Both shapes sum in one fixed order (kernels_cl/sampling_common.cl), so for the same seeds they
  // draw the same tokens, equal to sample_reference's, and give bit-identical log-probabilities,
  // over odd vocabulary sizes and batch sizes and every path: greedy, plain, top-k (the CPU
  // shape's heap and radix select against the GPU shape's work-group radix select), nucleus,
  // min-p, temperature, a bitmask.
  struct Size {
    uint32_t vocab, rows;
  };
  // 151,937 tokens: 297 segments of 512, more than the GPU shape's walk stages at once (256).
  for (const Size sz : {Size{1, 5}, Size{17, 33}, Size{1000, 64}, Size{128257, 9}, Size{151937, 9}}) {
    const uint32_t vocab = sz.vocab, rows = sz.rows;
    SCOPED_TRACE("vocab " + std::to_string(vocab) + " rows " + std::to_string(rows));
    auto logits = random_logits(rows, vocab, vocab * 7 + rows, 2.0f);
    if (vocab > 16)  // ties at the top and some -inf tokens in row 0
      for (uint32_t i = 0; i < vocab; i += 5) logits[i] = i % 10 ? 4.0f : -INFINITY;
    if (vocab > 256 * 512)  // rows 1, 2, 7: the mass, and so the draws, past segment 256
      for (uint32_t r : {1u, 2u, 7u})
        for (uint32_t i = 0; i < 140000; ++i) logits[size_t(r) * vocab + i] -= 8.0f;
    std::vector<uint32_t> bits(size_t(rows) * bitmask_words(vocab), 0xFFFF'FFFFu);
    for (uint32_t r = 1; r < rows; r += 4)  // every 4th row: only ids with bit 1 of id/3 clear
      for (uint32_t i = 0; i < vocab; ++i)
        if ((i / 3) & 2u) bits[size_t(r) * bitmask_words(vocab) + i / 32] &= ~(1u << (i % 32));
    const int32_t ks[] = {-1, 0, 3, 40, 256, 257, 1000, int32_t(vocab) - 1, 1};
    const float ps[] = {1.0f, 0.9f, 0.3f};
    const float temps[] = {1.0f, 0.6f, 1.7f, 0.0f};
    std::vector<SamplingParams> params(rows);
    for (uint32_t r = 0; r < rows; ++r) {
      params[r].top_k = ks[r % 9];
      params[r].top_p = ps[(r / 2) % 3];
      params[r].temperature = temps[(r / 3) % 4];
      params[r].min_p = r % 5 == 4 ? 0.05f : 0.0f;
    }
    const auto seeds = seeds_from(vocab + 11, rows);
    const cl::Mem buf = upload(logits), mask = upload_bits(bits);
    std::vector<int32_t> drawn[2];
    std::vector<TokenLogprobs> lps[2];
    std::vector<LogprobRow> req;
    for (uint32_t r = 0; r < rows; ++r)
      req.push_back({r, int32_t((r * 7919u) % vocab), r % 21, r % 2 ? 1.0f / 0.7f : 1.0f,
                     r % 4 == 1});
    for (int shape = 0; shape < 2; ++shape) {
      ShapeScope scope(shape ? KernelShape::WorkGroups : KernelShape::Chunks);
      drawn[shape] = sample_tokens(dev(), buf, rows, vocab, params, seeds, &mask);
      lps[shape] = compute_logprobs(dev(), buf, vocab, req, &mask);
    }
    for (uint32_t r = 0; r < rows; ++r) {
      const uint32_t* b = &bits[size_t(r) * bitmask_words(vocab)];
      EXPECT_EQ(drawn[1][r], drawn[0][r]) << "row " << r;
      EXPECT_EQ(drawn[0][r], sample_reference(&logits[size_t(r) * vocab], vocab, params[r],
                                              seeds[r], b))
          << "row " << r;
      const TokenLogprobs &c = lps[0][r], &g = lps[1][r];
      EXPECT_EQ(std::memcmp(&g.logprob, &c.logprob, 4), 0)
          << "row " << r << ": " << g.logprob << " vs " << c.logprob;
      ASSERT_EQ(g.top.size(), c.top.size()) << "row " << r;
      if (r != 0 && !req[r].use_bitmask) {  // every token allowed
        EXPECT_EQ(c.top.size(), std::min<size_t>(req[r].top_n, vocab)) << "row " << r;
      }
      for (size_t k = 0; k < c.top.size(); ++k) {
        EXPECT_EQ(g.top[k].token, c.top[k].token) << "row " << r << " top " << k;
        EXPECT_EQ(std::memcmp(&g.top[k].logprob, &c.top[k].logprob, 4), 0)
            << "row " << r << " top " << k;
      }
    }
  }
}

TEST(DeviceSamplingPhilox, MatchesRandom123KnownAnswers) {
  // Random123 tests/kat_vectors, "philox4x32 10" lines: counter, key -> output.
  EXPECT_EQ(philox4x32_10({0, 0, 0, 0}, {0, 0}),
            (std::array<uint32_t, 4>{0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}));
  EXPECT_EQ(philox4x32_10({0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff},
                          {0xffffffff, 0xffffffff}),
            (std::array<uint32_t, 4>{0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}));
  EXPECT_EQ(philox4x32_10({0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344},
                          {0xa4093822, 0x299f31d0}),
            (std::array<uint32_t, 4>{0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}));
}

TEST_P(DeviceSampling, GreedyIsArgmaxForOddVocabSizes) {
  for (uint32_t vocab : {1u, 7u, 1000u, 32001u, 128256u}) {
    SCOPED_TRACE(vocab);
    const uint32_t rows = 5;
    std::vector<float> logits = random_logits(rows, vocab, vocab);
    // Row 1: the maximum twice (ties go to the lower id); row 2: the maximum in the last slot
    // (the tail chunk).
    if (vocab > 3) {
      logits[1 * vocab + vocab / 3] = 100.0f;
      logits[1 * vocab + vocab - 2] = 100.0f;
      logits[2 * vocab + vocab - 1] = 100.0f;
    }
    SamplingParams greedy;
    greedy.temperature = 0.0f;
    const auto got = sample_tokens(dev(), upload(logits), rows, vocab,
                                   std::vector<SamplingParams>(rows, greedy), seeds_from(1, rows));
    for (uint32_t r = 0; r < rows; ++r)
      EXPECT_EQ(got[r], host_argmax(&logits[size_t(r) * vocab], vocab)) << "row " << r;
    if (vocab > 3) {
      EXPECT_EQ(got[1], int32_t(vocab / 3));
      EXPECT_EQ(got[2], int32_t(vocab - 1));
    }
  }
}

TEST_P(DeviceSampling, TopK1IsGreedy) {
  const uint32_t rows = 16, vocab = 4099;
  const auto logits = random_logits(rows, vocab, 7);
  SamplingParams top1;
  top1.temperature = 1.5f;
  top1.top_k = 1;
  const auto got = sample_tokens(dev(), upload(logits), rows, vocab,
                                 std::vector<SamplingParams>(rows, top1), seeds_from(3, rows));
  for (uint32_t r = 0; r < rows; ++r)
    EXPECT_EQ(got[r], host_argmax(&logits[size_t(r) * vocab], vocab)) << "row " << r;
}

TEST_P(DeviceSampling, SeededRunsRepeatAndRowsAreIndependentOfTheBatch) {
  const uint32_t vocab = 3001;
  const auto logits = random_logits(8, vocab, 11, 1.0f);  // flat enough that seeds matter
  std::vector<SamplingParams> params(8);
  params[1].top_p = 0.9f;
  params[2].top_k = 40;
  params[3].min_p = 0.05f;
  params[4].temperature = 0.7f;
  params[4].top_k = 300;  // radix-select path
  params[4].top_p = 0.8f;
  params[5].temperature = 0.0f;
  const auto seeds = seeds_from(42, 8);
  const cl::Mem buf = upload(logits);
  const auto first = sample_tokens(dev(), buf, 8, vocab, params, seeds);
  EXPECT_EQ(sample_tokens(dev(), buf, 8, vocab, params, seeds), first);

  // Different seeds give different draws (8 rows x 3 alternative seeds: some must differ).
  int changed = 0;
  for (uint64_t shift : {1ull, 2ull, 3ull}) {
    auto other = seeds;
    for (auto& s : other) s += shift;
    const auto got = sample_tokens(dev(), buf, 8, vocab, params, other);
    for (int r = 0; r < 8; ++r) changed += got[r] != first[r];
  }
  EXPECT_GT(changed, 0);

  // Row 4 alone, then at another position among unrelated rows with other parameters.
  const std::vector<float> row4(logits.begin() + 4 * vocab, logits.begin() + 5 * vocab);
  EXPECT_EQ(sample_tokens(dev(), upload(row4), 1, vocab, {params[4]}, {seeds[4]})[0], first[4]);
  auto batch = random_logits(6, vocab, 99, 2.0f);
  std::copy(row4.begin(), row4.end(), batch.begin() + 3 * vocab);
  std::vector<SamplingParams> mixed(6);
  mixed[0].temperature = 0.0f;
  mixed[1].top_k = 5;
  mixed[2].top_p = 0.3f;
  mixed[3] = params[4];
  mixed[5].min_p = 0.5f;
  std::vector<uint64_t> mixed_seeds = seeds_from(1000, 6);
  mixed_seeds[3] = seeds[4];
  EXPECT_EQ(sample_tokens(dev(), upload(batch), 6, vocab, mixed, mixed_seeds)[3], first[4]);
}

TEST_P(DeviceSampling, AgreesWithTheHostReferenceDrawForDraw) {
  // Every path (plain, heap top-k, radix top-k, nucleus rejection, min-p, tiny temperature) on
  // random rows; the kernel and sample_reference share the generator and the arithmetic order.
  const uint32_t rows = 600, vocab = 1000;
  const auto logits = random_logits(rows, vocab, 5, 2.0f);
  const int32_t ks[] = {-1, 0, 2, 17, 256, 257, 600, 999, 5000};
  const float ps[] = {1.0f, 0.95f, 0.5f, 0.05f};
  const float temps[] = {1.0f, 0.3f, 2.5f, 1e-7f};
  std::vector<SamplingParams> params(rows);
  for (uint32_t r = 0; r < rows; ++r) {
    params[r].top_k = ks[r % 9];
    params[r].top_p = ps[(r / 9) % 4];
    params[r].temperature = temps[(r / 36) % 4];
    params[r].min_p = (r / 144) % 2 ? 0.02f : 0.0f;
  }
  const auto seeds = seeds_from(77, rows);
  const auto got = sample_tokens(dev(), upload(logits), rows, vocab, params, seeds);
  int mismatches = 0;
  for (uint32_t r = 0; r < rows; ++r) {
    const float* row = &logits[size_t(r) * vocab];
    const auto dist = sampling_distribution(row, vocab, params[r]);
    ASSERT_GT(dist[got[r]], 0.0f) << "row " << r << " drew a token outside its kept set";
    mismatches += got[r] != sample_reference(row, vocab, params[r], seeds[r]);
  }
  // Only an ulp of exp() difference right at a boundary can split them.
  EXPECT_LE(mismatches, 1);
}

struct FrequencyCase {
  const char* name;
  SamplingParams params;
};

SamplingParams make(float t, int32_t k, float p, float min_p) {
  SamplingParams s;
  s.temperature = t;
  s.top_k = k;
  s.top_p = p;
  s.min_p = min_p;
  return s;
}

TEST_P(DeviceSampling, FrequenciesMatchTheReferenceDistribution) {
  const auto row = fixed_row();
  const FrequencyCase cases[] = {
      {"T=1", make(1.0f, -1, 1.0f, 0.0f)},
      {"T=0.5", make(0.5f, -1, 1.0f, 0.0f)},
      {"T=2", make(2.0f, -1, 1.0f, 0.0f)},
      {"top_k=5", make(1.0f, 5, 1.0f, 0.0f)},
      {"top_k=0 (all)", make(1.0f, 0, 1.0f, 0.0f)},
      {"top_p=0.6", make(1.0f, -1, 0.6f, 0.0f)},
      {"top_p=0.9 T=2", make(2.0f, -1, 0.9f, 0.0f)},
      {"min_p=0.1", make(1.0f, -1, 1.0f, 0.1f)},
      {"T=0.7 top_k=10 top_p=0.8", make(0.7f, 10, 0.8f, 0.0f)},
      {"T=1.5 min_p=0.05 top_p=0.9", make(1.5f, -1, 0.9f, 0.05f)},
      {"T=1.2 top_k=20 min_p=0.02 top_p=0.95", make(1.2f, 20, 0.95f, 0.02f)},
  };
  uint64_t seed = 1;
  for (const auto& c : cases) {
    const auto expected = sampling_distribution(row.data(), 50, c.params);
    const auto tokens = sample_many(row, c.params, 10000, seed);
    seed += 1'000'003;
    expect_matches_distribution(tokens, expected, c.name);
  }
  // The filters really cut: the kept sets of the reference are as small as the parameters say.
  EXPECT_EQ(support_size(sampling_distribution(row.data(), 50, make(1.0f, 5, 1.0f, 0.0f))), 5u);
  EXPECT_LT(support_size(sampling_distribution(row.data(), 50, make(1.0f, -1, 0.6f, 0.0f))), 15u);
  EXPECT_LT(support_size(sampling_distribution(row.data(), 50, make(1.0f, -1, 1.0f, 0.1f))), 30u);
  EXPECT_EQ(support_size(sampling_distribution(row.data(), 50, make(1.0f, -1, 1.0f, 0.0f))), 50u);
}

TEST_P(DeviceSampling, TopKAndTopPCutThroughTiesByLowerId) {
  const std::vector<float> flat(20, 0.5f);
  // top_k=5 of 20 equal tokens: ids 0..4, uniformly.
  std::vector<float> five(20, 0.0f);
  std::fill(five.begin(), five.begin() + 5, 0.2f);
  EXPECT_EQ(sampling_distribution(flat.data(), 20, make(1.0f, 5, 1.0f, 0.0f)), five);
  expect_matches_distribution(sample_many(flat, make(1.0f, 5, 1.0f, 0.0f), 10000, 5), five,
                              "flat top_k=5");
  // top_p=0.33 of 20 equal tokens (0.05 each): the smallest prefix reaching 0.33 has 7 tokens.
  std::vector<float> seven(20, 0.0f);
  std::fill(seven.begin(), seven.begin() + 7, 1.0f / 7.0f);
  EXPECT_EQ(support_size(sampling_distribution(flat.data(), 20, make(1.0f, -1, 0.33f, 0.0f))), 7u);
  expect_matches_distribution(sample_many(flat, make(1.0f, -1, 0.33f, 0.0f), 10000, 6), seven,
                              "flat top_p=0.33");
  // A radix-select top-k (k above the heap's 256) through a tie block: ids 0..299 at 1,
  // 300..349 at 2, 350..399 at 3. k=280 keeps the 50 threes, the 50 twos and the 180 lowest-id
  // ones (0..179).
  std::vector<float> tiered(400, 1.0f);
  for (uint32_t i = 300; i < 350; ++i) tiered[i] = 2.0f;
  for (uint32_t i = 350; i < 400; ++i) tiered[i] = 3.0f;
  const auto k280 = make(1.0f, 280, 1.0f, 0.0f);
  const auto d = sampling_distribution(tiered.data(), 400, k280);
  EXPECT_EQ(support_size(d), 280u);
  EXPECT_GT(d[179], 0.0f);
  EXPECT_EQ(d[180], 0.0f);
  const auto tokens = sample_many(tiered, k280, 4000, 9);
  for (int32_t t : tokens) ASSERT_TRUE(t < 180 || t >= 300) << t;
  EXPECT_TRUE(std::any_of(tokens.begin(), tokens.end(), [](int32_t t) { return t < 180; }));

  // The same through the chunk-maxima bound of the radix select (more chunks than k): 20000
  // tokens at 1 except every 97th at 2 (207 of them); k=300 keeps those and the 93 lowest-id ones.
  std::vector<float> sparse(20000, 1.0f);
  for (uint32_t i = 0; i < 20000; i += 97) sparse[i] = 2.0f;
  const auto k300 = make(1.0f, 300, 1.0f, 0.0f);
  const auto ds = sampling_distribution(sparse.data(), 20000, k300);
  EXPECT_EQ(support_size(ds), 300u);
  EXPECT_GT(ds[93], 0.0f);  // the kept ones are ids 1..93 (id 0 is a two)
  EXPECT_EQ(ds[94], 0.0f);
  EXPECT_GT(ds[19982], 0.0f);  // the last two
  for (int32_t t : sample_many(sparse, k300, 200, 10))
    ASSERT_TRUE(t <= 93 || t % 97 == 0) << t;
}

TEST_P(DeviceSampling, BitmaskExcludesTokensAndGreedyTakesTheBestAllowed) {
  for (uint32_t vocab : {37u, 1000u, 32001u}) {
    SCOPED_TRACE(vocab);
    const uint32_t rows = 64, words = bitmask_words(vocab);
    const auto logits = random_logits(rows, vocab, vocab + 1);
    std::mt19937 rng(vocab);
    std::vector<uint32_t> bits(size_t(rows) * words);
    for (auto& w : bits) w = uint32_t(rng()) & uint32_t(rng());  // ~25% allowed
    for (uint32_t r = 0; r < rows; ++r) bits[size_t(r) * words] |= 1u << (r % 32);  // >= 1 allowed
    // Row 0 allows exactly the last token.
    std::fill(bits.begin(), bits.begin() + words, 0u);
    bits[words - 1] = 1u << ((vocab - 1) % 32);
    const cl::Mem logit_buf = upload(logits), bit_buf = upload_bits(bits);
    auto is_allowed = [&](uint32_t r, int32_t t) {
      return (bits[size_t(r) * words + t / 32] >> (t % 32)) & 1u;
    };

    std::vector<SamplingParams> greedy(rows, make(0.0f, -1, 1.0f, 0.0f));
    const auto g = sample_tokens(dev(), logit_buf, rows, vocab, greedy, seeds_from(0, rows),
                                 &bit_buf);
    for (uint32_t r = 0; r < rows; ++r) {
      int32_t best = -1;
      for (uint32_t i = 0; i < vocab; ++i)
        if (is_allowed(r, int32_t(i)) && (best < 0 || logits[size_t(r) * vocab + i] >
                                                           logits[size_t(r) * vocab + best]))
          best = int32_t(i);
      EXPECT_EQ(g[r], best) << "row " << r;
    }
    EXPECT_EQ(g[0], int32_t(vocab - 1));

    // Hot, unfiltered sampling: many draws, none disallowed, and the reference agrees.
    std::vector<SamplingParams> hot(rows, make(3.0f, -1, 1.0f, 0.0f));
    hot[1] = make(1.0f, 3, 0.9f, 0.0f);
    for (uint64_t round = 0; round < 10; ++round) {
      const auto seeds = seeds_from(round * 977, rows);
      const auto s = sample_tokens(dev(), logit_buf, rows, vocab, hot, seeds, &bit_buf);
      for (uint32_t r = 0; r < rows; ++r) {
        ASSERT_TRUE(is_allowed(r, s[r])) << "row " << r << " drew disallowed token " << s[r];
        EXPECT_EQ(s[r], sample_reference(&logits[size_t(r) * vocab], vocab, hot[r], seeds[r],
                                         &bits[size_t(r) * words]));
      }
    }
  }
}

TEST_P(DeviceSampling, NonFiniteLogitsAndEmptyRows) {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  // -inf and NaN are never drawn; +inf tokens share all the mass.
  std::vector<float> row = {-inf, 1.0f, nan, 2.0f, -inf, 0.5f};
  auto tokens = sample_many(row, make(2.0f, -1, 1.0f, 0.0f), 2000, 3);
  for (int32_t t : tokens) ASSERT_TRUE(t == 1 || t == 3 || t == 5) << t;
  row = {inf, 1.0f, inf, 2.0f};
  tokens = sample_many(row, make(1.0f, -1, 1.0f, 0.0f), 2000, 4);
  for (int32_t t : tokens) ASSERT_TRUE(t == 0 || t == 2) << t;
  EXPECT_TRUE(std::count(tokens.begin(), tokens.end(), 0) > 800);
  EXPECT_TRUE(std::count(tokens.begin(), tokens.end(), 2) > 800);

  // A row with nothing allowed is an error that names the row.
  const std::vector<float> two_rows = {0.0f, 1.0f, -inf, nan};
  try {
    sample_tokens(dev(), upload(two_rows), 2, 2, std::vector<SamplingParams>(2), {1, 2});
    FAIL() << "expected an error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("row 1"), std::string::npos) << e.what();
  }
  EXPECT_THROW(sampling_distribution(&two_rows[2], 2, SamplingParams{}), std::invalid_argument);
  EXPECT_EQ(sample_reference(&two_rows[2], 2, SamplingParams{}, 1), -1);
}

TEST_P(DeviceSampling, LargeVocabBatchDrawsInsideTheKeptSet) {
  const uint32_t rows = 8, vocab = 128256;
  const auto logits = random_logits(rows, vocab, 2024, 2.0f);
  std::vector<SamplingParams> params = {
      make(1.0f, -1, 1.0f, 0.0f), make(0.8f, -1, 0.9f, 0.0f),  make(1.0f, 50, 0.95f, 0.0f),
      make(1.0f, 1000, 1.0f, 0.0f), make(1.0f, -1, 1.0f, 0.1f), make(0.6f, 40, 0.9f, 0.05f),
      make(1.0f, -1, 0.01f, 0.0f), make(1.3f, 128255, 0.99f, 0.0f)};
  const auto seeds = seeds_from(5, rows);
  const auto got = sample_tokens(dev(), upload(logits), rows, vocab, params, seeds);
  for (uint32_t r = 0; r < rows; ++r) {
    const float* row = &logits[size_t(r) * vocab];
    EXPECT_GT(sampling_distribution(row, vocab, params[r])[got[r]], 0.0f) << "row " << r;
    EXPECT_EQ(got[r], sample_reference(row, vocab, params[r], seeds[r])) << "row " << r;
  }
}

TEST_P(DeviceSampling, RejectsBadParametersAndSizes) {
  const uint32_t vocab = 10;
  const cl::Mem buf = upload(random_logits(2, vocab, 1));
  auto call = [&](const SamplingParams& p) {
    return sample_tokens(dev(), buf, 2, vocab, {SamplingParams{}, p}, {1, 2});
  };
  auto expect_invalid = [&](const SamplingParams& p, const char* field) {
    try {
      call(p);
      ADD_FAILURE() << "no error for bad " << field;
    } catch (const std::invalid_argument& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("row 1"), std::string::npos) << what;
      EXPECT_NE(what.find(field), std::string::npos) << what;
    }
  };
  expect_invalid(make(-0.5f, -1, 1.0f, 0.0f), "temperature");
  expect_invalid(make(std::nanf(""), -1, 1.0f, 0.0f), "temperature");
  expect_invalid(make(1.0f, -2, 1.0f, 0.0f), "top_k");
  expect_invalid(make(1.0f, -1, 0.0f, 0.0f), "top_p");
  expect_invalid(make(1.0f, -1, 1.5f, 0.0f), "top_p");
  expect_invalid(make(1.0f, -1, std::nanf(""), 0.0f), "top_p");
  expect_invalid(make(1.0f, -1, 1.0f, -0.1f), "min_p");
  expect_invalid(make(1.0f, -1, 1.0f, 1.5f), "min_p");
  EXPECT_THROW(validate_sampling_params(make(1.0f, -1, 0.0f, 0.0f)), std::invalid_argument);
  EXPECT_NO_THROW(validate_sampling_params(make(0.0f, 0, 1.0f, 1.0f)));

  EXPECT_THROW(sample_tokens(dev(), buf, 2, vocab, {SamplingParams{}}, {1, 2}),
               std::invalid_argument);  // params for 1 of 2 rows
  EXPECT_THROW(sample_tokens(dev(), buf, 2, vocab, std::vector<SamplingParams>(2), {1}),
               std::invalid_argument);  // seeds for 1 of 2 rows
  EXPECT_THROW(sample_tokens(dev(), buf, 3, vocab, std::vector<SamplingParams>(3), {1, 2, 3}),
               std::invalid_argument);  // logits buffer too small
  const cl::Mem small_mask = upload_bits({~0u});
  EXPECT_THROW(sample_tokens(dev(), buf, 2, vocab, std::vector<SamplingParams>(2), {1, 2},
                             &small_mask),
               std::invalid_argument);  // bitmask for 1 of 2 rows
  EXPECT_TRUE(sample_tokens(dev(), buf, 0, vocab, {}, {}).empty());
}

}  // namespace
}  // namespace clshard
