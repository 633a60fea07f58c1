// Llama 3 weight names -> tensors on a device. Names are Hugging Face's (model.layers.N.*). Under
// tensor parallelism each rank takes its slice: its query/key/value heads and MLP columns (rows of
// q/k/v/gate/up), the matching columns of o_proj and down_proj, and a vocabulary shard of the
// embedding and lm_head. A stacked qkv_proj / gate_up_proj is sliced the same way.
#pragma once

#include <vector>

#include "models/llama3/config.h"
#include "parallel/topology.h"
#include "runtime/tensor.h"

namespace clshard {
class Device;
class WeightStore;
}  // namespace clshard

namespace clshard::llama3 {

// What tensor-parallel rank `tensor_rank` of the topology owns (one rank: everything), as the
// topology splits heads, MLP columns and vocabulary rows.
struct ShardRange {
  parallel::TensorSlice heads;     // query heads
  parallel::TensorSlice kv_heads;  // key/value heads
  parallel::TensorSlice ffn;       // MLP intermediate columns
  parallel::TensorSlice vocab;     // embedding / lm_head rows
};
// Throws naming the config field that the rank count does not divide.
ShardRange shard_range(const Llama3Config& cfg, const parallel::Topology& topology,
                       size_t tensor_rank);

struct LayerWeights {
  Weight input_norm, post_attention_norm;
  Weight q, k, v;                    // this rank's heads (rows)
  Weight q_bias, k_bias, v_bias;     // when attention_bias
  Weight o;                          // this rank's head columns
  Weight gate, up;                   // this rank's MLP rows
  Weight down;                       // this rank's MLP columns
};

struct Llama3Weights {
  Weight embed;  // this rank's vocabulary rows
  std::vector<LayerWeights> layers;
  Weight final_norm;
  Weight lm_head;  // this rank's vocabulary rows (the embedding's when tied)
};

// Checks every tensor's shape and dtype against the config (errors name tensor, file, found and
// expected) and puts this rank's slices on `dev` (views of the mapped file where possible).
Llama3Weights load_weights(const Llama3Config& cfg, const WeightStore& store, Device& dev,
                           const ShardRange& shard);

}  // namespace clshard::llama3
