#include "parallel/expert_exchange.h"

#include <stdexcept>
#include <string>

namespace clshard::parallel {

ExpertExchangePlan plan_expert_exchange(const std::vector<std::vector<uint32_t>>& expert_offsets,
                                        const ExpertPlacement& placement) {
  const size_t N = expert_offsets.size();
  const uint32_t E = placement.n_experts();
  if (N != placement.ranks())
    throw std::invalid_argument("plan_expert_exchange: " + std::to_string(N) +
                                " sources, the placement has " +
                                std::to_string(placement.ranks()) + " ranks");
  for (size_t r = 0; r < N; ++r)
    if (expert_offsets[r].size() != size_t(E) + 1)
      throw std::invalid_argument("plan_expert_exchange: source " + std::to_string(r) + " has " +
                                  std::to_string(expert_offsets[r].size()) +
                                  " expert offsets, expected " + std::to_string(E + 1));

  ExpertExchangePlan p;
  p.send_off.assign(N, std::vector<uint32_t>(N + 1, 0));
  for (size_t r = 0; r < N; ++r)
    for (size_t d = 0; d <= N; ++d)
      p.send_off[r][d] = expert_offsets[r][placement.first_expert[d]];

  p.recv_off.assign(N, std::vector<uint32_t>(N + 1, 0));
  p.expert_rows.resize(N);
  p.perm.resize(N);
  p.inv.resize(N);
  p.regroup.assign(N, false);
  for (size_t d = 0; d < N; ++d) {
    const uint32_t e0 = placement.first_expert[d], e1 = placement.first_expert[d + 1];
    size_t senders = 0;
    for (size_t r = 0; r < N; ++r) {
      const uint32_t n = p.send_off[r][d + 1] - p.send_off[r][d];
      p.recv_off[d][r + 1] = p.recv_off[d][r] + n;
      senders += n > 0;
    }
    p.regroup[d] = senders > 1;
    p.expert_rows[d].push_back(0);
    for (uint32_t e = e0; e < e1; ++e) {
      for (size_t r = 0; r < N; ++r) {
        const uint32_t b = expert_offsets[r][e], n = expert_offsets[r][e + 1] - b;
        for (uint32_t i = 0; i < n; ++i)
          p.perm[d].push_back(p.recv_off[d][r] + (b - p.send_off[r][d]) + i);
      }
      p.expert_rows[d].push_back(uint32_t(p.perm[d].size()));
    }
    p.inv[d].resize(p.perm[d].size());
    for (uint32_t i = 0; i < p.perm[d].size(); ++i) p.inv[d][p.perm[d][i]] = i;
  }
  return p;
}

}  // namespace clshard::parallel
