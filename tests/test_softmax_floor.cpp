// Attention's softmax weights (kernels_cl/common.cl's softmax_exp): a weight that would be an f32
// denormal (a score more than 87 below its row's max) is 0, so no kernel computes with denormals,
// which on x86 without flush-to-zero cost a microcode assist each (a decode attention over 4096
// positions of widely spread scores ran 2-3x slower). Positions whose weight is exp(-95) = 5.5e-42
// carry values of 3e38 here: kept, each would move the output by 1.6e-3; flushed, every output is
// the value of the max's position, bit for bit. Over the CPU shape (attention.cl's tiles, mla.cl's
// decode) and the GPU shape (attention.cl's split-K decode and its prefill kernel).
#include <gtest/gtest.h>

#include <vector>

#include "runtime/ops.h"
#include "runtime/ops_mla.h"
#include "tests/test_util.h"

namespace clshard {
namespace {

constexpr uint32_t kPage = 16, kPositions = 10;
constexpr float kFarBelow = -95.0f;  // exp(-95): an f32 denormal
constexpr float kHuge = 3e38f;

// The max position's value: small integers, exact in any sum that adds nothing else.
float max_value(uint32_t i) { return float(i % 7) - 3.0f; }

struct Step {
  cl::Mem rows, pos, lut;
  ops::StepTokens st;
};

// One sequence (row 0, page 0 of the cache): the queries at the given positions.
Step step(Device& dev, const std::vector<uint32_t>& positions) {
  Step s;
  s.rows = test::upload(dev, std::vector<uint32_t>(positions.size(), 0));
  s.pos = test::upload(dev, positions);
  s.lut = test::upload(dev, std::vector<uint32_t>{0});
  s.st = ops::StepTokens{s.rows, s.pos, s.lut, uint32_t(positions.size()), 1, kPage};
  return s;
}

class SoftmaxFloor : public ::testing::TestWithParam<KernelShape> {};

// GQA (one KV head, head_dim 16): the keys' first element is the score (the queries are e0), 0 at
// position 0 and kFarBelow at the others, whose values are kHuge. Ten new tokens (the prefill
// kernels: past kPrefillAttentionFrom on the GPU shape) and one (decode: split-K there).
TEST_P(SoftmaxFloor, TiledAndSplitAttentionDropDenormalWeights) {
  Device& dev = test::default_device();
  test::ShapeScope shape(dev, GetParam());
  const uint32_t hd = 16;
  // [2 pages][K | V][kPage positions][hd]: page 0 holds the sequence, page 1 is never read.
  std::vector<float> cache(size_t(2) * 2 * kPage * hd, 0.0f);
  for (uint32_t p = 0; p < kPositions; ++p) {
    cache[size_t(p) * hd] = p == 0 ? 0.0f : kFarBelow;
    for (uint32_t i = 0; i < hd; ++i)
      cache[size_t(kPage + p) * hd + i] = p == 0 ? max_value(i) : kHuge;
  }
  cl::Mem cm = test::upload(dev, cache);
  for (const std::vector<uint32_t>& positions :
       {std::vector<uint32_t>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9}, std::vector<uint32_t>{9}}) {
    const uint32_t T = uint32_t(positions.size());
    std::vector<float> q(size_t(T) * hd, 0.0f);
    for (uint32_t t = 0; t < T; ++t) q[size_t(t) * hd] = 1.0f;
    Step s = step(dev, positions);
    cl::Mem qm = test::upload(dev, q), om = dev.alloc(size_t(T) * hd * 4);
    ops::paged_attention(dev, qm, hd, cm, s.st, 1, 1, hd, 1.0f, om, hd);
    const std::vector<float> out = test::download(dev, om, size_t(T) * hd);
    for (uint32_t t = 0; t < T; ++t)
      for (uint32_t i = 0; i < hd; ++i)
        ASSERT_EQ(out[size_t(t) * hd + i], max_value(i))
            << T << " new tokens, the one at position " << positions[t] << ", element " << i;
  }
}

// MLA's absorbed decode (one head; cache rows [latent 16 | rope 16], the value the latent part):
// the query is e0, so the row's first element is the score.
TEST_P(SoftmaxFloor, MlaDecodeDropsDenormalWeights) {
  Device& dev = test::default_device();
  test::ShapeScope shape(dev, GetParam());
  ops::MlaShape ms;
  ms.n_heads = 1;
  ms.kv_lora = 16;
  ms.nope = 8;
  ms.rope = 16;
  ms.v = 8;
  const uint32_t row = ms.row();
  std::vector<float> cache(size_t(2) * kPage * row, 0.0f);
  for (uint32_t p = 0; p < kPositions; ++p) {
    float* r = cache.data() + size_t(p) * row;
    for (uint32_t i = 1; i < ms.kv_lora; ++i) r[i] = p == 0 ? max_value(i) : kHuge;
    r[0] = p == 0 ? 0.0f : kFarBelow;
  }
  std::vector<float> qf(row, 0.0f);
  qf[0] = 1.0f;
  cl::Mem cm = test::upload(dev, cache), qm = test::upload(dev, qf),
          om = dev.alloc(size_t(ms.kv_lora) * 4);
  Step s = step(dev, {kPositions - 1});
  ops::mla_decode_attention(dev, qm, cm, s.st, ms, 1.0f, om);
  const std::vector<float> out = test::download(dev, om, ms.kv_lora);
  EXPECT_EQ(out[0], 0.0f);  // the max position's own score element
  for (uint32_t i = 1; i < ms.kv_lora; ++i) EXPECT_EQ(out[i], max_value(i)) << "element " << i;
}

INSTANTIATE_TEST_SUITE_P(Shapes, SoftmaxFloor,
                         ::testing::Values(KernelShape::Chunks, KernelShape::WorkGroups),
                         [](const auto& info) {
                           return std::string(info.param == KernelShape::Chunks ? "cpu" : "gpu");
                         });

}  // namespace
}  // namespace clshard
