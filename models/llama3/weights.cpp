#include "models/llama3/weights.h"

#include <algorithm>

#include "runtime/device.h"
#include "runtime/safetensors.h"

namespace clshard::llama3 {

namespace {

const std::vector<DType> kFloatTypes = {DType::F32, DType::BF16};

// clip_qkv (OLMo) clamps the Q/K/V weights before the matmul. The mapped file is read-only, so
// the clamped weight is an f32 copy made once at load.
Weight clamped(Device& dev, const TensorView& v, double clip) {
  std::vector<float> vals(size_t(v.numel()));
  for (size_t i = 0; i < vals.size(); ++i) {
    float x = v.dtype == DType::BF16
                  ? bf16_to_f32(reinterpret_cast<const uint16_t*>(v.data)[i])
                  : reinterpret_cast<const float*>(v.data)[i];
    vals[i] = std::clamp(x, float(-clip), float(clip));
  }
  return to_device_f32(dev, vals, v.shape, v.name);
}

}  // namespace

Llama3Weights load_weights(const Llama3Config& c, const WeightStore& s, Device& dev) {
  const int64_t H = c.hidden_size, V = c.vocab_size, hd = c.head_dim;
  const int64_t nq = c.num_attention_heads * hd, nkv = c.num_key_value_heads * hd;
  const int64_t F = c.intermediate_size;
  auto get = [&](const std::string& name, std::vector<int64_t> shape) {
    return to_device(dev, s.expect(name, shape, kFloatTypes));
  };
  auto qkv_weight = [&](const std::string& name, std::vector<int64_t> shape) {
    const TensorView& v = s.expect(name, shape, kFloatTypes);
    return c.clip_qkv ? clamped(dev, v, *c.clip_qkv) : to_device(dev, v);
  };

  Llama3Weights w;
  w.embed = get("model.embed_tokens.weight", {V, H});
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    LayerWeights L;
    L.input_norm = get(p + "input_layernorm.weight", {H});
    L.post_attention_norm = get(p + "post_attention_layernorm.weight", {H});
    if (c.stacked_qkv) {
      L.qkv = qkv_weight(p + "self_attn.qkv_proj.weight", {nq + 2 * nkv, H});
    } else {
      L.q = qkv_weight(p + "self_attn.q_proj.weight", {nq, H});
      L.k = qkv_weight(p + "self_attn.k_proj.weight", {nkv, H});
      L.v = qkv_weight(p + "self_attn.v_proj.weight", {nkv, H});
      if (c.attention_bias) {
        L.q_bias = get(p + "self_attn.q_proj.bias", {nq});
        L.k_bias = get(p + "self_attn.k_proj.bias", {nkv});
        L.v_bias = get(p + "self_attn.v_proj.bias", {nkv});
      }
    }
    L.o = get(p + "self_attn.o_proj.weight", {H, nq});
    if (c.stacked_mlp) {
      L.gate_up = get(p + "mlp.gate_up_proj.weight", {2 * F, H});
    } else {
      L.gate = get(p + "mlp.gate_proj.weight", {F, H});
      L.up = get(p + "mlp.up_proj.weight", {F, H});
    }
    L.down = get(p + "mlp.down_proj.weight", {H, F});
    w.layers.push_back(std::move(L));
  }
  w.final_norm = get("model.norm.weight", {H});
  w.lm_head = c.tie_word_embeddings ? w.embed : get("lm_head.weight", {V, H});
  return w;
}

}  // namespace clshard::llama3
