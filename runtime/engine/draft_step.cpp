#include "runtime/engine/draft_step.h"

#include <algorithm>

#include "runtime/ops_moe.h"

namespace clshard {

DraftStep::DraftStep(size_t replicas, uint32_t pages_per_row)
    : hidden_rows(replicas), rows_of_replica(replicas, 0) {
  in.input_row_offsets = {0};
  in.pages_per_row = pages_per_row;
}

void DraftStep::add_row(size_t replica, const std::vector<int32_t>& tokens, uint32_t cache_length,
                        const uint32_t* pages, uint32_t logits, uint32_t first_hidden_row) {
  in.tokens.insert(in.tokens.end(), tokens.begin(), tokens.end());
  in.input_row_offsets.push_back(uint32_t(in.tokens.size()));
  in.cache_lengths.push_back(cache_length);
  in.lookup_table.insert(in.lookup_table.end(), pages, pages + in.pages_per_row);
  in.logits_per_row.push_back(logits);
  for (uint32_t j = 0; j < tokens.size(); ++j) hidden_rows[replica].push_back(first_hidden_row + j);
  ++rows_of_replica[replica];
}

void DraftStep::finish_splits() {
  if (rows_of_replica.size() == 1) return;
  in.data_parallel_splits = {0};
  for (uint32_t n : rows_of_replica)
    in.data_parallel_splits.push_back(in.data_parallel_splits.back() + n);
}

std::vector<ReplicaHidden> DraftStep::gather(const std::vector<ReplicaHidden>& source,
                                             uint32_t width, std::vector<Scratch>& keep) const {
  std::vector<ReplicaHidden> out;
  for (size_t r = 0; r < source.size(); ++r) {
    Device& dev = *source[r].device;
    const auto& idx = hidden_rows.at(r);
    const uint32_t n = uint32_t(idx.size());
    keep.emplace_back(dev, std::max<size_t>(n, 1) * width * 4);
    const cl::Mem rows = keep.back().mem();
    if (n > 0) {
      keep.emplace_back(dev, n * 4);
      dev.write(keep.back().mem(), idx.data(), n * 4);
      ops::gather_rows(dev, source[r].rows, width, keep.back().mem(), n, width, rows, width);
    }
    out.push_back({&dev, rows, n});
  }
  return out;
}

}  // namespace clshard
