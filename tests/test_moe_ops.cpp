// MoE ops: the DeepSeek-V3 router (kernel and host reference) on hand-made scores and on random
// logits, its config validation, the host plan of expert batches, the gather into expert order and
// the slot-ordered combine.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <array>
#include <bit>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>

#include "runtime/device.h"
#include "runtime/device_manager.h"
#include "runtime/ops.h"
#include "runtime/ops_moe.h"
#include "runtime/tensor.h"

#include "tests/test_util.h"

namespace clshard {
namespace {

Device& device() { return test::default_device(); }

template <typename T>
cl::Mem upload(Device& dev, const std::vector<T>& v) {
  cl::Mem m = dev.alloc(v.size() * sizeof(T));
  dev.write(m, v.data(), v.size() * sizeof(T));
  return m;
}

template <typename T>
std::vector<T> download(Device& dev, const cl::Mem& m, size_t n) {
  std::vector<T> v(n);
  dev.read(m, v.data(), n * sizeof(T));
  return v;
}

// The logit whose sigmoid is p: hand-made cases are written as router scores.
std::vector<float> logits_of(const std::vector<float>& scores) {
  std::vector<float> l;
  for (float p : scores) l.push_back(std::log(p / (1.0f - p)));
  return l;
}

struct Routing {
  std::vector<int32_t> ids;
  std::vector<float> weights;
};

// Routed in the given kernel shape (WorkGroups: the GPU-shaped router, run on PoCL).
Routing route_on_device(const std::vector<float>& logits, const std::vector<float>* bias,
                        uint32_t T, const ops::RouterConfig& cfg, DType bias_dtype = DType::F32,
                        KernelShape shape = KernelShape::Chunks) {
  Device& dev = device();
  test::ShapeScope scope(dev, shape);
  cl::Mem lb = upload(dev, logits);
  Weight bw;
  if (bias) {
    if (bias_dtype == DType::BF16) {
      std::vector<uint16_t> b16;
      for (float b : *bias) b16.push_back(f32_to_bf16(b));
      bw.mem = upload(dev, b16);
      bw.dtype = DType::BF16;
      bw.shape = {int64_t(bias->size())};
      bw.name = "test.e_score_correction_bias";
    } else {
      bw = to_device_f32(dev, *bias, {int64_t(bias->size())}, "test.e_score_correction_bias");
    }
  }
  cl::Mem ids = dev.alloc(size_t(T) * cfg.top_k * sizeof(int32_t));
  cl::Mem wts = dev.alloc(size_t(T) * cfg.top_k * sizeof(float));
  ops::moe_route(dev, lb, bias ? &bw : nullptr, T, cfg, ids, wts);
  return {download<int32_t>(dev, ids, size_t(T) * cfg.top_k),
          download<float>(dev, wts, size_t(T) * cfg.top_k)};
}

Routing route_on_host(const std::vector<float>& logits, const std::vector<float>* bias, uint32_t T,
                      const ops::RouterConfig& cfg) {
  Routing r{std::vector<int32_t>(size_t(T) * cfg.top_k), std::vector<float>(size_t(T) * cfg.top_k)};
  reference::route(logits.data(), bias ? bias->data() : nullptr, T, cfg, r.ids.data(),
                   r.weights.data());
  return r;
}

// One token routed by the kernel and by the host reference: both must give `ids` exactly and
// `weights` to float rounding (the logits came from scores through log, the kernel's exp may
// differ from the host's by a few ulps).
void expect_route(const std::vector<float>& scores, const std::vector<float>* bias,
                  const ops::RouterConfig& cfg, const std::vector<int32_t>& ids,
                  const std::vector<float>& weights) {
  const std::vector<float> logits = logits_of(scores);
  for (const char* where : {"device cpu shape", "device gpu shape", "host"}) {
    SCOPED_TRACE(where);
    const std::string w = where;
    const Routing r = w == "host" ? route_on_host(logits, bias, 1, cfg)
                                  : route_on_device(logits, bias, 1, cfg, DType::F32,
                                                    w == "device cpu shape" ? KernelShape::Chunks
                                                                            : KernelShape::WorkGroups);
    EXPECT_EQ(r.ids, ids);
    ASSERT_EQ(r.weights.size(), weights.size());
    for (size_t i = 0; i < weights.size(); ++i)
      EXPECT_NEAR(r.weights[i], weights[i], 2e-6f * std::max(1.0f, std::abs(weights[i])))
          << "slot " << i;
  }
}

ops::RouterConfig config(uint32_t E, uint32_t top_k, uint32_t n_group, uint32_t topk_group,
                         bool norm = true, float scale = 1.0f) {
  ops::RouterConfig c;
  c.n_experts = E;
  c.top_k = top_k;
  c.n_group = n_group;
  c.topk_group = topk_group;
  c.norm_topk_prob = norm;
  c.routed_scaling_factor = scale;
  return c;
}

// ---------------------------------------------------------------------------------------------
// Router on hand-made scores

TEST(MoeRoute, BestExpertInMaskedGroupIsNotChosen) {
  // 4 groups of 2. Group scores (top-2 sums): 1.0, 1.2, 1.1, 0.5 -> groups 1 and 2 stay. Expert 0
  // (0.9) is the best overall but sits in group 0, which loses to groups whose top-2 sums are
  // larger.
  const std::vector<float> scores = {0.9f, 0.1f, 0.7f, 0.5f, 0.6f, 0.5f, 0.2f, 0.3f};
  expect_route(scores, nullptr, config(8, 2, 4, 2), {2, 4}, {0.7f / 1.3f, 0.6f / 1.3f});
  // With three groups kept, group 0 joins and expert 0 wins.
  expect_route(scores, nullptr, config(8, 2, 4, 3), {0, 2}, {0.9f / 1.6f, 0.7f / 1.6f});
}

TEST(MoeRoute, GroupScoreIsTopTwoSumNotMax) {
  // Group 0 has the single best expert (0.95) but a weak second (0.05): sum 1.0. Group 1 sums
  // 0.6 + 0.6 = 1.2 and wins the one kept group.
  const std::vector<float> scores = {0.95f, 0.05f, 0.6f, 0.6f};
  expect_route(scores, nullptr, config(4, 1, 2, 1), {2}, {1.0f});
}

TEST(MoeRoute, BiasSelectsButWeightsAreUnbiased) {
  // Bias lifts expert 2 (0.3 + 0.7 = 1.0) above experts 0 (0.9) and 1 (0.8); the weights are the
  // sigmoid scores 0.3 and 0.9 normalised, not the biased 1.0 and 0.9.
  const std::vector<float> scores = {0.9f, 0.8f, 0.3f, 0.2f};
  const std::vector<float> bias = {0.0f, 0.0f, 0.7f, 0.0f};
  expect_route(scores, &bias, config(4, 2, 1, 1), {2, 0}, {0.3f / 1.2f, 0.9f / 1.2f});
  // The bias also decides the groups: unbiased, group 0 (0.9 + 0.8) beats group 1 (0.2 + 0.3);
  // biased, group 0 sums 0.4 + 0.3 = 0.7 against group 1's 0.7 + 0.8 = 1.5.
  const std::vector<float> grouped_scores = {0.9f, 0.8f, 0.2f, 0.3f};
  const std::vector<float> grouped_bias = {-0.5f, -0.5f, 0.5f, 0.5f};
  expect_route(grouped_scores, &grouped_bias, config(4, 2, 2, 1), {3, 2},
               {0.3f / 0.5f, 0.2f / 0.5f});
}

TEST(MoeRoute, TiesGoToLowerIds) {
  // All scores equal: the groups tie (keep 0 and 1), the experts tie (0, 1, 2 in that order).
  const std::vector<float> flat(8, 0.5f);
  expect_route(flat, nullptr, config(8, 3, 4, 2), {0, 1, 2}, {1 / 3.0f, 1 / 3.0f, 1 / 3.0f});
  // Groups 1 and 3 tie for best (identical scores), group 3 loses the single kept slot; inside
  // group 1 the two equal experts come out lower id first.
  const std::vector<float> scores = {0.1f, 0.2f, 0.6f, 0.6f, 0.3f, 0.3f, 0.6f, 0.6f};
  expect_route(scores, nullptr, config(8, 2, 4, 1), {2, 3}, {0.5f, 0.5f});
}

TEST(MoeRoute, SingleGroup) {
  const std::vector<float> scores = {0.2f, 0.7f, 0.4f, 0.9f, 0.1f, 0.7f};
  expect_route(scores, nullptr, config(6, 3, 1, 1), {3, 1, 5},
               {0.9f / 2.3f, 0.7f / 2.3f, 0.7f / 2.3f});
}

TEST(MoeRoute, UnnormalisedAndScaled) {
  const std::vector<float> scores = {0.2f, 0.7f, 0.4f, 0.9f};
  // norm_topk_prob false: the raw scores times the scaling factor.
  expect_route(scores, nullptr, config(4, 2, 2, 2, false, 2.5f), {3, 1},
               {0.9f * 2.5f, 0.7f * 2.5f});
  // Normalised and scaled: the weights sum to the scaling factor.
  expect_route(scores, nullptr, config(4, 2, 2, 2, true, 2.5f), {3, 1},
               {0.9f / 1.6f * 2.5f, 0.7f / 1.6f * 2.5f});
}

// ---------------------------------------------------------------------------------------------
// Kernel against the host reference on random logits

void compare_random(uint32_t T, const ops::RouterConfig& cfg, bool with_bias, uint32_t seed,
                    DType bias_dtype = DType::F32) {
  SCOPED_TRACE("E=" + std::to_string(cfg.n_experts) + " groups=" + std::to_string(cfg.n_group) +
               " bias=" + std::to_string(with_bias));
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  std::vector<float> logits(size_t(T) * cfg.n_experts), bias(cfg.n_experts);
  for (auto& l : logits) l = normal(rng);
  // Bias of the size a trained router has (a few tenths), rounded to what the device will hold.
  for (auto& b : bias) {
    b = 0.2f * normal(rng);
    if (bias_dtype == DType::BF16) b = bf16_to_f32(f32_to_bf16(b));
  }
  const auto* bp = with_bias ? &bias : nullptr;
  const Routing dev = route_on_device(logits, bp, T, cfg, bias_dtype);
  const Routing host = route_on_host(logits, bp, T, cfg);
  EXPECT_EQ(dev.ids, host.ids);
  ASSERT_EQ(dev.weights.size(), host.weights.size());
  for (size_t i = 0; i < host.weights.size(); ++i)
    EXPECT_NEAR(dev.weights[i], host.weights[i], 2e-6f * cfg.routed_scaling_factor) << i;
  // The GPU-shaped router (a work-group per token) picks the same experts with the same weights,
  // bit for bit: the same arithmetic in the same order.
  const Routing wg = route_on_device(logits, bp, T, cfg, bias_dtype, KernelShape::WorkGroups);
  EXPECT_EQ(wg.ids, dev.ids);
  EXPECT_EQ(wg.weights, dev.weights);

  // What the routing must satisfy regardless of the implementation: distinct ids, from at most
  // topk_group groups, in descending selection-score order, weights summing to the scale.
  const uint32_t per_group = cfg.n_experts / cfg.n_group;
  for (uint32_t t = 0; t < T; ++t) {
    std::vector<int> groups;
    float sum = 0;
    for (uint32_t s = 0; s < cfg.top_k; ++s) {
      const int32_t id = host.ids[t * cfg.top_k + s];
      ASSERT_GE(id, 0);
      ASSERT_LT(uint32_t(id), cfg.n_experts);
      for (uint32_t s2 = 0; s2 < s; ++s2) EXPECT_NE(host.ids[t * cfg.top_k + s2], id);
      if (std::find(groups.begin(), groups.end(), id / per_group) == groups.end())
        groups.push_back(int(id / per_group));
      if (s > 0) {
        auto sel = [&](int32_t e) {
          const float sc = 1.0f / (1.0f + std::exp(-logits[t * cfg.n_experts + e]));
          return with_bias ? sc + bias[e] : sc;
        };
        EXPECT_GE(sel(host.ids[t * cfg.top_k + s - 1]), sel(id));
      }
      sum += host.weights[t * cfg.top_k + s];
    }
    EXPECT_LE(groups.size(), cfg.topk_group);
    EXPECT_NEAR(sum, cfg.routed_scaling_factor, 1e-5f);
  }
}

TEST(MoeRoute, KernelMatchesReference16Experts4Groups) {
  compare_random(37, config(16, 4, 4, 2, true, 2.5f), true, 1);
  compare_random(37, config(16, 4, 4, 2, true, 2.5f), false, 2);
  compare_random(37, config(16, 4, 4, 2, true, 2.5f), true, 3, DType::BF16);
}

TEST(MoeRoute, KernelMatchesReference64Experts8Groups) {
  compare_random(37, config(64, 8, 8, 4, true, 2.5f), true, 4);
  compare_random(1, config(64, 8, 8, 4, true, 1.0f), true, 5);
}

TEST(MoeRoute, KernelMatchesReferenceDeepSeekV3Shape) {
  compare_random(9, config(256, 8, 8, 4, true, 2.5f), true, 6);
}

TEST(MoeRoute, ValidateNamesTheBrokenRule) {
  auto expect_invalid = [](const ops::RouterConfig& c, const std::string& needle) {
    try {
      ops::validate(c);
      ADD_FAILURE() << "accepted a config that breaks: " << needle;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_invalid(config(0, 1, 1, 1), "n_experts must be > 0");
  expect_invalid(config(16, 0, 4, 2), "top_k (num_experts_per_tok) must be > 0");
  expect_invalid(config(16, 4, 0, 1), "n_group must be > 0");
  expect_invalid(config(18, 4, 4, 2), "multiple of n_group");
  expect_invalid(config(16, 4, 4, 5), "topk_group must be between 1 and n_group");
  expect_invalid(config(16, 4, 4, 0), "topk_group must be between 1 and n_group");
  expect_invalid(config(16, 9, 4, 2), "top_k exceeds the 8 experts in the kept groups");
  expect_invalid(config(4, 1, 4, 2), "at least 2 experts");
  EXPECT_NO_THROW(ops::validate(config(256, 8, 8, 4, true, 2.5f)));
  EXPECT_NO_THROW(ops::validate(config(8, 2, 1, 1)));
  EXPECT_NO_THROW(ops::validate(config(1, 1, 1, 1)));  // one group: no top-2 group score needed
  // The op validates before building anything.
  Device& dev = device();
  cl::Mem m = dev.alloc(64);
  EXPECT_THROW(ops::moe_route(dev, m, nullptr, 1, config(18, 4, 4, 2), m, m),
               std::invalid_argument);
}

// ---------------------------------------------------------------------------------------------
// group_by_expert

TEST(GroupByExpert, OrdersByExpertThenTokenThenSlot) {
  // Tokens: t0 -> {2, 0}, t1 -> {2, 3}, t2 -> {0, 2}; expert 1 gets nothing.
  const std::vector<int32_t> ids = {2, 0, 2, 3, 0, 2};
  const ops::ExpertBatches b = ops::group_by_expert(ids, 3, 2, 4);
  EXPECT_EQ(b.expert_offsets, (std::vector<uint32_t>{0, 2, 2, 5, 6}));
  // Rows: e0: (t0,s1) (t2,s0); e2: (t0,s0) (t1,s0) (t2,s1); e3: (t1,s1).
  EXPECT_EQ(b.src_token, (std::vector<uint32_t>{0, 2, 0, 1, 2, 1}));
  EXPECT_EQ(b.slot_row, (std::vector<uint32_t>{2, 0, 3, 5, 1, 4}));
}

TEST(GroupByExpert, RandomRoutingIsAConsistentPermutation) {
  const uint32_t T = 53, k = 4, E = 16;
  std::mt19937 rng(9);
  std::vector<int32_t> ids(T * k);
  for (uint32_t t = 0; t < T; ++t) {
    std::vector<int32_t> perm(E);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    std::copy(perm.begin(), perm.begin() + k, ids.begin() + t * k);
  }
  const ops::ExpertBatches b = ops::group_by_expert(ids, T, k, E);
  ASSERT_EQ(b.expert_offsets.size(), E + 1);
  EXPECT_EQ(b.expert_offsets.front(), 0u);
  EXPECT_EQ(b.expert_offsets.back(), T * k);
  std::vector<int> seen(T * k, 0);
  for (uint32_t t = 0; t < T; ++t)
    for (uint32_t s = 0; s < k; ++s) {
      const uint32_t row = b.slot_row[t * k + s];
      const int32_t e = ids[t * k + s];
      ASSERT_LT(row, T * k);
      ++seen[row];
      EXPECT_EQ(b.src_token[row], t);
      EXPECT_GE(row, b.expert_offsets[e]);
      EXPECT_LT(row, b.expert_offsets[e + 1]);
    }
  for (uint32_t r = 0; r < T * k; ++r) EXPECT_EQ(seen[r], 1) << "row " << r;
  // Within an expert, source tokens ascend.
  for (uint32_t e = 0; e < E; ++e)
    for (uint32_t r = b.expert_offsets[e] + 1; r < b.expert_offsets[e + 1]; ++r)
      EXPECT_LT(b.src_token[r - 1], b.src_token[r]);
}

TEST(GroupByExpert, RejectsBadIds) {
  EXPECT_THROW(ops::group_by_expert({0, 4}, 1, 2, 4), std::out_of_range);
  EXPECT_THROW(ops::group_by_expert({0, -1}, 1, 2, 4), std::out_of_range);
  EXPECT_THROW(ops::group_by_expert({0, 1, 2}, 1, 2, 4), std::invalid_argument);
  const ops::ExpertBatches empty = ops::group_by_expert({}, 0, 2, 3);
  EXPECT_EQ(empty.expert_offsets, (std::vector<uint32_t>{0, 0, 0, 0}));
}

// ---------------------------------------------------------------------------------------------
// gather_rows and moe_combine

// In both kernel shapes (the GPU shape: a lane per column, the last work-group of a row partly
// past the width).
TEST(GatherRows, CopiesSelectedRowsAndNothingElse) {
  Device& dev = device();
  const uint32_t rows_in = 10, width = 300, ldx = 310, ldy = 305;  // 256-float chunk + 44 tail
  std::vector<float> x(rows_in * ldx);
  for (size_t i = 0; i < x.size(); ++i) x[i] = float(i) * 0.5f - 7.0f;
  const std::vector<uint32_t> rows = {3, 0, 9, 3, 7, 1, 1};  // repeats, as a token in 2 experts
  const uint32_t n = uint32_t(rows.size());
  std::vector<float> y0(n * ldy, -1.0f);
  cl::Mem xb = upload(dev, x), rb = upload(dev, rows);
  for (const KernelShape shape : {KernelShape::Chunks, KernelShape::WorkGroups}) {
    SCOPED_TRACE(kernel_shape_name(shape));
    test::ShapeScope scope(dev, shape);
    cl::Mem yb = upload(dev, y0);
    ops::gather_rows(dev, xb, ldx, rb, n, width, yb, ldy);
    const std::vector<float> y = download<float>(dev, yb, y0.size());
    for (uint32_t i = 0; i < n; ++i)
      for (uint32_t c = 0; c < ldy; ++c) {
        const float want = c < width ? x[rows[i] * ldx + c] : -1.0f;
        ASSERT_EQ(y[i * ldy + c], want) << "row " << i << " col " << c;
      }
  }
}

// The C++ loop of the combine: fma in slot order starting from 0, then added to out.
std::vector<float> combine_on_host(const std::vector<float>& expert_out, uint32_t ld,
                                   const std::vector<uint32_t>& slot_row,
                                   const std::vector<float>& w, uint32_t T, uint32_t k, uint32_t H,
                                   std::vector<float> out, uint32_t ldo, bool accumulate) {
  for (uint32_t t = 0; t < T; ++t)
    for (uint32_t c = 0; c < H; ++c) {
      float acc = 0;
      for (uint32_t s = 0; s < k; ++s)
        acc = std::fma(w[t * k + s], expert_out[size_t(slot_row[t * k + s]) * ld + c], acc);
      float& o = out[size_t(t) * ldo + c];
      o = accumulate ? o + acc : acc;
    }
  return out;
}

// In both kernel shapes (the GPU shape: a lane per column).
TEST(MoeCombine, MatchesSlotOrderedLoopBitForBit) {
  Device& dev = device();
  const uint32_t T = 5, k = 3, E = 6, H = 300, ld = 310, ldo = 307;
  std::mt19937 rng(21);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<int32_t> ids = {0, 3, 5, 2, 3, 4, 5, 1, 0, 3, 2, 1, 4, 0, 2};
  const ops::ExpertBatches b = ops::group_by_expert(ids, T, k, E);
  std::vector<float> expert_out(T * k * ld), w(T * k), out0(T * ldo);
  for (auto& v : expert_out) v = normal(rng);
  for (auto& v : w) v = std::abs(normal(rng));
  for (auto& v : out0) v = normal(rng);
  cl::Mem eb = upload(dev, expert_out), sb = upload(dev, b.slot_row), wb = upload(dev, w);
  test::ShapeScope scope(dev, dev.kernel_shape());  // the device's own shape back afterwards
  for (const KernelShape shape : {KernelShape::Chunks, KernelShape::WorkGroups})
  for (bool accumulate : {false, true}) {
    dev.set_kernel_shape(shape);
    SCOPED_TRACE(std::string(kernel_shape_name(shape)) + (accumulate ? " accumulate" : " overwrite"));
    cl::Mem ob = upload(dev, out0);
    ops::moe_combine(dev, eb, ld, sb, wb, T, k, H, ob, ldo, accumulate);
    const std::vector<float> got = download<float>(dev, ob, out0.size());
    const std::vector<float> want =
        combine_on_host(expert_out, ld, b.slot_row, w, T, k, H, out0, ldo, accumulate);
    for (size_t i = 0; i < got.size(); ++i)
      ASSERT_EQ(std::bit_cast<uint32_t>(got[i]), std::bit_cast<uint32_t>(want[i]))
          << "element " << i << ": " << got[i] << " vs " << want[i];
  }
}

// Moving expert rows around (as when other devices computed other experts and their outputs land
// in a different layout) leaves the combined result bit-identical: the sum runs over slots.
TEST(MoeCombine, ResultIndependentOfExpertRowLayout) {
  Device& dev = device();
  const uint32_t T = 4, k = 2, H = 40;
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> per_slot(T * k * H), w(T * k);  // output of token t's slot s
  for (auto& v : per_slot) v = normal(rng);
  for (auto& v : w) v = normal(rng);
  cl::Mem wb = upload(dev, w);
  std::vector<std::vector<float>> results;
  for (uint32_t layout = 0; layout < 3; ++layout) {
    std::vector<uint32_t> perm(T * k);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    std::vector<float> expert_out(T * k * H);
    for (uint32_t i = 0; i < T * k; ++i)
      std::copy_n(per_slot.begin() + i * H, H, expert_out.begin() + perm[i] * H);
    cl::Mem eb = upload(dev, expert_out), sb = upload(dev, perm);
    cl::Mem ob = dev.alloc(T * H * sizeof(float));
    ops::moe_combine(dev, eb, H, sb, wb, T, k, H, ob, H, false);
    results.push_back(download<float>(dev, ob, T * H));
  }
  for (size_t i = 0; i < results[0].size(); ++i) {
    EXPECT_EQ(std::bit_cast<uint32_t>(results[1][i]), std::bit_cast<uint32_t>(results[0][i]));
    EXPECT_EQ(std::bit_cast<uint32_t>(results[2][i]), std::bit_cast<uint32_t>(results[0][i]));
  }
  // And it is the weighted sum (to rounding).
  for (uint32_t t = 0; t < T; ++t)
    for (uint32_t c = 0; c < H; ++c) {
      double want = 0;
      for (uint32_t s = 0; s < k; ++s) want += double(w[t * k + s]) * per_slot[(t * k + s) * H + c];
      EXPECT_NEAR(results[0][t * H + c], want, 1e-5);
    }
}


// ---------------------------------------------------------------------------------------------
// The device-side plan (moe_plan) and the grouped expert launch (moe_grouped_linear)

namespace grouped {

// Random top-k ids: k distinct experts per token.
std::vector<int32_t> random_ids(uint32_t T, uint32_t k, uint32_t E, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> ids(size_t(T) * k);
  for (uint32_t t = 0; t < T; ++t) {
    std::vector<int32_t> perm(E);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    std::copy(perm.begin(), perm.begin() + k, ids.begin() + size_t(t) * k);
  }
  return ids;
}

// E experts of [gate F x H, up F x H, down H x F] (+ F32 block scales for FP8) packed into one
// buffer at unaligned-to-the-tile offsets, and each matrix also as its own Weight, which the
// per-expert ops take.
struct Experts {
  ops::GroupedExperts grouped;
  std::vector<std::array<Weight, 3>> w, s;
};

// FP8 weights carry the load-time scan's result (Weight::fp8_nan_free: true, as none holds a NaN
// code), unless nan_watch: then it stays unknown and the tiles watch for NaN codes.
Experts make_experts(Device& dev, DType dt, uint32_t E, uint32_t H, uint32_t F, uint32_t seed,
                     bool nan_watch = false) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  const size_t es = dt == DType::F8_E4M3 ? 1 : dt == DType::F32 ? 4 : 2;
  std::vector<uint8_t> packed(64);  // a leading gap: offsets are not zero
  std::vector<uint64_t> table(size_t(E) * 6, 0);
  Experts ex;
  for (uint32_t e = 0; e < E; ++e) {
    std::array<Weight, 3> w, s;
    for (uint32_t m = 0; m < 3; ++m) {
      const uint32_t N = m == 2 ? H : F, K = m == 2 ? F : H;
      std::vector<uint8_t> bytes(size_t(N) * K * es);
      for (size_t i = 0; i < size_t(N) * K; ++i) {
        if (dt == DType::F8_E4M3) {
          uint8_t b = uint8_t(rng());
          if ((b & 0x7F) == 0x7F) b ^= 1;  // no NaN codes
          bytes[i] = b;
        } else if (dt == DType::BF16 || dt == DType::F16) {
          const float f = u(rng);
          const uint16_t v = dt == DType::BF16 ? f32_to_bf16(f) : f32_to_f16(f);
          std::memcpy(&bytes[i * 2], &v, 2);
        } else {
          const float v = u(rng);
          std::memcpy(&bytes[i * 4], &v, 4);
        }
      }
      table[e * 6 + m] = packed.size() / es;
      packed.insert(packed.end(), bytes.begin(), bytes.end());
      w[m].mem = upload(dev, bytes);
      w[m].dtype = dt;
      w[m].shape = {N, K};
      w[m].name = "test.expert" + std::to_string(e) + "." + std::to_string(m);
      w[m].fp8_nan_free = dt == DType::F8_E4M3 && !nan_watch && fp8_nan_free(bytes.data(), bytes.size());
      if (dt == DType::F8_E4M3) {
        std::vector<float> sc(size_t((N + 127) / 128) * ((K + 127) / 128));
        // 10 mantissa bits: a code times its scale needs up to 14, so bf16 compute's dequantization
        // (rounded to bf16's 8) is not exact.
        for (float& v : sc) v = std::ldexp(1.0f + float(rng() % 1024) / 1024, -int(rng() % 6));
        while (packed.size() % 4) packed.push_back(0);
        table[e * 6 + 3 + m] = packed.size() / 4;
        const auto* p = reinterpret_cast<const uint8_t*>(sc.data());
        packed.insert(packed.end(), p, p + sc.size() * 4);
        s[m] = to_device_f32(dev, sc, {int64_t((N + 127) / 128), int64_t((K + 127) / 128)},
                             w[m].name + "_scale_inv");
      }
      while (packed.size() % es) packed.push_back(0);
    }
    ex.w.push_back(w);
    ex.s.push_back(s);
  }
  ex.grouped.mem = upload(dev, packed);
  ex.grouped.table = upload(dev, table);
  ex.grouped.dtype = dt;
  ex.grouped.n_experts = E;
  ex.grouped.hidden = H;
  ex.grouped.inter = F;
  ex.grouped.pairs_aligned = es == 2 && ops::grouped_rows_aligned(table, H, F);
  ex.grouped.fp8_nan_free = dt == DType::F8_E4M3 && !nan_watch;
  for (const auto& w : ex.w)
    for (const Weight& m : w) ex.grouped.fp8_nan_free = ex.grouped.fp8_nan_free && m.fp8_nan_free;
  return ex;
}

void linear_of(Device& dev, const cl::Mem& x, uint32_t x_off, uint32_t ldx, const Weight& w,
               const Weight& s, const cl::Mem& y, uint32_t y_off, uint32_t ldy, uint32_t M) {
  if (w.dtype == DType::F8_E4M3)
    ops::linear_fp8(dev, x, x_off, ldx, w, s, y, y_off, ldy, M);
  else
    ops::linear(dev, x, x_off, ldx, w, nullptr, y, y_off, ldy, M);
}

struct Case {
  DType dtype;
  uint32_t T, k, E, H, F;
  bool with_shared = false;  // the last of the E experts is a shared expert every token visits
  KernelShape shape = KernelShape::Chunks;
  uint32_t vector = 0;  // KernelTuning::linear_vector for the GPU shape; 0: the device's
  bool nan_watch = false;  // FP8: the weights' NaN scan unknown, so the CPU tiles watch
  ComputeDType compute = ComputeDType::F32;
  bool portable = false;  // bf16 compute: the portable micro-kernel (gemm_bf16_dot 0)
  bool f16_decode = false;  // FP8: the f16-based e4m3 decode (CLSHARD_FP8_DECODE=f16) in both paths
  // bf16 compute: KernelTuning::moe_bf16_packed_rows or moe_fp8_packed_rows, the experts' dtype's
  // (0: the device's; the other dtype's field then 0, never), and the experts must then fall on
  // both sides of ops::moe_bf16_packed_rows_from (the packed GEMM and the dot-product tiles).
  uint32_t packed_rows = 0;
  // f32 compute over bf16 experts where the device selects AMX: experts must fall on both sides of
  // gemm_f32_amx_rows (AMX's f32 terms and the f32 tiles).
  bool f32_terms_both = false;
};

// Every gate, up and down row of 2-byte experts starts on an even element: even offsets and even
// H and F, checked over the table's weight slots only (3-5 are FP8 scales).
TEST(GroupedRowsAligned, EvenOffsetsAndRowLengthsOnly) {
  const std::vector<uint64_t> even = {32, 1032, 2032, 7, 9, 11, 3032, 4032, 5032, 0, 0, 0};
  EXPECT_TRUE(ops::grouped_rows_aligned(even, 50, 20));
  EXPECT_FALSE(ops::grouped_rows_aligned(even, 51, 20));
  EXPECT_FALSE(ops::grouped_rows_aligned(even, 50, 21));
  std::vector<uint64_t> odd = even;
  odd[7] = 4033;  // expert 1's up matrix
  EXPECT_FALSE(ops::grouped_rows_aligned(odd, 50, 20));
  EXPECT_FALSE(ops::grouped_rows_aligned({32, 1032, 2032}, 50, 20));  // not [n][6]
}

class GroupedExperts : public ::testing::TestWithParam<Case> {};

// The plan made on the device equals group_by_expert's (with a shared expert: the ids with the
// shared expert appended to every token's slots), and every grouped row's gate|up and down outputs
// equal, bit for bit, those of the per-expert ops on that expert's rows (the path they replace)
// in the same kernel shape, with tokens read through src_token. Then the combine with the shared
// row equals the routed combine followed by adding the shared rows, bit for bit.
TEST_P(GroupedExperts, MatchPerExpertOpsBitForBit) {
  const Case c = GetParam();
  Device& dev = device();
  test::ShapeScope scope(dev, c.shape);
  // The decode devices without f32 denormals get, for the grouped launches and the per-expert
  // ops alike (the variable is read when a kernel's options are made).
  struct DecodeScope {
    explicit DecodeScope(bool f16) {
      if (f16) setenv("CLSHARD_FP8_DECODE", "f16", 1);
    }
    ~DecodeScope() { unsetenv("CLSHARD_FP8_DECODE"); }
  } decode(c.f16_decode);
  KernelTuning tuning = dev.tuning();
  if (c.vector) tuning.linear_vector = c.vector;
  // bf16 compute: vdpbf16ps where the host has it (test::with_bf16_dot), or the portable kernel.
  tuning.gemm_bf16_dot = c.portable ? 0 : 1;
  if (c.portable) {
    tuning.gemm_bf16_amx = 0;
    // The packed experts over the other panel than the device's row gives them (weights widened
    // to f32 or bf16 pairs, gemm_bf16_packed_wf32; the reference below then takes it too): both
    // are checked on any host.
    tuning.gemm_bf16_packed_wf32 = tuning.gemm_bf16_packed_wf32 ? 0 : 1;
  }
  if (c.packed_rows) {
    const bool fp8 = c.dtype == DType::F8_E4M3;
    tuning.moe_bf16_packed_rows = fp8 ? 0 : c.packed_rows;
    tuning.moe_fp8_packed_rows = fp8 ? c.packed_rows : 0;
  }
  test::TuningScope tuned(dev, tuning);
  const uint32_t routed = c.with_shared ? c.E - 1 : c.E, slots = c.k + (c.with_shared ? 1 : 0);
  const auto ids = random_ids(c.T, c.k, routed, 11 + c.T);
  std::vector<int32_t> all_ids;  // with the shared expert's slot
  for (uint32_t t = 0; t < c.T; ++t) {
    all_ids.insert(all_ids.end(), ids.begin() + size_t(t) * c.k, ids.begin() + size_t(t + 1) * c.k);
    if (c.with_shared) all_ids.push_back(int32_t(c.E - 1));
  }
  const ops::ExpertBatches host = ops::group_by_expert(all_ids, c.T, slots, c.E);
  cl::Mem idb = upload(dev, ids);
  const ops::GroupedPlan plan = ops::plan_experts(dev, idb, c.T, c.k, c.E, c.with_shared);
  const uint32_t S = c.T * slots;
  ASSERT_EQ(plan.rows, S);
  EXPECT_EQ(download<uint32_t>(dev, plan.expert_offsets.mem(), c.E + 1), host.expert_offsets);
  EXPECT_EQ(download<uint32_t>(dev, plan.src_token.mem(), S), host.src_token);
  EXPECT_EQ(download<uint32_t>(dev, plan.slot_row.mem(), S), host.slot_row);

  const Experts ex = make_experts(dev, c.dtype, c.E, c.H, c.F, 3 + c.E, c.nan_watch);
  // make_experts packs its matrices from an even offset: 2-byte experts of even H and F have
  // every row on a 4-byte boundary, and bf16 compute's tiles then load their pairs as words.
  if (c.dtype == DType::BF16 || c.dtype == DType::F16) {
    EXPECT_EQ(ex.grouped.pairs_aligned, c.H % 2 == 0 && c.F % 2 == 0);
  }
  std::mt19937 rng(4);
  std::uniform_real_distribution<float> u(-2.0f, 2.0f);
  std::vector<float> x(size_t(c.T) * c.H);
  for (float& v : x) v = u(rng);
  cl::Mem xb = upload(dev, x);
  const uint32_t F2 = 2 * c.F;
  cl::Mem gu = dev.alloc(size_t(S) * F2 * 4), out = dev.alloc(size_t(S) * c.H * 4);
  ops::moe_grouped_linear(dev, xb, c.H, &plan.src_token.mem(), ex.grouped, 0, 2, plan, gu, F2,
                          c.compute, c.T);
  // down reads the gate|up rows themselves (any f32 rows do), at stride 2F.
  ops::moe_grouped_linear(dev, gu, F2, nullptr, ex.grouped, 2, 1, plan, out, c.H, c.compute);

  // The path it replaces: gather the tokens, then each expert's ops on its rows.
  cl::Mem rows = upload(dev, host.src_token), xg = dev.alloc(size_t(S) * c.H * 4);
  ops::gather_rows(dev, xb, c.H, rows, S, c.H, xg, c.H);
  cl::Mem gu_ref = dev.alloc(size_t(S) * F2 * 4), out_ref = dev.alloc(size_t(S) * c.H * 4);
  // bf16 compute takes the grouped experts where they average 8 rows or more
  // (kGroupedBf16RowsFrom); below, their tiles stay f32 and so does the reference (FP8 experts:
  // fp8_bf16_sums below).
  const bool bf16_path = c.compute == ComputeDType::BF16 && S >= 8 * c.E;
  if (bf16_path) {
    ASSERT_EQ(plan.tm, 4u) << "the case must plan 4-row tiles";
  }
  // Below 4 rows per expert (one-row tiles), bf16 experts take the bf16 sums where ops::bf16_gemv
  // holds: ops::linear's bf16 GEMV bits for each row, as the reference below gives them.
  const bool bf16_gemv_path = !bf16_path && c.compute == ComputeDType::BF16 &&
                              c.dtype == DType::BF16 && c.shape == KernelShape::Chunks &&
                              plan.tm == 1 && ops::bf16_gemv(dev);
  if (c.compute == ComputeDType::BF16 && c.dtype == DType::BF16 && !bf16_path)
    std::printf("bf16 experts below 8 rows on average (%s tiles): %s\n",
                plan.tm == 1 ? "one-row" : "4-row",
                bf16_gemv_path ? "bf16 sums (vdpbf16ps)" : "the f32 tiles");
  const bool bf16_sums = bf16_path || bf16_gemv_path;
  // The experts the packed GEMM takes (ops::moe_bf16_packed_rows_from rows or more; these shapes'
  // panels fit any device's local memory).
  const uint32_t packed_from = ops::moe_bf16_packed_rows_from(dev, c.dtype);
  if (bf16_path && c.packed_rows) {
    uint32_t packed = 0, tiled = 0;
    for (uint32_t e = 0; e < c.E; ++e) {
      const uint32_t n = host.expert_offsets[e + 1] - host.expert_offsets[e];
      if (n > 0) ++(n >= packed_from ? packed : tiled);
    }
    ASSERT_GT(packed, 0u) << "no expert of " << packed_from << " rows or more";
    ASSERT_GT(tiled, 0u) << "no expert of fewer than " << packed_from << " rows";
  }
  if (bf16_sums) {
    // Each expert's reference is ops::linear under bf16 compute; FP8 experts: of the weight
    // dequantized to bf16 by dequantize_fp8_bf16 (ops::linear_any's FP8 GEMM under bf16
    // compute). An expert of packed_from rows or more: ops::linear over its own rows, the
    // packed GEMM. Fewer: the bf16 GEMM's tile sums, which do not depend on the rows around
    // them, so ops::linear over all S rows with the packed GEMM off, of which the expert's own
    // are kept (its bf16 GEMV, for fewer than 4 rows, gives them the same bits).
    auto rows_of = [&](const cl::Mem& in, uint32_t ld_in, uint32_t mat, uint32_t N,
                       const cl::Mem& dst, uint32_t ld_dst, uint32_t col) {
      cl::Mem tmp = dev.alloc(size_t(S) * N * 4);
      std::vector<float> all(size_t(S) * ld_dst);
      dev.read(dst, all.data(), all.size() * 4);
      for (uint32_t e = 0; e < c.E; ++e) {
        const uint32_t b = host.expert_offsets[e], n = host.expert_offsets[e + 1] - b;
        if (n == 0) continue;
        Weight w = ex.w[e][mat];
        if (w.dtype == DType::F8_E4M3) {
          w.mem = dev.alloc(size_t(w.dim(0)) * w.dim(1) * 2);
          ops::dequantize_fp8_bf16(dev, ex.w[e][mat], ex.s[e][mat], w.mem);
          w.dtype = DType::BF16;
        }
        const bool packed = packed_from != 0 && n >= packed_from;
        // ops::linear takes the packed GEMM from the grouped experts' row count for the packed
        // ones (its own gemm_bf16_packed_rows may be more), never for the others.
        KernelTuning tiled = dev.tuning();
        tiled.gemm_bf16_packed_rows = !packed                     ? 0
                                      : c.dtype == DType::F8_E4M3 ? tiled.moe_fp8_packed_rows
                                                                  : tiled.moe_bf16_packed_rows;
        test::TuningScope scope(dev, tiled);
        ops::linear(dev, in, packed ? b * ld_in : 0, ld_in, w, nullptr, tmp, 0, N, packed ? n : S,
                    1.0f, false, ComputeDType::BF16);
        const auto t = download<float>(dev, tmp, size_t(S) * N);
        for (uint32_t r = b; r < b + n; ++r)
          std::copy_n(t.begin() + size_t(packed ? r - b : r) * N, N,
                      all.begin() + size_t(r) * ld_dst + col);
      }
      dev.write(dst, all.data(), all.size() * 4);
    };
    dev.fill_zero(gu_ref, size_t(S) * F2 * 4);
    dev.fill_zero(out_ref, size_t(S) * c.H * 4);
    rows_of(xg, c.H, 0, c.F, gu_ref, F2, 0);
    rows_of(xg, c.H, 1, c.F, gu_ref, F2, c.F);
    rows_of(gu, F2, 2, c.H, out_ref, c.H, 0);
  }
  // The f32 path: the grouped experts run the f32 tiles at any row count, and so does the
  // reference (the packed GEMM, which ops::linear takes for bf16 weights from
  // gemm_bf16_packed_rows rows, sums in another order: off), but for bf16 experts of
  // gemm_f32_amx_rows rows or more where the device selects AMX, which run on their rows' bf16
  // terms (moe_grouped_packed, -DX_SPLIT=3): their reference is ops::linear over their own rows
  // with AMX's terms, the streaming GEMM up to 32 rows and the packed one beyond.
  // FP8 experts under bf16 compute below that average, on the CPU shape, where linear_fp8 sums in
  // bf16 (vdpbf16ps, the short decode): every row those sums, whatever its expert's row count.
  // The reference: linear_fp8 under bf16 compute over the expert's rows in blocks of 4 (the last
  // padded with zero rows), where its bf16 sums run.
  const bool fp8_bf16_sums = c.compute == ComputeDType::BF16 && !bf16_path &&
                             c.dtype == DType::F8_E4M3 && c.shape == KernelShape::Chunks &&
                             !c.f16_decode && ops::bf16_dot_product(dev);
  if (c.compute == ComputeDType::BF16 && c.dtype == DType::F8_E4M3 && !bf16_path)
    std::printf("FP8 experts below 8 rows on average: %s\n",
                fp8_bf16_sums ? "bf16 sums (vdpbf16ps)" : "the f32 tiles");
  if (fp8_bf16_sums) {
    auto rows_of = [&](const cl::Mem& in, uint32_t ld_in, uint32_t b, uint32_t n, uint32_t e,
                       uint32_t mat, const cl::Mem& dst, uint32_t ld_dst, uint32_t col) {
      const Weight& w = ex.w[e][mat];
      const uint32_t N = uint32_t(w.dim(0)), K = uint32_t(w.dim(1));
      cl::Mem block = dev.alloc(size_t(4) * K * 4), tmp = dev.alloc(size_t(4) * N * 4);
      for (uint32_t r0 = 0; r0 < n; r0 += 4) {
        const uint32_t m = std::min(4u, n - r0);
        std::vector<float> rows(size_t(4) * K, 0.0f), got(size_t(4) * N);
        for (uint32_t i = 0; i < m; ++i)
          dev.read(in, &rows[size_t(i) * K], size_t(K) * 4, (size_t(b + r0 + i) * ld_in) * 4);
        dev.write(block, rows.data(), rows.size() * 4);
        ops::linear_fp8(dev, block, 0, K, w, ex.s[e][mat], tmp, 0, N, 4, 1.0f, false,
                        ComputeDType::BF16);
        dev.read(tmp, got.data(), got.size() * 4);
        for (uint32_t i = 0; i < m; ++i)
          dev.write(dst, &got[size_t(i) * N], size_t(N) * 4,
                    (size_t(b + r0 + i) * ld_dst + col) * 4);
      }
    };
    for (uint32_t e = 0; e < c.E; ++e) {
      const uint32_t b = host.expert_offsets[e], n = host.expert_offsets[e + 1] - b;
      rows_of(xg, c.H, b, n, e, 0, gu_ref, F2, 0);
      rows_of(xg, c.H, b, n, e, 1, gu_ref, F2, c.F);
      rows_of(gu, F2, b, n, e, 2, out_ref, c.H, 0);  // down reads the grouped gate|up rows
    }
    // Not the f32 tiles' sums: some outputs differ from them (x rounded to bf16).
    cl::Mem gu_f32 = dev.alloc(size_t(S) * F2 * 4);
    ops::moe_grouped_linear(dev, xb, c.H, &plan.src_token.mem(), ex.grouped, 0, 2, plan, gu_f32, F2,
                            ComputeDType::F32, c.T);
    const auto f32 = download<float>(dev, gu_f32, size_t(S) * F2);
    const auto bf16 = download<float>(dev, gu_ref, size_t(S) * F2);
    size_t differ = 0;
    for (size_t i = 0; i < f32.size(); ++i)
      differ += std::bit_cast<uint32_t>(f32[i]) != std::bit_cast<uint32_t>(bf16[i]);
    EXPECT_GT(differ, 0u);
  }
  if (!bf16_sums && !fp8_bf16_sums) {
    const uint32_t terms_from =
        c.dtype == DType::BF16 && c.shape == KernelShape::Chunks && ops::bf16_amx(dev)
            ? dev.tuning().gemm_f32_amx_rows
            : 0;
    uint32_t with_terms = 0, without = 0;
    for (uint32_t e = 0; e < c.E; ++e) {
      const uint32_t b = host.expert_offsets[e], n = host.expert_offsets[e + 1] - b;
      if (n == 0) continue;
      const bool terms = terms_from != 0 && n >= terms_from;
      ++(terms ? with_terms : without);
      KernelTuning f32_tiles = dev.tuning();
      f32_tiles.gemm_bf16_packed_rows = 0;
      if (!terms) f32_tiles.gemm_f32_amx_rows = 0;
      test::TuningScope f32_scope(dev, f32_tiles);
      linear_of(dev, xg, b * c.H, c.H, ex.w[e][0], ex.s[e][0], gu_ref, b * F2, F2, n);
      linear_of(dev, xg, b * c.H, c.H, ex.w[e][1], ex.s[e][1], gu_ref, b * F2 + c.F, F2, n);
      // down reads the grouped gate|up rows, as the grouped down did.
      linear_of(dev, gu, b * F2, F2, ex.w[e][2], ex.s[e][2], out_ref, b * c.H, c.H, n);
    }
    if (c.f32_terms_both && terms_from != 0) {
      EXPECT_GT(with_terms, 0u) << "no expert of " << terms_from << " rows or more";
      EXPECT_GT(without, 0u) << "no expert of fewer than " << terms_from << " rows";
    }
  }
  // The experts' SwiGLU in one op against the gate|up rows above followed by silu_mul: bit for
  // bit where the op runs those two itself; on the bf16-compute path, one launch with the SwiGLU
  // in its epilogue (as linear_bf16's GLU tiles), within 4 x FLT_EPSILON (relative).
  {
    cl::Mem act = dev.alloc(size_t(S) * c.F * 4), act_ref = dev.alloc(size_t(S) * c.F * 4);
    ops::moe_grouped_swiglu(dev, xb, c.H, &plan.src_token.mem(), ex.grouped, plan, act, c.F,
                            c.compute, c.T);
    ops::silu_mul(dev, gu, 0, F2, gu, c.F, F2, act_ref, c.F, S, c.F);
    const auto a = download<float>(dev, act, size_t(S) * c.F);
    const auto ar = download<float>(dev, act_ref, size_t(S) * c.F);
    const bool fused = bf16_sums;
    size_t differ = 0;
    for (size_t i = 0; i < a.size(); ++i) {
      const bool same = fused ? std::abs(double(a[i]) - ar[i]) <= 4 * FLT_EPSILON * std::abs(ar[i])
                              : std::bit_cast<uint32_t>(a[i]) == std::bit_cast<uint32_t>(ar[i]);
      if (!same && differ++ < 5)
        ADD_FAILURE() << "swiglu row " << i / c.F << " col " << i % c.F << ": " << a[i] << " vs "
                      << ar[i];
    }
    EXPECT_EQ(differ, 0u);
  }
  const auto g = download<float>(dev, gu, size_t(S) * F2);
  const auto gr = download<float>(dev, gu_ref, size_t(S) * F2);
  const auto o = download<float>(dev, out, size_t(S) * c.H);
  const auto orf = download<float>(dev, out_ref, size_t(S) * c.H);
  size_t bad = 0;
  for (size_t i = 0; i < g.size(); ++i)
    if (std::bit_cast<uint32_t>(g[i]) != std::bit_cast<uint32_t>(gr[i]) && bad++ < 5)
      ADD_FAILURE() << "gate|up row " << i / F2 << " col " << i % F2 << ": " << g[i] << " vs "
                    << gr[i];
  for (size_t i = 0; i < o.size(); ++i)
    if (std::bit_cast<uint32_t>(o[i]) != std::bit_cast<uint32_t>(orf[i]) && bad++ < 10)
      ADD_FAILURE() << "down row " << i / c.H << " col " << i % c.H << ": " << o[i] << " vs "
                    << orf[i];
  EXPECT_EQ(bad, 0u);
  // Not vacuous: the outputs are finite and not all zero.
  EXPECT_TRUE(std::all_of(o.begin(), o.end(), [](float v) { return std::isfinite(v); }));
  EXPECT_GT(std::count_if(o.begin(), o.end(), [](float v) { return v != 0.0f; }), 0);

  if (!c.with_shared) return;
  // The combine with the shared row: (h + routed) + shared, against the routed combine over the
  // routed slots, then h + shared on the host.
  std::vector<float> wts(size_t(c.T) * c.k), h(size_t(c.T) * c.H);
  for (float& v : wts) v = u(rng);
  for (float& v : h) v = u(rng);
  cl::Mem wb = upload(dev, wts), hb = upload(dev, h), href = upload(dev, h);
  ops::moe_combine(dev, out, c.H, plan.slot_row.mem(), wb, c.T, c.k, c.H, hb, c.H, true, true);
  std::vector<uint32_t> routed_rows;
  for (uint32_t t = 0; t < c.T; ++t)
    for (uint32_t s = 0; s < c.k; ++s) routed_rows.push_back(host.slot_row[size_t(t) * slots + s]);
  cl::Mem rb = upload(dev, routed_rows);
  ops::moe_combine(dev, out, c.H, rb, wb, c.T, c.k, c.H, href, c.H, true);
  const auto got = download<float>(dev, hb, h.size());
  auto want = download<float>(dev, href, h.size());
  for (uint32_t t = 0; t < c.T; ++t)
    for (uint32_t i = 0; i < c.H; ++i)
      want[size_t(t) * c.H + i] += o[size_t(host.slot_row[size_t(t) * slots + c.k]) * c.H + i];
  size_t bad_combine = 0;
  for (size_t i = 0; i < got.size(); ++i)
    if (std::bit_cast<uint32_t>(got[i]) != std::bit_cast<uint32_t>(want[i]) && bad_combine++ < 5)
      ADD_FAILURE() << "combine token " << i / c.H << " col " << i % c.H << ": " << got[i]
                    << " vs " << want[i];
  EXPECT_EQ(bad_combine, 0u);
}

// Odd shapes: K tails (H % 16, F % 16), partial column tiles (F % 4), partial FP8 blocks, decode
// (one-row tiles), prefill (four-row tiles) and an expert with more rows than one tile (64); a
// shared expert; both kernel shapes (the WorkGroups one runs linear_wg's order for f32 / bf16 /
// f16, linear_fp8_wg's for FP8).
constexpr KernelShape kWg = KernelShape::WorkGroups;
INSTANTIATE_TEST_SUITE_P(
    MoeOps, GroupedExperts,
    ::testing::Values(Case{DType::BF16, 1, 3, 7, 200, 70}, Case{DType::BF16, 13, 3, 5, 200, 70},
                      // Between one and four rows per expert (batched decode): 4-row tiles on the
                      // CPU shape for bf16 / f32 / f16 experts, tiles in turn for FP8 ones (up to
                      // 4 rows of one expert; below 32 rows per expert, as T30_E4's 15).
                      Case{DType::BF16, 4, 3, 7, 200, 70}, Case{DType::F8_E4M3, 4, 3, 7, 300, 150},
                      Case{DType::F32, 5, 2, 6, 72, 34}, Case{DType::F16, 9, 2, 3, 40, 18},
                      Case{DType::BF16, 100, 2, 3, 48, 20}, Case{DType::F8_E4M3, 1, 4, 9, 300, 150},
                      Case{DType::F8_E4M3, 30, 2, 4, 200, 136},
                      // FP8 tiles in turn of up to 4 rows at 20 rows per expert, and from 32
                      // rows per expert 4-row tiles over decoded weight panels (fp8_tile.cl).
                      Case{DType::F8_E4M3, 40, 2, 4, 200, 136},
                      Case{DType::F8_E4M3, 100, 2, 3, 200, 136},
                      Case{DType::F8_E4M3, 1, 4, 9, 300, 150, false, KernelShape::Chunks, 0, true},
                      Case{DType::F8_E4M3, 30, 2, 4, 200, 136, false, KernelShape::Chunks, 0, true},
                      Case{DType::F8_E4M3, 40, 2, 4, 200, 136, false, KernelShape::Chunks, 0, true},
                      Case{DType::BF16, 1, 3, 8, 200, 70, true},
                      Case{DType::F8_E4M3, 3, 2, 6, 300, 150, true},
                      // FP8 experts of 4, 6, 0, 3, 2, 3 and (shared) 9 rows: tiles in turn of up
                      // to 4 rows of one expert, its last tile of 1, 2, 3 or 4 rows; the
                      // NaN-watched decode and the f16-based one.
                      Case{DType::F8_E4M3, 9, 2, 7, 300, 150, true},
                      Case{DType::F8_E4M3, 9, 2, 7, 300, 150, true, KernelShape::Chunks, 0, true},
                      Case{DType::F8_E4M3, 9, 2, 7, 300, 150, true, KernelShape::Chunks, 0, false,
                           ComputeDType::F32, false, true},
                      Case{DType::BF16, 1, 3, 7, 200, 70, false, kWg},
                      Case{DType::BF16, 13, 3, 5, 200, 70, true, kWg},
                      Case{DType::F32, 5, 2, 6, 72, 34, false, kWg},
                      Case{DType::F16, 70, 2, 3, 40, 18, false, kWg},
                      Case{DType::F8_E4M3, 3, 2, 6, 300, 150, true, kWg},
                      Case{DType::F8_E4M3, 30, 2, 4, 200, 138, false, kWg},
                      // Wider lane steps (wg_dots.cl): whole steps and tails on both GEMMs.
                      Case{DType::BF16, 13, 3, 5, 600, 300, true, kWg, 4},
                      Case{DType::F32, 5, 2, 6, 520, 264, false, kWg, 8},
                      Case{DType::F16, 9, 2, 3, 300, 140, false, kWg, 2},
                      // bf16 compute (the experts average 8 rows or more): the bf16 GEMM's
                      // sums, with the dot product where the host has it and the portable
                      // micro-kernel; K % 32 tails on both GEMMs and an odd K on down. Below 8
                      // (4.8 here, 4-row tiles) the f32 tiles' bits; below 4 (one-row tiles:
                      // one token with the shared expert, 3 tokens) the bf16 GEMVs' where the
                      // host has vdpbf16ps, with the portable micro-kernel forced the f32 tiles'.
                      Case{DType::BF16, 100, 2, 3, 48, 20, false, KernelShape::Chunks, 0, false,
                           ComputeDType::BF16},
                      Case{DType::BF16, 40, 3, 5, 70, 45, true, KernelShape::Chunks, 0, false,
                           ComputeDType::BF16},
                      Case{DType::BF16, 12, 2, 5, 70, 45, false, KernelShape::Chunks, 0, false,
                           ComputeDType::BF16},
                      Case{DType::BF16, 1, 3, 8, 200, 70, true, KernelShape::Chunks, 0, false,
                           ComputeDType::BF16},
                      Case{DType::BF16, 3, 3, 9, 333, 150, false, KernelShape::Chunks, 0, false,
                           ComputeDType::BF16},
                      Case{DType::BF16, 3, 3, 9, 333, 150, false, KernelShape::Chunks, 0, false,
                           ComputeDType::BF16, true},
                      Case{DType::BF16, 40, 3, 5, 70, 45, true, KernelShape::Chunks, 0, false,
                           ComputeDType::BF16, true},
                      // Experts on both sides of the packed GEMM's row count (from 10 rows here,
                      // or AMX's 8 where the host has it; 60 routed rows over 7 experts):
                      // moe_grouped_packed for some, the dot-product tiles for the others; AMX
                      // or the dot product, and the portable micro-kernels.
                      Case{DType::BF16, 20, 3, 8, 70, 45, true, KernelShape::Chunks, 0, false,
                           ComputeDType::BF16, false, false, 10},
                      Case{DType::BF16, 20, 3, 8, 70, 45, true, KernelShape::Chunks, 0, false,
                           ComputeDType::BF16, true, false, 10},
                      // The same with every weight row on a 4-byte boundary (even H and F),
                      // whose pairs are then loaded as words: by the packed GEMM's packing on
                      // both micro-kernels, and by the portable tiles.
                      Case{DType::BF16, 20, 3, 8, 70, 46, true, KernelShape::Chunks, 0, false,
                           ComputeDType::BF16, false, false, 10},
                      Case{DType::BF16, 20, 3, 8, 70, 46, true, KernelShape::Chunks, 0, false,
                           ComputeDType::BF16, true, false, 10},
                      // gate|up over K = 2101: the packed panels in two chunks, the rows'
                      // partial sums between them.
                      Case{DType::BF16, 20, 3, 8, 2101, 45, true, KernelShape::Chunks, 0, false,
                           ComputeDType::BF16, false, false, 10},
                      // FP8 experts on both sides (dequantized as they are packed; the NaN-free
                      // decode and the watched one).
                      Case{DType::F8_E4M3, 20, 3, 8, 300, 150, true, KernelShape::Chunks, 0, false,
                           ComputeDType::BF16, false, false, 10},
                      Case{DType::F8_E4M3, 20, 3, 8, 300, 150, true, KernelShape::Chunks, 0, true,
                           ComputeDType::BF16, false, false, 10},
                      // FP8 experts under bf16 compute (bf16 panels of the dequantized rows):
                      // the K % 16 and K % 32 tails and a partial last scale block on both GEMMs,
                      // N not a multiple of the tile; both micro-kernels; the NaN-free decode
                      // and (watch) the exact one.
                      Case{DType::F8_E4M3, 40, 3, 5, 300, 150, true, KernelShape::Chunks, 0, false,
                           ComputeDType::BF16},
                      Case{DType::F8_E4M3, 40, 3, 5, 300, 150, true, KernelShape::Chunks, 0, false,
                           ComputeDType::BF16, true},
                      Case{DType::F8_E4M3, 60, 2, 3, 200, 137, false, KernelShape::Chunks, 0, true,
                           ComputeDType::BF16},
                      // The f16-based decode: the bf16 panels (NaN-free and watched) and the
                      // f32 tiles' panels.
                      Case{DType::F8_E4M3, 40, 3, 5, 300, 150, true, KernelShape::Chunks, 0, false,
                           ComputeDType::BF16, false, true},
                      Case{DType::F8_E4M3, 60, 2, 3, 200, 137, false, KernelShape::Chunks, 0, true,
                           ComputeDType::BF16, false, true},
                      Case{DType::F8_E4M3, 100, 2, 3, 200, 136, false, KernelShape::Chunks, 0,
                           false, ComputeDType::F32, false, true},
                      // An expert of more rows than a CPU tile takes (256; the shared expert's
                      // 300 here): two tiles, in f32 and in bf16 compute (FP8 panels).
                      Case{DType::BF16, 300, 2, 3, 48, 20, true},
                      // f32 compute with AMX: experts below gemm_f32_amx_rows (16: 8-15 rows),
                      // at it, between it and 32 rows (18, 19: ops::linear's streaming GEMM) and
                      // past 32 (the shared expert's 40: the packed one); K = 70 and 45.
                      Case{DType::BF16, 40, 2, 7, 70, 45, true, KernelShape::Chunks, 0, false,
                           ComputeDType::F32, false, false, 0, true},
                      Case{DType::BF16, 28, 2, 4, 70, 45, false, KernelShape::Chunks, 0, false,
                           ComputeDType::F32, false, false, 0, true},
                      Case{DType::F8_E4M3, 300, 2, 3, 200, 136, true, KernelShape::Chunks, 0, false,
                           ComputeDType::BF16},
                      // FP8 experts under bf16 compute below 8 rows on average (batched decode):
                      // tiles in turn of 1-4 rows summed in bf16 where the host has vdpbf16ps,
                      // else the f32 tiles; whole blocks only (H 256) and partial ones (300, 150,
                      // 136); the NaN-watched decode; the f16-based one (the f32 tiles).
                      Case{DType::F8_E4M3, 9, 2, 7, 300, 150, true, KernelShape::Chunks, 0, false,
                           ComputeDType::BF16},
                      Case{DType::F8_E4M3, 9, 2, 7, 256, 136, true, KernelShape::Chunks, 0, true,
                           ComputeDType::BF16},
                      Case{DType::F8_E4M3, 1, 4, 9, 300, 150, false, KernelShape::Chunks, 0, false,
                           ComputeDType::BF16},
                      Case{DType::F8_E4M3, 9, 2, 7, 300, 150, true, KernelShape::Chunks, 0, false,
                           ComputeDType::BF16, false, true}),
    [](const ::testing::TestParamInfo<Case>& i) {
      return std::string(dtype_name(i.param.dtype)) + "_T" + std::to_string(i.param.T) + "_E" +
             std::to_string(i.param.E) + (i.param.with_shared ? "_shared" : "") +
             (i.param.shape == KernelShape::WorkGroups ? "_gpu" : "_cpu") +
             (i.param.vector ? "_vw" + std::to_string(i.param.vector) : "") +
             (i.param.nan_watch ? "_watch" : "") +
             (i.param.compute == ComputeDType::BF16 ? "_bf16compute" : "") +
             (i.param.portable ? "_portable" : "") + (i.param.f16_decode ? "_f16decode" : "") +
             (i.param.packed_rows ? "_packed" + std::to_string(i.param.packed_rows) : "") +
             (i.param.H > 1024 ? "_H" + std::to_string(i.param.H) : "") +
             (i.param.dtype == DType::BF16 && i.param.H % 2 == 0 && i.param.F % 2 == 0 ? "_aligned"
                                                                                       : "") +
             (i.param.f32_terms_both ? "_f32terms" : "");
    });

// KernelTuning::fp8_stream_k decides whether grouped FP8 experts of fewer than 32 rows each read
// their columns in turn (K at most it; tiles of up to 4 rows of one expert) or take 4-row tiles
// that read four weight rows side by side; both give the same bits. 14 tokens on 2 of 4 experts
// (4-10 rows each): gate|up over K = 300 and down over K = 150, at fp8_stream_k 4096 (both in
// turn), 160 (down in turn) and 128 (neither).
TEST(GroupedFp8, StreamKChangesNoBit) {
  Device& dev = device();
  test::ShapeScope scope(dev, KernelShape::Chunks);
  const KernelTuning saved = dev.tuning();
  test::TuningScope restore(dev, saved);
  const uint32_t T = 14, k = 2, E = 4, H = 300, F = 150, S = T * k;
  const Experts ex = make_experts(dev, DType::F8_E4M3, E, H, F, 91);
  cl::Mem idb = upload(dev, random_ids(T, k, E, 92));
  const ops::GroupedPlan plan = ops::plan_experts(dev, idb, T, k, E);
  const std::vector<uint32_t> offsets = download<uint32_t>(dev, plan.expert_offsets.mem(), E + 1);
  for (uint32_t e = 0; e < E; ++e) {
    ASSERT_GE(offsets[e + 1] - offsets[e], 4u) << "expert " << e;
  }
  std::mt19937 rng(93);
  std::uniform_real_distribution<float> u(-2.0f, 2.0f);
  std::vector<float> x(size_t(T) * H);
  for (float& v : x) v = u(rng);
  cl::Mem xb = upload(dev, x);
  auto run = [&](uint32_t stream_k) {
    KernelTuning t = saved;
    t.fp8_stream_k = stream_k;
    dev.set_tuning(t);
    cl::Mem gu = dev.alloc(size_t(S) * 2 * F * 4), out = dev.alloc(size_t(S) * H * 4);
    ops::moe_grouped_linear(dev, xb, H, &plan.src_token.mem(), ex.grouped, 0, 2, plan, gu, 2 * F);
    ops::moe_grouped_linear(dev, gu, 2 * F, nullptr, ex.grouped, 2, 1, plan, out, H);
    std::vector<float> r = download<float>(dev, gu, size_t(S) * 2 * F);
    const std::vector<float> o = download<float>(dev, out, size_t(S) * H);
    r.insert(r.end(), o.begin(), o.end());
    return r;
  };
  const std::vector<float> in_turn = run(4096);
  for (const uint32_t stream_k : {160u, 128u}) {
    const std::vector<float> other = run(stream_k);
    for (size_t i = 0; i < in_turn.size(); ++i)
      ASSERT_EQ(std::bit_cast<uint32_t>(other[i]), std::bit_cast<uint32_t>(in_turn[i]))
          << "element " << i << " at fp8_stream_k " << stream_k;
  }
}

}  // namespace grouped

}  // namespace
}  // namespace clshard
