// The reference cases of ../shared/reference (logits from Meta's and DeepSeek's own code) and the
// checks every architecture runs on them, so each model's test file only names its cases.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "runtime/engine.h"
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

// A `kind: eagle3` case: per sequence the target's captures and the draft's outputs, from the
// reference code; the draft's position i reads token i + 1 and capture row i.
struct Eagle3Sequence {
  std::vector<int32_t> tokens;      // [S]
  std::vector<float> aux_hidden;    // [S, aux_width]: the target layers' raw outputs, concatenated
  std::vector<float> draft_logits;  // [S - 1, vocab]: row i predicts token i + 2
  std::vector<float> draft_hidden;  // [S - 1, hidden]: the draft's output before its norm
};
struct Eagle3Case {
  std::string id;
  std::filesystem::path target, draft;  // checkpoint directories
  bool mha = false;                     // "draft_kind": "mha"
  uint32_t vocab = 0, hidden = 0, aux_width = 0;
  std::vector<int64_t> aux_layer_ids;
  std::vector<Eagle3Sequence> seqs;
};
Eagle3Case load_eagle3_case(const std::string& id);
std::vector<std::string> eagle3_case_ids();
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
