#include "models/deepseek_v3/model.h"

#include <algorithm>
#include <stdexcept>

#include "runtime/device.h"
#include "runtime/ops.h"
#include "runtime/step_device.h"

namespace clshard::deepseek_v3 {

DeepseekV3Model::DeepseekV3Model(const std::filesystem::path& dir, const LoadOptions& opts)
    : cfg_(DeepseekV3Config::from_dir(dir)), dev_(*opts.devices.at(0)) {
  if (opts.devices.size() != 1)
    throw std::runtime_error("DeepSeek-V3 on " + std::to_string(opts.devices.size()) +
                             " devices needs a parallel layout (data/expert) from parallel/");
  mla_.n_heads = uint32_t(cfg_.num_attention_heads);
  mla_.kv_lora = uint32_t(cfg_.kv_lora_rank);
  mla_.nope = uint32_t(cfg_.qk_nope_head_dim);
  mla_.rope = uint32_t(cfg_.qk_rope_head_dim);
  mla_.v = uint32_t(cfg_.v_head_dim);
  router_.n_experts = uint32_t(cfg_.n_routed_experts);
  router_.top_k = uint32_t(cfg_.num_experts_per_tok);
  router_.n_group = uint32_t(cfg_.n_group);
  router_.topk_group = uint32_t(cfg_.topk_group);
  router_.norm_topk_prob = cfg_.norm_topk_prob;
  router_.routed_scaling_factor = float(cfg_.routed_scaling_factor);
  try {
    ops::validate(mla_);
    ops::validate(router_);
  } catch (const std::invalid_argument& e) {
    throw std::runtime_error((dir / "config.json").string() + ": not supported: " + e.what());
  }

  store_ = std::make_unique<WeightStore>(dir);
  w_ = load_weights(cfg_, *store_, dev_);
  mtp_layers_ = mtp_layers_present(cfg_, *store_);

  info_.architecture = cfg_.architecture;
  info_.vocab_size = uint32_t(cfg_.vocab_size);
  info_.hidden_size = uint32_t(cfg_.hidden_size);
  info_.num_layers = uint32_t(cfg_.num_hidden_layers);
  info_.max_seq_len = uint32_t(cfg_.max_position_embeddings);
  if (opts.max_length) {
    if (*opts.max_length > info_.max_seq_len)
      throw std::runtime_error("model.max_length " + std::to_string(*opts.max_length) +
                               " exceeds max_position_embeddings " +
                               std::to_string(info_.max_seq_len) + " of " + dir.string());
    info_.max_seq_len = *opts.max_length;
  }
  for (int64_t e : cfg_.eos_token_ids) info_.eos_token_ids.push_back(int32_t(e));
  if (cfg_.bos_token_id) info_.bos_token_id = int32_t(*cfg_.bos_token_id);
  info_.weight_bytes = store_->total_bytes();

  const auto inv = cfg_.rope_inv_freqs();
  inv_freq_ = dev_.alloc(inv.size() * sizeof(float), CL_MEM_READ_ONLY);
  dev_.write(inv_freq_, inv.data(), inv.size() * sizeof(float));
}

uint64_t DeepseekV3Model::kv_bytes_per_token() const {
  return uint64_t(cfg_.num_hidden_layers) * mla_.row() * sizeof(float);
}

void DeepseekV3Model::allocate_kv_cache(uint32_t num_pages, uint32_t page_size) {
  if (page_size == 0) throw std::invalid_argument("kv_cache.page_size must be positive");
  cache_.clear();
  const size_t layer_bytes = size_t(num_pages + 1) * page_size * mla_.row() * sizeof(float);
  if (layer_bytes > dev_.info().max_alloc)
    throw std::runtime_error("MLA cache: " + std::to_string(num_pages) + " pages of " +
                             std::to_string(page_size) + " tokens need " +
                             std::to_string(layer_bytes) + " bytes per layer, over the " +
                             std::to_string(dev_.info().max_alloc) +
                             "-byte allocation limit of " + dev_.label());
  for (int64_t l = 0; l < cfg_.num_hidden_layers; ++l) {
    cache_.push_back(dev_.alloc(layer_bytes));
    dev_.fill_zero(cache_.back(), layer_bytes);  // the null page must hold finite values
  }
  num_pages_ = num_pages;
  page_size_ = page_size;
}

void DeepseekV3Model::mlp(const MlpWeights& m, const cl::Mem& x, uint32_t x_off, uint32_t M,
                          uint32_t F, const cl::Mem& gu, const cl::Mem& y, uint32_t y_off,
                          bool accumulate) {
  const uint32_t H = info_.hidden_size;
  ops::linear_any(dev_, x, x_off, H, m.gate.w, &m.gate.scale_inv, gu, 0, 2 * F, M);
  ops::linear_any(dev_, x, x_off, H, m.up.w, &m.up.scale_inv, gu, F, 2 * F, M);
  // silu(gate) * up over the gate half, then the down projection.
  ops::silu_mul(dev_, gu, 0, 2 * F, gu, F, 2 * F, gu, 2 * F, M, F);
  ops::linear_any(dev_, gu, 0, 2 * F, m.down.w, &m.down.scale_inv, y, y_off, H, M, 1.0f,
                  accumulate);
}

void DeepseekV3Model::moe(const MoeWeights& m, const cl::Mem& xn, const cl::Mem& h, uint32_t T) {
  const uint32_t H = info_.hidden_size, E = router_.n_experts, k = router_.top_k;
  const uint32_t F = uint32_t(cfg_.moe_intermediate_size);
  const uint32_t Fs = uint32_t(cfg_.n_shared_experts) * F;
  Scratch logits(dev_, size_t(T) * E * 4), ids(dev_, size_t(T) * k * 4),
      weights(dev_, size_t(T) * k * 4);
  ops::linear(dev_, xn, 0, H, m.router, nullptr, logits.mem(), 0, E, T);
  ops::moe_route(dev_, logits.mem(), &m.correction_bias, T, router_, ids.mem(), weights.mem());

  // The grouping is planned on the host: it decides how many rows each expert's GEMM gets.
  std::vector<int32_t> host_ids(size_t(T) * k);
  dev_.read(ids.mem(), host_ids.data(), host_ids.size() * 4);
  const ops::ExpertBatches eb = ops::group_by_expert(host_ids, T, k, E);
  const uint32_t R = T * k;
  Scratch src(dev_, size_t(R) * 4), slot(dev_, size_t(R) * 4);
  dev_.write(src.mem(), eb.src_token.data(), size_t(R) * 4);
  dev_.write(slot.mem(), eb.slot_row.data(), size_t(R) * 4);

  Scratch xg(dev_, size_t(R) * H * 4), out(dev_, size_t(R) * H * 4);
  Scratch gu(dev_, size_t(std::max(R * F, T * Fs)) * 2 * 4);
  ops::gather_rows(dev_, xn, H, src.mem(), R, H, xg.mem(), H);
  for (uint32_t e = 0; e < E; ++e) {
    const uint32_t begin = eb.expert_offsets[e], n = eb.expert_offsets[e + 1] - begin;
    if (n == 0) continue;
    mlp(m.experts[e], xg.mem(), begin * H, n, F, gu.mem(), out.mem(), begin * H, false);
  }
  ops::moe_combine(dev_, out.mem(), H, slot.mem(), weights.mem(), T, k, H, h, H, true);
  if (m.shared) mlp(m.shared, xn, 0, T, Fs, gu.mem(), h, 0, true);
}

StepOutputs DeepseekV3Model::forward(const StepInputs& in) {
  if (cache_.empty()) throw std::logic_error("DeepseekV3Model::forward before allocate_kv_cache");
  DeviceStep st = upload_step(dev_, in, page_size_, num_pages_, info_.vocab_size);
  const uint32_t T = uint32_t(in.num_tokens());
  const uint32_t H = info_.hidden_size, V = info_.vocab_size;
  const uint32_t Lq = uint32_t(cfg_.q_lora_rank), Nh = mla_.n_heads;
  const uint32_t q_width = Nh * mla_.qk(), att_width = Nh * mla_.v;
  // The fused projection's output per token: [q_a (Lq) | c_kv (kv_lora) | k_pe (rope)].
  const uint32_t qkv_a_width = Lq + mla_.row();
  const float eps = float(cfg_.rms_norm_eps);
  const uint32_t R = uint32_t(st.logit_token_indices.size());

  StepOutputs out;
  out.device = &dev_;
  out.rows = R;
  out.vocab = V;
  out.logit_offsets = st.logit_offsets;
  if (size_t(R) * V > logits_capacity_) {
    logits_capacity_ = size_t(R) * V;
    logits_ = dev_.alloc(logits_capacity_ * sizeof(float));
  }
  out.logits = logits_;
  if (T == 0) return out;

  uint32_t max_query = 0;
  for (size_t b = 0; b < in.num_rows(); ++b) max_query = std::max(max_query, in.row_length(b));
  last_path_ = ops::choose_mla_path(mla_path_, max_query);
  ops::MlaPrefillPlan plan;
  if (last_path_ == ops::MlaPath::Prefill) plan = ops::upload_mla_prefill_plan(dev_, in, page_size_);

  const uint32_t ffn = uint32_t(std::max(cfg_.intermediate_size, cfg_.moe_intermediate_size));
  Scratch h(dev_, size_t(T) * H * 4), xn(dev_, size_t(T) * H * 4);
  Scratch qkv_a(dev_, size_t(T) * qkv_a_width * 4), q(dev_, size_t(T) * q_width * 4);
  Scratch qa_norm(dev_, size_t(T) * std::max(Lq, 1u) * 4), att(dev_, size_t(T) * att_width * 4);
  Scratch gu(dev_, size_t(T) * 2 * ffn * 4);

  ops::embedding(dev_, st.token_ids, T, w_.embed, h.mem(), 1.0f);
  for (size_t l = 0; l < w_.layers.size(); ++l) {
    const LayerWeights& L = w_.layers[l];
    const MlaWeights& a = L.attn;
    ops::rmsnorm(dev_, h.mem(), 0, H, nullptr, L.input_norm, xn.mem(), 0, H, T, H, eps);
    if (Lq > 0) {
      ops::linear_any(dev_, xn.mem(), 0, H, a.q_a.w, &a.q_a.scale_inv, qkv_a.mem(), 0,
                      qkv_a_width, T);
      ops::linear_any(dev_, xn.mem(), 0, H, a.kv_a.w, &a.kv_a.scale_inv, qkv_a.mem(), Lq,
                      qkv_a_width, T);
      ops::rmsnorm(dev_, qkv_a.mem(), 0, qkv_a_width, nullptr, a.q_a_norm, qa_norm.mem(), 0, Lq,
                   T, Lq, eps);
      ops::linear_any(dev_, qa_norm.mem(), 0, Lq, a.q_b.w, &a.q_b.scale_inv, q.mem(), 0, q_width,
                      T);
    } else {
      ops::linear_any(dev_, xn.mem(), 0, H, a.q.w, &a.q.scale_inv, q.mem(), 0, q_width, T);
      ops::linear_any(dev_, xn.mem(), 0, H, a.kv_a.w, &a.kv_a.scale_inv, qkv_a.mem(), 0,
                      qkv_a_width, T);
    }
    ops::mla_rope_store(dev_, q.mem(), 0, q_width, qkv_a.mem(), Lq, qkv_a_width, a.kv_a_norm, eps,
                        inv_freq_, cfg_.rope_attention_factor(), cfg_.rope_interleave, mla_,
                        st.tokens, cache_[l]);
    if (last_path_ == ops::MlaPath::Decode)
      ops::mla_attention_decode(dev_, q.mem(), 0, q_width, cache_[l], st.tokens, a.kv_b.w,
                                &a.kv_b.scale_inv, mla_, cfg_.softmax_scale(), att.mem(),
                                att_width);
    else
      ops::mla_attention_prefill(dev_, q.mem(), 0, q_width, cache_[l], st.tokens, plan, a.kv_b.w,
                                 &a.kv_b.scale_inv, mla_, cfg_.softmax_scale(), att.mem(),
                                 att_width);
    ops::linear_any(dev_, att.mem(), 0, att_width, a.o.w, &a.o.scale_inv, h.mem(), 0, H, T, 1.0f,
                    true);

    ops::rmsnorm(dev_, h.mem(), 0, H, nullptr, L.post_attention_norm, xn.mem(), 0, H, T, H, eps);
    if (L.is_moe)
      moe(L.moe, xn.mem(), h.mem(), T);
    else
      mlp(L.mlp, xn.mem(), 0, T, uint32_t(cfg_.intermediate_size), gu.mem(), h.mem(), 0, true);
  }
  if (R > 0) {
    Scratch xs(dev_, size_t(R) * H * 4);
    ops::rmsnorm(dev_, h.mem(), 0, H, &st.logit_rows, w_.final_norm, xs.mem(), 0, H, R, H, eps);
    ops::linear(dev_, xs.mem(), 0, H, w_.lm_head, nullptr, logits_, 0, V, R);
  }
  dev_.flush();  // start the queued work now; the caller reads the logits when it needs them
  return out;
}

}  // namespace clshard::deepseek_v3
