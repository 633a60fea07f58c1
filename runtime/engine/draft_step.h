// The rows of one draft-model step, replica by replica like the target step they follow, and the
// hidden rows each token reads: gathered on each replica's device from a per-replica source (the
// target's returned hidden states, or the draft's own output of its previous step).
#pragma once

#include <cstdint>
#include <vector>

#include "runtime/device.h"
#include "runtime/step.h"

namespace clshard {

struct DraftStep {
  StepInputs in;
  std::vector<std::vector<uint32_t>> hidden_rows;  // per replica: source row of each token
  std::vector<uint32_t> rows_of_replica;

  DraftStep(size_t replicas, uint32_t pages_per_row);
  // Adds a row of replica `replica` (rows must come in replica order): its tokens at positions
  // cache_length.., its page table row, `logits` logits rows, and source hidden rows
  // first_hidden_row, first_hidden_row + 1, ... for its tokens.
  void add_row(size_t replica, const std::vector<int32_t>& tokens, uint32_t cache_length,
               const uint32_t* pages, uint32_t logits, uint32_t first_hidden_row);
  // Sets data_parallel_splits from the rows each replica got (nothing on one replica).
  void finish_splits();
  // Gathers the hidden rows into scratch buffers, which `keep` holds until the draft has run.
  std::vector<ReplicaHidden> gather(const std::vector<ReplicaHidden>& source, uint32_t width,
                                    std::vector<Scratch>& keep) const;
};

}  // namespace clshard
