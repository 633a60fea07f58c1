#include "models/deepseek_v3/model.h"

#include <algorithm>
#include <iostream>
#include <stdexcept>

#include "parallel/collectives.h"
#include "parallel/expert_exchange.h"
#include "runtime/device.h"
#include "runtime/ops.h"
#include "runtime/step_device.h"

namespace clshard::deepseek_v3 {

// One replica's share of a step: its rows as a step of their own, uploaded to its device, and the
// activations of its T tokens (buffers of at least one row, so an idle replica still has spans to
// hand to the collectives).
struct DeepseekV3Model::Work {
  Device* dev = nullptr;
  StepInputs in;
  DeviceStep st;
  ops::MlaPrefillPlan plan;
  uint32_t T = 0;
  Scratch h, xn, qkv_a, q, qa_norm, att, gu;
};

DeepseekV3Model::DeepseekV3Model(const std::filesystem::path& dir, const LoadOptions& opts,
                                 std::optional<parallel::ExpertPlacement> placement)
    : DeepseekV3Model(dir, opts,
                      parallel::Topology(kLayout, opts.degrees(), opts.devices.size(), kName),
                      std::move(placement)) {}

DeepseekV3Model::DeepseekV3Model(const std::filesystem::path& dir, const LoadOptions& opts,
                                 const parallel::Topology& topology,
                                 std::optional<parallel::ExpertPlacement> placement)
    : cfg_(DeepseekV3Config::from_dir(dir)) {
  const size_t N = opts.devices.size();
  // The topology checked the layout: every device a replica and an expert-parallel rank.
  if (topology.layout() != kLayout || topology.devices() != N)
    throw std::invalid_argument("DeepseekV3Model: the topology is not DP = EP over the " +
                                std::to_string(N) + " devices of the options");
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

  // Placement comes from the topology: even blocks, or blocks sized by measured device speed.
  if (placement) {
    if (placement->ranks() != N || placement->n_experts() != router_.n_experts)
      throw std::invalid_argument(
          "DeepseekV3Model: the given expert placement covers " +
          std::to_string(placement->n_experts()) + " experts over " +
          std::to_string(placement->ranks()) + " ranks; the model has " +
          std::to_string(router_.n_experts) + " experts on " + std::to_string(N) + " devices");
    placement_ = std::move(*placement);
  } else {
    if (topology.balanced_experts())
      throughput_ = parallel::measure_device_throughput(opts.devices);
    placement_ = topology.expert_blocks(router_.n_experts, throughput_);
  }
  if (N > 1)
    std::cerr << "deepseek_v3: " << N << " data-parallel replicas, experts over " << N
              << " expert-parallel ranks:\n"
              << placement_.describe() << std::flush;

  store_ = std::make_unique<WeightStore>(dir);
  const auto inv = cfg_.rope_inv_freqs();
  for (size_t r = 0; r < N; ++r) {
    Replica rep;
    rep.dev = opts.devices[r];
    rep.w = load_weights(cfg_, *store_, *rep.dev, placement_.first_expert[r],
                         placement_.first_expert[r + 1]);
    rep.inv_freq = rep.dev->alloc(inv.size() * sizeof(float), CL_MEM_READ_ONLY);
    rep.dev->write(rep.inv_freq, inv.data(), inv.size() * sizeof(float));
    replicas_.push_back(std::move(rep));
  }
  if (N > 1) comm_ = std::make_unique<parallel::Communicator>(opts.devices);
  mtp_layers_ = mtp_layers_present(cfg_, *store_);
  fp8_act_quant_ = opts.quantize_fp8_activations;

  info_.architecture = cfg_.architecture;
  info_.vocab_size = uint32_t(cfg_.vocab_size);
  info_.hidden_size = uint32_t(cfg_.hidden_size);
  info_.num_layers = uint32_t(cfg_.num_hidden_layers);
  info_.max_seq_len = uint32_t(cfg_.max_position_embeddings);
  info_.cap_max_seq_len(opts.max_length, dir);
  info_.set_special_tokens(cfg_.eos_token_ids, cfg_.bos_token_id);
  info_.weight_bytes = store_->total_bytes();
}

DeepseekV3Model::~DeepseekV3Model() = default;

std::vector<Device*> DeepseekV3Model::devices() const {
  std::vector<Device*> d;
  for (const auto& r : replicas_) d.push_back(r.dev);
  return d;
}

uint64_t DeepseekV3Model::kv_bytes_per_token() const {
  return uint64_t(cfg_.num_hidden_layers) * mla_.row() * sizeof(float);
}

void DeepseekV3Model::allocate_kv_cache(uint32_t num_pages, uint32_t page_size) {
  if (page_size == 0) throw std::invalid_argument("kv_cache.page_size must be positive");
  const size_t layer_bytes = size_t(num_pages + 1) * page_size * mla_.row() * sizeof(float);
  for (auto& rep : replicas_) {
    Device& dev = *rep.dev;
    rep.cache.clear();
    if (layer_bytes > dev.info().max_alloc)
      throw std::runtime_error("MLA cache: " + std::to_string(num_pages) + " pages of " +
                               std::to_string(page_size) + " tokens need " +
                               std::to_string(layer_bytes) + " bytes per layer, over the " +
                               std::to_string(dev.info().max_alloc) +
                               "-byte allocation limit of " + dev.label());
    const size_t page_bytes = layer_bytes / (num_pages + 1);
    for (int64_t l = 0; l < cfg_.num_hidden_layers; ++l) {
      rep.cache.push_back(dev.alloc(layer_bytes));
      // Only the null page is read before it is written (prefill over-reads pad with it): keep
      // it finite, and leave the rest untouched so a large pool costs no time or resident memory.
      dev.fill_zero(rep.cache.back(), page_bytes, size_t(num_pages) * page_bytes);
    }
  }
  num_pages_ = num_pages;
  page_size_ = page_size;
}

void DeepseekV3Model::mlp(Device& dev, const MlpWeights& m, const cl::Mem& x, uint32_t x_off,
                          uint32_t M, uint32_t F, const cl::Mem& gu, const cl::Mem& y,
                          uint32_t y_off, bool accumulate) {
  const uint32_t H = info_.hidden_size;
  ops::linear_any(dev, x, x_off, H, m.gate.w, &m.gate.scale_inv, gu, 0, 2 * F, M, 1.0f, false, fp8_act_quant_);
  ops::linear_any(dev, x, x_off, H, m.up.w, &m.up.scale_inv, gu, F, 2 * F, M, 1.0f, false, fp8_act_quant_);
  // silu(gate) * up over the gate half, then the down projection.
  ops::silu_mul(dev, gu, 0, 2 * F, gu, F, 2 * F, gu, 2 * F, M, F);
  ops::linear_any(dev, gu, 0, 2 * F, m.down.w, &m.down.scale_inv, y, y_off, H, M, 1.0f, accumulate, fp8_act_quant_);
}

void DeepseekV3Model::moe(size_t layer, std::vector<Work>& work) {
  const size_t N = replicas_.size();
  const uint32_t H = info_.hidden_size, E = router_.n_experts, k = router_.top_k;
  const uint32_t F = uint32_t(cfg_.moe_intermediate_size);
  const uint32_t Fs = uint32_t(cfg_.n_shared_experts) * F;
  auto moe_of = [&](size_t r) -> const MoeWeights& { return replicas_[r].w.layers[layer].moe; };
  auto rows = [](size_t n) { return std::max<size_t>(n, 1); };  // buffers of at least one row

  // Routing, on each token's device. Every device's router is enqueued before any id is read.
  std::vector<Scratch> ids(N), weights(N);
  for (size_t r = 0; r < N; ++r) {
    Device& dev = *work[r].dev;
    const uint32_t T = work[r].T;
    ids[r] = Scratch(dev, rows(size_t(T) * k) * 4);
    weights[r] = Scratch(dev, rows(size_t(T) * k) * 4);
    if (T == 0) continue;
    Scratch logits(dev, size_t(T) * E * 4);
    ops::linear(dev, work[r].xn.mem(), 0, H, moe_of(r).router, nullptr, logits.mem(), 0, E, T);
    ops::moe_route(dev, logits.mem(), &moe_of(r).correction_bias, T, router_, ids[r].mem(),
                   weights[r].mem());
    dev.flush();
  }

  // The plan, on the host (parallel/expert_exchange.h): where each source's (token, slot) rows go,
  // where they arrive, and how each rank regroups them by expert.
  std::vector<ops::ExpertBatches> eb(N);
  std::vector<std::vector<uint32_t>> expert_offsets(N);
  for (size_t r = 0; r < N; ++r) {
    const uint32_t T = work[r].T;
    std::vector<int32_t> host_ids(size_t(T) * k);
    if (T > 0) work[r].dev->read(ids[r].mem(), host_ids.data(), host_ids.size() * 4);
    eb[r] = ops::group_by_expert(host_ids, T, k, E);
    expert_offsets[r] = eb[r].expert_offsets;
  }
  const auto plan = parallel::plan_expert_exchange(expert_offsets, placement_);
  const auto& send_off = plan.send_off;
  const auto& recv_off = plan.recv_off;
  const auto& expert_rows = plan.expert_rows;
  const auto& perm = plan.perm;
  const auto& inv = plan.inv;
  const auto& regroup = plan.regroup;

  // The plan's index tables go up now, while every device is idle after the ids were read:
  // Device::write blocks until its queue drains, so a write between enqueued kernels would hold
  // the host (and every other device) until that device caught up.
  std::vector<Scratch> src_token(N), slot_row(N), fwd(N), back(N);
  for (size_t r = 0; r < N; ++r) {
    Device& dev = *work[r].dev;
    const size_t S = size_t(work[r].T) * k, M = perm[r].size();
    src_token[r] = Scratch(dev, rows(S) * 4);
    slot_row[r] = Scratch(dev, rows(S) * 4);
    dev.write(src_token[r].mem(), eb[r].src_token.data(), S * 4);
    dev.write(slot_row[r].mem(), eb[r].slot_row.data(), S * 4);
    if (!regroup[r]) continue;
    fwd[r] = Scratch(dev, M * 4);
    back[r] = Scratch(dev, M * 4);
    dev.write(fwd[r].mem(), perm[r].data(), M * 4);
    dev.write(back[r].mem(), inv[r].data(), M * 4);
  }

  // Dispatch: each source gathers its rows in send order, then they travel to the experts' ranks
  // (on one device the gathered rows are already the experts' input).
  std::vector<Scratch> xsend(N), xrecv(N), ret(N);
  for (size_t r = 0; r < N; ++r) {
    Device& dev = *work[r].dev;
    const uint32_t S = work[r].T * k;
    xsend[r] = Scratch(dev, rows(S) * H * 4);
    if (S > 0)
      ops::gather_rows(dev, work[r].xn.mem(), H, src_token[r].mem(), S, H, xsend[r].mem(), H);
  }
  auto exchange = [&](std::vector<Scratch>& from, const std::vector<std::vector<uint32_t>>& from_off,
                      std::vector<Scratch>& to, const std::vector<std::vector<uint32_t>>& to_off,
                      const char* what) {
    // from[i] holds, at from_off[i][j], the rows for rank j; to[j] gets them in source order.
    std::vector<std::vector<parallel::DeviceSpan>> send(N);
    std::vector<parallel::DeviceSpan> recv;
    for (size_t i = 0; i < N; ++i)
      for (size_t j = 0; j < N; ++j)
        send[i].push_back({from[i].mem(), size_t(from_off[i][j]) * H,
                           size_t(from_off[i][j + 1] - from_off[i][j]) * H});
    for (size_t j = 0; j < N; ++j) recv.push_back({to[j].mem(), 0, size_t(to_off[j][N]) * H});
    comm_->all_to_all_rows(send, recv, H, what);
  };
  if (N == 1) {
    xrecv[0] = std::move(xsend[0]);
  } else {
    for (size_t d = 0; d < N; ++d) xrecv[d] = Scratch(*work[d].dev, rows(recv_off[d][N]) * H * 4);
    exchange(xsend, send_off, xrecv, recv_off, "MoE dispatch");
  }

  // The local experts on the rows they received.
  std::vector<Scratch> out_recv(N);
  for (size_t d = 0; d < N; ++d) {
    Device& dev = *work[d].dev;
    const uint32_t M = recv_off[d][N];
    out_recv[d] = Scratch(dev, rows(M) * H * 4);
    if (M == 0) continue;
    Scratch xg, outg;
    const cl::Mem* x = &xrecv[d].mem();
    const cl::Mem* y = &out_recv[d].mem();
    if (regroup[d]) {
      xg = Scratch(dev, size_t(M) * H * 4);
      outg = Scratch(dev, size_t(M) * H * 4);
      ops::gather_rows(dev, xrecv[d].mem(), H, fwd[d].mem(), M, H, xg.mem(), H);
      x = &xg.mem();
      y = &outg.mem();
    }
    uint32_t widest = 0;
    for (size_t e = 0; e + 1 < expert_rows[d].size(); ++e)
      widest = std::max(widest, expert_rows[d][e + 1] - expert_rows[d][e]);
    Scratch gu(dev, size_t(widest) * 2 * F * 4);
    const MoeWeights& m = moe_of(d);
    for (size_t e = 0; e + 1 < expert_rows[d].size(); ++e) {
      const uint32_t begin = expert_rows[d][e], n = expert_rows[d][e + 1] - begin;
      if (n > 0) mlp(dev, m.experts[e], *x, begin * H, n, F, gu.mem(), *y, begin * H, false);
    }
    if (regroup[d]) ops::gather_rows(dev, outg.mem(), H, back[d].mem(), M, H, out_recv[d].mem(), H);
    dev.flush();
  }

  // Combine: the outputs return to their tokens' devices, in the order they were sent, so
  // slot_row (the send order) indexes them; the sum runs in slot order there.
  if (N == 1) {
    ret[0] = std::move(out_recv[0]);
  } else {
    for (size_t r = 0; r < N; ++r) ret[r] = Scratch(*work[r].dev, rows(send_off[r][N]) * H * 4);
    exchange(out_recv, recv_off, ret, send_off, "MoE combine");
  }
  for (size_t r = 0; r < N; ++r) {
    Work& w = work[r];
    if (w.T == 0) continue;
    ops::moe_combine(*w.dev, ret[r].mem(), H, slot_row[r].mem(), weights[r].mem(), w.T, k, H,
                     w.h.mem(), H, true);
    if (moe_of(r).shared) mlp(*w.dev, moe_of(r).shared, w.xn.mem(), 0, w.T, Fs, w.gu.mem(),
                              w.h.mem(), 0, true);
  }
}

StepOutputs DeepseekV3Model::forward(const StepInputs& in) {
  if (replicas_[0].cache.empty())
    throw std::logic_error("DeepseekV3Model::forward before allocate_kv_cache");
  const size_t N = replicas_.size();
  if (in.num_replicas() != N)
    throw std::invalid_argument("step has " + std::to_string(in.num_replicas()) +
                                " replica(s), the model " + std::to_string(N) +
                                " (data_parallel_splits)");
  const uint32_t T = uint32_t(in.num_tokens());
  const uint32_t H = info_.hidden_size, V = info_.vocab_size;
  const uint32_t Lq = uint32_t(cfg_.q_lora_rank), Nh = mla_.n_heads;
  const uint32_t q_width = Nh * mla_.qk(), att_width = Nh * mla_.v;
  // The fused projection's output per token: [q_a (Lq) | c_kv (kv_lora) | k_pe (rope)].
  const uint32_t qkv_a_width = Lq + mla_.row();
  const float eps = float(cfg_.rms_norm_eps);
  const uint32_t ffn = uint32_t(std::max(cfg_.intermediate_size, cfg_.moe_intermediate_size));
  const uint32_t Fs = uint32_t(cfg_.n_shared_experts * cfg_.moe_intermediate_size);

  // One MLA path for the whole step, chosen from every replica's rows, so each replica computes
  // what one device would.
  uint32_t max_query = 0;
  for (size_t b = 0; b < in.num_rows(); ++b) max_query = std::max(max_query, in.row_length(b));
  last_path_ = ops::choose_mla_path(mla_path_, max_query);

  std::vector<Work> work(N);
  for (size_t r = 0; r < N; ++r) {
    Work& w = work[r];
    Device& dev = *replicas_[r].dev;
    w.dev = &dev;
    w.in = N == 1 ? in : in.replica_step(r);
    w.in.data_parallel_splits.clear();
    w.st = upload_step(dev, w.in, page_size_, num_pages_, V);
    w.T = uint32_t(w.in.num_tokens());
    const size_t t = std::max<uint32_t>(w.T, 1);
    if (w.T > 0 && last_path_ == ops::MlaPath::Prefill)
      w.plan = ops::upload_mla_prefill_plan(dev, w.in, page_size_);
    w.h = Scratch(dev, t * H * 4);
    w.xn = Scratch(dev, t * H * 4);
    w.qkv_a = Scratch(dev, t * qkv_a_width * 4);
    w.q = Scratch(dev, t * q_width * 4);
    w.qa_norm = Scratch(dev, t * std::max(Lq, 1u) * 4);
    w.att = Scratch(dev, t * att_width * 4);
    w.gu = Scratch(dev, t * 2 * std::max(ffn, Fs) * 4);
  }

  // Logits: lm_head is replicated (MAX's replicated mode, not vocab-parallel): each replica
  // computes its own rows' logits, and the rows are gathered on device 0 in replica order, which
  // is the step's row order. That keeps the lm_head GEMM split by rows with no extra collective
  // per vocabulary shard; the tiny vocabularies here gain nothing from sharding it.
  Replica& first = replicas_[0];
  StepOutputs out;
  out.device = first.dev;
  out.vocab = V;
  out.logit_offsets = {0};
  std::vector<uint32_t> rows_of(N);
  for (size_t r = 0; r < N; ++r) {
    const auto& o = work[r].st.logit_offsets;
    for (size_t b = 1; b < o.size(); ++b) out.logit_offsets.push_back(out.rows + o[b]);
    rows_of[r] = uint32_t(work[r].st.logit_token_indices.size());
    out.rows += rows_of[r];
  }
  for (size_t r = 0; r < N; ++r) {
    Replica& rep = replicas_[r];
    const size_t need = size_t(r == 0 ? out.rows : rows_of[r]) * V;
    if (need > rep.logits_capacity) {
      rep.logits_capacity = need;
      rep.logits = rep.dev->alloc(need * sizeof(float));
    }
  }
  out.logits = first.logits;
  if (T == 0) return out;

  for (size_t r = 0; r < N; ++r)
    if (work[r].T > 0)
      ops::embedding(*work[r].dev, work[r].st.token_ids, work[r].T, replicas_[r].w.embed,
                     work[r].h.mem(), 1.0f);
  for (size_t l = 0; l < size_t(cfg_.num_hidden_layers); ++l) {
    for (size_t r = 0; r < N; ++r) {
      Work& w = work[r];
      if (w.T == 0) continue;
      Device& dev = *w.dev;
      const uint32_t Tr = w.T;
      const LayerWeights& L = replicas_[r].w.layers[l];
      const MlaWeights& a = L.attn;
      const cl::Mem& cache = replicas_[r].cache[l];
      ops::rmsnorm(dev, w.h.mem(), 0, H, nullptr, L.input_norm, w.xn.mem(), 0, H, Tr, H, eps);
      if (Lq > 0) {
        ops::linear_any(dev, w.xn.mem(), 0, H, a.q_a.w, &a.q_a.scale_inv, w.qkv_a.mem(), 0, qkv_a_width, Tr, 1.0f, false, fp8_act_quant_);
        ops::linear_any(dev, w.xn.mem(), 0, H, a.kv_a.w, &a.kv_a.scale_inv, w.qkv_a.mem(), Lq, qkv_a_width, Tr, 1.0f, false, fp8_act_quant_);
        ops::rmsnorm(dev, w.qkv_a.mem(), 0, qkv_a_width, nullptr, a.q_a_norm, w.qa_norm.mem(), 0,
                     Lq, Tr, Lq, eps);
        ops::linear_any(dev, w.qa_norm.mem(), 0, Lq, a.q_b.w, &a.q_b.scale_inv, w.q.mem(), 0, q_width, Tr, 1.0f, false, fp8_act_quant_);
      } else {
        ops::linear_any(dev, w.xn.mem(), 0, H, a.q.w, &a.q.scale_inv, w.q.mem(), 0, q_width, Tr, 1.0f, false, fp8_act_quant_);
        ops::linear_any(dev, w.xn.mem(), 0, H, a.kv_a.w, &a.kv_a.scale_inv, w.qkv_a.mem(), 0, qkv_a_width, Tr, 1.0f, false, fp8_act_quant_);
      }
      ops::mla_rope_store(dev, w.q.mem(), 0, q_width, w.qkv_a.mem(), Lq, qkv_a_width,
                          a.kv_a_norm, eps, replicas_[r].inv_freq, cfg_.rope_attention_factor(),
                          cfg_.rope_interleave, mla_, w.st.tokens, cache);
      if (last_path_ == ops::MlaPath::Decode)
        ops::mla_attention_decode(dev, w.q.mem(), 0, q_width, cache, w.st.tokens, a.kv_b.w,
                                  &a.kv_b.scale_inv, mla_, cfg_.softmax_scale(), w.att.mem(),
                                  att_width);
      else
        ops::mla_attention_prefill(dev, w.q.mem(), 0, q_width, cache, w.st.tokens, w.plan,
                                   a.kv_b.w, &a.kv_b.scale_inv, mla_, cfg_.softmax_scale(),
                                   w.att.mem(), att_width);
      ops::linear_any(dev, w.att.mem(), 0, att_width, a.o.w, &a.o.scale_inv, w.h.mem(), 0, H, Tr, 1.0f, true, fp8_act_quant_);
      ops::rmsnorm(dev, w.h.mem(), 0, H, nullptr, L.post_attention_norm, w.xn.mem(), 0, H, Tr, H,
                   eps);
      if (!L.is_moe)
        mlp(dev, L.mlp, w.xn.mem(), 0, Tr, uint32_t(cfg_.intermediate_size), w.gu.mem(),
            w.h.mem(), 0, true);
      dev.flush();  // this device starts while the host feeds the next
    }
    if (replicas_[0].w.layers[l].is_moe) moe(l, work);  // every replica, idle ones included
  }

  for (size_t r = 0; r < N; ++r) {
    Work& w = work[r];
    if (rows_of[r] == 0) continue;
    Scratch xs(*w.dev, size_t(rows_of[r]) * H * 4);
    ops::rmsnorm(*w.dev, w.h.mem(), 0, H, &w.st.logit_rows, replicas_[r].w.final_norm, xs.mem(),
                 0, H, rows_of[r], H, eps);
    ops::linear(*w.dev, xs.mem(), 0, H, replicas_[r].w.lm_head, nullptr, replicas_[r].logits, 0,
                V, rows_of[r]);
  }
  if (N > 1) {
    // Gather: replica r > 0 sends its rows to device 0, behind replica 0's own rows (which its
    // lm_head wrote in place); nothing goes anywhere else.
    std::vector<std::vector<parallel::DeviceSpan>> send(N, std::vector<parallel::DeviceSpan>(N));
    std::vector<parallel::DeviceSpan> recv(N);
    for (size_t r = 1; r < N; ++r) send[r][0] = {replicas_[r].logits, 0, size_t(rows_of[r]) * V};
    recv[0] = {first.logits, size_t(rows_of[0]) * V, size_t(out.rows - rows_of[0]) * V};
    comm_->all_to_all_rows(send, recv, V, "logits gather");
  }
  for (auto& w : work) w.dev->flush();  // the caller reads the logits when it needs them
  return out;
}

}  // namespace clshard::deepseek_v3
