#include "models/deepseek_v3/blocks.h"

#include <algorithm>

#include "parallel/collectives.h"
#include "runtime/ops.h"

namespace clshard::deepseek_v3 {

MlaParams MlaParams::from(const DeepseekV3Config& c, bool fp8_act_quant) {
  MlaParams p;
  p.shape.n_heads = uint32_t(c.num_attention_heads);
  p.shape.kv_lora = uint32_t(c.kv_lora_rank);
  p.shape.nope = uint32_t(c.qk_nope_head_dim);
  p.shape.rope = uint32_t(c.qk_rope_head_dim);
  p.shape.v = uint32_t(c.v_head_dim);
  ops::validate(p.shape);
  p.q_lora = uint32_t(c.q_lora_rank);
  p.eps = float(c.rms_norm_eps);
  p.rope_factor = c.rope_attention_factor();
  p.rope_interleave = c.rope_interleave;
  p.softmax_scale = c.softmax_scale();
  p.fp8_act_quant = fp8_act_quant;
  return p;
}

MlaScratch::MlaScratch(Device& dev, const MlaParams& p, size_t rows)
    : qkv_a(dev, rows * p.qkv_a_width() * 4),
      q(dev, rows * p.q_width() * 4),
      qa_norm(dev, rows * std::max(p.q_lora, 1u) * 4),
      att(dev, rows * p.att_width() * 4) {}

void mla_attention(Device& dev, const MlaWeights& a, const MlaParams& p, const cl::Mem& x,
                   uint32_t ldx, uint32_t T, const MlaCacheStep& cs, MlaScratch& s,
                   const cl::Mem& h, uint32_t ldh, bool accumulate, const LayerLora& lora) {
  const uint32_t Lq = p.q_lora, qkv_a_width = p.qkv_a_width(), q_width = p.q_width();
  const uint32_t att_width = p.att_width();
  const bool aq = p.fp8_act_quant;
  auto linear = [&](const cl::Mem& in, uint32_t ld, const Linear& l, const cl::Mem& out,
                    uint32_t off, uint32_t ldo, bool acc) {
    ops::linear_any(dev, in, 0, ld, l.w, &l.scale_inv, out, off, ldo, T, 1.0f, acc, aq, p.compute);
  };
  // Without FP8 weights or adapters q_a and kv_a run side by side in one launch (the bits of two),
  // then q_a_layernorm and q_b (ops::linear_fused). dsv3-mini's decode step launches 6 kernels
  // fewer.
  const bool plain = !lora.active() && !a.q_a.fp8() && !a.kv_a.fp8() && !a.q_b.fp8() &&
                     a.q_a.w.dtype == a.kv_a.w.dtype;
  if (Lq > 0 && plain) {
    ops::linear_fused(dev, x, 0, ldx, nullptr, nullptr, p.eps, {&a.q_a.w, &a.kv_a.w},
                      s.qkv_a.mem(), 0, qkv_a_width, T, 1.0f, false, p.compute);
    ops::linear_fused(dev, s.qkv_a.mem(), 0, qkv_a_width, nullptr, &a.q_a_norm, p.eps,
                      {&a.q_b.w}, s.q.mem(), 0, q_width, T, 1.0f, false, p.compute);
  } else if (Lq > 0) {
    if (lora.active()) {
      linear(x, ldx, a.q_a, s.qkv_a.mem(), 0, qkv_a_width, false);
      lora.apply(kLoraQa, x, 0, ldx, s.qkv_a.mem(), 0, qkv_a_width);
      linear(x, ldx, a.kv_a, s.qkv_a.mem(), Lq, qkv_a_width, false);
      lora.apply(kLoraKvA, x, 0, ldx, s.qkv_a.mem(), Lq, qkv_a_width);
    } else {
      // FP8 q_a and kv_a in one launch where they take linear_fp8's tiles (the bits of two):
      // dsv3-mini fp8's decode step 6 launches fewer.
      ops::linear_any_pair(dev, x, 0, ldx, a.q_a.w, &a.q_a.scale_inv, a.kv_a.w, &a.kv_a.scale_inv,
                           s.qkv_a.mem(), 0, qkv_a_width, T, aq, p.compute);
    }
    ops::rmsnorm(dev, s.qkv_a.mem(), 0, qkv_a_width, nullptr, a.q_a_norm, s.qa_norm.mem(), 0, Lq, T,
                 Lq, p.eps);
    linear(s.qa_norm.mem(), Lq, a.q_b, s.q.mem(), 0, q_width, false);
    lora.apply(kLoraQb, s.qa_norm.mem(), 0, Lq, s.q.mem(), 0, q_width);
  } else {
    linear(x, ldx, a.q, s.q.mem(), 0, q_width, false);
    lora.apply(kLoraQ, x, 0, ldx, s.q.mem(), 0, q_width);
    linear(x, ldx, a.kv_a, s.qkv_a.mem(), 0, qkv_a_width, false);
    lora.apply(kLoraKvA, x, 0, ldx, s.qkv_a.mem(), 0, qkv_a_width);
  }
  ops::mla_rope_store(dev, s.q.mem(), 0, q_width, s.qkv_a.mem(), Lq, qkv_a_width, a.kv_a_norm,
                      p.eps, *cs.inv_freq, p.rope_factor, p.rope_interleave, p.shape, *cs.tokens,
                      *cs.cache_layer);
  if (cs.path == ops::MlaPath::Decode)
    ops::mla_attention_decode(dev, s.q.mem(), 0, q_width, *cs.cache_layer, *cs.tokens, a.kv_b.w,
                              &a.kv_b.scale_inv, p.shape, p.softmax_scale, s.att.mem(), att_width);
  else
    ops::mla_attention_prefill(dev, s.q.mem(), 0, q_width, *cs.cache_layer, *cs.tokens, *cs.plan,
                               a.kv_b.w, &a.kv_b.scale_inv, p.shape, p.softmax_scale, s.att.mem(),
                               att_width, p.compute);
  linear(s.att.mem(), att_width, a.o, h, 0, ldh, accumulate);
  lora.apply(kLoraO, s.att.mem(), 0, att_width, h, 0, ldh);
}

void dense_mlp(Device& dev, const MlpWeights& m, const cl::Mem& x, uint32_t x_off, uint32_t ldx,
               uint32_t M, const cl::Mem& gu, const cl::Mem& y, uint32_t y_off, uint32_t ldy,
               bool accumulate, bool fp8_act_quant, const LayerLora& lora, ComputeDType compute) {
  const uint32_t F = m.gate.out_features();
  // gate and up side by side in gu ([gate | up] per row): FP8 weights in one launch, as q_a and
  // kv_a (dsv3-mini fp8's decode step one launch fewer); the adapters add to their columns after.
  ops::linear_any_pair(dev, x, x_off, ldx, m.gate.w, &m.gate.scale_inv, m.up.w, &m.up.scale_inv, gu,
                       0, 2 * F, M, fp8_act_quant, compute);
  lora.apply(kLoraGate, x, x_off, ldx, gu, 0, 2 * F);
  lora.apply(kLoraUp, x, x_off, ldx, gu, F, 2 * F);
  // silu(gate) * up over the gate half, then the down projection.
  ops::silu_mul(dev, gu, 0, 2 * F, gu, F, 2 * F, gu, 2 * F, M, F);
  ops::linear_any(dev, gu, 0, 2 * F, m.down.w, &m.down.scale_inv, y, y_off, ldy, M, 1.0f,
                  accumulate, fp8_act_quant, compute);
  lora.apply(kLoraDown, gu, 0, 2 * F, y, y_off, ldy);
}

void ReplicaLogits::prepare(const std::vector<Device*>& devs,
                            const std::vector<const DeviceStep*>& steps, uint32_t vocab,
                            StepOutputs& out) {
  const size_t N = devs.size();
  bufs_.resize(N);
  rows_.assign(N, 0);
  vocab_ = vocab;
  total_ = 0;
  // The first replica this process runs (0 in process; over MPI the process's own rank, whose
  // buffer then holds only its rows: the step's logits are on rank 0's process).
  size_t out_r = 0;
  while (out_r + 1 < N && !devs[out_r]) ++out_r;
  out.device = devs[out_r];
  out.vocab = vocab;
  out.logit_offsets = {0};
  for (size_t r = 0; r < N; ++r) {
    const auto& o = steps[r]->logit_offsets;
    for (size_t b = 1; b < o.size(); ++b) out.logit_offsets.push_back(total_ + o[b]);
    rows_[r] = uint32_t(steps[r]->logit_token_indices.size());
    total_ += rows_[r];
  }
  out.rows = total_;
  for (size_t r = 0; r < N; ++r) {
    if (!devs[r]) continue;
    const size_t need = std::max<size_t>(size_t(r == out_r ? total_ : rows_[r]) * vocab, 1);
    if (need > bufs_[r].capacity) {
      bufs_[r].capacity = need;
      bufs_[r].mem = devs[r]->alloc(need * sizeof(float));
    }
  }
  out.logits = bufs_[out_r].mem;
}

void ReplicaLogits::gather(parallel::Communicator* comm, const char* what) {
  const size_t N = bufs_.size();
  if (N < 2 || total_ == 0) return;
  std::vector<std::vector<parallel::DeviceSpan>> send(N, std::vector<parallel::DeviceSpan>(N));
  std::vector<parallel::DeviceSpan> recv(N);
  for (size_t r = 1; r < N; ++r) send[r][0] = {bufs_[r].mem, 0, size_t(rows_[r]) * vocab_};
  recv[0] = {bufs_[0].mem, size_t(rows_[0]) * vocab_, size_t(total_ - rows_[0]) * vocab_};
  comm->all_to_all_rows(send, recv, vocab_, what);
}

}  // namespace clshard::deepseek_v3
