// The DeepSeek-V3 forward pass (MAX's DeepseekV3 / DeepseekV3DecoderLayer in DP_EP mode, computed
// as DeepSeek's inference/model.py):
//   h = embed(tokens)
//   per layer: h += o_proj(MLA(norm(h)));  h += MLP(norm(h)) for the first dense layers,
//              h += sum_k w_k expert_k(norm(h)) + shared(norm(h)) for the MoE layers
//   logits = lm_head(norm(h[rows]))
// MLA writes one latent row per token per layer into the paged cache and takes the absorbed
// (decode) or decompressed (prefill) path per step (runtime/ops_mla.h). Routing, permutation and
// combine are runtime/ops_moe.h's; each routed expert runs as its own GEMM over its rows.
//
// On N devices (max-reference.md §3, data_parallel_degree = expert_parallel_degree = N) device r
// holds replica r: the embedding, attention, dense layers, shared experts, norms and lm_head (views
// of the one mapped checkpoint where the device shares host memory), its own MLA cache of
// kv_num_pages() pages, and the routed experts of EP rank r (parallel::place_experts_*). A step's
// rows [data_parallel_splits[r], [r+1]) run attention on device r; every MoE layer routes on each
// device, sends each (token, slot) row to the rank owning its expert (all_to_all_rows, dispatch),
// runs the local experts, sends the outputs back (combine) and sums them in slot order on the
// token's device, so the result does not depend on N. One device is the N = 1 case of the same
// pass, with no collectives.
#pragma once

#include <filesystem>
#include <memory>
#include <optional>
#include <vector>

#include "models/deepseek_v3/config.h"
#include "models/deepseek_v3/weights.h"
#include "models/load_options.h"
#include "parallel/placement.h"
#include "parallel/topology.h"
#include "runtime/model.h"
#include "runtime/ops_mla.h"
#include "runtime/ops_moe.h"
#include "runtime/safetensors.h"

namespace clshard::parallel {
class Communicator;
}

namespace clshard::deepseek_v3 {

class DeepseekV3Model : public CausalLM {
 public:
  // The one layout (MAX's DP_EP: DP = EP = number of devices, TP = 1), and the name the
  // topology's errors give the model.
  static constexpr parallel::Layout kLayout = parallel::Layout::DataParallelAttentionExpertParallel;
  static constexpr const char* kName = "DeepSeek-V3";

  // On every device of opts, placed by `topology` (built from opts when not given; a TopologyError
  // naming parallel.data / parallel.expert / parallel.tensor for any other layout). The expert
  // blocks are the topology's: even, or balanced over measure_device_throughput when
  // opts.balanced_experts; `placement` (made by one of parallel::place_experts_*) overrides them,
  // for tests and tools that pin the blocks.
  DeepseekV3Model(const std::filesystem::path& dir, const LoadOptions& opts,
                  std::optional<parallel::ExpertPlacement> placement = std::nullopt);
  DeepseekV3Model(const std::filesystem::path& dir, const LoadOptions& opts,
                  const parallel::Topology& topology,
                  std::optional<parallel::ExpertPlacement> placement = std::nullopt);
  ~DeepseekV3Model() override;

  const ModelInfo& info() const override { return info_; }
  uint64_t kv_bytes_per_token() const override;
  // num_pages pages (plus the null page) per replica.
  void allocate_kv_cache(uint32_t num_pages, uint32_t page_size) override;
  uint32_t kv_num_pages() const override { return num_pages_; }
  uint32_t kv_page_size() const override { return page_size_; }
  // The returned logits buffer (on the first device) is the model's and stays valid until the
  // next forward.
  StepOutputs forward(const StepInputs& step) override;
  std::vector<Device*> devices() const override;
  uint32_t num_replicas() const override { return uint32_t(replicas_.size()); }

  const DeepseekV3Config& config() const { return cfg_; }
  // Replica 0's weights (its routed experts are EP rank 0's block).
  const DeepseekV3Weights& weights() const { return replicas_.at(0).w; }
  const parallel::ExpertPlacement& expert_placement() const { return placement_; }
  // The per-device throughputs the balanced placement was made from (empty otherwise).
  const std::vector<double>& measured_throughput() const { return throughput_; }
  // The collectives between the devices (their stats); null on one device.
  const parallel::Communicator* communicator() const { return comm_.get(); }
  // Auto (the default) chooses the MLA path per step as MAX does; Decode/Prefill force one, so
  // tests can run both on the same inputs.
  void set_mla_path(ops::MlaPath p) { mla_path_ = p; }
  ops::MlaPath last_mla_path() const { return last_path_; }
  // The MTP layers found in the checkpoint (kept on disk for speculative decoding).
  const std::vector<int64_t>& mtp_layers() const { return mtp_layers_; }

 private:
  // What one device holds.
  struct Replica {
    Device* dev = nullptr;
    DeepseekV3Weights w;  // routed experts: this rank's block only
    cl::Mem inv_freq;
    // Paged MLA cache, one buffer per layer: [(num_pages + 1) * page_size, kv_lora + rope] f32.
    std::vector<cl::Mem> cache;
    cl::Mem logits;  // this replica's logits rows (device 0: the step's whole output)
    size_t logits_capacity = 0;
  };
  struct Work;  // one replica's share of a step (model.cpp)

  // y (+)= down(silu(gate(x)) * up(x)) for M rows on dev; gu is scratch of at least M x 2F floats.
  void mlp(Device& dev, const MlpWeights& m, const cl::Mem& x, uint32_t x_off, uint32_t M,
           uint32_t F, const cl::Mem& gu, const cl::Mem& y, uint32_t y_off, bool accumulate);
  // Every replica's h += routed experts + shared expert of its xn, for MoE layer `layer`.
  void moe(size_t layer, std::vector<Work>& work);

  DeepseekV3Config cfg_;
  std::unique_ptr<WeightStore> store_;  // keeps the mapped files alive under the weights
  std::vector<Replica> replicas_;       // replica r = device r = EP rank r
  parallel::ExpertPlacement placement_;
  std::vector<double> throughput_;
  std::unique_ptr<parallel::Communicator> comm_;  // when more than one device
  std::vector<int64_t> mtp_layers_;
  ModelInfo info_;
  ops::MlaShape mla_;
  ops::RouterConfig router_;
  ops::MlaPath mla_path_ = ops::MlaPath::Auto, last_path_ = ops::MlaPath::Auto;
  // FP8 weights: activations fake-quantized per token per 128 columns before each FP8 linear
  // (LoadOptions::quantize_fp8_activations, as MAX runs FP8 checkpoints), or kept f32 (default).
  bool fp8_act_quant_ = false;
  uint32_t num_pages_ = 0, page_size_ = 0;
};

}  // namespace clshard::deepseek_v3
