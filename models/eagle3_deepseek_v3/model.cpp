#include "models/eagle3_deepseek_v3/model.h"

#include <algorithm>
#include <stdexcept>

#include "parallel/collectives.h"
#include "parallel/topology.h"
#include "runtime/device.h"
#include "runtime/ops.h"
#include "runtime/ops_moe.h"
#include "runtime/step_device.h"

namespace clshard::eagle3_deepseek_v3 {

namespace {

// y[R, vt] = the draft logits x[R, vd] at their target ids, -inf elsewhere (draft_vocab.cl).
void draft_to_target_vocab(Device& dev, const cl::Mem& x, uint32_t vd, const cl::Mem& draft_of,
                           const cl::Mem& y, uint32_t vt, uint32_t R) {
  constexpr uint32_t chunk = 256;  // CHUNK in draft_vocab.cl; the GPU shape's work-group
  const bool wg = dev.kernel_shape() == KernelShape::WorkGroups;
  cl::Kernel k =
      dev.kernel("draft_vocab.cl", wg ? "draft_to_target_vocab_wg" : "draft_to_target_vocab");
  cl::set_args(k, x, vd, draft_of, y, vt);
  const uint32_t chunks = (vt + chunk - 1) / chunk;
  if (wg) {
    const size_t local[3] = {chunk, 1, 1};
    dev.launch(k, {size_t(chunks) * chunk, R, 1}, 2, local);
  } else {
    dev.launch(k, {R, chunks, 1}, 2);
  }
}

}  // namespace

// One replica's share of a step and its activations (buffers of at least one row).
struct Eagle3Draft::Work {
  Device* dev = nullptr;
  StepInputs in;
  DeviceStep st;
  ops::MlaPrefillPlan plan;
  uint32_t T = 0, R = 0;
  const ReplicaHidden* hidden = nullptr;
  Scratch h, x, xn, gu, qkv, att;
  deepseek_v3::MlaScratch mla;
};

Eagle3Draft::Eagle3Draft(const std::filesystem::path& target_dir,
                         const std::filesystem::path& draft_dir, const LoadOptions& opts)
    : cfg_(Eagle3Config::from_dir(draft_dir)) {
  try {
    target_ = deepseek_v3::DeepseekV3Config::from_dir(target_dir);
  } catch (const std::runtime_error& e) {
    throw std::runtime_error(std::string(e.what()) + " (the Eagle3 draft " + draft_dir.string() +
                             " needs a DeepSeek-V3 target)");
  }
  // The draft runs where the target's attention runs: one replica per device (the topology checks
  // the target's layout and names the key at fault).
  const parallel::Topology topology(parallel::Layout::DataParallelAttentionExpertParallel,
                                    opts.degrees(), opts.devices.size(), "Eagle3 draft");
  const size_t N = topology.replicas();
  cfg_.check_target(target_, (target_dir / "config.json").string());
  fp8_act_quant_ = opts.quantize_fp8_activations;
  if (cfg_.kind == DraftKind::Mla) {
    try {
      mla_ = deepseek_v3::MlaParams::from(cfg_.mla, fp8_act_quant_);
    } catch (const std::invalid_argument& e) {
      throw std::runtime_error(cfg_.config_path + ": not supported: " + e.what());
    }
  }

  // model.mmap applies to the draft's own file; the target's stays mapped (the target model holds
  // its own copy where it copies, and the draft reads a few tensors of it).
  store_ = std::make_unique<WeightStore>(draft_dir, opts.weight_memory, opts.load_progress);
  target_store_ = std::make_unique<WeightStore>(target_dir);
  layout_ = inspect_draft(cfg_, *store_);
  const auto inv =
      cfg_.kind == DraftKind::Mla ? cfg_.mla.rope_inv_freqs() : cfg_.mha.rope_inv_freqs();
  for (size_t r = 0; r < N; ++r) {
    Replica rep;
    rep.dev = opts.devices[r];
    rep.w = load_weights(cfg_, layout_, *store_, *target_store_, *rep.dev);
    rep.inv_freq = rep.dev->alloc(inv.size() * sizeof(float), CL_MEM_READ_ONLY);
    rep.dev->write(rep.inv_freq, inv.data(), inv.size() * sizeof(float));
    if (!layout_.vocab.identity) {
      const auto& map = layout_.vocab.draft_of_target;
      rep.draft_of_target = rep.dev->alloc(map.size() * sizeof(int32_t), CL_MEM_READ_ONLY);
      rep.dev->write(rep.draft_of_target, map.data(), map.size() * sizeof(int32_t));
    }
    replicas_.push_back(std::move(rep));
  }
  if (N > 1) comm_ = std::make_unique<parallel::Communicator>(opts.devices);

  info_.architecture = cfg_.architecture;
  info_.vocab_size = uint32_t(target_.vocab_size);
  info_.hidden_size = uint32_t(cfg_.hidden_size);
  info_.target_hidden = ReturnHidden::SelectedLayers;
  info_.target_layers = cfg_.target_layers();
  info_.target_hidden_width = layout_.fc_in;
  info_.weight_bytes = store_->total_bytes();
}

Eagle3Draft::~Eagle3Draft() = default;

std::vector<Device*> Eagle3Draft::devices() const {
  std::vector<Device*> d;
  for (const auto& r : replicas_) d.push_back(r.dev);
  return d;
}

uint64_t Eagle3Draft::kv_bytes_per_token() const {
  if (cfg_.kind == DraftKind::Mla) return uint64_t(mla_.shape.row()) * sizeof(float);
  return uint64_t(2) * cfg_.mha.num_key_value_heads * cfg_.mha.head_dim * sizeof(float);
}

void Eagle3Draft::allocate_kv_cache(uint32_t num_pages, uint32_t page_size) {
  if (page_size == 0) throw std::invalid_argument("kv_cache.page_size must be positive");
  const size_t page_bytes = size_t(page_size) * kv_bytes_per_token();
  const size_t bytes = size_t(num_pages + 1) * page_bytes;
  for (auto& rep : replicas_) {
    Device& dev = *rep.dev;
    rep.cache = cl::Mem();
    if (bytes > dev.info().max_alloc)
      throw std::runtime_error("Eagle3 draft cache: " + std::to_string(num_pages) + " pages of " +
                               std::to_string(page_size) + " tokens need " + std::to_string(bytes) +
                               " bytes, over the " + std::to_string(dev.info().max_alloc) +
                               "-byte allocation limit of " + dev.label());
    rep.cache = dev.alloc(bytes);
    // Only the null page is read before it is written: keep it finite.
    dev.fill_zero(rep.cache, page_bytes, size_t(num_pages) * page_bytes);
  }
  num_pages_ = num_pages;
  page_size_ = page_size;
}

void Eagle3Draft::attention(Work& w, Replica& rep, bool accumulate) {
  Device& dev = *w.dev;
  const uint32_t H = info_.hidden_size;
  if (cfg_.kind == DraftKind::Mla) {
    deepseek_v3::MlaCacheStep cs;
    cs.cache_layer = &rep.cache;
    cs.tokens = &w.st.tokens;
    cs.path = last_path_;
    cs.plan = &w.plan;
    cs.inv_freq = &rep.inv_freq;
    deepseek_v3::mla_attention(dev, rep.w.mla, mla_, w.x.mem(), 2 * H, w.T, cs, w.mla, w.h.mem(), H,
                               accumulate);
    return;
  }
  const auto& m = cfg_.mha;
  const uint32_t nh = uint32_t(m.num_attention_heads), nkv = uint32_t(m.num_key_value_heads);
  const uint32_t hd = uint32_t(m.head_dim), qkv_w = (nh + 2 * nkv) * hd;
  const MhaWeights& a = rep.w.mha;
  auto linear = [&](const cl::Mem& x, uint32_t ldx, const Linear& l, const cl::Mem& y,
                    uint32_t y_off, uint32_t ldy, bool acc) {
    ops::linear_any(dev, x, 0, ldx, l.w, &l.scale_inv, y, y_off, ldy, w.T, 1.0f, acc,
                    fp8_act_quant_);
  };
  linear(w.x.mem(), 2 * H, a.q, w.qkv.mem(), 0, qkv_w, false);
  linear(w.x.mem(), 2 * H, a.k, w.qkv.mem(), nh * hd, qkv_w, false);
  linear(w.x.mem(), 2 * H, a.v, w.qkv.mem(), (nh + nkv) * hd, qkv_w, false);
  ops::rope_store_kv(dev, w.qkv.mem(), qkv_w, nh, nkv, hd, rep.inv_freq, rep.inv_freq, 0xffffffffu,
                     w.st.tokens, rep.cache);
  ops::paged_attention(dev, w.qkv.mem(), qkv_w, rep.cache, w.st.tokens, nh, nkv, hd,
                       m.softmax_scale(), w.att.mem(), nh * hd);
  linear(w.att.mem(), nh * hd, a.o, w.h.mem(), 0, H, accumulate);
}

StepOutputs Eagle3Draft::forward(const StepInputs& in, const std::vector<ReplicaHidden>& hidden,
                                 uint32_t hidden_width) {
  if (!replicas_[0].cache) throw std::logic_error("Eagle3Draft::forward before allocate_kv_cache");
  const size_t N = replicas_.size();
  if (in.num_replicas() != N)
    throw std::invalid_argument("draft step has " + std::to_string(in.num_replicas()) +
                                " replica(s), the draft " + std::to_string(N) +
                                " (data_parallel_splits)");
  const uint32_t H = info_.hidden_size, V = info_.vocab_size;
  const uint32_t Vd = uint32_t(cfg_.draft_vocab_size);
  if (hidden_width != layout_.fc_in && hidden_width != H)
    throw std::invalid_argument("draft step: hidden rows " + std::to_string(hidden_width) +
                                " wide; the draft reads the target's captures (" +
                                std::to_string(layout_.fc_in) + ") or its own output (" +
                                std::to_string(H) + ")");
  if (hidden.size() != N)
    throw std::invalid_argument("draft step: hidden states for " + std::to_string(hidden.size()) +
                                " replica(s), the draft has " + std::to_string(N));
  const bool from_target = hidden_width == layout_.fc_in;
  const uint32_t F = uint32_t(cfg_.intermediate_size);

  uint32_t max_query = 0;
  for (size_t b = 0; b < in.num_rows(); ++b) max_query = std::max(max_query, in.row_length(b));
  last_path_ =
      cfg_.kind == DraftKind::Mla ? ops::choose_mla_path(mla_path_, max_query) : ops::MlaPath::Auto;

  std::vector<Work> work(N);
  for (size_t r = 0; r < N; ++r) {
    Work& w = work[r];
    Device& dev = *replicas_[r].dev;
    w.dev = &dev;
    w.in = N == 1 ? in : in.replica_step(r);
    w.in.data_parallel_splits.clear();
    w.st = upload_step(dev, w.in, page_size_, num_pages_, V);
    w.T = uint32_t(w.in.num_tokens());
    w.R = uint32_t(w.st.logit_token_indices.size());
    w.hidden = &hidden[r];
    if (w.T == 0) continue;
    if (hidden[r].count != w.T || hidden[r].device != &dev || !hidden[r].rows)
      throw std::invalid_argument("draft step: replica " + std::to_string(r) + " has " +
                                  std::to_string(w.T) + " tokens but its hidden states hold " +
                                  std::to_string(hidden[r].count) + " rows" +
                                  (hidden[r].device != &dev ? " on another device" : ""));
    const size_t t = w.T;
    if (last_path_ == ops::MlaPath::Prefill)
      w.plan = ops::upload_mla_prefill_plan(dev, w.in, page_size_);
    w.h = Scratch(dev, t * H * 4);
    w.x = Scratch(dev, t * 2 * H * 4);
    w.xn = Scratch(dev, t * H * 4);
    w.gu = Scratch(dev, t * 2 * F * 4);
    if (cfg_.kind == DraftKind::Mla) {
      w.mla = deepseek_v3::MlaScratch(dev, mla_, t);
    } else {
      const auto& m = cfg_.mha;
      w.qkv =
          Scratch(dev, t * (m.num_attention_heads + 2 * m.num_key_value_heads) * m.head_dim * 4);
      w.att = Scratch(dev, t * m.num_attention_heads * m.head_dim * 4);
    }
  }

  // Outputs: logits rows gathered on device 0 in replica order (the step's row order), hidden
  // rows on each replica's device.
  StepOutputs out;
  std::vector<const DeviceStep*> steps;
  for (const auto& w : work) steps.push_back(&w.st);
  logits_.prepare(devices(), steps, V, out);
  out.hidden_width = H;
  for (size_t r = 0; r < N; ++r) {
    ReplicaHidden rh;
    rh.device = replicas_[r].dev;
    rh.count = work[r].R;
    rh.rows = rh.device->alloc(std::max<size_t>(work[r].R, 1) * H * sizeof(float));
    out.hidden.push_back(std::move(rh));
  }

  const float eps = float(cfg_.rms_norm_eps);
  for (size_t r = 0; r < N; ++r) {
    Work& w = work[r];
    if (w.T == 0) continue;
    Device& dev = *w.dev;
    Replica& rep = replicas_[r];
    const Eagle3Weights& W = rep.w;
    const uint32_t T = w.T;
    // fused: fc over the target's captures into h, or the draft's own rows as they are.
    const cl::Mem& rows = w.hidden->rows;
    if (from_target)
      ops::linear_any(dev, rows, 0, hidden_width, W.fc.w, &W.fc.scale_inv, w.h.mem(), 0, H, T, 1.0f,
                      false, fp8_act_quant_);
    const cl::Mem& fused = from_target ? w.h.mem() : rows;
    // x = [input_layernorm(embed(tokens)) | hidden_norm(fused)]
    ops::embedding(dev, w.st.token_ids, T, W.embed, w.xn.mem(), 1.0f);
    ops::rmsnorm(dev, w.xn.mem(), 0, H, nullptr, W.input_norm, w.x.mem(), 0, 2 * H, T, H, eps);
    ops::rmsnorm(dev, fused, 0, H, nullptr, W.hidden_norm, w.x.mem(), H, 2 * H, T, H, eps);
    // h = fused + o_proj(attention(x))
    attention(w, rep, from_target);
    if (!from_target) ops::axpy(dev, w.h.mem(), rows, 1.0f, T * H);
    // h += MLP(post_attention_layernorm(h))
    ops::rmsnorm(dev, w.h.mem(), 0, H, nullptr, W.post_attention_norm, w.xn.mem(), 0, H, T, H, eps);
    deepseek_v3::dense_mlp(dev, W.mlp, w.xn.mem(), 0, H, T, w.gu.mem(), w.h.mem(), 0, H, true,
                           fp8_act_quant_);
    if (w.R > 0) {
      ops::gather_rows(dev, w.h.mem(), H, w.st.logit_rows, w.R, H, out.hidden[r].rows, H);
      Scratch xs(dev, size_t(w.R) * H * 4);
      ops::rmsnorm(dev, w.h.mem(), 0, H, &w.st.logit_rows, W.final_norm, xs.mem(), 0, H, w.R, H,
                   eps);
      if (layout_.vocab.identity) {
        ops::linear(dev, xs.mem(), 0, H, W.lm_head, nullptr, logits_.buffer(r), 0, V, w.R);
      } else {
        Scratch draft_logits(dev, size_t(w.R) * Vd * 4);
        ops::linear(dev, xs.mem(), 0, H, W.lm_head, nullptr, draft_logits.mem(), 0, Vd, w.R);
        draft_to_target_vocab(dev, draft_logits.mem(), Vd, rep.draft_of_target, logits_.buffer(r),
                              V, w.R);
      }
    }
    dev.flush();
  }
  logits_.gather(comm_.get(), "draft logits gather");
  for (auto& w : work) w.dev->flush();
  return out;
}

std::unique_ptr<Eagle3Draft> load(const std::filesystem::path& target_dir,
                                  const std::filesystem::path& draft_dir, const LoadOptions& opts) {
  return std::make_unique<Eagle3Draft>(target_dir, draft_dir, opts);
}

}  // namespace clshard::eagle3_deepseek_v3
