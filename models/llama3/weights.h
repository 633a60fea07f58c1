// Llama 3 weight names -> tensors on a device. Names are Hugging Face's (model.layers.N.*); a
// stacked qkv_proj / gate_up_proj is taken as is.
#pragma once

#include <vector>

#include "models/llama3/config.h"
#include "runtime/tensor.h"

namespace clshard {
class Device;
class WeightStore;
}  // namespace clshard

namespace clshard::llama3 {

struct LayerWeights {
  Weight input_norm, post_attention_norm;
  // Either q, k, v (+ biases) or one stacked qkv.
  Weight q, k, v, qkv;
  Weight q_bias, k_bias, v_bias;
  Weight o;
  // Either gate and up, or one stacked gate_up.
  Weight gate, up, gate_up;
  Weight down;
};

struct Llama3Weights {
  Weight embed;
  std::vector<LayerWeights> layers;
  Weight final_norm;
  Weight lm_head;  // the embedding when tied
};

// Checks every tensor's shape and dtype against the config (errors name tensor, file, found and
// expected) and puts them on `dev`.
Llama3Weights load_weights(const Llama3Config& cfg, const WeightStore& store, Device& dev);

}  // namespace clshard::llama3
