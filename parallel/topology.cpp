#include "parallel/topology.h"

#include <algorithm>
#include <numeric>

namespace clshard::parallel {

namespace {

std::string count_of_devices(size_t n) {
  return std::to_string(n) + (n == 1 ? " device" : " devices");
}

// The checks of one layout, before the shared ones: each names the setting the layout fixes.
void check_layout(Layout layout, const ParallelDegrees& d, size_t devices,
                  const std::string& model) {
  if (layout != Layout::DataParallelAttentionExpertParallel) return;
  const std::string n = std::to_string(devices);
  if (d.tensor != 1)
    throw TopologyError({"parallel.tensor"},
                        model + ": parallel.tensor = " + std::to_string(d.tensor) +
                            " is not supported (attention runs data-parallel, experts "
                            "expert-parallel; set parallel.tensor = 1)");
  if (d.data != devices)
    throw TopologyError({"parallel.data"},
                        model + " on " + n + " device(s) runs one data-parallel replica per "
                        "device: parallel.data must be " + n + ", got " + std::to_string(d.data));
  if (d.expert != devices)
    throw TopologyError({"parallel.expert"},
                        model + " on " + n + " device(s) spreads the experts over all of them: "
                        "parallel.expert must be " + n + ", got " + std::to_string(d.expert) +
                        " (expert parallelism over fewer ranks than devices is not supported)");
}

}  // namespace

TopologyError::TopologyError(std::vector<std::string> keys, const std::string& detail)
    : std::runtime_error((keys.size() == 1 ? keys[0] : std::string("parallel")) + ": " + detail),
      keys_(std::move(keys)),
      detail_(detail) {}

void check_degrees(const ParallelDegrees& d, size_t devices) {
  for (const auto& [key, value] : {std::pair{"parallel.data", d.data},
                                   std::pair{"parallel.tensor", d.tensor},
                                   std::pair{"parallel.expert", d.expert}})
    if (value == 0) throw TopologyError({key}, "must be at least 1, got 0");
  if (d.data * d.tensor != devices)
    throw TopologyError({"parallel.data", "parallel.tensor"},
                        "data (" + std::to_string(d.data) + ") * tensor (" +
                            std::to_string(d.tensor) +
                            ") must equal the number of devices, and the deployment has " +
                            count_of_devices(devices));
  if (devices % d.expert != 0)
    throw TopologyError({"parallel.expert"},
                        std::to_string(d.expert) +
                            " expert-parallel ranks must divide the number of devices (" +
                            count_of_devices(devices) + ")");
}

Topology::Topology(Layout layout, const ParallelDegrees& degrees, size_t devices,
                   std::string model, size_t processes)
    : layout_(layout), degrees_(degrees), devices_(devices), processes_(processes) {
  if (devices == 0) throw TopologyError({"devices"}, "no device selected");
  if (processes == 0 || devices % processes != 0)
    throw TopologyError({"devices"}, count_of_devices(devices) + " cannot be shared evenly by " +
                                         std::to_string(processes) + " processes");
  check_layout(layout, degrees, devices, model);
  check_degrees(degrees, devices);
  // A replica's group lies inside one process or spans whole processes, so every process builds
  // the same number of groups that talk over MPI (their transports are created collectively).
  const size_t k = devices / processes;
  if (processes > 1 && degrees.tensor % k != 0 && k % degrees.tensor != 0)
    throw TopologyError({"parallel.tensor"},
                        std::to_string(degrees.tensor) + " tensor-parallel devices per replica "
                        "over processes of " + count_of_devices(k) + " each: one must divide "
                        "the other");
  replicas_ = place_replicas(devices, degrees.data, degrees.tensor);
}

const std::vector<size_t>& Topology::devices_of_replica(size_t replica) const {
  if (replica >= replicas())
    throw std::out_of_range("replica " + std::to_string(replica) + " of " +
                            std::to_string(replicas()));
  return replicas_.devices_of_replica[replica];
}

std::vector<size_t> Topology::processes_of_replica(size_t replica) const {
  std::vector<size_t> p;
  for (size_t d : devices_of_replica(replica))
    if (p.empty() || p.back() != process_of_device(d)) p.push_back(process_of_device(d));
  return p;
}

size_t Topology::tensor_rank_of_device(size_t device) const {
  const auto& group = devices_of_replica(replica_of_device(device));
  return size_t(std::find(group.begin(), group.end(), device) - group.begin());
}

TensorSlice Topology::tensor_slice(size_t tensor_rank, int64_t count,
                                   const std::string& field) const {
  const int64_t ranks = int64_t(tensor_degree());
  if (count % ranks != 0)
    throw std::runtime_error("tensor parallelism over " + std::to_string(ranks) +
                             " devices needs " + field + " (" + std::to_string(count) +
                             ") divisible by it");
  return {int64_t(tensor_rank) * (count / ranks), count / ranks};
}

TensorSlice Topology::tensor_slice_or_copy(size_t tensor_rank, int64_t count,
                                           const std::string& field) const {
  const int64_t ranks = int64_t(tensor_degree());
  if (count % ranks == 0) return tensor_slice(tensor_rank, count, field);
  if (ranks % count == 0) return {int64_t(tensor_rank) / (ranks / count), 1};
  throw std::runtime_error("tensor parallelism over " + std::to_string(ranks) + " devices needs " +
                           field + " (" + std::to_string(count) +
                           ") to divide it or be divisible by it");
}

TensorSlice Topology::tensor_rows(size_t tensor_rank, int64_t count) const {
  const int64_t ranks = int64_t(tensor_degree()), rank = int64_t(tensor_rank);
  const int64_t base = count / ranks, extra = count % ranks;
  return {rank * base + std::min(rank, extra), base + (rank < extra ? 1 : 0)};
}

size_t Topology::expert_ranks() const {
  if (layout_ != Layout::DataParallelAttentionExpertParallel)
    throw std::logic_error("Topology: a dense layout has no expert-parallel ranks");
  return degrees_.expert;
}

ExpertPlacement Topology::expert_blocks(uint32_t n_experts,
                                        const std::vector<double>& throughput) const {
  if (!degrees_.balanced_experts) return place_experts_even(n_experts, expert_ranks());
  if (throughput.size() != expert_ranks())
    throw std::invalid_argument("Topology: balanced expert blocks need one throughput per "
                                "expert-parallel rank (" + std::to_string(expert_ranks()) +
                                "), got " + std::to_string(throughput.size()));
  return place_experts_balanced(n_experts, throughput);
}

}  // namespace clshard::parallel
