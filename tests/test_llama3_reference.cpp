// Llama 3 logits against Meta's reference code (../shared/reference), every position of every
// sequence, and the batching/paging/decode invariants on the same checkpoints.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>

#include "runtime/device.h"
#include "runtime/generation.h"
#include "runtime/model.h"
#include "tests/test_util.h"

namespace clshard {
namespace {

constexpr float kTolerance = 1e-3f;  // the reference README's fp32-engine tolerance (max abs)

struct RefSequence {
  std::vector<int32_t> tokens, prompt, continuation;
  std::vector<float> logits;  // [S, vocab]
  std::vector<float> margins;
};

struct RefCase {
  std::string id;
  std::filesystem::path checkpoint;
  uint32_t vocab = 0;
  std::vector<RefSequence> seqs;
};

RefCase load_case(const std::string& id) {
  for (const auto& c : test::reference_index()["cases"]) {
    if (c["id"] != id) continue;
    RefCase rc;
    rc.id = id;
    rc.checkpoint = test::reference_dir() / c["checkpoint"].get<std::string>();
    auto manifest_path = test::reference_dir() / c["manifest"].get<std::string>();
    auto manifest = nlohmann::json::parse(std::ifstream(manifest_path));
    rc.vocab = manifest["vocab_size"].get<uint32_t>();
    for (const auto& s : manifest["sequences"]) {
      RefSequence r;
      r.tokens = s["sequence"].get<std::vector<int32_t>>();
      r.prompt = s["prompt"].get<std::vector<int32_t>>();
      r.continuation = s["continuation"].get<std::vector<int32_t>>();
      r.margins = s["top2_margin_per_step"].get<std::vector<float>>();
      r.logits = test::read_f32(manifest_path.parent_path() / s["logits_raw"].get<std::string>());
      EXPECT_EQ(r.logits.size(), r.tokens.size() * rc.vocab) << id;
      rc.seqs.push_back(std::move(r));
    }
    return rc;
  }
  throw std::runtime_error("no reference case " + id);
}

float max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  float m = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) m = std::max(m, std::abs(a[i] - b[i]));
  return m;
}

std::unique_ptr<CausalLM> load(const RefCase& rc) {
  return load_model(rc.checkpoint, LoadOptions{{&test::default_device()}, std::nullopt});
}

class Llama3Reference : public ::testing::TestWithParam<std::string> {};

// All sequences of the case in ONE ragged batch, with small pages so prompts cross page
// boundaries: every position within the tolerance.
TEST_P(Llama3Reference, RaggedBatchMatchesReferenceAtEveryPosition) {
  RefCase rc = load_case(GetParam());
  auto model = load(rc);
  std::vector<std::vector<int32_t>> seqs;
  for (const auto& s : rc.seqs) seqs.push_back(s.tokens);
  auto logits = all_position_logits(*model, seqs, /*page_size=*/16);
  ASSERT_EQ(logits.size(), rc.seqs.size());
  for (size_t i = 0; i < rc.seqs.size(); ++i)
    EXPECT_LT(max_abs_diff(logits[i], rc.seqs[i].logits), kTolerance) << rc.id << " seq " << i;
}

// Each sequence alone gives what it gave inside the ragged batch; one big page gives what many
// small pages give.
TEST_P(Llama3Reference, AloneEqualsRaggedAndPageSizeDoesNotMatter) {
  RefCase rc = load_case(GetParam());
  auto model = load(rc);
  std::vector<std::vector<int32_t>> seqs;
  for (const auto& s : rc.seqs) seqs.push_back(s.tokens);
  auto ragged = all_position_logits(*model, seqs, 16);
  for (size_t i = 0; i < seqs.size(); ++i) {
    auto alone_small = all_position_logits(*model, {seqs[i]}, 16);
    auto alone_big = all_position_logits(*model, {seqs[i]}, 512);
    EXPECT_LT(max_abs_diff(alone_small[0], ragged[i]), 1e-5f) << rc.id << " seq " << i;
    EXPECT_LT(max_abs_diff(alone_big[0], ragged[i]), 1e-5f) << rc.id << " seq " << i;
  }
}

// Prefill the prompt, then feed the rest one token per step (all rows together): every logits row
// equals the whole-sequence prefill.
TEST_P(Llama3Reference, DecodeOneTokenAtATimeEqualsPrefill) {
  RefCase rc = load_case(GetParam());
  auto model = load(rc);
  const size_t B = rc.seqs.size();
  std::vector<uint32_t> lengths;
  for (const auto& s : rc.seqs) lengths.push_back(uint32_t(s.tokens.size()));
  StepInputs in;
  in.lookup_table = plan_static_pages(*model, lengths, 16, &in.pages_per_row);
  in.return_logits = ReturnLogits::All;
  in.input_row_offsets = {0};
  for (const auto& s : rc.seqs) {
    in.tokens.insert(in.tokens.end(), s.prompt.begin(), s.prompt.end());
    in.input_row_offsets.push_back(uint32_t(in.tokens.size()));
    in.cache_lengths.push_back(0);
  }
  std::vector<std::vector<float>> got(B);
  std::vector<size_t> fed(B);
  while (true) {
    StepOutputs out = model->forward(in);
    auto logits = out.read_logits();
    for (size_t b = 0; b < B; ++b) {
      got[b].insert(got[b].end(), logits.begin() + size_t(out.logit_offsets[b]) * rc.vocab,
                    logits.begin() + size_t(out.logit_offsets[b + 1]) * rc.vocab);
      in.cache_lengths[b] += in.row_length(b);
      fed[b] = in.cache_lengths[b];
    }
    // Next step: one forced token per unfinished row (finished rows send none).
    in.tokens.clear();
    in.input_row_offsets = {0};
    bool any = false;
    for (size_t b = 0; b < B; ++b) {
      if (fed[b] < rc.seqs[b].tokens.size()) {
        in.tokens.push_back(rc.seqs[b].tokens[fed[b]]);
        any = true;
      }
      in.input_row_offsets.push_back(uint32_t(in.tokens.size()));
    }
    if (!any) break;
  }
  for (size_t b = 0; b < B; ++b)
    EXPECT_LT(max_abs_diff(got[b], rc.seqs[b].logits), kTolerance) << rc.id << " seq " << b;
}

