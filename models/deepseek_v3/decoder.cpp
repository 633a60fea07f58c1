#include "models/deepseek_v3/decoder.h"

#include <algorithm>
#include <iostream>
#include <stdexcept>

#include "parallel/collectives.h"
#include "parallel/expert_exchange.h"
#include "parallel/mpi_transport.h"
#include "runtime/device.h"
#include "runtime/ops.h"

namespace clshard::deepseek_v3 {

DecoderStack::DecoderStack(const DeepseekV3Config& cfg, const std::filesystem::path& dir,
                           const LoadOptions& opts, const parallel::Topology& topology,
                           std::optional<parallel::ExpertPlacement> placement, const char* who)
    : cfg_(cfg) {
  const size_t N = opts.ranks();
  const bool mpi = opts.mpi_ranks > 0;
  // The topology checked the layout: every device a replica and an expert-parallel rank.
  if (topology.layout() != parallel::Layout::DataParallelAttentionExpertParallel ||
      topology.devices() != N || N == 0)
    throw std::invalid_argument(std::string(who) + ": the topology is not DP = EP over the " +
                                std::to_string(N) + " devices of the options");
  if (mpi && topology.processes() != opts.processes())
    throw std::invalid_argument(std::string(who) + ": the topology spans " +
                                std::to_string(topology.processes()) + " processes, MPI " +
                                std::to_string(opts.processes()));
  mla_.n_heads = uint32_t(cfg_.num_attention_heads);
  mla_.kv_lora = uint32_t(cfg_.kv_lora_rank);
  mla_.nope = uint32_t(cfg_.qk_nope_head_dim);
  mla_.rope = uint32_t(cfg_.qk_rope_head_dim);
  mla_.v = uint32_t(cfg_.v_head_dim);
  mla_.cache_dtype = opts.kv_cache_dtype;
  if (mla_.cache_dtype != DType::F32 && mla_.cache_dtype != DType::BF16 &&
      mla_.cache_dtype != DType::F8_E4M3)
    throw std::invalid_argument(std::string(who) + ": kv_cache.dtype " +
                                dtype_name(mla_.cache_dtype) + " is not supported (f32, bf16 or fp8)");
  router_.n_experts = uint32_t(cfg_.n_routed_experts);
  router_.top_k = uint32_t(cfg_.num_experts_per_tok);
  router_.n_group = uint32_t(cfg_.n_group);
  router_.topk_group = uint32_t(cfg_.topk_group);
  router_.norm_topk_prob = cfg_.norm_topk_prob;
  router_.routed_scaling_factor = float(cfg_.routed_scaling_factor);
  try {
    ops::validate(mla_);
    ops::validate(router_);
    mla_params_ = MlaParams::from(cfg_, opts.quantize_fp8_activations);
    mla_params_.shape.cache_dtype = opts.kv_cache_dtype;
    mla_params_.compute = opts.compute_dtype;
  } catch (const std::invalid_argument& e) {
    throw std::runtime_error((dir / "config.json").string() + ": not supported: " + e.what());
  }

  // Placement comes from parallel/: even blocks, or blocks sized by measured device speed.
  if (placement) {
    if (placement->ranks() != N || placement->n_experts() != router_.n_experts)
      throw std::invalid_argument(
          std::string(who) + ": the given expert placement covers " +
          std::to_string(placement->n_experts()) + " experts over " +
          std::to_string(placement->ranks()) + " ranks; the model has " +
          std::to_string(router_.n_experts) + " experts on " + std::to_string(N) + " devices");
    placement_ = std::move(*placement);
  } else {
    if (topology.balanced_experts() && mpi)
      throw std::invalid_argument(std::string(who) + ": parallel.placement: balanced is not "
                                  "supported over MPI (the processes would measure apart)");
    if (topology.balanced_experts())
      throughput_ = parallel::measure_device_throughput(opts.devices);
    placement_ = topology.expert_blocks(router_.n_experts, throughput_);
  }
  if (N > 1 && (!mpi || opts.mpi_rank == 0))
    std::cerr << who << ": " << N << " data-parallel replicas, experts over " << N
              << " expert-parallel ranks:\n"
              << placement_.describe() << std::flush;
  const auto inv = cfg_.rope_inv_freqs();
  for (size_t r = 0; r < N; ++r) {
    Replica rep;
    // Over MPI this process drives the devices the topology gives it; the others' are remote.
    rep.dev = topology.process_of_device(r) == opts.process()
                  ? opts.devices[topology.local_index(r)]
                  : nullptr;
    if (!rep.dev) {
      replicas_.push_back(std::move(rep));
      continue;
    }
    rep.inv_freq = rep.dev->alloc(inv.size() * sizeof(float), CL_MEM_READ_ONLY);
    rep.dev->write(rep.inv_freq, inv.data(), inv.size() * sizeof(float));
    replicas_.push_back(std::move(rep));
  }
  first_local_ = opts.process() * topology.devices_per_process();
  if (mpi) {
#ifdef CLSHARD_HAVE_MPI
    // Every process of the world in one group: transport rank = device.
    comm_ = std::make_unique<parallel::Communicator>(
        std::make_unique<parallel::MpiTransport>(opts.devices, 0));
#else
    throw std::invalid_argument(std::string(who) + ": this build has no MPI transport (OpenMPI "
                                "not found at build time)");
#endif
  } else if (N > 1) {
    comm_ = std::make_unique<parallel::Communicator>(opts.devices);
  }
  fp8_act_quant_ = opts.quantize_fp8_activations;
  compute_ = opts.compute_dtype;
}

DecoderStack::~DecoderStack() = default;

void DecoderStack::load_lora(const LoadOptions& opts) {
  if (opts.lora_adapters.empty()) return;
  const LoraTargets targets = lora_targets(cfg_);
  auto adapters = std::make_shared<const std::vector<LoraAdapter>>(
      read_lora_adapters(opts.lora_adapters, opts.lora_max_rank, targets));
  for (auto& rep : replicas_)
    if (rep.dev) rep.lora = LoraAdapters(*rep.dev, adapters, targets.modules, opts.lora_max_loaded);
}

std::vector<Device*> DecoderStack::devices() const {
  std::vector<Device*> d;
  for (const auto& r : replicas_)
    if (r.dev) d.push_back(r.dev);
  return d;
}

uint64_t DecoderStack::kv_bytes_per_token() const {
  return uint64_t(num_layers()) * mla_.row() * dtype_size(mla_.cache_dtype);
}

void DecoderStack::allocate_cache(uint32_t num_pages, uint32_t page_size) {
  if (page_size == 0) throw std::invalid_argument("kv_cache.page_size must be positive");
  const size_t layer_bytes =
      size_t(num_pages + 1) * page_size * mla_.row() * dtype_size(mla_.cache_dtype);
  for (auto& rep : replicas_) {
    if (!rep.dev) continue;
    Device& dev = *rep.dev;
    rep.cache.clear();
    if (layer_bytes > dev.info().max_alloc)
      throw std::runtime_error("MLA cache: " + std::to_string(num_pages) + " pages of " +
                               std::to_string(page_size) + " tokens need " +
                               std::to_string(layer_bytes) + " bytes per layer, over the " +
                               std::to_string(dev.info().max_alloc) +
                               "-byte allocation limit of " + dev.label());
    const size_t page_bytes = layer_bytes / (num_pages + 1);
    for (size_t l = 0; l < rep.layers.size(); ++l) {
      rep.cache.push_back(dev.alloc(layer_bytes));
      // Only the null page is read before it is written (prefill over-reads pad with it): keep
      // it finite, and leave the rest untouched so a large pool costs no time or resident memory.
      dev.fill_zero(rep.cache.back(), page_bytes, size_t(num_pages) * page_bytes);
    }
  }
  num_pages_ = num_pages;
  page_size_ = page_size;
}

void DecoderStack::moe_on_device(size_t layer, ReplicaWork& w) {
  if (w.T == 0) return;
  Device& dev = *w.dev;
  const MoeWeights& m = replicas_[first_local_].layers[layer].moe;
  const ops::GroupedExperts& g = m.grouped;
  const uint32_t H = uint32_t(cfg_.hidden_size), E = router_.n_experts;
  const uint32_t k = router_.top_k, T = w.T;
  // The shared expert rides in the grouped launches unless a LoRA adapter may target it (the
  // adapters apply to dense_mlp's projections).
  const bool fuse_shared = m.grouped_has_shared && !w.lora.active();
  Scratch logits(dev, size_t(T) * E * 4), ids(dev, size_t(T) * k * 4), weights(dev, size_t(T) * k * 4);
  ops::linear(dev, w.xn.mem(), 0, H, m.router, nullptr, logits.mem(), 0, E, T);
  ops::moe_route(dev, logits.mem(), &m.correction_bias, T, router_, ids.mem(), weights.mem());
  // With the shared expert in the buffer but not fused, its rows are planned for nobody: the plan
  // covers the routed experts and the shared one's slot is left out.
  const ops::GroupedPlan plan =
      ops::plan_experts(dev, ids.mem(), T, k, g.n_experts, fuse_shared);
  Scratch out(dev, size_t(plan.rows) * H * 4);
  grouped_experts(dev, g, plan, w.xn.mem(), &plan.src_token.mem(), T, out.mem());
  ops::moe_combine(dev, out.mem(), H, plan.slot_row.mem(), weights.mem(), T, k, H, w.h.mem(), H,
                   true, fuse_shared);
  if (m.shared && !fuse_shared)
    dense_mlp(dev, m.shared, w.xn.mem(), 0, H, T, w.gu.mem(), w.h.mem(), 0, H, true,
              fp8_act_quant_, LayerLora{&w.lora, layer}, compute_);
  dev.flush();
}

void DecoderStack::grouped_experts(Device& dev, const ops::GroupedExperts& g,
                                   const ops::GroupedPlan& plan, const cl::Mem& x,
                                   const cl::Mem* x_rows, uint32_t x_count,
                                   const cl::Mem& out) const {
  const uint32_t H = g.hidden, F = g.inter, S = plan.rows, X = x_rows ? x_count : S;
  // FP8 activation quantization is per row: the x rows are quantized once, which quantizes every
  // grouped row that reads them, and the silu output is quantized per row.
  const bool aq = fp8_act_quant_ && g.dtype == DType::F8_E4M3;
  const cl::Mem* in = &x;
  Scratch xq;
  if (aq) {
    xq = Scratch(dev, size_t(X) * H * 4);
    ops::act_quant_fp8(dev, x, 0, H, X, H, xq.mem());
    in = &xq.mem();
  }
  // With act_quant the experts run DeepSeek's FP8 GEMM recipe (quantized x, exact products) in
  // f32 whatever the compute dtype, as ops::linear_any runs the dense FP8 layers.
  const ComputeDType compute = aq ? ComputeDType::F32 : compute_;
  Scratch act(dev, size_t(S) * F * 4);
  ops::moe_grouped_swiglu(dev, *in, H, x_rows, g, plan, act.mem(), F, compute, x_count);
  const cl::Mem* down_in = &act.mem();
  Scratch gq;
  if (aq) {
    gq = Scratch(dev, size_t(S) * F * 4);
    ops::act_quant_fp8(dev, act.mem(), 0, F, S, F, gq.mem());
    down_in = &gq.mem();
  }
  ops::moe_grouped_linear(dev, *down_in, F, nullptr, g, 2, 1, plan, out, H, compute);
}

void DecoderStack::moe(size_t layer, std::vector<ReplicaWork>& work) {
  const size_t N = replicas_.size();
  // One device: routing, plan, experts and combine all on the device, nothing read back.
  if (N == 1 && !comm_ && replicas_[0].layers[layer].moe.grouped) {
    moe_on_device(layer, work[0]);
    return;
  }
  const uint32_t H = uint32_t(cfg_.hidden_size), E = router_.n_experts, k = router_.top_k;
  const uint32_t F = uint32_t(cfg_.moe_intermediate_size);
  auto moe_of = [&](size_t r) -> const MoeWeights& { return replicas_[r].layers[layer].moe; };
  auto rows = [](size_t n) { return std::max<size_t>(n, 1); };  // buffers of at least one row

  // Routing, on each token's device. Every device's router is enqueued before any id is read.
  std::vector<Scratch> ids(N), weights(N);
  for (size_t r = 0; r < N; ++r) {
    if (!local(r)) continue;  // here and below: another process runs replica r
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
    if (!local(r)) continue;
    const uint32_t T = work[r].T;
    std::vector<int32_t> host_ids(size_t(T) * k);
    if (T > 0) work[r].dev->read(ids[r].mem(), host_ids.data(), host_ids.size() * 4);
    eb[r] = ops::group_by_expert(host_ids, T, k, E);
    expert_offsets[r] = eb[r].expert_offsets;
  }
  if (comm_) comm_->share_host(expert_offsets, "MoE counts");  // the other processes' ranks
  const auto plan = parallel::plan_expert_exchange(expert_offsets, placement_);
  const auto& send_off = plan.send_off;
  const auto& recv_off = plan.recv_off;
  const auto& expert_rows = plan.expert_rows;
  const auto& perm = plan.perm;
  const auto& inv = plan.inv;
  const auto& regroup = plan.regroup;

  // The plan's index tables go up now, while every device is idle after the ids were read:
  // a blocking write waits until its queue drains, so one between enqueued kernels would hold
  // the host (and every other device) until that device caught up.
  // So does each rank's tile plan of its grouped experts over the rows it will receive, in
  // expert order (the shared expert, last in the buffer, gets none: it runs on the tokens'
  // devices after the combine). The tables are queued and a device waited for once, not once a
  // table (each wait a round trip to the device's threads).
  std::vector<Scratch> src_token(N), slot_row(N), fwd(N), back(N);
  std::vector<ops::GroupedPlan> plans(N);
  for (size_t r = 0; r < N; ++r) {
    if (!local(r)) continue;
    Device& dev = *work[r].dev;
    const size_t S = size_t(work[r].T) * k, M = perm[r].size();
    WriteBatch batch(dev);
    src_token[r] = Scratch(dev, rows(S) * 4);
    slot_row[r] = Scratch(dev, rows(S) * 4);
    batch.write(src_token[r].mem(), eb[r].src_token.data(), S * 4);
    batch.write(slot_row[r].mem(), eb[r].slot_row.data(), S * 4);
    if (regroup[r]) {
      fwd[r] = Scratch(dev, M * 4);
      back[r] = Scratch(dev, M * 4);
      batch.write(fwd[r].mem(), perm[r].data(), M * 4);
      batch.write(back[r].mem(), inv[r].data(), M * 4);
    }
    if (const ops::GroupedExperts& g = moe_of(r).grouped; g && expert_rows[r].back() > 0) {
      std::vector<uint32_t> offsets = expert_rows[r];
      offsets.resize(g.n_experts + 1, offsets.back());
      // Its blocking write drains the queue: the batch's wait then costs nothing (0.07 us).
      plans[r] = ops::plan_expert_tiles(dev, offsets);
    }
    batch.wait();
  }

  // Dispatch: each source gathers its rows in send order, then they travel to the experts' ranks
  // (on one device the gathered rows are already the experts' input).
  std::vector<Scratch> xsend(N), xrecv(N), ret(N);
  for (size_t r = 0; r < N; ++r) {
    if (!local(r)) continue;
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
    for (size_t d = 0; d < N; ++d)
      if (local(d)) xrecv[d] = Scratch(*work[d].dev, rows(recv_off[d][N]) * H * 4);
    exchange(xsend, send_off, xrecv, recv_off, "MoE dispatch");
  }

  // The local experts on the rows they received.
  std::vector<Scratch> out_recv(N);
  for (size_t d = 0; d < N; ++d) {
    if (!local(d)) continue;
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
    const MoeWeights& m = moe_of(d);
    if (m.grouped) {
      // The rank's experts in grouped launches over the rows in expert order, as one device
      // runs them.
      grouped_experts(dev, m.grouped, plans[d], *x, nullptr, 0, *y);
    } else {
      uint32_t widest = 0;
      for (size_t e = 0; e + 1 < expert_rows[d].size(); ++e)
        widest = std::max(widest, expert_rows[d][e + 1] - expert_rows[d][e]);
      Scratch gu(dev, size_t(widest) * 2 * F * 4);
      for (size_t e = 0; e + 1 < expert_rows[d].size(); ++e) {
        const uint32_t begin = expert_rows[d][e], n = expert_rows[d][e + 1] - begin;
        if (n > 0)
          dense_mlp(dev, m.experts[e], *x, begin * H, H, n, gu.mem(), *y, begin * H, H, false,
                    fp8_act_quant_, {}, compute_);
      }
    }
    if (regroup[d]) ops::gather_rows(dev, outg.mem(), H, back[d].mem(), M, H, out_recv[d].mem(), H);
    dev.flush();
  }

  // Combine: the outputs return to their tokens' devices, in the order they were sent, so
  // slot_row (the send order) indexes them; the sum runs in slot order there.
  if (N == 1) {
    ret[0] = std::move(out_recv[0]);
  } else {
    for (size_t r = 0; r < N; ++r)
      if (local(r)) ret[r] = Scratch(*work[r].dev, rows(send_off[r][N]) * H * 4);
    exchange(out_recv, recv_off, ret, send_off, "MoE combine");
  }
  for (size_t r = 0; r < N; ++r) {
    ReplicaWork& w = work[r];
    if (w.T == 0) continue;
    ops::moe_combine(*w.dev, ret[r].mem(), H, slot_row[r].mem(), weights[r].mem(), w.T, k, H,
                     w.h.mem(), H, true);
    if (moe_of(r).shared)
      dense_mlp(*w.dev, moe_of(r).shared, w.xn.mem(), 0, H, w.T, w.gu.mem(), w.h.mem(), 0, H,
                true, fp8_act_quant_, LayerLora{&w.lora, layer}, compute_);
  }
}

void DecoderStack::attention(size_t l, ReplicaWork& w, Replica& rep) {
  Device& dev = *w.dev;
  const uint32_t H = uint32_t(cfg_.hidden_size);
  const LayerWeights& L = rep.layers[l];
  ops::rmsnorm(dev, w.h.mem(), 0, H, nullptr, L.input_norm, w.xn.mem(), 0, H, w.T, H,
               mla_params_.eps);
  const MlaCacheStep cs{&rep.cache[l], &w.st.tokens, last_path_, &w.plan, &rep.inv_freq};
  const LayerLora lora{&w.lora, l};
  mla_attention(dev, L.attn, mla_params_, w.xn.mem(), H, w.T, cs, w.mla, w.h.mem(), H, true, lora);
  ops::rmsnorm(dev, w.h.mem(), 0, H, nullptr, L.post_attention_norm, w.xn.mem(), 0, H, w.T, H,
               mla_params_.eps);
  if (!L.is_moe)
    dense_mlp(dev, L.mlp, w.xn.mem(), 0, H, w.T, w.gu.mem(), w.h.mem(), 0, H, true,
              fp8_act_quant_, lora, compute_);
}

std::vector<ReplicaWork> DecoderStack::begin_step(const StepInputs& in, uint32_t vocab,
                                                  uint32_t input_width) {
  if (!has_cache()) throw std::logic_error("DeepSeek-V3: forward before allocate_kv_cache");
  const size_t N = replicas_.size();
  if (in.num_replicas() != N)
    throw std::invalid_argument("step has " + std::to_string(in.num_replicas()) +
                                " replica(s), the model " + std::to_string(N) +
                                " (data_parallel_splits)");
  const uint32_t H = uint32_t(cfg_.hidden_size);
  const uint32_t ffn = uint32_t(std::max(cfg_.intermediate_size, cfg_.moe_intermediate_size));
  const uint32_t Fs = uint32_t(cfg_.n_shared_experts * cfg_.moe_intermediate_size);

  uint32_t max_query = 0;
  for (size_t b = 0; b < in.num_rows(); ++b) max_query = std::max(max_query, in.row_length(b));
  last_path_ = ops::choose_mla_path(mla_path_, max_query);

  std::vector<ReplicaWork> work(N);
  for (size_t r = 0; r < N; ++r) {
    ReplicaWork& w = work[r];
    w.in = N == 1 ? in : in.replica_step(r);
    w.in.data_parallel_splits.clear();
    if (!local(r)) {  // another process runs it: its rows are known here, its work is not
      w.st = host_step(w.in);
      continue;
    }
    Device& dev = *replicas_[r].dev;
    w.dev = &dev;
    w.st = upload_step(dev, w.in, page_size_, num_pages_, vocab);
    w.T = uint32_t(w.in.num_tokens());
    const size_t t = std::max<uint32_t>(w.T, 1);
    if (w.T > 0 && last_path_ == ops::MlaPath::Prefill)
      w.plan = ops::upload_mla_prefill_plan(dev, w.in, page_size_);
    w.h = Scratch(dev, t * H * 4);
    w.xn = Scratch(dev, t * std::max(H, input_width) * 4);
    w.mla = MlaScratch(dev, mla_params_, t);
    w.gu = Scratch(dev, t * 2 * std::max(ffn, Fs) * 4);
    w.lora = replicas_[r].lora.bind(w.in);
  }
  return work;
}

void DecoderStack::run_layers(std::vector<ReplicaWork>& work,
                              const std::function<void(size_t)>& after_layer) {
  const size_t N = replicas_.size();
  for (size_t l = 0; l < num_layers(); ++l) {
    for (size_t r = 0; r < N; ++r) {
      if (work[r].T == 0) continue;
      attention(l, work[r], replicas_[r]);
      work[r].dev->flush();  // this device starts while the host feeds the next
    }
    if (replicas_[first_local_].layers[l].is_moe) moe(l, work);  // every replica, idle ones included
    if (after_layer) after_layer(l);
  }
}

StepOutputs DecoderStack::logits(std::vector<ReplicaWork>& work,
                                 const std::vector<const Weight*>& final_norm,
                                 const std::vector<const Weight*>& lm_head) {
  // lm_head is replicated (MAX's replicated mode, not vocab-parallel): each replica computes its
  // own rows' logits, and the rows are gathered on device 0 in replica order, which is the step's
  // row order. That keeps the lm_head GEMM split by rows with no extra collective per vocabulary
  // shard; the tiny vocabularies here gain nothing from sharding it.
  const size_t N = replicas_.size();
  const uint32_t H = uint32_t(cfg_.hidden_size), V = uint32_t(lm_head.at(first_local_)->dim(0));
  std::vector<const DeviceStep*> steps;
  for (const auto& w : work) steps.push_back(&w.st);
  StepOutputs out;
  std::vector<Device*> devs;  // null for replicas of other processes
  for (const auto& rep : replicas_) devs.push_back(rep.dev);
  logits_.prepare(devs, steps, V, out);
  for (size_t r = 0; r < N; ++r) {
    ReplicaWork& w = work[r];
    const uint32_t rows = logits_.rows(r);
    if (rows == 0 || !w.dev) continue;
    Scratch xs(*w.dev, size_t(rows) * H * 4);
    ops::rmsnorm(*w.dev, w.h.mem(), 0, H, &w.st.logit_rows, *final_norm[r], xs.mem(), 0, H, rows,
                 H, eps());
    ops::linear(*w.dev, xs.mem(), 0, H, *lm_head[r], nullptr, logits_.buffer(r), 0, V, rows, 1.0f,
                false, compute_);
  }
  logits_.gather(comm_.get(), "logits gather");
  for (auto& w : work)
    if (w.dev) w.dev->flush();  // the caller reads the logits when it needs them
  return out;
}

ReplicaHidden DecoderStack::hidden_buffer(size_t r, uint32_t rows, uint32_t width) {
  Replica& rep = replicas_.at(r);
  if (!rep.dev) return {nullptr, {}, rows};  // another process's replica
  const size_t need = size_t(std::max<uint32_t>(rows, 1)) * width;
  if (need > rep.hidden_capacity) {
    rep.hidden_capacity = need;
    rep.hidden = rep.dev->alloc(need * sizeof(float));
  }
  return {rep.dev, rep.hidden, rows};
}

}  // namespace clshard::deepseek_v3
