// DeepSeek-V3 weight names -> tensors on a device. Names are Hugging Face's (model.layers.N.*).
// Linear weights are F32, BF16, or F8_E4M3 with a companion `weight_scale_inv` (F32 block
// multipliers, [ceil(out/128), ceil(in/128)]) that the GEMV/GEMM kernels apply while reading —
// nothing is expanded to f32 in memory. The MTP layers (model.layers.{num_hidden_layers}.*) are
// recognised and left for speculative decoding.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "models/deepseek_v3/config.h"
#include "runtime/ops_moe.h"
#include "runtime/tensor.h"

namespace clshard {
class Device;
class WeightStore;
}  // namespace clshard

namespace clshard::deepseek_v3 {

// A linear layer's weight [out, in] and, for F8_E4M3, its block scales.
struct Linear {
  Weight w;
  Weight scale_inv;  // set iff w is F8_E4M3
  bool fp8() const { return bool(scale_inv); }
  uint32_t out_features() const { return uint32_t(w.dim(0)); }
  uint32_t in_features() const { return uint32_t(w.dim(1)); }
};

struct MlaWeights {
  Linear q_a, q_b;  // q_lora_rank > 0: q = q_b(norm(q_a(x)))
  Weight q_a_norm;
  Linear q;         // q_lora_rank == 0: q = q_proj(x)
  Linear kv_a;      // kv_a_proj_with_mqa [kv_lora_rank + rope, H]
  Weight kv_a_norm;
  Linear kv_b;      // [heads * (nope + v), kv_lora_rank]: K-nope and V up-projections per head
  Linear o;         // [H, heads * v]
};

struct MlpWeights {
  Linear gate, up, down;
  explicit operator bool() const { return bool(gate.w); }
};

struct MoeWeights {
  Weight router;           // gate.weight [E, H]
  Weight correction_bias;  // gate.e_score_correction_bias [E], F32, used for selection only
  // The routed experts this device holds, each its own tensors: experts[i] is global expert
  // first_expert + i (all of them on one device; an expert-parallel rank's block otherwise).
  std::vector<MlpWeights> experts;
  uint32_t first_expert = 0;
  MlpWeights shared;  // n_shared_experts * moe_intermediate_size wide; empty when none
  // The same experts as one buffer for the grouped kernels (runtime/ops_moe.h), where the device
  // reads host memory and the tensors lie in one file; empty otherwise (the experts run one by
  // one). With grouped_has_shared its last expert is `shared` (n_shared_experts == 1).
  ops::GroupedExperts grouped;
  bool grouped_has_shared = false;
};

struct LayerWeights {
  Weight input_norm, post_attention_norm;
  MlaWeights attn;
  bool is_moe = false;
  MlpWeights mlp;  // dense layers
  MoeWeights moe;  // MoE layers
};

struct DeepseekV3Weights {
  Weight embed;
  std::vector<LayerWeights> layers;
  Weight final_norm;
  Weight lm_head;
};

// Checks the tensor names against the config (expert ids below n_routed_experts, layer ids below
// num_hidden_layers + num_nextn_predict_layers), then every tensor's shape and dtype (errors name
// tensor, file, found and expected), and puts them on `dev`. Only the routed experts
// [expert_begin, expert_end) of each MoE layer are loaded (an expert-parallel rank's block; the
// end is capped at n_routed_experts); everything else is loaded whole.
DeepseekV3Weights load_weights(const DeepseekV3Config& cfg, const WeightStore& store, Device& dev,
                               uint32_t expert_begin = 0, uint32_t expert_end = UINT32_MAX);

// One decoder layer whose tensors are named `prefix` + "input_layernorm.weight" etc. (the main
// layers' "model.layers.N.", or the NextN block's): MLA, and a dense MLP or an MoE with the
// routed experts [expert_begin, expert_end) only.
LayerWeights load_layer(const DeepseekV3Config& cfg, const WeightStore& store, Device& dev,
                        const std::string& prefix, bool is_moe, uint32_t expert_begin = 0,
                        uint32_t expert_end = UINT32_MAX);

// `prefix`.weight [out, in] on `dev` (F32, BF16 or F8_E4M3) and, when it is F8_E4M3, its block
// scales `prefix`.weight_scale_inv; errors name the tensor and the file.
Linear load_linear(const WeightStore& store, Device& dev, const std::string& prefix, int64_t out,
                   int64_t in);

// The layer ids of the MTP blocks present in the checkpoint ([num_hidden_layers, ...)).
std::vector<int64_t> mtp_layers_present(const DeepseekV3Config& cfg, const WeightStore& store);

}  // namespace clshard::deepseek_v3
