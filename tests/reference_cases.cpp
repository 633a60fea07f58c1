#include "tests/reference_cases.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <map>

#include "runtime/engine/generation.h"
#include "tests/test_util.h"

namespace clshard::test {

std::vector<std::vector<int32_t>> RefCase::sequences() const {
  std::vector<std::vector<int32_t>> s;
  for (const auto& r : seqs) s.push_back(r.tokens);
  return s;
}

namespace {
const nlohmann::json& case_entry(const std::string& id) {
  for (const auto& c : reference_index()["cases"])
    if (c["id"] == id) return c;
  throw std::runtime_error("no reference case " + id);
}
}  // namespace

RefCase load_case(const std::string& id) {
  const auto& c = case_entry(id);
  RefCase rc;
  rc.id = id;
  rc.checkpoint = reference_dir() / c["checkpoint"].get<std::string>();
  const auto manifest_path = reference_dir() / c["manifest"].get<std::string>();
  const auto manifest = nlohmann::json::parse(std::ifstream(manifest_path));
  rc.vocab = manifest["vocab_size"].get<uint32_t>();
  for (const auto& s : manifest["sequences"]) {
    RefSequence r;
    r.tokens = s["sequence"].get<std::vector<int32_t>>();
    r.prompt = s["prompt"].get<std::vector<int32_t>>();
    r.continuation = s["continuation"].get<std::vector<int32_t>>();
    r.margins = s["top2_margin_per_step"].get<std::vector<float>>();
    r.logits = read_f32(manifest_path.parent_path() / s["logits_raw"].get<std::string>());
    EXPECT_EQ(r.logits.size(), r.tokens.size() * rc.vocab) << id;
    rc.seqs.push_back(std::move(r));
  }
  return rc;
}

DraftRefCase load_draft_case(const std::string& id) {
  const auto& c = case_entry(id);
  DraftRefCase rc;
  rc.id = id;
  rc.kind = c["kind"].get<std::string>();
  rc.target = reference_dir() / c["checkpoint"].get<std::string>();
  const bool eagle3 = rc.kind == "eagle3";
  if (eagle3) {
    rc.draft = reference_dir() / c["draft_checkpoint"].get<std::string>();
    rc.mha = c.value("draft_kind", "") == "mha";
    rc.aux_layer_ids = c["eagle3"]["eagle_aux_hidden_state_layer_ids"].get<std::vector<int64_t>>();
  }
  const auto manifest_path = reference_dir() / c["manifest"].get<std::string>();
  const auto manifest = nlohmann::json::parse(std::ifstream(manifest_path));
  rc.vocab = manifest["vocab_size"].get<uint32_t>();
  rc.hidden = manifest["hidden_size"].get<uint32_t>();
  const std::string hidden_key = eagle3 ? "aux_hidden" : "hidden";
  for (const auto& s : manifest["sequences"]) {
    DraftRefSequence r;
    r.tokens = s["sequence"].get<std::vector<int32_t>>();
    auto file = [&](const std::string& key) {
      return read_f32(manifest_path.parent_path() / s[key + "_raw"].get<std::string>());
    };
    r.target_hidden = file(hidden_key);
    r.draft_logits = file("draft_logits");
    r.draft_hidden = file("draft_hidden");
    const size_t S = r.tokens.size();
    rc.hidden_width = s[hidden_key + "_shape"][1].get<uint32_t>();
    EXPECT_EQ(r.target_hidden.size(), S * rc.hidden_width) << id;
    EXPECT_EQ(r.draft_logits.size(), (S - 1) * rc.vocab) << id;
    EXPECT_EQ(r.draft_hidden.size(), (S - 1) * rc.hidden) << id;
    rc.seqs.push_back(std::move(r));
  }
  return rc;
}

std::vector<std::string> case_ids(const std::string& kind) {
  std::vector<std::string> ids;
  for (const auto& c : reference_index()["cases"])
    if (c["kind"] == kind) ids.push_back(c["id"].get<std::string>());
  return ids;
}

std::vector<std::string> logit_case_ids(const std::string& model_type) {
  std::vector<std::string> ids;
  for (const auto& c : reference_index()["cases"])
    if (c["kind"] == "logits" && c["model_type"] == model_type)
      ids.push_back(c["id"].get<std::string>());
  return ids;
}

float max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  float m = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) m = std::max(m, std::abs(a[i] - b[i]));
  return m;
}

float max_abs_diff(const std::vector<std::vector<float>>& a,
                   const std::vector<std::vector<float>>& b) {
  EXPECT_EQ(a.size(), b.size());
  float m = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) m = std::max(m, max_abs_diff(a[i], b[i]));
  return m;
}

