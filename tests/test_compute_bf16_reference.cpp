// model.compute_dtype: bf16 against the reference logits (computed in f32 by Meta's and DeepSeek's
// code), checked statistically as the FP8 act_quant cases are: rounding activations to bf16 moves
// logits by more than the f32 tolerance, so the test bounds the median over positions of the
// per-position max |logit difference| and the rate at which the top token agrees. The same
// checkpoint at compute_dtype f32 runs alongside: the bf16 run must differ from it (the rounding
// happened) and still track the reference.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "models/registry.h"
#include "runtime/device.h"
#include "runtime/engine/generation.h"
#include "runtime/model.h"
#include "tests/reference_cases.h"
#include "tests/test_util.h"

namespace clshard {
namespace {

// Per position: max |a - b| over the vocabulary, and whether the argmaxes agree.
struct PositionStats {
  std::vector<float> max_diff;
  size_t positions = 0, argmax_equal = 0;
  void add(const std::vector<float>& a, const std::vector<float>& b, uint32_t vocab) {
    for (size_t r = 0; r * vocab < a.size(); ++r) {
      const float* pa = a.data() + r * vocab;
      const float* pb = b.data() + r * vocab;
      float m = 0;
      for (uint32_t v = 0; v < vocab; ++v) m = std::max(m, std::abs(pa[v] - pb[v]));
      max_diff.push_back(m);
      ++positions;
      argmax_equal += std::max_element(pa, pa + vocab) - pa == std::max_element(pb, pb + vocab) - pb;
    }
  }
  float median() const {
    std::vector<float> s = max_diff;
    std::sort(s.begin(), s.end());
    return s[s.size() / 2];
  }
  double agreement() const { return double(argmax_equal) / double(positions); }
};

class ComputeBf16Reference : public ::testing::TestWithParam<std::string> {};

// Measured on this machine's bf16 cases (the README's FP8 statistical bound is a median of 0.5):
// medians of 0.013-0.034 against the reference, top tokens agreeing at 98-100% of positions; the
// f32 run's medians are 2-5e-6. The two micro-kernels give the same bits (test_gemm_bf16), so the
// figures do not depend on the CPU, but for the attention and the GEMVs of few rows: where the
// host has vdpbf16ps and the device's row takes it (gemm_bf16_dot 1; the Xeons' row does not,
// kernel_tuning.cpp) they run in bf16 too (ops::attention_bf16, ops::bf16_gemv), which moved the
// medians to 0.014-0.042 (llama32-tiny's 0.034 to 0.042) and the agreement to 94-100%
// (llama32-tiny's 50 positions: 47 against 49). A GEMM that scales one 32-element partial sum per
// tile by 1.01 moves the medians to 0.05-0.08 on half the cases: the bound sits between.
constexpr float kMedianBound = 0.05f;
constexpr double kAgreementBound = 0.9;

TEST_P(ComputeBf16Reference, LogitsTrackTheReferenceStatistically) {
  test::RefCase rc = test::load_case(GetParam());
  LoadOptions bf16{{&test::default_device()}, std::nullopt};
  bf16.compute_dtype = ComputeDType::BF16;
  auto model = load_model(rc.checkpoint, bf16);
  auto plain = load_model(rc.checkpoint, LoadOptions{{&test::default_device()}, std::nullopt});
  const auto seqs = rc.sequences();
  auto got = all_position_logits(*model, seqs, 16);
  auto got_f32 = all_position_logits(*plain, seqs, 16);
  PositionStats vs_ref, f32_vs_ref;
  for (size_t i = 0; i < seqs.size(); ++i) {
    vs_ref.add(got[i], rc.seqs[i].logits, rc.vocab);
    f32_vs_ref.add(got_f32[i], rc.seqs[i].logits, rc.vocab);
  }
  RecordProperty("median_bf16", std::to_string(vs_ref.median()));
  RecordProperty("argmax_agreement_bf16", std::to_string(vs_ref.agreement()));
  RecordProperty("median_f32", std::to_string(f32_vs_ref.median()));
  std::printf("%s: bf16 compute median max|diff| %.4g, argmax agreement %.3f (%zu positions); "
              "f32 compute median %.3g\n",
              rc.id.c_str(), vs_ref.median(), vs_ref.agreement(), vs_ref.positions,
              f32_vs_ref.median());
  EXPECT_LT(vs_ref.median(), kMedianBound) << rc.id;
  EXPECT_GE(vs_ref.agreement(), kAgreementBound) << rc.id;
  // The rounding is there: bf16 activations move the logits well past the f32 run's error.
  EXPECT_GT(vs_ref.median(), 10 * f32_vs_ref.median()) << rc.id;
}

INSTANTIATE_TEST_SUITE_P(Cases, ComputeBf16Reference,
                         ::testing::Values("llama3-tiny-bf16/short", "llama32-tiny-bf16/short",
                                           "llama3-tiny-bf16/ragged8",
                                           "llama3-tiny-rope64-bf16/long",
                                           "deepseek-v3-tiny-bf16/short",
                                           "deepseek-v3-tiny-grouped-bf16/short",
                                           "deepseek-v3-tiny-grouped-fp8/long",
                                           "deepseek-v3-tiny-grouped-fp8/ragged8"),
                         [](const auto& info) {
                           std::string n = info.param;
                           for (char& c : n)
                             if (!isalnum(static_cast<unsigned char>(c))) c = '_';
                           return n;
                         });

}  // namespace
}  // namespace clshard
