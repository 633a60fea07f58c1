// Placement decisions: which devices hold which data-parallel replica, which expert lives on which
// expert-parallel rank, how a step's requests split over replicas. parallel::Topology (topology.h)
// makes them for a deployment with these functions, and models ask it; the engine routes requests
// with least_loaded_replica. Nothing else computes placement (ARCHITECTURE.md, "Decisions").
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace clshard {
class Device;
}

namespace clshard::parallel {

// Replica r owns the contiguous device group [r * tensor_degree, (r + 1) * tensor_degree), as
// MAX's devices_per_replica; within a group, the devices are the tensor-parallel shards in order.
struct ReplicaPlacement {
  std::vector<std::vector<size_t>> devices_of_replica;

  size_t replicas() const { return devices_of_replica.size(); }
  // The replica that owns `device` (throws for a device outside every group).
  size_t replica_of_device(size_t device) const;
  std::string describe() const;
};

// Throws std::invalid_argument naming the numbers when data_degree * tensor_degree is not the
// device count (every device must belong to exactly one replica) or a degree is 0.
ReplicaPlacement place_replicas(size_t n_devices, size_t data_degree, size_t tensor_degree);

// Experts in contiguous blocks per expert-parallel rank: rank r owns experts
// [first_expert[r], first_expert[r + 1]). MAX uses equal blocks (n_experts divisible by the EP
// size); here blocks may differ in size, and a rank may own none (it still takes part in every
// dispatch and combine with empty shares).
struct ExpertPlacement {
  std::vector<uint32_t> first_expert;  // [ranks + 1], first_expert[0] = 0, last = n_experts
  std::string how;                     // "even" or "balanced (throughput ...)", for describe()

  size_t ranks() const { return first_expert.empty() ? 0 : first_expert.size() - 1; }
  uint32_t n_experts() const { return first_expert.empty() ? 0 : first_expert.back(); }
  uint32_t rank_of(uint32_t expert) const;         // throws for an expert >= n_experts()
  uint32_t local_index(uint32_t expert) const { return expert - first_expert[rank_of(expert)]; }
  uint32_t count(size_t rank) const;               // experts on `rank`
  // A printable table: rank, experts, block; a note when the blocks are uneven or some empty.
  std::string describe() const;
};

// Blocks as even as possible: the first n_experts % ranks ranks own one expert more (E=16 on 3
// ranks: 6, 5, 5). With fewer experts than ranks, the last ranks own none (said in describe()).
// Throws for 0 experts or 0 ranks.
ExpertPlacement place_experts_even(uint32_t n_experts, size_t ranks);

// Block sizes proportional to throughput (relative, per rank, > 0), rounded by largest remainder
// so they add up to exactly n_experts, every rank owning at least one expert. Throws when
// n_experts < ranks or a throughput is not a positive finite number.
ExpertPlacement place_experts_balanced(uint32_t n_experts, const std::vector<double>& throughput);

// The speed of each device on the work experts do: a fixed small GEMM (ops::linear, 16 rows
// through 4 MiB of f32 weights), timed after a warm-up as the best of a few bursts. Returns
// multiply-adds per second per device; only the ratios matter to place_experts_balanced. Devices
// are measured one after another, so a shared thread pool does not skew the figures.
std::vector<double> measure_device_throughput(const std::vector<Device*>& devices);

// MAX's data_parallel_splits: prefix sums of the request counts per replica, [dp + 1] entries
// starting at 0. A replica with no requests gives two equal entries.
std::vector<uint32_t> data_parallel_splits(const std::vector<uint32_t>& requests_per_replica);

// The replica a new request goes to: the least loaded, ties to the lowest index (MAX's
// get_next_replica_idx). Throws for an empty list.
size_t least_loaded_replica(const std::vector<uint64_t>& load);

}  // namespace clshard::parallel