// Greedy continuation from the prompts, all rows in one ragged batch, equals the reference's
// wherever its top-2 margin is well above the tolerance (up to the first close call).
TEST_P(Llama3Reference, GreedyContinuationsEqual) {
  RefCase rc = load_case(GetParam());
  auto model = load(rc);
  std::vector<std::vector<int32_t>> prompts;
  uint32_t n_new = 0;
  for (const auto& s : rc.seqs) {
    prompts.push_back(s.prompt);
    n_new = std::max(n_new, uint32_t(s.continuation.size()));
  }
  auto gen = greedy_generate(*model, prompts, n_new, 16);
  size_t compared = 0;
  for (size_t b = 0; b < rc.seqs.size(); ++b) {
    for (size_t i = 0; i < rc.seqs[b].continuation.size(); ++i) {
      if (rc.seqs[b].margins[i] < 10 * kTolerance) break;  // a near-tie may flip legitimately
      EXPECT_EQ(gen[b][i], rc.seqs[b].continuation[i]) << rc.id << " seq " << b << " step " << i;
      ++compared;
    }
  }
  EXPECT_GT(compared, rc.seqs.size()) << "too few confident steps to compare";
}

// ReturnLogits::Variable (speculative verification): the last n positions of each row, which
// are the same rows as in All.
TEST(Llama3Step, VariableLogitsAreTheLastNOfEachRow) {
  RefCase rc = load_case("llama3-tiny-f32/short");
  auto model = load(rc);
  std::vector<uint32_t> lengths;
  StepInputs in;
  in.input_row_offsets = {0};
  for (const auto& s : rc.seqs) {
    in.tokens.insert(in.tokens.end(), s.tokens.begin(), s.tokens.end());
    in.input_row_offsets.push_back(uint32_t(in.tokens.size()));
    in.cache_lengths.push_back(0);
    lengths.push_back(uint32_t(s.tokens.size()));
  }
  in.lookup_table = plan_static_pages(*model, lengths, 16, &in.pages_per_row);
  in.return_logits = ReturnLogits::Variable;
  in.return_n_logits = 3;
  StepOutputs out = model->forward(in);
  auto logits = out.read_logits();
  ASSERT_EQ(out.rows, 3 * rc.seqs.size());
  for (size_t b = 0; b < rc.seqs.size(); ++b) {
    ASSERT_EQ(out.logit_offsets[b + 1] - out.logit_offsets[b], 3u);
    const size_t S = rc.seqs[b].tokens.size();
    for (size_t i = 0; i < 3; ++i)
      for (uint32_t v = 0; v < rc.vocab; ++v)
        ASSERT_NEAR(logits[(out.logit_offsets[b] + i) * rc.vocab + v],
                    rc.seqs[b].logits[(S - 3 + i) * rc.vocab + v], kTolerance);
  }
}

// The GPU-shaped linear kernels (work-groups of lanes), run here on PoCL: the same logits.
TEST(Llama3Step, WorkGroupShapedKernelsMatchTheReference) {
  RefCase rc = load_case("llama3-tiny-bf16/short");
  Device& dev = test::default_device();
  dev.set_kernel_shape(KernelShape::WorkGroups);
  std::vector<std::vector<float>> logits;
  try {
    auto model = load(rc);
    std::vector<std::vector<int32_t>> seqs;
    for (const auto& s : rc.seqs) seqs.push_back(s.tokens);
    logits = all_position_logits(*model, seqs, 16);
  } catch (...) {
    dev.set_kernel_shape(KernelShape::Chunks);
    throw;
  }
  dev.set_kernel_shape(KernelShape::Chunks);
  for (size_t i = 0; i < rc.seqs.size(); ++i)
    EXPECT_LT(max_abs_diff(logits[i], rc.seqs[i].logits), kTolerance) << i;
}

INSTANTIATE_TEST_SUITE_P(Cases, Llama3Reference,
                         ::testing::Values("llama3-tiny-f32/short", "llama3-tiny-bf16/short",
                                           "llama32-tiny-f32/short", "llama32-tiny-bf16/short",
                                           "llama3-tiny-bf16/ragged8",
                                           "llama3-tiny-rope64-bf16/long"),
                         [](const auto& info) {
                           std::string n = info.param;
                           for (char& c : n)
                             if (!isalnum(static_cast<unsigned char>(c))) c = '_';
                           return n;
                         });

}  // namespace
}  // namespace clshard
