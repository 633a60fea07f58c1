#include "models/deepseek_v3/plan.h"

#include <algorithm>

namespace clshard::deepseek_v3 {

namespace {

// Sums parameters and bytes of tensors in the dtypes of a checkpoint: decoder-layer linear weights
// in `linear_bytes` (1 for e4m3, plus one f32 scale per 128x128 block), other float tensors
// (embedding, head, norms, router, eh_proj) in `float_bytes`, correction biases in f32.
class Tally {
 public:
  Tally(bool fp8, uint64_t float_bytes) : fp8_(fp8), float_bytes_(float_bytes) {}
  void linear(uint64_t rows, uint64_t cols) {
    params += rows * cols;
    bytes += fp8_ ? rows * cols + ((rows + 127) / 128) * ((cols + 127) / 128) * 4
                  : rows * cols * float_bytes_;
  }
  void plain(uint64_t n) {
    params += n;
    bytes += n * float_bytes_;
  }
  void f32(uint64_t n) {
    params += n;
    bytes += n * 4;
  }
  uint64_t params = 0, bytes = 0;

 private:
  bool fp8_;
  uint64_t float_bytes_;
};

struct Shapes {
  const DeepseekV3Config& c;
  uint64_t H, V;

  void attention(Tally& t) const {
    const uint64_t Nh = c.num_attention_heads, qk = c.qk_head_dim(), Lq = c.q_lora_rank;
    const uint64_t Lkv = c.kv_lora_rank, Dr = c.qk_rope_head_dim;
    if (Lq > 0) {
      t.linear(Lq, H);
      t.plain(Lq);
      t.linear(Nh * qk, Lq);
    } else {
      t.linear(Nh * qk, H);
    }
    t.linear(Lkv + Dr, H);
    t.plain(Lkv);
    t.linear(Nh * (c.qk_nope_head_dim + c.v_head_dim), Lkv);
    t.linear(H, Nh * c.v_head_dim);
  }
  void mlp(Tally& t, uint64_t F) const {
    t.linear(F, H);
    t.linear(F, H);
    t.linear(H, F);
  }
  // Router, its bias, and `experts` routed experts plus the shared ones.
  void moe(Tally& t, uint64_t experts) const {
    t.plain(uint64_t(c.n_routed_experts) * H);
    t.f32(uint64_t(c.n_routed_experts));
    for (uint64_t e = 0; e < experts; ++e) mlp(t, c.moe_intermediate_size);
    if (c.n_shared_experts > 0) mlp(t, uint64_t(c.n_shared_experts) * c.moe_intermediate_size);
  }
  // A decoder layer with all its experts (as stored) or only the active ones (top-k).
  void layer(Tally& t, int64_t l, bool active_only) const {
    t.plain(2 * H);  // input and post-attention norms
    attention(t);
    if (c.is_moe_layer(l))
      moe(t, active_only ? uint64_t(c.num_experts_per_tok) : uint64_t(c.n_routed_experts));
    else
      mlp(t, c.intermediate_size);
  }
};

}  // namespace

MemoryPlan plan_memory(const DeepseekV3Config& c, const PlanOptions& o) {
  MemoryPlan p;
  p.options = o;
  p.n_routed_experts = uint32_t(c.n_routed_experts);
  p.num_experts_per_tok = uint32_t(c.num_experts_per_tok);
  p.hidden_size = uint32_t(c.hidden_size);
  const bool fp8 = c.quantization.has_value();
  // Released FP8 checkpoints keep the non-linear tensors in BF16; otherwise torch_dtype says.
  const uint64_t float_bytes = fp8 ? 2 : (c.torch_dtype == "float32" ? 4 : 2);
  p.linear_dtype = fp8 ? "F8_E4M3+scales" : (float_bytes == 4 ? "F32" : "BF16");
  const Shapes s{c, uint64_t(c.hidden_size), uint64_t(c.vocab_size)};
  const uint64_t H = s.H, V = s.V;

  auto count = [&](auto&& fn) {
    Tally t(fp8, float_bytes);
    fn(t);
    return t;
  };
  p.params.embedding = V * H;
  p.params.lm_head = V * H;
  p.params.attention_per_layer = count([&](Tally& t) { s.attention(t); }).params;
  p.params.dense_mlp_per_layer = count([&](Tally& t) { s.mlp(t, c.intermediate_size); }).params;
  p.params.routed_expert = count([&](Tally& t) { s.mlp(t, c.moe_intermediate_size); }).params;
  p.params.moe_per_layer = count([&](Tally& t) { s.moe(t, c.n_routed_experts); }).params;

  const Tally main = count([&](Tally& t) {
    t.plain(V * H);  // embedding
    for (int64_t l = 0; l < c.num_hidden_layers; ++l) s.layer(t, l, false);
    t.plain(H);      // final norm
    t.plain(V * H);  // lm_head
  });
  p.params.main = main.params;
  p.weight_bytes_main = main.bytes;
  int64_t moe_layers = 0;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) moe_layers += c.is_moe_layer(l) ? 1 : 0;
  p.routed_expert_bytes_main = count([&](Tally& t) { s.mlp(t, c.moe_intermediate_size); }).bytes *
                               uint64_t(c.n_routed_experts) * uint64_t(moe_layers);