std::vector<std::vector<int32_t>> run_greedy_requests(Engine& engine,
                                                      const std::vector<std::vector<int32_t>>& prompts,
                                                      uint32_t max_tokens,
                                                      std::vector<size_t>* per_replica) {
  std::vector<uint64_t> handles;
  for (const auto& p : prompts) {
    GenerationRequest r;
    r.prompt = p;
    r.sampling.temperature = 0;
    r.max_tokens = max_tokens;
    handles.push_back(engine.submit(r));
  }
  if (per_replica)
    for (uint64_t h : handles) ++(*per_replica)[engine.replica_of(h)];
  std::map<uint64_t, std::vector<int32_t>> out;
  while (engine.has_work())
    for (auto& res : engine.step()) out[res.handle] = res.token_ids;
  std::vector<std::vector<int32_t>> ordered;
  for (uint64_t h : handles) ordered.push_back(out.at(h));
  return ordered;
}

std::vector<std::vector<float>> prefill_then_decode(CausalLM& model, const RefCase& rc,
                                                    const std::function<void(int)>& after_step) {
  const size_t B = rc.seqs.size();
  std::vector<uint32_t> lengths;
  for (const auto& s : rc.seqs) lengths.push_back(uint32_t(s.tokens.size()));
  StepInputs in;
  in.lookup_table = plan_static_pages(model, lengths, 16, &in.pages_per_row);
  in.return_logits = ReturnLogits::All;
  in.input_row_offsets = {0};
  for (const auto& s : rc.seqs) {
    in.tokens.insert(in.tokens.end(), s.prompt.begin(), s.prompt.end());
    in.input_row_offsets.push_back(uint32_t(in.tokens.size()));
    in.cache_lengths.push_back(0);
  }
  std::vector<std::vector<float>> got(B);
  int decode_steps = 0;
  while (true) {
    StepOutputs out = model.forward(in);
    if (decode_steps > 0 && after_step) after_step(decode_steps);
    const auto logits = out.read_logits();
    for (size_t b = 0; b < B; ++b) {
      got[b].insert(got[b].end(), logits.begin() + size_t(out.logit_offsets[b]) * rc.vocab,
                    logits.begin() + size_t(out.logit_offsets[b + 1]) * rc.vocab);
      in.cache_lengths[b] += in.row_length(b);
    }
    // Next step: one forced token per unfinished row (finished rows send none).
    in.tokens.clear();
    in.input_row_offsets = {0};
    bool any = false;
    for (size_t b = 0; b < B; ++b) {
      if (in.cache_lengths[b] < rc.seqs[b].tokens.size()) {
        in.tokens.push_back(rc.seqs[b].tokens[in.cache_lengths[b]]);
        any = true;
      }
      in.input_row_offsets.push_back(uint32_t(in.tokens.size()));
    }
    if (!any) break;
    ++decode_steps;
  }
  EXPECT_GT(decode_steps, 0) << rc.id;
  return got;
}

void expect_greedy_continuations(CausalLM& model, const RefCase& rc, float tolerance) {
  std::vector<std::vector<int32_t>> prompts;
  uint32_t n_new = 0;
  for (const auto& s : rc.seqs) {
    prompts.push_back(s.prompt);
    n_new = std::max(n_new, uint32_t(s.continuation.size()));
  }
  auto gen = greedy_generate(model, prompts, n_new, 16);
  size_t compared = 0;
  for (size_t b = 0; b < rc.seqs.size(); ++b) {
    for (size_t i = 0; i < rc.seqs[b].continuation.size(); ++i) {
      if (rc.seqs[b].margins[i] < 10 * tolerance) break;  // a near-tie may flip legitimately
      EXPECT_EQ(gen[b][i], rc.seqs[b].continuation[i]) << rc.id << " seq " << b << " step " << i;
      ++compared;
    }
  }
  EXPECT_GT(compared, rc.seqs.size()) << "too few confident steps to compare";
}

void expect_alone_equals_ragged(CausalLM& model, const RefCase& rc, float tolerance) {
  const auto seqs = rc.sequences();
  auto ragged = all_position_logits(model, seqs, 16);
  for (size_t i = 0; i < seqs.size(); ++i) {
    auto alone_small = all_position_logits(model, {seqs[i]}, 16);
    auto alone_big = all_position_logits(model, {seqs[i]}, 512);
    EXPECT_LT(max_abs_diff(alone_small[0], ragged[i]), tolerance) << rc.id << " seq " << i;
    EXPECT_LT(max_abs_diff(alone_big[0], ragged[i]), tolerance) << rc.id << " seq " << i;
  }
}

}  // namespace clshard::test
