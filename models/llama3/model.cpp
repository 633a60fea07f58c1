#include "models/llama3/model.h"

#include <stdexcept>

#include "runtime/device.h"
#include "runtime/ops.h"
#include "runtime/step_device.h"

namespace clshard::llama3 {

Llama3Model::Llama3Model(const std::filesystem::path& dir, const LoadOptions& opts)
    : cfg_(Llama3Config::from_dir(dir)), dev_(*opts.devices.at(0)) {
  if (opts.devices.size() != 1)
    throw std::runtime_error("Llama 3 on " + std::to_string(opts.devices.size()) +
                             " devices needs a parallel layout (data/tensor) from parallel/");
  store_ = std::make_unique<WeightStore>(dir);
  cfg_.finalize(*store_);
  if (cfg_.head_dim % 8 != 0)
    throw std::runtime_error((dir / "config.json").string() + ": head_dim " +
                             std::to_string(cfg_.head_dim) +
                             " is not supported (the attention kernel needs a multiple of 8)");
  w_ = load_weights(cfg_, *store_, dev_);

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

  auto inv = cfg_.rope_inv_freqs();
  inv_freq_ = dev_.alloc(inv.size() * sizeof(float), CL_MEM_READ_ONLY);
  dev_.write(inv_freq_, inv.data(), inv.size() * sizeof(float));
  inv_freq_long_ = inv_freq_;
  if (cfg_.longrope_scaling) {
    auto lf = cfg_.rope_inv_freqs_long();
    inv_freq_long_ = dev_.alloc(lf.size() * sizeof(float), CL_MEM_READ_ONLY);
    dev_.write(inv_freq_long_, lf.data(), lf.size() * sizeof(float));
    long_from_ = uint32_t(cfg_.longrope_scaling->original_max_position);
  }
}

uint64_t Llama3Model::kv_bytes_per_token() const {
  return uint64_t(cfg_.num_hidden_layers) * 2 * cfg_.num_key_value_heads * cfg_.head_dim *
         sizeof(float);
}

void Llama3Model::allocate_kv_cache(uint32_t num_pages, uint32_t page_size) {
  if (page_size == 0 || page_size % 16 != 0)
    throw std::invalid_argument("kv_cache.page_size must be a positive multiple of 16, got " +
                                std::to_string(page_size));
  kv_.clear();
  const size_t layer_bytes = size_t(num_pages + 1) * 2 * page_size * cfg_.num_key_value_heads *
                             cfg_.head_dim * sizeof(float);
  if (layer_bytes > dev_.info().max_alloc)
    throw std::runtime_error("KV cache: " + std::to_string(num_pages) + " pages of " +
                             std::to_string(page_size) + " tokens need " +
                             std::to_string(layer_bytes) + " bytes per layer, over the " +
                             std::to_string(dev_.info().max_alloc) +
                             "-byte allocation limit of " + dev_.label());
  const size_t page_bytes = layer_bytes / (num_pages + 1);
  for (int64_t l = 0; l < cfg_.num_hidden_layers; ++l) {
    kv_.push_back(dev_.alloc(layer_bytes));
    // Only the null page is ever read before it is written; keep it finite. The other pages are
    // left untouched, so a large pool costs no time and, on host memory, no resident memory
    // until used.
    dev_.fill_zero(kv_.back(), page_bytes, size_t(num_pages) * page_bytes);
  }
  num_pages_ = num_pages;
  page_size_ = page_size;
}

StepOutputs Llama3Model::forward(const StepInputs& in) {
  if (kv_.empty()) throw std::logic_error("Llama3Model::forward before allocate_kv_cache");
  DeviceStep st = upload_step(dev_, in, page_size_, num_pages_, info_.vocab_size);
  const uint32_t T = uint32_t(in.num_tokens());
  const uint32_t H = uint32_t(cfg_.hidden_size), hd = uint32_t(cfg_.head_dim);
  const uint32_t nh = uint32_t(cfg_.num_attention_heads), nkv = uint32_t(cfg_.num_key_value_heads);
  const uint32_t F = uint32_t(cfg_.intermediate_size), V = info_.vocab_size;
  const uint32_t qkv_w = (nh + 2 * nkv) * hd;
  const float eps = float(cfg_.rms_norm_eps), m = float(cfg_.residual_multiplier);
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

  Scratch h(dev_, size_t(T) * H * 4), xn(dev_, size_t(T) * H * 4);
  Scratch qkv(dev_, size_t(T) * qkv_w * 4), att(dev_, size_t(T) * nh * hd * 4);
  Scratch gu(dev_, size_t(T) * 2 * F * 4);

  ops::embedding(dev_, st.token_ids, T, w_.embed, h.mem(), float(cfg_.embedding_multiplier));
  for (size_t l = 0; l < w_.layers.size(); ++l) {
    const LayerWeights& L = w_.layers[l];
    ops::rmsnorm(dev_, h.mem(), 0, H, nullptr, L.input_norm, xn.mem(), 0, H, T, H, eps);
    if (L.qkv) {
      ops::linear(dev_, xn.mem(), 0, H, L.qkv, nullptr, qkv.mem(), 0, qkv_w, T);
    } else {
      const bool bias = bool(L.q_bias);
      ops::linear(dev_, xn.mem(), 0, H, L.q, bias ? &L.q_bias : nullptr, qkv.mem(), 0, qkv_w, T);
      ops::linear(dev_, xn.mem(), 0, H, L.k, bias ? &L.k_bias : nullptr, qkv.mem(), nh * hd,
                  qkv_w, T);
      ops::linear(dev_, xn.mem(), 0, H, L.v, bias ? &L.v_bias : nullptr, qkv.mem(),
                  (nh + nkv) * hd, qkv_w, T);
    }
    ops::rope_store_kv(dev_, qkv.mem(), qkv_w, nh, nkv, hd, inv_freq_, inv_freq_long_, long_from_,
                       st.tokens, kv_[l]);
    ops::paged_attention(dev_, qkv.mem(), qkv_w, kv_[l], st.tokens, nh, nkv, hd,
                         cfg_.attention_scale(), att.mem(), nh * hd);
    ops::linear(dev_, att.mem(), 0, nh * hd, L.o, nullptr, h.mem(), 0, H, T, m, true);

    ops::rmsnorm(dev_, h.mem(), 0, H, nullptr, L.post_attention_norm, xn.mem(), 0, H, T, H, eps);
    if (L.gate_up) {
      ops::linear(dev_, xn.mem(), 0, H, L.gate_up, nullptr, gu.mem(), 0, 2 * F, T);
    } else {
      ops::linear(dev_, xn.mem(), 0, H, L.gate, nullptr, gu.mem(), 0, 2 * F, T);
      ops::linear(dev_, xn.mem(), 0, H, L.up, nullptr, gu.mem(), F, 2 * F, T);
    }
    // silu(gate) * up written over the gate half, then down-projected into the residual.
    ops::silu_mul(dev_, gu.mem(), 0, 2 * F, gu.mem(), F, 2 * F, gu.mem(), 2 * F, T, F);
    ops::linear(dev_, gu.mem(), 0, 2 * F, L.down, nullptr, h.mem(), 0, H, T, m, true);
  }
  if (R > 0) {
    Scratch xs(dev_, size_t(R) * H * 4);
    ops::rmsnorm(dev_, h.mem(), 0, H, &st.logit_rows, w_.final_norm, xs.mem(), 0, H, R, H, eps);
    ops::linear(dev_, xs.mem(), 0, H, w_.lm_head, nullptr, logits_, 0, V, R,
                float(1.0 / cfg_.logits_scaling));
  }
  dev_.flush();
  return out;
}

}  // namespace clshard::llama3
