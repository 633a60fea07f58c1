#include "models/llama3/weights.h"

#include <algorithm>

#include "runtime/device.h"
#include "runtime/safetensors.h"

namespace clshard::llama3 {

namespace {

const std::vector<DType> kFloatTypes = {DType::F32, DType::BF16, DType::F16};

// clip_qkv (OLMo) clamps the Q/K/V weights before the matmul. The mapped file is read-only, so
// the clamped rows are an f32 copy made once at load.
Weight clamped_rows(Device& dev, const TensorView& v, int64_t r0, int64_t r1, double clip) {
  const int64_t K = v.shape.size() > 1 ? v.shape[1] : 1;
  std::vector<float> vals(size_t((r1 - r0) * K));
  for (size_t i = 0; i < vals.size(); ++i) {
    const size_t src = size_t(r0 * K) + i;
    const uint16_t* half_bits = reinterpret_cast<const uint16_t*>(v.data);
    float x = v.dtype == DType::BF16  ? bf16_to_f32(half_bits[src])
              : v.dtype == DType::F16 ? f16_to_f32(half_bits[src])
                                      : reinterpret_cast<const float*>(v.data)[src];
    vals[i] = std::clamp(x, float(-clip), float(clip));
  }
  std::vector<int64_t> shape = v.shape;
  shape[0] = r1 - r0;
  return to_device_f32(dev, vals, shape, v.name);
}

}  // namespace

ShardRange shard_range(const Llama3Config& c, const parallel::Topology& topology,
                       size_t tensor_rank) {
  // Query heads and MLP columns must divide; key/value heads divide or are copied (more ranks than
  // kv heads, as vLLM does: the KV cache is then replicated ranks / nkv times); the vocabulary need
  // not divide.
  ShardRange s;
  s.heads = topology.tensor_slice(tensor_rank, c.num_attention_heads, "num_attention_heads");
  s.ffn = topology.tensor_slice(tensor_rank, c.intermediate_size, "intermediate_size");
  s.kv_heads =
      topology.tensor_slice_or_copy(tensor_rank, c.num_key_value_heads, "num_key_value_heads");
  s.vocab = topology.tensor_rows(tensor_rank, c.vocab_size);
  return s;
}

Llama3Weights load_weights(const Llama3Config& c, const WeightStore& s, Device& dev,
                           const ShardRange& r) {
  const int64_t H = c.hidden_size, V = c.vocab_size, hd = c.head_dim;
  const int64_t nq = c.num_attention_heads * hd, nkv = c.num_key_value_heads * hd;
  const int64_t F = c.intermediate_size;
  const int64_t q0 = r.heads.begin * hd, q1 = q0 + r.heads.count * hd;
  const int64_t kv0 = r.kv_heads.begin * hd, kv1 = kv0 + r.kv_heads.count * hd;
  const int64_t f0 = r.ffn.begin, f1 = f0 + r.ffn.count;
  const int64_t v0 = r.vocab.begin, v1 = v0 + r.vocab.count;
  auto whole = [&](const std::string& name, std::vector<int64_t> shape) {
    return to_device(dev, s.expect(name, shape, kFloatTypes));
  };
  auto rows = [&](const TensorView& t, int64_t a, int64_t b) {
    return to_device_rows(dev, t, a, b);
  };
  auto qkv_rows = [&](const TensorView& t, int64_t a, int64_t b) {
    return c.clip_qkv ? clamped_rows(dev, t, a, b, *c.clip_qkv) : to_device_rows(dev, t, a, b);
  };

  Llama3Weights w;
  const TensorView& embed = s.expect("model.embed_tokens.weight", {V, H}, kFloatTypes);
  w.embed = rows(embed, v0, v1);
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    LayerWeights L;
    L.input_norm = whole(p + "input_layernorm.weight", {H});
    L.post_attention_norm = whole(p + "post_attention_layernorm.weight", {H});
    if (c.stacked_qkv) {
      const TensorView& t = s.expect(p + "self_attn.qkv_proj.weight", {nq + 2 * nkv, H}, kFloatTypes);
      L.q = qkv_rows(t, q0, q1);
      L.k = qkv_rows(t, nq + kv0, nq + kv1);
      L.v = qkv_rows(t, nq + nkv + kv0, nq + nkv + kv1);
    } else {
      L.q = qkv_rows(s.expect(p + "self_attn.q_proj.weight", {nq, H}, kFloatTypes), q0, q1);
      L.k = qkv_rows(s.expect(p + "self_attn.k_proj.weight", {nkv, H}, kFloatTypes), kv0, kv1);
      L.v = qkv_rows(s.expect(p + "self_attn.v_proj.weight", {nkv, H}, kFloatTypes), kv0, kv1);
      if (c.attention_bias) {
        L.q_bias = rows(s.expect(p + "self_attn.q_proj.bias", {nq}, kFloatTypes), q0, q1);
        L.k_bias = rows(s.expect(p + "self_attn.k_proj.bias", {nkv}, kFloatTypes), kv0, kv1);
        L.v_bias = rows(s.expect(p + "self_attn.v_proj.bias", {nkv}, kFloatTypes), kv0, kv1);
      }
    }
    L.o = to_device_columns(dev, s.expect(p + "self_attn.o_proj.weight", {H, nq}, kFloatTypes),
                            q0, q1);
    if (c.stacked_mlp) {
      const TensorView& t = s.expect(p + "mlp.gate_up_proj.weight", {2 * F, H}, kFloatTypes);
      L.gate = rows(t, f0, f1);
      L.up = rows(t, F + f0, F + f1);
    } else {
      L.gate = rows(s.expect(p + "mlp.gate_proj.weight", {F, H}, kFloatTypes), f0, f1);
      L.up = rows(s.expect(p + "mlp.up_proj.weight", {F, H}, kFloatTypes), f0, f1);
    }
    L.down = to_device_columns(dev, s.expect(p + "mlp.down_proj.weight", {H, F}, kFloatTypes),
                               f0, f1);
    w.layers.push_back(std::move(L));
  }
  w.final_norm = whole("model.norm.weight", {H});
  w.lm_head = c.tie_word_embeddings
                  ? w.embed
                  : rows(s.expect("lm_head.weight", {V, H}, kFloatTypes), v0, v1);
  return w;
}

}  // namespace clshard::llama3
