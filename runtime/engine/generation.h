// Direct drivers of a model for fixed sets of sequences: all-position logits of a ragged batch,
// and greedy continuation. Pages are laid out once for the whole run (no scheduler): these are
// the building blocks of `clshard logits` and `clshard generate --tokens`, and of the tests.
#pragma once

#include <cstdint>
#include <vector>

#include "runtime/model.h"

namespace clshard {

// Lays out pages for sequences that will reach the given lengths: row b gets
// ceil(len_b / page_size) consecutive pages. Returns the table [B, pages_per_row] and sets
// pages_per_row; (re)allocates the model's cache when it is too small. One replica.
std::vector<uint32_t> plan_static_pages(CausalLM& model, const std::vector<uint32_t>& lengths,
                                        uint32_t page_size, uint32_t* pages_per_row);

// Feeds every sequence whole, in one ragged step, and returns per sequence its logits for every
// position ([len, vocab] row-major). On a data-parallel model the sequences are spread over the
// replicas round-robin.
std::vector<std::vector<float>> all_position_logits(CausalLM& model,
                                                    const std::vector<std::vector<int32_t>>& seqs,
                                                    uint32_t page_size = 128);

// The draft head's logits over each sequence (`clshard logits --head`): the target runs the
// sequences in one ragged step and returns the hidden states the draft reads; the draft then runs
// positions 0..S-2, position i reading token i + 1 and the target's hidden row i. Per sequence
// [S - 1, vocab]: row i predicts token i + 2. The draft's cache is (re)allocated like the target's.
std::vector<std::vector<float>> all_position_draft_logits(
    CausalLM& target, DraftModel& draft, const std::vector<std::vector<int32_t>>& seqs,
    uint32_t page_size = 128);

// Greedy continuation (argmax, ties to the lowest id) of each prompt by max_new_tokens tokens: one
// ragged prefill step, then one decode step per token for all rows together.
std::vector<std::vector<int32_t>> greedy_generate(CausalLM& model,
                                                  const std::vector<std::vector<int32_t>>& prompts,
                                                  uint32_t max_new_tokens, uint32_t page_size = 128);

int32_t argmax(const float* row, uint32_t n);

}  // namespace clshard
