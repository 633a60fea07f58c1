#include "parallel/placement.h"

#include <algorithm>
#include <cmath>
#include <iomanip>
#include <numeric>
#include <sstream>
#include <stdexcept>

namespace clshard::parallel {

size_t ReplicaPlacement::replica_of_device(size_t device) const {
  for (size_t r = 0; r < devices_of_replica.size(); ++r)
    for (size_t d : devices_of_replica[r])
      if (d == device) return r;
  throw std::out_of_range("device " + std::to_string(device) + " belongs to no replica");
}

std::string ReplicaPlacement::describe() const {
  std::ostringstream o;
  o << "replica  devices\n";
  for (size_t r = 0; r < devices_of_replica.size(); ++r) {
    o << std::setw(7) << r << "  ";
    for (size_t i = 0; i < devices_of_replica[r].size(); ++i)
      o << (i ? "," : "") << devices_of_replica[r][i];
    o << "\n";
  }
  return o.str();
}

ReplicaPlacement place_replicas(size_t n_devices, size_t data_degree, size_t tensor_degree) {
  if (data_degree == 0 || tensor_degree == 0)
    throw std::invalid_argument("parallel: data_parallel_degree (" + std::to_string(data_degree) +
                                ") and tensor_parallel_degree (" + std::to_string(tensor_degree) +
                                ") must be at least 1");
  if (data_degree * tensor_degree != n_devices)
    throw std::invalid_argument(
        "parallel: " + std::to_string(data_degree) + " data-parallel replica(s) x " +
        std::to_string(tensor_degree) + " tensor-parallel device(s) each need " +
        std::to_string(data_degree * tensor_degree) + " devices, but " +
        std::to_string(n_devices) + " are selected (every device must belong to one replica)");
  ReplicaPlacement p;
  for (size_t r = 0; r < data_degree; ++r) {
    std::vector<size_t> group(tensor_degree);
    std::iota(group.begin(), group.end(), r * tensor_degree);
    p.devices_of_replica.push_back(std::move(group));
  }
  return p;
}

uint32_t ExpertPlacement::rank_of(uint32_t expert) const {
  if (expert >= n_experts())
    throw std::out_of_range("expert " + std::to_string(expert) + " of " +
                            std::to_string(n_experts()));
  // The last rank whose block starts at or before the expert; empty ranks before it share its
  // start, and upper_bound steps past them.
  auto it = std::upper_bound(first_expert.begin(), first_expert.end(), expert);
  return uint32_t(it - first_expert.begin() - 1);
}

uint32_t ExpertPlacement::count(size_t rank) const {
  if (rank >= ranks())
    throw std::out_of_range("rank " + std::to_string(rank) + " of " + std::to_string(ranks()));
  return first_expert[rank + 1] - first_expert[rank];
}

std::string ExpertPlacement::describe() const {
  std::ostringstream o;
  o << "expert placement (" << how << "): " << n_experts() << " experts over " << ranks()
    << " rank(s)\n  rank  experts  block\n";
  uint32_t lo = UINT32_MAX, hi = 0;
  size_t empty = 0;
  for (size_t r = 0; r < ranks(); ++r) {
    const uint32_t c = count(r);
    lo = std::min(lo, c);
    hi = std::max(hi, c);
    empty += c == 0;
    o << std::setw(6) << r << std::setw(9) << c << "  ";
    if (c) o << "[" << first_expert[r] << ", " << first_expert[r + 1] << ")";
    else o << "none";
    o << "\n";
  }
  if (ranks() && lo != hi)
    o << "  note: uneven blocks (" << lo << " to " << hi
      << " experts per rank); MAX requires equal blocks, clshard sizes each rank's receive "
         "buffers for its own block\n";
  if (empty)
    o << "  note: " << empty << " rank(s) own no expert (fewer experts than ranks); they still "
      << "take part in every dispatch and combine with empty shares\n";
  return o.str();
}

ExpertPlacement place_experts_even(uint32_t n_experts, size_t ranks) {
  if (n_experts == 0) throw std::invalid_argument("expert placement: the model has no experts");
  if (ranks == 0) throw std::invalid_argument("expert placement: no expert-parallel ranks");
  ExpertPlacement p;
  p.how = "even";
  p.first_expert.assign(ranks + 1, 0);
  const uint32_t base = uint32_t(n_experts / ranks), extra = uint32_t(n_experts % ranks);
  for (size_t r = 0; r < ranks; ++r)
    p.first_expert[r + 1] = p.first_expert[r] + base + (r < extra ? 1 : 0);
  return p;
}

ExpertPlacement place_experts_balanced(uint32_t n_experts,
                                       const std::vector<double>& throughput) {
  const size_t ranks = throughput.size();
  if (ranks == 0) throw std::invalid_argument("expert placement: no expert-parallel ranks");
  if (n_experts < ranks)
    throw std::invalid_argument("expert placement (balanced): " + std::to_string(n_experts) +
                                " experts cannot give each of " + std::to_string(ranks) +
                                " ranks at least one");
  double total = 0;
  for (size_t r = 0; r < ranks; ++r) {
    if (!std::isfinite(throughput[r]) || throughput[r] <= 0)
      throw std::invalid_argument("expert placement (balanced): throughput of rank " +
                                  std::to_string(r) + " is " + std::to_string(throughput[r]) +
                                  "; it must be a positive number");
    total += throughput[r];
  }
  // Largest remainder with a floor of one expert: start from floor(ideal), then hand the missing
  // experts to the ranks furthest below their ideal share, or take the surplus (which the floor of
  // one can create) from the ranks furthest above it.
  std::vector<double> ideal(ranks);
  std::vector<int64_t> n(ranks);
  int64_t sum = 0;
  for (size_t r = 0; r < ranks; ++r) {
    ideal[r] = double(n_experts) * throughput[r] / total;
    n[r] = std::max<int64_t>(1, int64_t(std::floor(ideal[r])));
    sum += n[r];
  }
  while (sum < int64_t(n_experts)) {
    size_t best = 0;
    for (size_t r = 1; r < ranks; ++r)
      if (ideal[r] - double(n[r]) > ideal[best] - double(n[best])) best = r;
    ++n[best];
    ++sum;
  }
  while (sum > int64_t(n_experts)) {
    size_t best = ranks;
    for (size_t r = 0; r < ranks; ++r)
      if (n[r] > 1 && (best == ranks || double(n[r]) - ideal[r] > double(n[best]) - ideal[best]))
        best = r;
    --n[best];
    --sum;
  }
  ExpertPlacement p;
  std::ostringstream how;
  how << "balanced by throughput";
  for (size_t r = 0; r < ranks; ++r)
    how << (r ? ", " : " ") << std::setprecision(3) << throughput[r] / total * double(ranks);
  how << " (relative to the mean)";
  p.how = how.str();
  p.first_expert.assign(ranks + 1, 0);
  for (size_t r = 0; r < ranks; ++r) p.first_expert[r + 1] = p.first_expert[r] + uint32_t(n[r]);
  return p;
}

std::vector<uint32_t> data_parallel_splits(const std::vector<uint32_t>& requests_per_replica) {
  std::vector<uint32_t> splits(requests_per_replica.size() + 1, 0);
  for (size_t r = 0; r < requests_per_replica.size(); ++r)
    splits[r + 1] = splits[r] + requests_per_replica[r];
  return splits;
}

size_t least_loaded_replica(const std::vector<uint64_t>& load) {
  if (load.empty()) throw std::invalid_argument("least_loaded_replica: no replicas");
  // min_element keeps the first of equal minima: ties go to the lowest index.
  return size_t(std::min_element(load.begin(), load.end()) - load.begin());
}

}  // namespace clshard::parallel
