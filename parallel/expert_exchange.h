// The host-side plan of one expert-parallel MoE exchange (dispatch there, combine back), from where
// each source rank's (token, slot) rows go and where the experts live. Pure arithmetic on offsets,
// so the model only moves rows by it and tests can check it without devices.
//
// Each source sends its rows in (expert, token, slot) order — the order group_by_expert
// (runtime/ops_moe.h) gives them — and since expert blocks are contiguous, that is also
// destination order. Rank d receives the sources' rows in source order: within each source, by
// expert. Its expert GEMMs want each local expert's rows together, so unless only one source sent
// it anything, it regroups them (expert, source, token, slot) with `perm` and puts the outputs back
// in received order with `inv` before the combine.
#pragma once

#include <cstdint>
#include <vector>

#include "parallel/placement.h"

namespace clshard::parallel {

struct ExpertExchangePlan {
  // send_off[r][d] .. send_off[r][d + 1]: source r's rows (in its send order) for rank d.
  std::vector<std::vector<uint32_t>> send_off;
  // recv_off[d][r] .. recv_off[d][r + 1]: where rank d receives source r's rows.
  std::vector<std::vector<uint32_t>> recv_off;
  // expert_rows[d][e] .. [e + 1]: local expert e's rows on rank d after regrouping.
  std::vector<std::vector<uint32_t>> expert_rows;
  // perm[d][i]: the received row that regrouped row i is; inv[d] is its inverse.
  std::vector<std::vector<uint32_t>> perm, inv;
  // Whether rank d regroups (more than one source sent it rows); otherwise its received rows are
  // already grouped by expert and perm/inv are the identity.
  std::vector<bool> regroup;

  size_t ranks() const { return send_off.size(); }
  uint32_t rows_sent(size_t source) const { return send_off[source].back(); }
  uint32_t rows_received(size_t rank) const { return recv_off[rank].back(); }
};

// expert_offsets[r] is source r's rows grouped by expert: expert e's rows are
// [expert_offsets[r][e], expert_offsets[r][e + 1]) of its send order ([n_experts + 1] entries, as
// group_by_expert's ExpertBatches::expert_offsets). One source per expert-parallel rank of
// `placement`. Throws std::invalid_argument when the counts do not match.
ExpertExchangePlan plan_expert_exchange(const std::vector<std::vector<uint32_t>>& expert_offsets,
                                        const ExpertPlacement& placement);

}  // namespace clshard::parallel
