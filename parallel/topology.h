// The one description of how a deployment spreads over its devices (ARCHITECTURE.md, "One
// Topology, one Transport"): built once from the parallel settings (parallel.data / tensor / expert
// / placement), the device count and the model's layout, and asked by everything that places work
// — the model registry (replica groups), the models (tensor-parallel ranges, expert blocks),
// `clshard plan` (memory per device). Nothing else decides placement, and the degrees are checked
// here, by one set of rules with one set of messages. Requests go to replicas by
// least_loaded_replica (placement.h), which the engine asks per request.
//
// A rank is a device: rank d is the deployment's device d. Replica r owns the device group
// devices_of_replica(r); inside a group the devices are the tensor-parallel ranks in order.
// Over MPI (cluster.transport: mpi) the devices are spread over the processes in order: process p
// drives devices [p * k, p * k + k), k = devices_per_process(), as its local devices 0 .. k - 1.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "parallel/placement.h"

namespace clshard::parallel {

// What the deployment asks for (its `parallel:` section).
struct ParallelDegrees {
  size_t data = 1;    // data-parallel replicas
  size_t tensor = 1;  // tensor-parallel devices per replica
  size_t expert = 1;  // expert-parallel ranks
  bool balanced_experts = false;  // parallel.placement: balanced (expert blocks sized by speed)
};

// How a model family spreads over devices; the registry says which one each architecture uses.
enum class Layout {
  // Dense models (Llama 3): `data` replicas, each a group of `tensor` consecutive devices holding
  // tensor-parallel shards (heads, MLP columns, vocabulary). There are no experts: parallel.expert
  // is held to the rule every layout shares (it divides the device count) and otherwise unused.
  TensorParallelReplicas,
  // DeepSeek-V3 as MAX runs it (DP_EP): every device is an attention replica and an
  // expert-parallel rank, so data = expert = the device count and tensor = 1. Expert parallelism
  // over fewer ranks than devices is not supported: parallel.expert below the device count is an
  // error.
  DataParallelAttentionExpertParallel,
};

// A parallel degree that does not fit the devices or the layout. keys() are the settings at fault
// (the first one the deployment file sets is the one to point at); what() is "key: detail".
class TopologyError : public std::runtime_error {
 public:
  TopologyError(std::vector<std::string> keys, const std::string& detail);
  const std::vector<std::string>& keys() const { return keys_; }
  const std::string& detail() const { return detail_; }

 private:
  std::vector<std::string> keys_;
  std::string detail_;
};

// The rules every layout shares, for when the model (and so its layout) is not known yet, as
// when a deployment file is read: every degree at least 1, data * tensor = devices (each device
// belongs to exactly one replica), and expert divides the device count.
void check_degrees(const ParallelDegrees& degrees, size_t devices);

// A contiguous run of items (heads, columns, rows) one tensor-parallel rank owns.
struct TensorSlice {
  int64_t begin = 0, count = 0;
};

class Topology {
 public:
  // Checks the degrees against the device count by the layout's rules and the shared ones
  // (TopologyError naming the key); `model` names the model family in the messages.
  // `processes`: how many processes share the devices (MPI ranks; 1 in process); it must divide
  // the device count.
  Topology(Layout layout, const ParallelDegrees& degrees, size_t devices,
           std::string model = "the model", size_t processes = 1);

  Layout layout() const { return layout_; }
  const ParallelDegrees& degrees() const { return degrees_; }
  size_t devices() const { return devices_; }  // = ranks

  // Processes (MPI ranks) and the devices each drives.
  size_t processes() const { return processes_; }
  size_t devices_per_process() const { return devices_ / processes_; }
  size_t process_of_device(size_t device) const { return device / devices_per_process(); }
  // The device's index among its process's devices.
  size_t local_index(size_t device) const { return device % devices_per_process(); }
  // The processes a replica's device group spans, in order.
  std::vector<size_t> processes_of_replica(size_t replica) const;

  // Replicas and their device groups.
  size_t replicas() const { return replicas_.replicas(); }
  const std::vector<size_t>& devices_of_replica(size_t replica) const;
  size_t replica_of_device(size_t device) const { return replicas_.replica_of_device(device); }
  const ReplicaPlacement& replica_placement() const { return replicas_; }

  // Tensor parallelism inside a replica: tensor rank t is the t-th device of the group.
  size_t tensor_degree() const { return degrees_.tensor; }
  size_t tensor_rank_of_device(size_t device) const;
  // `count` items split evenly over the tensor ranks; throws naming `field` when they do not
  // divide it.
  TensorSlice tensor_slice(size_t tensor_rank, int64_t count, const std::string& field) const;
  // tensor_slice, or with more ranks than items (ranks a multiple of count), one item per rank,
  // each item copied on ranks / count consecutive ranks (key/value heads, as vLLM replicates them).
  TensorSlice tensor_slice_or_copy(size_t tensor_rank, int64_t count,
                                   const std::string& field) const;
  // Rows that need not divide (the vocabulary): the first count % ranks ranks take one more.
  TensorSlice tensor_rows(size_t tensor_rank, int64_t count) const;

  // Expert parallelism: expert rank r is device r. Blocks are even, or with
  // degrees().balanced_experts sized by `throughput` (one positive figure per expert rank, from
  // measure_device_throughput over the deployment's devices).
  size_t expert_ranks() const;
  bool balanced_experts() const { return degrees_.balanced_experts; }
  ExpertPlacement expert_blocks(uint32_t n_experts,
                                const std::vector<double>& throughput = {}) const;

  // The device whose buffer holds a step's gathered logits (sampling runs there): the first
  // device of replica 0.
  size_t logits_device() const { return replicas_.devices_of_replica.at(0).at(0); }

 private:
  Layout layout_;
  ParallelDegrees degrees_;
  size_t devices_ = 0;
  size_t processes_ = 1;
  ReplicaPlacement replicas_;
};

}  // namespace clshard::parallel
