// FP8 activation fake-quantization (model.fp8_activations: fp8): the kernel against a host
// rounding to the nearest e4m3 value, and the FP8 reference checkpoints run with it against
// DeepSeek's own act_quant logits.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <random>

#include "models/registry.h"
#include "runtime/device.h"
#include "runtime/engine/generation.h"
#include "runtime/model.h"
#include "runtime/ops_mla.h"
#include "runtime/ops_moe.h"
#include "tests/test_util.h"

namespace clshard {
namespace {

// The nearest e4m3fn value by search over all finite codes (ties: the even code, i.e. the one
// whose lowest mantissa bit is 0), saturating at 448.
float nearest_e4m3(float v) {
  float best = 0;
  int best_code = 0;
  for (int c = 0; c < 256; ++c) {
    const float e = reference::e4m3_to_f32(uint8_t(c));
    if (std::isnan(e)) continue;
    const float d = std::abs(e - v), db = std::abs(best - v);
    if (d < db || (d == db && (c & 1) == 0 && (best_code & 1) == 1)) {
      best = e;
      best_code = c;
    }
  }
  return best;
}

// Both kernel shapes (the GPU one on PoCL): each element equals the host's nearest e4m3 value
// times the block's scale; a NaN in a block leaves its scale to the other elements (the amax
// passes over it) and stays NaN itself.
class Fp8ActQuant : public test::BothShapes {};

TEST_P(Fp8ActQuant, KernelRoundsEachBlockToE4m3) {
  Device& dev = test::default_device();
  const uint32_t M = 3, K = 300;  // two full 128-column blocks and a partial one
  std::mt19937 rng(5);
  std::normal_distribution<float> d(0, 2);
  std::vector<float> x(size_t(M) * K);
  for (auto& v : x) v = d(rng);
  x[7] = 0.0f;
  x[K + 3] = 1e-7f;  // below the smallest subnormal step of its block
  x[2 * K + 140] = std::nanf("");  // row 2, second block
  cl::Mem xm = dev.alloc(x.size() * 4), ym = dev.alloc(x.size() * 4);
  dev.write(xm, x.data(), x.size() * 4);
  ops::act_quant_fp8(dev, xm, 0, K, M, K, ym);
  std::vector<float> y(x.size());
  dev.read(ym, y.data(), y.size() * 4);
  EXPECT_TRUE(std::isnan(y[2 * K + 140]));
  x[2 * K + 140] = 0.0f;  // the host's amax below skips it as the kernel's does
  y[2 * K + 140] = 0.0f;
  size_t changed = 0;
  for (uint32_t m = 0; m < M; ++m)
    for (uint32_t b = 0; b * 128 < K; ++b) {
      const uint32_t k0 = b * 128, k1 = std::min(K, k0 + 128);
      float amax = 0;
      for (uint32_t k = k0; k < k1; ++k) amax = std::max(amax, std::abs(x[m * K + k]));
      const float s = std::clamp(amax, 1e-4f, 1200.0f) / 448.0f;
      for (uint32_t k = k0; k < k1; ++k) {
        const float want = nearest_e4m3(x[m * K + k] / s) * s;
        ASSERT_FLOAT_EQ(y[m * K + k], want) << m << "," << k;
        changed += y[m * K + k] != x[m * K + k];
      }
    }
  EXPECT_GT(changed, x.size() / 2) << "quantization should move most values";
}
INSTANTIATE_TEST_SUITE_P(Shapes, Fp8ActQuant,
                         test::both_shapes(), test::ShapeParamName());

// Median over positions of the per-position max |logit difference| (the README's metric).
float median_row_max(const std::vector<float>& a, const std::vector<float>& b, uint32_t vocab) {
  std::vector<float> rows;
  for (size_t r = 0; r * vocab < a.size(); ++r) {
    float m = 0;
    for (uint32_t v = 0; v < vocab; ++v)
      m = std::max(m, std::abs(a[r * vocab + v] - b[r * vocab + v]));
    rows.push_back(m);
  }
  std::sort(rows.begin(), rows.end());
  return rows[rows.size() / 2];
}

class Fp8ActQuantReference : public ::testing::TestWithParam<std::string> {};

// With activation quantization the engine tracks DeepSeek's act_quant logits far more closely than
// the dequantize-only engine does (which the reference measured at a median of ~0.25).
TEST_P(Fp8ActQuantReference, QuantizedActivationsMatchTheReference) {
  const std::string dir = GetParam();
  auto manifest_path = test::reference_dir() / "cases" / (dir + ".short.act_quant") / "manifest.json";
  auto manifest = nlohmann::json::parse(std::ifstream(manifest_path));
  const uint32_t vocab = manifest["vocab_size"].get<uint32_t>();
  std::vector<std::vector<int32_t>> seqs;
  std::vector<std::vector<float>> want;
  for (const auto& s : manifest["sequences"]) {
    seqs.push_back(s["sequence"].get<std::vector<int32_t>>());
    want.push_back(test::read_f32(manifest_path.parent_path() / s["logits_raw"].get<std::string>()));
  }
  LoadOptions o{{&test::default_device()}, std::nullopt};
  o.quantize_fp8_activations = true;
  auto quantized = load_model(test::reference_dir() / "ckpt" / dir, o);
  auto plain = load_model(test::reference_dir() / "ckpt" / dir,
                          LoadOptions{{&test::default_device()}, std::nullopt});
  auto got_q = all_position_logits(*quantized, seqs, 16);
  auto got_plain = all_position_logits(*plain, seqs, 16);
  std::vector<float> all_want, all_q, all_plain;
  for (size_t i = 0; i < seqs.size(); ++i) {
    all_want.insert(all_want.end(), want[i].begin(), want[i].end());
    all_q.insert(all_q.end(), got_q[i].begin(), got_q[i].end());
    all_plain.insert(all_plain.end(), got_plain[i].begin(), got_plain[i].end());
  }
  const float q = median_row_max(all_q, all_want, vocab);
  const float p = median_row_max(all_plain, all_want, vocab);
  RecordProperty("median_quantized", std::to_string(q));
  RecordProperty("median_dequantize_only", std::to_string(p));
  EXPECT_LE(q, 0.5f) << "the README's statistical tolerance";
  // Measured: ~3e-6 quantized against ~0.25 dequantize-only: the same rounding as the reference
  // at most positions (a rounding flip moves a few positions, not the median).
  EXPECT_LT(q, 1e-3f) << "quantized " << q;
  EXPECT_LT(q, p / 4) << "quantized " << q << " vs dequantize-only " << p;
}

INSTANTIATE_TEST_SUITE_P(Checkpoints, Fp8ActQuantReference,
                         ::testing::Values("deepseek-v3-tiny-fp8", "deepseek-v3-tiny-grouped-fp8"),
                         [](const auto& info) {
                           std::string n = info.param;
                           std::replace(n.begin(), n.end(), '-', '_');
                           return n;
                         });

}  // namespace
}  // namespace clshard
