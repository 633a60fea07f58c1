// DeepSeek-V3 logits against DeepSeek's own inference code (../shared/reference): every
// `deepseek-v3-*` case of kind `logits` (f32, bf16 and fp8 checkpoints; FP8 cases dequantize
// weights and keep activations unquantized, as this engine does), every position of every
// sequence, and the invariants on the same checkpoints: ragged batch == each alone, small pages ==
// one big page, decode (absorbed, latent) path == prefill (decompressed) path, one token per step
// == whole-sequence prefill, greedy continuations.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <iostream>

#include "models/deepseek_v3/model.h"
#include "models/registry.h"
#include "runtime/device.h"
#include "runtime/engine/generation.h"
#include "runtime/model.h"
#include "runtime/ops.h"
#include "runtime/safetensors.h"
#include "runtime/tensor.h"
#include "tests/reference_cases.h"
#include "tests/test_util.h"

namespace clshard {
namespace {

constexpr float kTolerance = 1e-3f;      // the reference's fp32-engine tolerance (max abs)
constexpr float kPathTolerance = 1e-4f;  // decode vs prefill path: f32 rounding only
constexpr float kBatchTolerance = 1e-5f;  // batch/page layout: the same arithmetic per token

using test::RefCase;
using test::load_case;
using test::max_abs_diff;

std::vector<std::string> deepseek_logit_cases() { return test::logit_case_ids("deepseek_v3"); }

std::unique_ptr<deepseek_v3::DeepseekV3Model> load(const RefCase& rc) {
  return std::make_unique<deepseek_v3::DeepseekV3Model>(
      rc.checkpoint, LoadOptions{{&test::default_device()}, std::nullopt});
}

std::vector<std::vector<int32_t>> sequences(const RefCase& rc) { return rc.sequences(); }

TEST(DeepseekV3ReferenceIndex, ListsTheExpectedLogitCases) {
  const auto ids = deepseek_logit_cases();
  for (const char* want :
       {"deepseek-v3-tiny-f32/short", "deepseek-v3-tiny-bf16/short", "deepseek-v3-tiny-fp8/short",
        "deepseek-v3-tiny-grouped-f32/short", "deepseek-v3-tiny-grouped-bf16/short",
        "deepseek-v3-tiny-grouped-fp8/short", "deepseek-v3-tiny-grouped-bf16/ragged8",
        "deepseek-v3-tiny-grouped-fp8/ragged8", "deepseek-v3-tiny-grouped-fp8/long"})
    EXPECT_NE(std::find(ids.begin(), ids.end(), want), ids.end()) << want;
}

// The generic loader takes DeepSeek-V3 checkpoints, and the grouped checkpoint's MTP layer
// (model.layers.3.*) is recognised, not an error.
TEST(DeepseekV3Reference, RegistryLoadsAndRecognisesTheMtpLayer) {
  const auto dir = test::reference_dir() / "ckpt/deepseek-v3-tiny-grouped-fp8";
  auto model = load_model(dir, LoadOptions{{&test::default_device()}, std::nullopt});
  EXPECT_EQ(model->info().architecture, "DeepseekV3ForCausalLM");
  EXPECT_EQ(model->info().num_layers, 3u);
  auto* ds = dynamic_cast<deepseek_v3::DeepseekV3Model*>(model.get());
  ASSERT_NE(ds, nullptr);
  EXPECT_EQ(ds->mtp_layers(), std::vector<int64_t>{3});
  EXPECT_FALSE(ds->weights().layers[0].is_moe);
  EXPECT_TRUE(ds->weights().layers[1].is_moe);
  EXPECT_TRUE(ds->weights().layers[1].moe.experts[15].gate.fp8());
}

// Each FP8 weight records its share of subnormal codes (the scan of its tensor's bytes), and the
// grouped experts, which one launch decodes, the mean of theirs: what picks the e4m3 decode
// (ops::fp8_decode_option). The reference checkpoint's quantized weights hold about 1e-4. On the
// CPU device: the experts are grouped only on a device that reads host memory (group_experts).
TEST(DeepseekV3Weights, GroupedFp8ExpertsCarryTheMeanSubnormalShare) {
  const auto dir = test::reference_dir() / "ckpt/deepseek-v3-tiny-grouped-fp8";
  deepseek_v3::DeepseekV3Model model(dir, LoadOptions{{&test::cpu_device()}, std::nullopt});
  WeightStore store(dir);
  size_t moe_layers = 0;
  for (const auto& L : model.weights().layers) {
    if (!L.is_moe) continue;
    ++moe_layers;
    ASSERT_TRUE(bool(L.moe.grouped));
    ASSERT_EQ(L.moe.grouped.dtype, DType::F8_E4M3);
    ASSERT_TRUE(L.moe.grouped_has_shared);
    double sum = 0;
    size_t mats = 0;
    auto add = [&](const deepseek_v3::MlpWeights& m) {
      for (const Weight* w : {&m.gate.w, &m.up.w, &m.down.w}) {
        const TensorView& t = store.get(w->name);
        const double share = double(scan_fp8_codes(t.data, t.bytes).subnormal) / double(t.bytes);
        EXPECT_EQ(w->fp8_subnormal_share, float(share)) << w->name;
        sum += w->fp8_subnormal_share;
        ++mats;
      }
    };
    add(L.moe.shared);
    for (const auto& m : L.moe.experts) add(m);
    EXPECT_FLOAT_EQ(L.moe.grouped.fp8_subnormal_share, float(sum / double(mats)));
    EXPECT_GT(L.moe.grouped.fp8_subnormal_share, 2e-5f);
    EXPECT_LT(L.moe.grouped.fp8_subnormal_share, ops::kFp8DenormMaxSubnormalShare);
  }
  EXPECT_EQ(moe_layers, 2u);
}

// model.mmap: false (WeightMemory::Copied) on the grouped checkpoint, whose experts one buffer
// views in place (deepseek_v3/weights.cpp's group_experts): none of the checkpoint's files mapped,
// the logits the mapped weights give, bit for bit, on both paths. (A device that does not read
// host memory, a discrete GPU, runs the experts one by one: no grouped buffer there.)
TEST(DeepseekV3WeightMemory, CopiedWeightsGiveTheMappedLogitsBits) {
  const RefCase rc = load_case("deepseek-v3-tiny-grouped-bf16/ragged8");
  Device& dev = test::default_device();
  LoadOptions opts{{&dev}, std::nullopt};
  opts.weight_memory = WeightMemory::Copied;
  auto copied_model = std::make_unique<deepseek_v3::DeepseekV3Model>(rc.checkpoint, opts);
  EXPECT_EQ(test::regions_mapping_files_of(rc.checkpoint), 0u);
  ASSERT_EQ(bool(copied_model->weights().layers[1].moe.grouped), dev.info().host_unified_memory);
  const auto copied = all_position_logits(*copied_model, sequences(rc), 16);
  const auto copied_decode = test::prefill_then_decode(*copied_model, rc);
  copied_model.reset();
  auto mapped_model = load(rc);
  EXPECT_GT(test::regions_mapping_files_of(rc.checkpoint), 0u) << "the mapped load maps its files";
  const auto mapped = all_position_logits(*mapped_model, sequences(rc), 16);
  const auto mapped_decode = test::prefill_then_decode(*mapped_model, rc);
  ASSERT_EQ(copied.size(), mapped.size());
  ASSERT_EQ(copied_decode.size(), mapped_decode.size());
  for (size_t i = 0; i < mapped.size(); ++i) {
    ASSERT_EQ(copied[i].size(), mapped[i].size()) << i;
    EXPECT_EQ(std::memcmp(copied[i].data(), mapped[i].data(), mapped[i].size() * 4), 0) << i;
    ASSERT_EQ(copied_decode[i].size(), mapped_decode[i].size()) << i;
    EXPECT_EQ(
        std::memcmp(copied_decode[i].data(), mapped_decode[i].data(), mapped_decode[i].size() * 4),
        0)
        << "decode " << i;
  }
}

class DeepseekV3Reference : public ::testing::TestWithParam<std::string> {};

// All sequences of the case in ONE ragged batch, with small pages so prompts cross page
// boundaries: every position within the tolerance. The rows are long, so this is the prefill
// (decompressed) path.
TEST_P(DeepseekV3Reference, RaggedBatchMatchesReferenceAtEveryPosition) {
  RefCase rc = load_case(GetParam());
  auto model = load(rc);
  auto logits = all_position_logits(*model, sequences(rc), /*page_size=*/16);
  EXPECT_EQ(model->last_mla_path(), ops::MlaPath::Prefill);
  ASSERT_EQ(logits.size(), rc.seqs.size());
  float worst = 0;
  for (size_t i = 0; i < rc.seqs.size(); ++i) {
    const float d = max_abs_diff(logits[i], rc.seqs[i].logits);
    worst = std::max(worst, d);
    EXPECT_LT(d, kTolerance) << rc.id << " seq " << i;
  }
  std::cout << "[ max |diff| ] " << rc.id << ": " << worst << "\n";
  RecordProperty("max_abs_diff", std::to_string(worst));
}

// The same batch through the absorbed latent-space path and the decompressed path.
TEST_P(DeepseekV3Reference, DecodePathEqualsPrefillPath) {
  RefCase rc = load_case(GetParam());
  auto model = load(rc);
  model->set_mla_path(ops::MlaPath::Decode);
  auto decode = all_position_logits(*model, sequences(rc), 16);
  EXPECT_EQ(model->last_mla_path(), ops::MlaPath::Decode);
  model->set_mla_path(ops::MlaPath::Prefill);
  auto prefill = all_position_logits(*model, sequences(rc), 16);
  EXPECT_EQ(model->last_mla_path(), ops::MlaPath::Prefill);
  float worst = 0;
  for (size_t i = 0; i < rc.seqs.size(); ++i) {
    const float d = max_abs_diff(decode[i], prefill[i]);
    worst = std::max(worst, d);
    EXPECT_LT(d, kPathTolerance) << rc.id << " seq " << i;
    EXPECT_LT(max_abs_diff(decode[i], rc.seqs[i].logits), kTolerance) << rc.id << " seq " << i;
  }
  std::cout << "[ decode vs prefill path ] " << rc.id << ": " << worst << "\n";
}

// Each sequence alone gives what it gave inside the ragged batch; one big page gives what many
// small pages give.
TEST_P(DeepseekV3Reference, AloneEqualsRaggedAndPageSizeDoesNotMatter) {
  RefCase rc = load_case(GetParam());
  auto model = load(rc);
  test::expect_alone_equals_ragged(*model, rc, kBatchTolerance);
}

// Prefill the prompts (one ragged step), then feed the rest one token per step for all rows
// together (the decode path, MAX's choice for one query token): every logits row matches the
// reference's whole-sequence forward.
TEST_P(DeepseekV3Reference, DecodeOneTokenAtATimeMatchesReference) {
  RefCase rc = load_case(GetParam());
  auto model = load(rc);
  auto got = test::prefill_then_decode(*model, rc, [&](int) {
    EXPECT_EQ(model->last_mla_path(), ops::MlaPath::Decode);
  });
  for (size_t b = 0; b < rc.seqs.size(); ++b)
    EXPECT_LT(max_abs_diff(got[b], rc.seqs[b].logits), kTolerance) << rc.id << " seq " << b;
}

// Greedy continuation from the prompts, all rows in one ragged batch, equals the reference's
// wherever its top-2 margin is well above the tolerance (up to the first close call).
TEST_P(DeepseekV3Reference, GreedyContinuationsEqual) {
  RefCase rc = load_case(GetParam());
  auto model = load(rc);
  test::expect_greedy_continuations(*model, rc, kTolerance);
}

// kv_cache.dtype: bf16 (MAX's default for the MLA latent cache). A bf16 row moves a logit by
// more than the f32 tolerance, and where an expert's router score sits near another's, that
// rounding flips the routing and the logits of later positions move by O(1): a max-abs bound
// per case cannot hold. So the check is statistical over every logit case, both paths (one ragged
// prefill, and prefill then one token per step): the median over positions of the per-position
// max |logit - reference| (measured 7.3e-3 on both paths over 2588 positions; the f32 cache is
// within 1e-3 at every position) and how often the argmax agrees with the reference's (measured
// 99.7%). A store that truncates to bf16 instead of rounding to nearest even measured a median of
// 1.59e-2 (agreement 99.2%), so the median bound, 1.5x the measured figure, catches it.
struct LogitStats {
  std::vector<float> row_max;  // per position: max |logit - reference|
  size_t positions = 0, argmax_agree = 0;
  void add(const std::vector<float>& got, const std::vector<float>& want, uint32_t vocab) {
    for (size_t r = 0; r * vocab < want.size(); ++r) {
      float m = 0;
      size_t ag = 0, aw = 0;
      for (uint32_t v = 0; v < vocab; ++v) {
        const size_t i = r * vocab + v;
        m = std::max(m, std::abs(got[i] - want[i]));
        if (got[i] > got[r * vocab + ag]) ag = v;
        if (want[i] > want[r * vocab + aw]) aw = v;
      }
      row_max.push_back(m);
      ++positions;
      argmax_agree += ag == aw;
    }
  }
  float median() {
    std::sort(row_max.begin(), row_max.end());
    return row_max[row_max.size() / 2];
  }
  double agreement() const { return double(argmax_agree) / double(positions); }
};

// fp8 (e4m3fn, no scale: 2^-4 relative steps, 16 times bf16's) measured a median of 0.120 on both
// paths and an argmax agreement of 94.9%; its bounds are 0.18 (1.5x) and 90%.
struct NarrowCacheBounds {
  DType dtype;
  float median;
  double argmax_agreement;
};

class DeepseekV3NarrowCache : public ::testing::TestWithParam<NarrowCacheBounds> {};

TEST_P(DeepseekV3NarrowCache, MedianDifferenceAndArgmaxAgreementOverEveryCase) {
  const auto [cdt, median_bound, agreement_bound] = GetParam();
  LogitStats prefill_stats, decode_stats;
  for (const std::string& id : deepseek_logit_cases()) {
    const RefCase rc = load_case(id);
    LoadOptions opts{{&test::default_device()}, std::nullopt};
    opts.kv_cache_dtype = cdt;
    auto model = std::make_unique<deepseek_v3::DeepseekV3Model>(rc.checkpoint, opts);
    EXPECT_EQ(model->kv_bytes_per_token() * 4, load(rc)->kv_bytes_per_token() * dtype_size(cdt))
        << id;
    const auto prefill = all_position_logits(*model, sequences(rc), 16);
    const auto decode = test::prefill_then_decode(*model, rc);
    for (size_t i = 0; i < rc.seqs.size(); ++i) {
      prefill_stats.add(prefill[i], rc.seqs[i].logits, rc.vocab);
      decode_stats.add(decode[i], rc.seqs[i].logits, rc.vocab);
    }
  }
  const float mp = prefill_stats.median(), md = decode_stats.median();
  std::cout << "[ " << dtype_name(cdt) << " MLA cache ] " << prefill_stats.positions
            << " positions: median max|diff| "
            << mp << " prefill, " << md << " decode; argmax agreement "
            << prefill_stats.agreement() << " prefill, " << decode_stats.agreement()
            << " decode\n";
  RecordProperty("median_prefill", std::to_string(mp));
  RecordProperty("median_decode", std::to_string(md));
  EXPECT_LT(mp, median_bound);
  EXPECT_LT(md, median_bound);
  EXPECT_GE(prefill_stats.agreement(), agreement_bound);
  EXPECT_GE(decode_stats.agreement(), agreement_bound);
}

INSTANTIATE_TEST_SUITE_P(Dtypes, DeepseekV3NarrowCache,
                         ::testing::Values(NarrowCacheBounds{DType::BF16, 1.1e-2f, 0.95},
                                           NarrowCacheBounds{DType::F8_E4M3, 0.18f, 0.90}),
                         [](const auto& info) { return std::string(dtype_name(info.param.dtype)); });

INSTANTIATE_TEST_SUITE_P(Cases, DeepseekV3Reference, ::testing::ValuesIn(deepseek_logit_cases()),
                         [](const auto& info) {
                           std::string n = info.param;
                           for (char& c : n)
                             if (!isalnum(static_cast<unsigned char>(c))) c = '_';
                           return n;
                         });

}  // namespace
}  // namespace clshard
