// The inputs of one forward step, the same for every model: a ragged batch of rows (requests),
// each with its new tokens, the length of what its KV cache already holds, and its page table.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "runtime/cl.h"

namespace clshard {

// Which positions get logits (as MAX's ReturnLogits).
enum class ReturnLogits {
  LastToken,  // one row per request: its last new token
  All,        // every new token
  Variable,   // the last `return_n_logits` tokens of each request (speculative verification)
};

// Which hidden states a step returns besides the logits (as MAX's ReturnHiddenStates).
enum class ReturnHidden {
  None,
  LastPerRow,      // each row's last token's output of the last decoder layer (before the norm)
  All,             // every new token's output of the last decoder layer (before the final norm)
  AllNormalized,   // the same after the final norm (what the NextN/MTP draft reads)
  SelectedLayers,  // the raw outputs of `hidden_layers`, concatenated per token (Eagle3 captures)
};

struct StepInputs {
  std::vector<int32_t> tokens;              // [T] the new tokens of every row, concatenated
  std::vector<uint32_t> input_row_offsets;  // [B+1] prefix sums of the rows' token counts
  std::vector<uint32_t> cache_lengths;      // [B] tokens already in each row's KV cache
  // [B, pages_per_row] page ids; position p of row b lives in page lookup_table[b][p / page_size]
  // at slot p % page_size. Unused entries hold the pool's null page.
  std::vector<uint32_t> lookup_table;
  uint32_t pages_per_row = 0;
  ReturnLogits return_logits = ReturnLogits::LastToken;
  uint32_t return_n_logits = 1;  // for Variable
  // When not empty ([B]): row b returns logits for its last logits_per_row[b] tokens (0 for none),
  // overriding return_logits. Speculative steps ask drafts + 1 of a verifying row, 1 of a
  // prefill's last chunk, 0 of an intermediate chunk.
  std::vector<uint32_t> logits_per_row;
  ReturnHidden return_hidden = ReturnHidden::None;
  // SelectedLayers: 0-based decoder layers whose outputs are captured, in this order (HF's Eagle3
  // id L is layer L - 1 here).
  std::vector<uint32_t> hidden_layers;
  // Data parallelism (MAX's data_parallel_splits): rows [splits[r], splits[r+1]) belong to
  // replica r, whose page ids index replica r's own page pool. Empty: one replica.
  std::vector<uint32_t> data_parallel_splits;
  // LoRA: per row ([B]) the adapter its request runs with, 0 for the base model (1 + the adapter's
  // index in the model's loaded adapters). Empty: every row runs the base model.
  std::vector<uint32_t> adapter_ids;

  size_t num_rows() const { return input_row_offsets.empty() ? 0 : input_row_offsets.size() - 1; }
  size_t num_tokens() const { return tokens.size(); }
  uint32_t row_length(size_t b) const { return input_row_offsets[b + 1] - input_row_offsets[b]; }
  // The token indices (into `tokens`) whose logits this step returns, in output order.
  std::vector<uint32_t> logit_token_indices() const;
  // Throws std::invalid_argument naming the first inconsistency (offsets, table size, lengths).
  void validate(uint32_t page_size, uint32_t num_pages) const;
  size_t num_replicas() const {
    return data_parallel_splits.empty() ? 1 : data_parallel_splits.size() - 1;
  }
  // The rows of replica r as a step of their own (offsets rebased to 0, no splits).
  StepInputs replica_step(size_t r) const;
};

// One step of several replicas: the replicas' steps concatenated in replica order, with
// data_parallel_splits saying whose rows are whose. Tables are padded to the widest with
// `null_page`.
StepInputs merge_replica_steps(const std::vector<StepInputs>& steps, uint32_t null_page);

class Device;

// Hidden states of one replica's tokens, on that replica's device: f32 [rows, width].
struct ReplicaHidden {
  Device* device = nullptr;
  cl::Mem rows;
  uint32_t count = 0;
};

// What a step returns: f32 logits [rows, vocab] on `device` (where sampling runs), in the order of
// logit_token_indices(), and per request the range of its rows: [logit_offsets[b],
// logit_offsets[b+1]).
struct StepOutputs {
  Device* device = nullptr;
  cl::Mem logits;  // rows * vocab floats
  uint32_t rows = 0;
  uint32_t vocab = 0;
  std::vector<uint32_t> logit_offsets;
  // return_hidden != None: hidden[r] holds replica r's hidden rows. A target returns one row per
  // token of the replica's rows, in step order (LastPerRow: one per row with tokens); a draft
  // returns one row per logits row (its output before the final norm, which its next step
  // reads). hidden_width floats per row.
  std::vector<ReplicaHidden> hidden;
  uint32_t hidden_width = 0;
  std::vector<float> read_logits() const;  // copies the logits to the host
  std::vector<float> read_hidden() const;  // every replica's rows, in replica order
};

}  // namespace clshard
