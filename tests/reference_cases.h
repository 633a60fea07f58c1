// The reference cases of ../shared/reference (logits from Meta's and DeepSeek's own code) and the
// checks every architecture runs on them, so each model's test file only names its cases.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "runtime/engine/engine.h"
#include "runtime/model.h"

namespace clshard::test {

struct RefSequence {
  std::vector<int32_t> tokens, prompt, continuation;
  std::vector<float> logits;  // [S, vocab]: row t = logits of the token after position t
  std::vector<float> margins;  // top-2 margin per greedy step
};

struct RefCase {
  std::string id;
  std::filesystem::path checkpoint;
  uint32_t vocab = 0;
  std::vector<RefSequence> seqs;
  std::vector<std::vector<int32_t>> sequences() const;
};

RefCase load_case(const std::string& id);

// A draft-head case (`kind: mtp` or `kind: eagle3`), from the reference code: per sequence the
// target's hidden rows the draft reads ([S, H] after the final norm for MTP; [S, 3H] raw outputs
// of the aux layers for Eagle3) and the draft's outputs; draft position i reads token i + 1 and
// hidden row i, and its logits row i predicts token i + 2.
struct DraftRefSequence {
  std::vector<int32_t> tokens;        // [S]
  std::vector<float> target_hidden;   // [S, hidden_width]
  std::vector<float> draft_logits;    // [S - 1, vocab]
  std::vector<float> draft_hidden;    // [S - 1, hidden]: the draft's output before its norm
};
struct DraftRefCase {
  std::string id, kind;                 // kind "mtp" | "eagle3"
  std::filesystem::path target, draft;  // checkpoint directories (draft: eagle3 only)
  bool mha = false;                     // eagle3 "draft_kind": "mha" (Llama-style draft)
  uint32_t vocab = 0, hidden = 0, hidden_width = 0;
  std::vector<int64_t> aux_layer_ids;   // eagle3: HF ids (id L = output of layer L - 1)
  std::vector<DraftRefSequence> seqs;
};
DraftRefCase load_draft_case(const std::string& id);
// The ids of every case of a kind ("mtp", "eagle3").
std::vector<std::string> case_ids(const std::string& kind);
// The ids of every `kind: logits` case of a model_type ("llama", "deepseek_v3").
std::vector<std::string> logit_case_ids(const std::string& model_type);
float max_abs_diff(const std::vector<float>& a, const std::vector<float>& b);
// The largest over every sequence of per-sequence logits.
float max_abs_diff(const std::vector<std::vector<float>>& a,
                   const std::vector<std::vector<float>>& b);

// Prefills every prompt in one ragged step, then feeds the rest of each sequence one token per
// step for all rows together; returns each sequence's logits at every position. `after_step(n)`
// runs after decode step n (n >= 1) for checks on the model.
std::vector<std::vector<float>> prefill_then_decode(CausalLM& model, const RefCase& rc,
                                                    const std::function<void(int)>& after_step = {});

// Expects greedy continuations from the prompts (one ragged batch) to equal the reference's
// wherever its top-2 margin exceeds 10 x tolerance, and enough of them to compare.
void expect_greedy_continuations(CausalLM& model, const RefCase& rc, float tolerance);

// Expects each sequence alone (16-token pages and one 512-token page) to give what it gives inside
// the ragged batch, within `tolerance`.
void expect_alone_equals_ragged(CausalLM& model, const RefCase& rc, float tolerance);

// Submits each prompt as a greedy request of max_tokens to the engine, runs it to the end and
// returns the completions in prompt order; per_replica (when given) counts the requests each
// replica got.
std::vector<std::vector<int32_t>> run_greedy_requests(Engine& engine,
                                                      const std::vector<std::vector<int32_t>>& prompts,
                                                      uint32_t max_tokens,
                                                      std::vector<size_t>* per_replica = nullptr);

}  // namespace clshard::test
