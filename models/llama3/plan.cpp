#include "models/llama3/plan.h"

namespace clshard::llama3 {

nlohmann::json plan_memory(const Llama3Config& c, uint64_t bytes_per_param) {
  const uint64_t H = c.hidden_size, V = c.vocab_size, hd = c.head_dim, I = c.intermediate_size;
  const uint64_t nq = c.num_attention_heads * hd, nkv = c.num_key_value_heads * hd;
  const uint64_t per_layer = 2 * H + nq * H + 2 * nkv * H + H * nq + 3 * H * I +
                             (c.attention_bias ? nq + 2 * nkv : 0);
  const uint64_t params = V * H + uint64_t(c.num_hidden_layers) * per_layer + H +
                          (c.tie_word_embeddings ? 0 : V * H);
  const uint64_t kv_per_token = uint64_t(c.num_hidden_layers) * 2 * nkv * sizeof(float);
  const uint64_t page_size = 128, max_batch_tokens = 8192;
  const uint64_t per_token = 2 * H + nq + 2 * nkv + nq + 2 * I;  // f32 step scratch
  nlohmann::ordered_json j;
  j["architecture"] = c.architecture;
  j["parameters"] = {{"total", params}, {"active_per_token", params}};
  j["weights"] = {{"bytes_total", params * bytes_per_param},
                  {"active_bytes_per_token", (params - V * H + H) * bytes_per_param}};
  j["kv_cache"] = {{"layout", "K and V per layer per kv head"},
                   {"dtype_bytes", sizeof(float)},
                   {"bytes_per_token", kv_per_token},
                   {"page_size", page_size},
                   {"bytes_per_page", kv_per_token * page_size}};
  j["activations"] = {{"bytes", 4 * max_batch_tokens * per_token},
                      {"max_batch_tokens", max_batch_tokens}};
  return j;
}

}  // namespace clshard::llama3
