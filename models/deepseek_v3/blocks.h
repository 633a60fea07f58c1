// The two halves of a DeepSeek-V3 decoder layer as functions over its weights: MLA attention
// (fused projections, q LoRA, rope + cache store, the absorbed or decompressed attention, o_proj)
// and the dense SwiGLU MLP. The input width is the weights' (q_a_proj / kv_a_proj_with_mqa's
// in_features), so the Eagle3 MLA draft, whose attention reads [embedding | hidden] 2H wide and
// writes H, runs the same code as the target's layers.
#pragma once

#include <cstdint>
#include <vector>

#include "models/deepseek_v3/config.h"
#include "models/deepseek_v3/lora.h"
#include "models/deepseek_v3/weights.h"
#include "runtime/ops_mla.h"
#include "runtime/step_device.h"

namespace clshard::parallel {
class Communicator;
}

namespace clshard::deepseek_v3 {

// What an MLA attention needs besides its weights, from the config it was trained with.
struct MlaParams {
  ops::MlaShape shape;
  uint32_t q_lora = 0;  // 0: a plain q_proj
  float eps = 1e-6f;
  float rope_factor = 1.0f;  // YaRN's multiplier on cos/sin
  bool rope_interleave = true;
  float softmax_scale = 1.0f;
  bool fp8_act_quant = false;  // fake-quantize activations before FP8 linears
  ComputeDType compute = ComputeDType::F32;  // model.compute_dtype (bf16 weights' GEMMs)
  // Throws std::invalid_argument when the kernels cannot take the shape (ops::validate).
  static MlaParams from(const DeepseekV3Config& c, bool fp8_act_quant);
  // Per token: [q_a (q_lora) | c_kv (kv_lora) | k_pe (rope)], then the heads' q and outputs.
  uint32_t qkv_a_width() const { return q_lora + shape.row(); }
  uint32_t q_width() const { return shape.n_heads * shape.qk(); }
  uint32_t att_width() const { return shape.n_heads * shape.v; }
};

// Activations of one MLA attention over up to `rows` tokens.
struct MlaScratch {
  MlaScratch() = default;
  MlaScratch(Device& dev, const MlaParams& p, size_t rows);
  Scratch qkv_a, q, qa_norm, att;
};

// One step's view of the paged MLA cache: its layer buffer, the tokens' rows and positions, the
// path and (for the decompressed path) the prefill plan.
struct MlaCacheStep {
  const cl::Mem* cache_layer = nullptr;
  const ops::StepTokens* tokens = nullptr;
  ops::MlaPath path = ops::MlaPath::Decode;
  const ops::MlaPrefillPlan* plan = nullptr;  // path == Prefill
  const cl::Mem* inv_freq = nullptr;          // qk_rope_head_dim / 2 floats
};

// h[T, o_proj out] (+)= o_proj(MLA(x)) for x [T, a.kv_a.in_features()] at row stride ldx; writes
// the T tokens' cache rows first. `lora` adds the adapters' products to the projections' outputs
// (q_a, q_b or q, kv_a before its norm and the cache, o).
void mla_attention(Device& dev, const MlaWeights& a, const MlaParams& p, const cl::Mem& x,
                   uint32_t ldx, uint32_t T, const MlaCacheStep& cs, MlaScratch& s,
                   const cl::Mem& h, uint32_t ldh, bool accumulate = true,
                   const LayerLora& lora = {});

// y[M, down out] (+)= down(silu(gate(x)) * up(x)), x rows of gate's in_features at stride ldx;
// gu is scratch of at least M x 2 x gate's out_features floats. `lora` (its M rows are the
// step's tokens) adds the adapters' gate, up and down products.
void dense_mlp(Device& dev, const MlpWeights& m, const cl::Mem& x, uint32_t x_off, uint32_t ldx,
               uint32_t M, const cl::Mem& gu, const cl::Mem& y, uint32_t y_off, uint32_t ldy,
               bool accumulate, bool fp8_act_quant, const LayerLora& lora = {},
               ComputeDType compute = ComputeDType::F32);

// The logits of a step whose rows run on data-parallel replicas with a replicated lm_head (MAX's
// DP mode): replica r writes its rows' logits into buffer(r), and device 0's buffer, which the
// step returns, receives the other replicas' rows behind its own, in replica order = row order.
class ReplicaLogits {
 public:
  // From each replica's uploaded step: sets out.device (devs[0]), vocab, rows, logit_offsets and
  // logits, growing the buffers to the rows they take.
  void prepare(const std::vector<Device*>& devs, const std::vector<const DeviceStep*>& steps,
               uint32_t vocab, StepOutputs& out);
  const cl::Mem& buffer(size_t r) const { return bufs_.at(r).mem; }
  uint32_t rows(size_t r) const { return rows_.at(r); }
  // Sends replicas 1..'s rows to device 0 (nothing to do on one device).
  void gather(parallel::Communicator* comm, const char* what);

 private:
  struct Buffer {
    cl::Mem mem;
    size_t capacity = 0;  // floats
  };
  std::vector<Buffer> bufs_;
  std::vector<uint32_t> rows_;
  uint32_t vocab_ = 0, total_ = 0;
};

}  // namespace clshard::deepseek_v3
