#include "models/llama3/model.h"

#include <algorithm>
#include <optional>
#include <stdexcept>

#include "parallel/collectives.h"
#include "parallel/mpi_transport.h"
#include "parallel/topology.h"
#include "runtime/device.h"
#include "runtime/ops.h"
#include "runtime/ops_lora.h"
#include "runtime/step_device.h"

namespace clshard::llama3 {

Llama3Model::Llama3Model(const std::filesystem::path& dir, const LoadOptions& opts,
                         const parallel::Topology& topology, size_t replica)
    : cfg_(Llama3Config::from_dir(dir)) {
  if (topology.devices() != opts.ranks())
    throw std::invalid_argument("Llama3Model: the topology has " +
                                std::to_string(topology.devices()) + " devices, the options " +
                                std::to_string(opts.ranks()));
  // This process's devices of the replica's group and their tensor ranks (over MPI the others
  // are other processes'; in process, all of them).
  std::vector<Device*> devices;
  const auto& group = topology.devices_of_replica(replica);
  for (size_t t = 0; t < group.size(); ++t) {
    if (topology.process_of_device(group[t]) != opts.process()) continue;
    devices.push_back(opts.devices[topology.local_index(group[t])]);
    tensor_ranks_.push_back(t);
  }
  if (devices.empty())
    throw std::invalid_argument("Llama3Model: replica " + std::to_string(replica) +
                                " has no device in this process");
  if (opts.kv_cache_dtype != DType::F32 && opts.kv_cache_dtype != DType::BF16 &&
      opts.kv_cache_dtype != DType::F8_E4M3)
    throw std::invalid_argument(std::string("Llama3Model: kv_cache.dtype ") +
                                dtype_name(opts.kv_cache_dtype) + " is not supported (f32, bf16 or fp8)");
  kv_dtype_ = opts.kv_cache_dtype;
  store_ = std::make_unique<WeightStore>(dir, opts.weight_memory, opts.load_progress);
  cfg_.finalize(*store_);
  if (cfg_.head_dim % 8 != 0)
    throw std::runtime_error((dir / "config.json").string() + ": head_dim " +
                             std::to_string(cfg_.head_dim) +
                             " is not supported (the attention kernel needs a multiple of 8)");
  const size_t ranks = devices.size();
  const bool mpi = topology.processes_of_replica(replica).size() > 1;
  if (group.size() > 1) {
    for (Device* d : devices)
      if (d->context() != devices[0]->context())
        throw std::runtime_error(
            "tensor parallelism needs devices of one OpenCL platform (one context): the ranks "
            "write their logits columns into one buffer");
    if (cfg_.embedding_multiplier != 1.0 || cfg_.residual_multiplier != 1.0)
      throw std::runtime_error(
          "tensor parallelism with embedding/residual multipliers (Granite) is not supported, as "
          "in MAX");
  }
  for (size_t t = 0; t < group.size(); ++t)
    vocab_cols_.push_back(uint32_t(shard_range(cfg_, topology, t).vocab.count));
  auto inv = cfg_.rope_inv_freqs();
  std::vector<float> inv_long = cfg_.longrope_scaling ? cfg_.rope_inv_freqs_long() : inv;
  if (cfg_.longrope_scaling) long_from_ = uint32_t(cfg_.longrope_scaling->original_max_position);
  for (size_t r = 0; r < ranks; ++r) {
    Shard s;
    s.dev = devices[r];
    s.range = shard_range(cfg_, topology, tensor_ranks_[r]);
    s.w = load_weights(cfg_, *store_, *s.dev, s.range);
    s.inv_freq = s.dev->alloc(inv.size() * sizeof(float), CL_MEM_READ_ONLY);
    s.dev->write(s.inv_freq, inv.data(), inv.size() * sizeof(float));
    s.inv_freq_long = s.dev->alloc(inv_long.size() * sizeof(float), CL_MEM_READ_ONLY);
    s.dev->write(s.inv_freq_long, inv_long.data(), inv_long.size() * sizeof(float));
    shards_.push_back(std::move(s));
  }
  if (mpi) {
    // The group's processes exchange over MPI (one group per replica: color = replica); each
    // process's transport ranks are its devices of the group.
#ifdef CLSHARD_HAVE_MPI
    comm_ = std::make_unique<parallel::Communicator>(
        std::make_unique<parallel::MpiTransport>(devices, int(replica)));
#else
    throw std::invalid_argument("Llama3Model: this build has no MPI transport");
#endif
  } else if (ranks > 1) {
    comm_ = std::make_unique<parallel::Communicator>(devices);
  }
  if (!opts.lora_adapters.empty() && comm_)
    throw std::runtime_error("LoRA adapters with tensor parallelism are not supported yet "
                             "(parallel.tensor must be 1)");
  lora_ = load_llama_lora(cfg_, opts, *devices[0]);

  info_.architecture = cfg_.architecture;
  info_.vocab_size = uint32_t(cfg_.vocab_size);
  info_.hidden_size = uint32_t(cfg_.hidden_size);
  info_.num_layers = uint32_t(cfg_.num_hidden_layers);
  info_.max_seq_len = uint32_t(cfg_.max_position_embeddings);
  info_.cap_max_seq_len(opts.max_length, dir);
  compute_ = opts.compute_dtype;
  info_.set_special_tokens(cfg_.eos_token_ids, cfg_.bos_token_id);
  info_.weight_bytes = store_->total_bytes();
}

Llama3Model::~Llama3Model() = default;

std::vector<Device*> Llama3Model::devices() const {
  std::vector<Device*> d;
  for (const auto& s : shards_) d.push_back(s.dev);
  return d;
}

uint64_t Llama3Model::kv_bytes_per_token() const {
  return uint64_t(cfg_.num_hidden_layers) * 2 * cfg_.num_key_value_heads * cfg_.head_dim *
         dtype_size(kv_dtype_);
}

void Llama3Model::allocate_kv_cache(uint32_t num_pages, uint32_t page_size) {
  if (page_size == 0 || page_size % 16 != 0)
    throw std::invalid_argument("kv_cache.page_size must be a positive multiple of 16, got " +
                                std::to_string(page_size));
  for (auto& s : shards_) {
    s.kv.clear();
    const size_t page_bytes =
        size_t(2) * page_size * size_t(s.range.kv_heads.count) * cfg_.head_dim *
        dtype_size(kv_dtype_);
    const size_t layer_bytes = size_t(num_pages + 1) * page_bytes;
    if (layer_bytes > s.dev->info().max_alloc)
      throw std::runtime_error("KV cache: " + std::to_string(num_pages) + " pages of " +
                               std::to_string(page_size) + " tokens need " +
                               std::to_string(layer_bytes) + " bytes per layer, over the " +
                               std::to_string(s.dev->info().max_alloc) +
                               "-byte allocation limit of " + s.dev->label());
    for (int64_t l = 0; l < cfg_.num_hidden_layers; ++l) {
      s.kv.push_back(s.dev->alloc(layer_bytes));
      // Only the null page is ever read before it is written; keep it finite. The other pages
      // are left untouched, so a large pool costs no time and, on host memory, no resident
      // memory until used.
      s.dev->fill_zero(s.kv.back(), page_bytes, size_t(num_pages) * page_bytes);
    }
  }
  num_pages_ = num_pages;
  page_size_ = page_size;
}

StepOutputs Llama3Model::forward(const StepInputs& in) {
  if (shards_[0].kv.empty()) throw std::logic_error("Llama3Model::forward before allocate_kv_cache");
  const size_t P = shards_.size();
  const uint32_t T = uint32_t(in.num_tokens());
  const uint32_t H = uint32_t(cfg_.hidden_size), hd = uint32_t(cfg_.head_dim);
  const uint32_t V = uint32_t(cfg_.vocab_size);
  const float eps = float(cfg_.rms_norm_eps), m = float(cfg_.residual_multiplier);
  Device& dev0 = *shards_[0].dev;

  // Per rank: the step's inputs and scratch. Sizes are this rank's heads and columns.
  struct Work {
    DeviceStep st;
    Scratch h, xn, qkv, att, gu, part;
    uint32_t nh, nkv, f, qkv_w;
  };
  std::vector<Work> work;
  for (auto& s : shards_) {
    Work w;
    w.st = upload_step(*s.dev, in, page_size_, num_pages_, V);
    w.nh = uint32_t(s.range.heads.count);
    w.nkv = uint32_t(s.range.kv_heads.count);
    w.f = uint32_t(s.range.ffn.count);
    w.qkv_w = (w.nh + 2 * w.nkv) * hd;
    const size_t t = std::max<uint32_t>(T, 1);
    w.h = Scratch(*s.dev, t * H * 4);
    w.xn = Scratch(*s.dev, t * H * 4);
    w.qkv = Scratch(*s.dev, t * w.qkv_w * 4);
    w.att = Scratch(*s.dev, t * w.nh * hd * 4);
    // LoRA runs gate and up unfused, side by side (2 * f); the fused path writes f.
    w.gu = Scratch(*s.dev, t * (lora_.count() > 0 ? 2 : 1) * w.f * 4);
    if (comm_) w.part = Scratch(*s.dev, t * H * 4);
    work.push_back(std::move(w));
  }
  const uint32_t R = uint32_t(work[0].st.logit_token_indices.size());
  StepOutputs out;
  out.device = &dev0;
  out.rows = R;
  out.vocab = V;
  out.logit_offsets = work[0].st.logit_offsets;
  if (size_t(R) * V > logits_capacity_) {
    logits_capacity_ = size_t(R) * V;
    logits_ = dev0.alloc(logits_capacity_ * sizeof(float));
  }
  out.logits = logits_;
  if (T == 0) return out;

  // LoRA: the rows' adapters made resident, each token's slot on the device (inactive when no
  // row runs an adapter).
  const LoraAdapters::Batch lora_batch = lora_.bind(in);
  const bool lora_slot = lora_batch.active();
  // y += alpha * B (A x) of layer l's target t, for the tokens whose row runs an adapter.
  auto lora = [&](size_t l, LoraTarget t, const cl::Mem& x, uint32_t ldx, const cl::Mem& y,
                  uint32_t y_off, uint32_t ldy, float alpha) {
    lora_batch.apply(lora_module(l, t), x, 0, ldx, y, y_off, ldy, alpha);
  };

  // The ranks' partial sums (of the embedding shards, of o_proj and down_proj over their
  // columns) become the whole on every rank, then join the residual stream.
  // Over MPI the other processes' ranks take part with their lengths only.
  auto allreduce = [&](auto member, const char* what) {
    std::vector<parallel::DeviceSpan> spans(comm_->size(), {cl::Mem(), 0, size_t(T) * H});
    for (size_t r = 0; r < P; ++r)
      spans[tensor_ranks_[r]] = {(work[r].*member).mem(), 0, size_t(T) * H};
    comm_->allreduce(spans, what);
  };

  for (size_t r = 0; r < P; ++r)
    ops::embedding(*shards_[r].dev, work[r].st.token_ids, T, shards_[r].w.embed, work[r].h.mem(),
                   float(cfg_.embedding_multiplier), uint32_t(shards_[r].range.vocab.begin));
  if (comm_) allreduce(&Work::h, "embedding");

  for (int64_t l = 0; l < cfg_.num_hidden_layers; ++l) {
    for (size_t r = 0; r < P; ++r) {
      Device& d = *shards_[r].dev;
      const LayerWeights& L = shards_[r].w.layers[l];
      Work& w = work[r];
      if (L.q_bias) {  // the norm, then one GEMV (with its bias, and LoRA) per projection
        const Weight* qb = L.q_bias ? &L.q_bias : nullptr;
        const Weight* kb = L.q_bias ? &L.k_bias : nullptr;
        const Weight* vb = L.q_bias ? &L.v_bias : nullptr;
        ops::rmsnorm(d, w.h.mem(), 0, H, nullptr, L.input_norm, w.xn.mem(), 0, H, T, H, eps);
        ops::linear(d, w.xn.mem(), 0, H, L.q, qb, w.qkv.mem(), 0, w.qkv_w, T, 1.0f, false, compute_);
        lora(l, kLoraQ, w.xn.mem(), H, w.qkv.mem(), 0, w.qkv_w, 1.0f);
        ops::linear(d, w.xn.mem(), 0, H, L.k, kb, w.qkv.mem(), w.nh * hd, w.qkv_w, T, 1.0f, false,
                    compute_);
        lora(l, kLoraK, w.xn.mem(), H, w.qkv.mem(), w.nh * hd, w.qkv_w, 1.0f);
        ops::linear(d, w.xn.mem(), 0, H, L.v, vb, w.qkv.mem(), (w.nh + w.nkv) * hd, w.qkv_w, T,
                    1.0f, false, compute_);
        lora(l, kLoraV, w.xn.mem(), H, w.qkv.mem(), (w.nh + w.nkv) * hd, w.qkv_w, 1.0f);
      } else {  // norm, q, k and v in one launch
        ops::linear_fused(d, w.h.mem(), 0, H, nullptr, &L.input_norm, eps, {&L.q, &L.k, &L.v},
                          w.qkv.mem(), 0, w.qkv_w, T, 1.0f, false, compute_);
        if (lora_slot) {  // LoRA adds to q, k and v from the normed input, which it needs apart
          ops::rmsnorm(d, w.h.mem(), 0, H, nullptr, L.input_norm, w.xn.mem(), 0, H, T, H, eps);
          lora(l, kLoraQ, w.xn.mem(), H, w.qkv.mem(), 0, w.qkv_w, 1.0f);
          lora(l, kLoraK, w.xn.mem(), H, w.qkv.mem(), w.nh * hd, w.qkv_w, 1.0f);
          lora(l, kLoraV, w.xn.mem(), H, w.qkv.mem(), (w.nh + w.nkv) * hd, w.qkv_w, 1.0f);
        }
      }
      ops::rope_store_kv(d, w.qkv.mem(), w.qkv_w, w.nh, w.nkv, hd, shards_[r].inv_freq,
                         shards_[r].inv_freq_long, long_from_, w.st.tokens, shards_[r].kv[l],
                         kv_dtype_);
      ops::paged_attention(d, w.qkv.mem(), w.qkv_w, shards_[r].kv[l], w.st.tokens, w.nh, w.nkv, hd,
                           cfg_.attention_scale(), w.att.mem(), w.nh * hd, kv_dtype_, compute_);
      if (!comm_)
        ops::linear(d, w.att.mem(), 0, w.nh * hd, L.o, nullptr, w.h.mem(), 0, H, T, m, true,
                    compute_);
      lora(l, kLoraO, w.att.mem(), w.nh * hd, w.h.mem(), 0, H, m);
      if (comm_)
        ops::linear(d, w.att.mem(), 0, w.nh * hd, L.o, nullptr, w.part.mem(), 0, H, T, 1.0f, false,
                    compute_);
    }
    if (comm_) {
      allreduce(&Work::part, "attention output");
      for (size_t r = 0; r < P; ++r)
        ops::axpy(*shards_[r].dev, work[r].h.mem(), work[r].part.mem(), m, T * H);
    }
    for (size_t r = 0; r < P; ++r) {
      Device& d = *shards_[r].dev;
      const LayerWeights& L = shards_[r].w.layers[l];
      Work& w = work[r];
      // LoRA adds to gate and up before silu: the unfused path, gate and up side by side (when
      // an adapter targets them; down_proj's adapters read either layout).
      const bool gu_lora = lora_slot && (lora_.targets(lora_module(l, kLoraGate)) ||
                                         lora_.targets(lora_module(l, kLoraUp)));
      const uint32_t ldg = gu_lora ? 2 * w.f : w.f;
      if (gu_lora) {
        ops::rmsnorm(d, w.h.mem(), 0, H, nullptr, L.post_attention_norm, w.xn.mem(), 0, H, T, H,
                     eps);
        ops::linear(d, w.xn.mem(), 0, H, L.gate, nullptr, w.gu.mem(), 0, 2 * w.f, T, 1.0f, false,
                    compute_);
        lora(l, kLoraGate, w.xn.mem(), H, w.gu.mem(), 0, 2 * w.f, 1.0f);
        ops::linear(d, w.xn.mem(), 0, H, L.up, nullptr, w.gu.mem(), w.f, 2 * w.f, T, 1.0f, false,
                    compute_);
        lora(l, kLoraUp, w.xn.mem(), H, w.gu.mem(), w.f, 2 * w.f, 1.0f);
        ops::silu_mul(d, w.gu.mem(), 0, 2 * w.f, w.gu.mem(), w.f, 2 * w.f, w.gu.mem(), 2 * w.f,
                      T, w.f);
      } else {
        // norm, gate, up and silu(gate) * up in one launch, then down-projected into the residual.
        ops::linear_swiglu(d, w.h.mem(), 0, H, &L.post_attention_norm, eps, L.gate, L.up,
                           w.gu.mem(), 0, w.f, T, compute_);
      }
      if (!comm_)
        ops::linear(d, w.gu.mem(), 0, ldg, L.down, nullptr, w.h.mem(), 0, H, T, m, true, compute_);
      lora(l, kLoraDown, w.gu.mem(), ldg, w.h.mem(), 0, H, m);
      if (comm_)
        ops::linear(d, w.gu.mem(), 0, ldg, L.down, nullptr, w.part.mem(), 0, H, T, 1.0f, false,
                    compute_);
    }
    if (comm_) {
      allreduce(&Work::part, "MLP output");
      for (size_t r = 0; r < P; ++r)
        ops::axpy(*shards_[r].dev, work[r].h.mem(), work[r].part.mem(), m, T * H);
    }
    // Each layer's launches go to the device while the host enqueues the next layer's, as
    // DeepSeek's decoder flushes per MoE layer: a GPU driver may otherwise hold a step's hundred
    // launches until the logits are read (not yet measured on a GPU; on PoCL no change).
    for (size_t r = 0; r < P; ++r) shards_[r].dev->flush();
  }
  if (R > 0 && comm_ && comm_->size() > P) {
    // Over MPI each rank computes its vocabulary columns as a block of their own, and every rank
    // gathers the blocks into the [R, V] logits (this process's first rank into logits_).
    std::vector<Scratch> cols(P), full(P);
    std::vector<parallel::DeviceSpan> send, recv;
    for (size_t t = 0; t < comm_->size(); ++t) {
      send.push_back({cl::Mem(), 0, size_t(R) * vocab_cols_[t]});
      recv.push_back({cl::Mem(), 0, size_t(R) * V});
    }
    for (size_t r = 0; r < P; ++r) {
      Device& d = *shards_[r].dev;
      const uint32_t cols_r = vocab_cols_[tensor_ranks_[r]];
      cols[r] = Scratch(d, std::max<size_t>(size_t(R) * cols_r, 1) * 4);
      ops::linear_fused(d, work[r].h.mem(), 0, H, &work[r].st.logit_rows,
                        &shards_[r].w.final_norm, eps, {&shards_[r].w.lm_head}, cols[r].mem(), 0,
                        cols_r, R, float(1.0 / cfg_.logits_scaling), false, compute_);
      send[tensor_ranks_[r]].buf = cols[r].mem();
      if (r > 0) full[r] = Scratch(d, size_t(R) * V * 4);
      recv[tensor_ranks_[r]].buf = r == 0 ? logits_ : full[r].mem();
    }
    comm_->allgather_columns(send, recv, R, "logits");
  } else if (R > 0) {
    // Each rank computes its vocabulary columns of the logits straight into the first device's
    // buffer (one context, so one buffer serves all).
    for (size_t r = 0; r < P; ++r) {
      Device& d = *shards_[r].dev;
      ops::linear_fused(d, work[r].h.mem(), 0, H, &work[r].st.logit_rows,
                        &shards_[r].w.final_norm, eps, {&shards_[r].w.lm_head}, logits_,
                        uint32_t(shards_[r].range.vocab.begin), V, R,
                        float(1.0 / cfg_.logits_scaling), false, compute_);
    }
  }
  // The other ranks' logits columns must be in place before the first device reads them.
  for (size_t r = 1; r < P; ++r) shards_[r].dev->finish();
  dev0.flush();
  return out;
}

}  // namespace clshard::llama3
