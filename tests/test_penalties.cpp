// Penalties and log-probabilities on the device (runtime/engine/sampling.h) against host references
// computed here in double precision on hand-made logits: odd vocabulary sizes, repeated tokens,
// negative logits, ties, -inf; and the distribution drawn after penalties by chi-square.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <numeric>
#include <stdexcept>
#include <string>
#include <vector>

#include "runtime/device.h"
#include "runtime/engine/sampling.h"
#include "tests/test_util.h"

namespace clshard {
namespace {

Device& dev() { return test::default_device(); }

std::vector<float> read_floats(const cl::Mem& m, size_t n) {
  std::vector<float> v(n);
  dev().read(m, v.data(), n * 4);
  return v;
}

// Penalties: relative tolerance on the penalised logit (float division and two subtractions
// against the exact value).
constexpr double kPenaltyTolerance = 1e-6;
// Log-probabilities: absolute tolerance (a float log-sum-exp over up to 128k tokens).
constexpr double kLogprobTolerance = 2e-5;

struct RequestHistory {
  std::vector<int32_t> prompt;
  std::vector<int32_t> generated;
};

// The rule of sampling.h in double precision, from the token lists themselves.
std::vector<double> penalised_reference(const float* row, uint32_t vocab, const SamplingParams& p,
                                        const RequestHistory& h) {
  std::map<int32_t, int> gen;
  for (int32_t t : h.generated) ++gen[t];
  std::vector<double> out(row, row + vocab);
  for (uint32_t i = 0; i < vocab; ++i) {
    const int g = gen.count(int32_t(i)) ? gen[int32_t(i)] : 0;
    const bool in_prompt =
        std::find(h.prompt.begin(), h.prompt.end(), int32_t(i)) != h.prompt.end();
    double l = out[i];
    if (in_prompt || g > 0) l = l > 0 ? l / p.repetition_penalty : l * p.repetition_penalty;
    l -= double(p.frequency_penalty) * g + (g > 0 ? double(p.presence_penalty) : 0.0);
    out[i] = l;
  }
  return out;
}

SamplingParams penalties(float freq, float pres, float rep) {
  SamplingParams p;
  p.frequency_penalty = freq;
  p.presence_penalty = pres;
  p.repetition_penalty = rep;
  return p;
}

void expect_penalised(const std::vector<float>& got, const std::vector<double>& want,
                      const std::string& what) {
  ASSERT_EQ(got.size(), want.size());
  size_t bad = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double tol = kPenaltyTolerance * std::max(1.0, std::fabs(want[i]));
    if (!(std::fabs(double(got[i]) - want[i]) <= tol) && bad++ < 5)
      ADD_FAILURE() << what << ": token " << i << ": got " << got[i] << ", want " << want[i];
  }
}

TEST(DevicePenalties, MatchTheDoubleReferenceInPlaceAndOutOfPlace) {
  for (uint32_t vocab : {7u, 1000u, 32001u}) {
    SCOPED_TRACE(vocab);
    const uint32_t rows = 4;
    std::vector<float> logits = test::random_logits(rows, vocab, vocab + 11);
    // Negative and positive logits both on repeated tokens.
    logits[0] = -2.5f;
    logits[1] = 3.0f;
    PenaltyCounts counts(dev(), vocab);
    std::vector<RequestHistory> hist(3);
    hist[0].prompt = {0, 1, 2, 2, int32_t(vocab - 1)};
    hist[1].prompt = {int32_t(vocab / 2)};
    hist[2].prompt = {};
    std::vector<uint32_t> slots;
    for (const auto& h : hist) slots.push_back(counts.acquire(h.prompt));
    // Committed tokens over three steps; a token twice in one step (a speculative run) too.
    const std::vector<std::vector<std::pair<size_t, int32_t>>> steps = {
        {{0, 1}, {1, 3 % int32_t(vocab)}, {2, int32_t(vocab - 1)}},
        {{0, 1}, {0, 1}, {0, 4 % int32_t(vocab)}, {2, int32_t(vocab - 1)}},
        {{0, int32_t(vocab - 1)}, {1, 0}}};
    for (const auto& step : steps) {
      std::vector<std::pair<uint32_t, int32_t>> add;
      for (auto [req, token] : step) {
        add.emplace_back(slots[req], token);
        hist[req].generated.push_back(token);
      }
      counts.add(add);
    }
    // Row 0: all three penalties; row 1: repetition only; row 2: no penalty (not listed);
    // row 3: frequency and presence, negative (they favour repeats), with request 2's counts.
    std::vector<PenaltyRow> listed = {{0, slots[0], penalties(0.7f, 1.3f, 1.6f), {}},
                                      {1, slots[1], penalties(0.0f, 0.0f, 0.5f), {}},
                                      {3, slots[2], penalties(-1.0f, -2.0f, 1.0f), {}}};
    const std::vector<size_t> request_of_row = {0, 1, 99, 2};
    auto expect_rows = [&](const std::vector<float>& got, const char* how) {
      for (uint32_t r = 0; r < rows; ++r) {
        std::vector<float> g(got.begin() + size_t(r) * vocab, got.begin() + size_t(r + 1) * vocab);
        const float* raw = logits.data() + size_t(r) * vocab;
        if (request_of_row[r] == 99) {
          EXPECT_EQ(g, std::vector<float>(raw, raw + vocab)) << how << ": unlisted row changed";
          continue;
        }
        const PenaltyRow& pr = *std::find_if(listed.begin(), listed.end(),
                                             [&](const PenaltyRow& x) { return x.row == r; });
        expect_penalised(g, penalised_reference(raw, vocab, pr.params, hist[request_of_row[r]]),
                         std::string(how) + " row " + std::to_string(r));
      }
    };
    const cl::Mem src = test::upload(dev(), logits);
    const cl::Mem dst = dev().alloc(logits.size() * 4);
    apply_penalties(counts, src, dst, rows, listed);
    expect_rows(read_floats(dst, logits.size()), "out of place");
    EXPECT_EQ(read_floats(src, logits.size()), logits) << "out of place changed the source";
    apply_penalties(counts, src, src, rows, listed);
    expect_rows(read_floats(src, logits.size()), "in place");
  }
}

TEST(DevicePenalties, ExtraTokensCountAsGenerated) {
  // A verified draft run: position i counts the drafts before it on top of the slot's counts.
  const uint32_t vocab = 333;
  std::vector<float> logits = test::random_logits(3, vocab, 5);
  PenaltyCounts counts(dev(), vocab);
  RequestHistory h{{10, 20}, {30}};
  const uint32_t slot = counts.acquire(h.prompt);
  counts.add({{slot, 30}});
  const SamplingParams p = penalties(0.5f, 0.25f, 1.3f);
  const std::vector<int32_t> drafts = {30, 40};
  std::vector<PenaltyRow> listed;
  for (uint32_t i = 0; i < 3; ++i)
    listed.push_back({i, slot, p, std::vector<int32_t>(drafts.begin(), drafts.begin() + i)});
  const cl::Mem buf = test::upload(dev(), logits);
  apply_penalties(counts, buf, buf, 3, listed);
  const auto got = read_floats(buf, logits.size());
  for (uint32_t i = 0; i < 3; ++i) {
    RequestHistory hi = h;
    hi.generated.insert(hi.generated.end(), drafts.begin(), drafts.begin() + i);
    expect_penalised(std::vector<float>(got.begin() + i * vocab, got.begin() + (i + 1) * vocab),
                     penalised_reference(logits.data() + i * vocab, vocab, p, hi),
                     "position " + std::to_string(i));
  }
}

TEST(DevicePenalties, ReleasedSlotsComeBackZeroedAndTheBufferGrows) {
  const uint32_t vocab = 50;
  PenaltyCounts counts(dev(), vocab);
  std::vector<uint32_t> slots;
  for (int i = 0; i < 6; ++i) slots.push_back(counts.acquire({int32_t(i)}));  // grows past 4
  EXPECT_EQ(counts.slots_in_use(), 6u);
  counts.add({{slots[5], 7}, {slots[0], 8}});
  counts.release(slots[0]);
  const uint32_t again = counts.acquire({});
  EXPECT_EQ(again, slots[0]);
  std::vector<uint32_t> words(size_t(8) * vocab);
  dev().read(counts.counts(), words.data(), words.size() * 4);
  for (uint32_t i = 0; i < vocab; ++i) EXPECT_EQ(words[size_t(again) * vocab + i], 0u) << i;
  // Slot 5 survived the growth: its prompt token and its generated token.
  EXPECT_EQ(words[size_t(slots[5]) * vocab + 5], 0x80000000u);
  EXPECT_EQ(words[size_t(slots[5]) * vocab + 7], 1u);
  EXPECT_THROW(counts.add({{7, 1}}), std::logic_error);
}

TEST(DevicePenalties, SampledFrequenciesMatchThePenalisedDistribution) {
  // A 50-token row with a known spread, penalised with a history, sampled 10000 times.
  const uint32_t vocab = 50, draws = 10000;
  std::vector<float> row(vocab);
  for (uint32_t i = 0; i < vocab; ++i)
    row[i] = 3.0f * std::sin(0.37f * float(i) + 1.0f) - 0.02f * float(i);
  RequestHistory h{{3, 4, 5}, {7, 7, 7, 12, 3, 8}};
  PenaltyCounts counts(dev(), vocab);
  const uint32_t slot = counts.acquire(h.prompt);
  std::vector<std::pair<uint32_t, int32_t>> add;
  for (int32_t t : h.generated) add.emplace_back(slot, t);
  counts.add(add);
  SamplingParams p = penalties(0.4f, 0.8f, 1.5f);
  p.temperature = 0.9f;
  std::vector<float> all(size_t(draws) * vocab);
  std::vector<PenaltyRow> listed;
  for (uint32_t r = 0; r < draws; ++r) {
    std::copy(row.begin(), row.end(), all.begin() + size_t(r) * vocab);
    listed.push_back({r, slot, p, {}});
  }
  const cl::Mem buf = test::upload(dev(), all);
  apply_penalties(counts, buf, buf, draws, listed);
  const auto tokens = sample_tokens(dev(), buf, draws, vocab,
                                    std::vector<SamplingParams>(draws, p),
                                    test::seeds_from(77, draws));
  const auto ref = penalised_reference(row.data(), vocab, p, h);
  const std::vector<float> ref_f(ref.begin(), ref.end());
  const auto expected = sampling_distribution(ref_f.data(), vocab, p);
  test::expect_matches_distribution(tokens, expected, "penalised");
  // The penalties move real mass: token 7 (generated 3 times) loses most of its probability.
  const auto unpenalised = sampling_distribution(row.data(), vocab, p);
  EXPECT_LT(expected[7], 0.2f * unpenalised[7]);
}

// log_softmax(l * inv_t) over the allowed tokens, in double.
std::vector<double> log_softmax_reference(const float* row, uint32_t vocab, double inv_t,
                                          const uint32_t* bits = nullptr) {
  auto allowed = [&](uint32_t i) {
    return token_allowed(row, bits, i);
  };
  double m = -std::numeric_limits<double>::infinity();
  for (uint32_t i = 0; i < vocab; ++i)
    if (allowed(i)) m = std::max(m, double(std::fmin(row[i], FLT_MAX)) * inv_t);
  double z = 0;
  for (uint32_t i = 0; i < vocab; ++i)
    if (allowed(i)) z += std::exp(double(std::fmin(row[i], FLT_MAX)) * inv_t - m);
  std::vector<double> out(vocab, -std::numeric_limits<double>::infinity());
  for (uint32_t i = 0; i < vocab; ++i)
    if (allowed(i)) out[i] = double(std::fmin(row[i], FLT_MAX)) * inv_t - m - std::log(z);
  return out;
}

// The n best allowed ids, logit descending, ties to the lower id.
std::vector<int32_t> top_ids(const float* row, uint32_t vocab, uint32_t n, const uint32_t* bits) {
  std::vector<int32_t> ids;
  for (uint32_t i = 0; i < vocab; ++i)
    if (token_allowed(row, bits, i)) ids.push_back(int32_t(i));
  std::stable_sort(ids.begin(), ids.end(),
                   [&](int32_t a, int32_t b) { return token_rank(row, a) > token_rank(row, b); });
  if (ids.size() > n) ids.resize(n);
  return ids;
}

// In both kernel shapes: row_logprobs (sampling.cl) and row_logprobs_wg (sampling_wg.cl, forced
// on PoCL; DeviceSamplingShapes checks that the two agree bit for bit).
class DeviceLogprobs : public test::BothShapes {};
INSTANTIATE_TEST_SUITE_P(Shapes, DeviceLogprobs,
                         test::both_shapes(), test::ShapeParamName());

TEST_P(DeviceLogprobs, MatchTheDoubleReference) {
  for (uint32_t vocab : {7u, 1000u, 32001u, 128256u}) {
    SCOPED_TRACE(vocab);
    const uint32_t rows = 5;
    std::vector<float> logits = test::random_logits(rows, vocab, vocab + 3);
    // Row 1: ties at the top (lower id first); row 2: -inf tokens and a +inf-free negative row.
    if (vocab > 6) {
      logits[1 * vocab + vocab - 1] = 20.0f;
      logits[1 * vocab + 2] = 20.0f;
      logits[1 * vocab + 5] = 20.0f;
      for (uint32_t i = 0; i < vocab; i += 3)
        logits[2 * vocab + i] = -std::numeric_limits<float>::infinity();
    }
    for (uint32_t i = 0; i < vocab; ++i) logits[3 * vocab + i] -= 50.0f;
    std::vector<uint32_t> bits(size_t(rows) * bitmask_words(vocab), 0x5555'5555u);  // even ids
    const cl::Mem buf = test::upload(dev(), logits);
    const cl::Mem mask = test::upload(dev(), bits);
    std::vector<LogprobRow> req = {
        {0, 1, 5, 1.0f, false},
        {1, 2, 20, 1.0f, false},
        {2, 0, 3, 1.0f, false},  // token 0 is -inf there: logprob -inf
        {3, int32_t(vocab - 1), 0, 1.0f, false},
        {4, 4 % int32_t(vocab), 7, 1.0f / 0.7f, true},  // processed: T = 0.7, even ids only
    };
    const auto got = compute_logprobs(dev(), buf, vocab, req, &mask);
    ASSERT_EQ(got.size(), req.size());
    for (size_t j = 0; j < req.size(); ++j) {
      SCOPED_TRACE(j);
      const float* row = logits.data() + size_t(req[j].row) * vocab;
      const uint32_t* b =
          req[j].use_bitmask ? bits.data() + size_t(req[j].row) * bitmask_words(vocab) : nullptr;
      const auto ref = log_softmax_reference(row, vocab, req[j].inv_temperature, b);
      EXPECT_EQ(got[j].token, req[j].token);
      const double want = ref[size_t(req[j].token)];
      if (std::isinf(want))
        EXPECT_EQ(got[j].logprob, -std::numeric_limits<float>::infinity());
      else
        EXPECT_NEAR(got[j].logprob, want, kLogprobTolerance);
      const auto ids = top_ids(row, vocab, req[j].top_n, b);
      ASSERT_EQ(got[j].top.size(), ids.size());
      for (size_t k = 0; k < ids.size(); ++k) {
        EXPECT_EQ(got[j].top[k].token, ids[k]) << "top " << k;
        EXPECT_NEAR(got[j].top[k].logprob, ref[size_t(ids[k])], kLogprobTolerance) << "top " << k;
      }
    }
    if (vocab > 6) {
      // The tie at the top goes to the lower id: 2, 5, then vocab - 1.
      EXPECT_EQ(got[1].top[0].token, 2);
      EXPECT_EQ(got[1].top[1].token, 5);
      EXPECT_EQ(got[1].top[2].token, int32_t(vocab - 1));
    }
  }
  // Fewer allowed tokens than asked: the list is as long as the allowed set.
  const std::vector<float> tiny = {1.0f, -std::numeric_limits<float>::infinity(), 0.5f};
  const auto got = compute_logprobs(dev(), test::upload(dev(), tiny), 3, {{0, 2, 20, 1.0f, false}});
  ASSERT_EQ(got[0].top.size(), 2u);
  EXPECT_EQ(got[0].top[0].token, 0);
  EXPECT_EQ(got[0].top[1].token, 2);
}

TEST(SamplingParamsValidation, PenaltiesAndLogprobsNameTheField) {
  auto message = [](const SamplingParams& p) -> std::string {
    try {
      validate_sampling_params(p);
    } catch (const std::invalid_argument& e) {
      return e.what();
    }
    return "";
  };
  SamplingParams p;
  p.frequency_penalty = 2.5f;
  EXPECT_EQ(message(p), "frequency_penalty must be in [-2, 2], got 2.500000");
  p = {};
  p.presence_penalty = -2.01f;
  EXPECT_EQ(message(p).rfind("presence_penalty must be in [-2, 2], got -2.01", 0), 0u);
  p = {};
  p.repetition_penalty = 0.0f;
  EXPECT_EQ(message(p), "repetition_penalty must be finite and > 0, got 0.000000");
  p = {};
  p.logprobs = true;
  p.top_logprobs = 21;
  EXPECT_EQ(message(p), "top_logprobs must be in [0, 20], got 21");
  p.logprobs = false;
  p.top_logprobs = 3;
  EXPECT_EQ(message(p), "top_logprobs needs logprobs");
  p = {};
  p.frequency_penalty = -2.0f;
  p.presence_penalty = 2.0f;
  p.repetition_penalty = 0.01f;
  p.logprobs = true;
  p.top_logprobs = 20;
  EXPECT_EQ(message(p), "");
}

}  // namespace
}  // namespace clshard