  const Tally mtp = count([&](Tally& t) {
    for (int64_t m = 0; m < c.num_nextn_predict_layers; ++m) {
      const int64_t l = c.num_hidden_layers + m;
      t.plain(V * H);          // embed_tokens (a copy of the model's)
      t.plain(2 * H);          // enorm, hnorm
      t.plain(2 * H * H);      // eh_proj [H, 2H], unquantized in the released checkpoint
      s.layer(t, l, false);
      t.plain(H);              // shared_head.norm
      t.plain(V * H);          // shared_head.head (a copy of lm_head)
    }
  });
  int64_t mtp_moe_layers = 0;
  for (int64_t m = 0; m < c.num_nextn_predict_layers; ++m)
    mtp_moe_layers += c.is_moe_layer(std::max(c.num_hidden_layers + m, c.first_k_dense_replace));
  p.routed_expert_bytes_mtp = count([&](Tally& t) { s.mlp(t, c.moe_intermediate_size); }).bytes *
                              uint64_t(c.n_routed_experts) * uint64_t(mtp_moe_layers);
  p.mtp_copy_bytes = uint64_t(c.num_nextn_predict_layers) * 2 * V * H * float_bytes;
  p.params.mtp = mtp.params;
  p.params.mtp_unique = mtp.params - uint64_t(c.num_nextn_predict_layers) * 2 * V * H;
  p.weight_bytes_mtp = mtp.bytes;

  // One decode token: every attention and dense weight, top-k routed + shared experts, lm_head;
  // the embedding contributes one row.
  const Tally active = count([&](Tally& t) {
    for (int64_t l = 0; l < c.num_hidden_layers; ++l) s.layer(t, l, true);
    t.plain(H);
    t.plain(V * H);
  });
  p.params.active_per_token = active.params + V * H;  // counted with the embedding, as DeepSeek
  p.active_weight_bytes_per_token = active.bytes + H * float_bytes;

  p.kv_bytes_per_token = uint64_t(c.num_hidden_layers) * c.cache_row_width() * o.cache_dtype_bytes;
  p.kv_bytes_per_page = p.kv_bytes_per_token * o.page_size;

  // This engine's per-step scratch (f32), prefill path: per new token the residual and normed
  // stream, the fused projection, q, attention output, the FFN halves and the MoE permutation
  // buffers; per decompressed context row its latent and K-nope|V; logits per returned row.
  const uint64_t Nh = c.num_attention_heads, Lq = c.q_lora_rank, k = c.num_experts_per_tok;
  const uint64_t F = c.moe_intermediate_size, ffn = std::max<uint64_t>(c.intermediate_size, F);
  const uint64_t per_token = 2 * H + Lq + c.cache_row_width() + Nh * c.qk_head_dim() + Lq +
                             Nh * c.v_head_dim + 2 * ffn + c.n_routed_experts + 2 * k +
                             2 * k * H + 2 * std::max<uint64_t>(k * F, c.n_shared_experts * F);
  const uint64_t per_context_row =
      c.kv_lora_rank + Nh * (c.qk_nope_head_dim + c.v_head_dim);
  p.activation_bytes = 4 * (uint64_t(o.max_batch_tokens) * per_token +
                            uint64_t(o.max_context_tokens) * per_context_row);
  return p;
}

nlohmann::json to_json(const MemoryPlan& p) {
  nlohmann::ordered_json j;
  j["architecture"] = "DeepseekV3ForCausalLM";
  j["moe"] = {{"n_routed_experts", p.n_routed_experts},
              {"num_experts_per_tok", p.num_experts_per_tok},
              {"hidden_size", p.hidden_size}};
  j["parameters"] = {{"total", p.params.total()},
                     {"main", p.params.main},
                     {"mtp", p.params.mtp},
                     {"mtp_unique", p.params.mtp_unique},
                     {"active_per_token", p.params.active_per_token},
                     {"embedding", p.params.embedding},
                     {"lm_head", p.params.lm_head},
                     {"attention_per_layer", p.params.attention_per_layer},
                     {"dense_mlp_per_layer", p.params.dense_mlp_per_layer},
                     {"moe_per_layer", p.params.moe_per_layer},
                     {"routed_expert", p.params.routed_expert}};
  j["weights"] = {{"linear_dtype", p.linear_dtype},
                  {"bytes_total", p.weight_bytes_main + p.weight_bytes_mtp},
                  {"bytes_main", p.weight_bytes_main},
                  {"bytes_mtp", p.weight_bytes_mtp},
                  {"routed_expert_bytes_mtp", p.routed_expert_bytes_mtp},
                  {"mtp_copy_bytes", p.mtp_copy_bytes},
                  {"routed_expert_bytes_main", p.routed_expert_bytes_main},
                  {"active_bytes_per_token", p.active_weight_bytes_per_token}};
  j["kv_cache"] = {{"layout", "MLA: one kv_lora_rank + qk_rope_head_dim row per token per layer"},
                   {"dtype_bytes", p.options.cache_dtype_bytes},
                   {"bytes_per_token", p.kv_bytes_per_token},
                   {"page_size", p.options.page_size},
                   {"bytes_per_page", p.kv_bytes_per_page}};
  j["activations"] = {{"bytes", p.activation_bytes},
                      {"max_batch_tokens", p.options.max_batch_tokens},
                      {"max_context_tokens", p.options.max_context_tokens}};
  return j;
}

}  // namespace clshard::deepseek_v3
