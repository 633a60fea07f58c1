// DeepSeek-V3 decoder layers over N devices — what the target model and its NextN/MTP head both
// run (MAX's DeepseekV3DecoderLayer in DP_EP mode, computed as DeepSeek's inference/model.py):
//   per layer: h += o_proj(MLA(norm(h)));  h += MLP(norm(h)) for the first dense layers,
//              h += sum_k w_k expert_k(norm(h)) + shared(norm(h)) for the MoE layers
// MLA writes one latent row per token per layer into the paged cache and takes the absorbed
// (decode) or decompressed (prefill) path per step (runtime/ops_mla.h). Routing, permutation and
// combine are runtime/ops_moe.h's. On one device whose experts are grouped (MoeWeights::grouped)
// the routing, the plan and the experts stay on the device: one grouped launch per projection
// over the active experts, the shared expert among them. Otherwise the routing is read back, and
// each routed expert runs as its own GEMM over its rows; both give the same values.
//
// On N devices (max-reference.md §3, data_parallel_degree = expert_parallel_degree = N) device r
// holds replica r: attention, dense layers, shared experts and norms, its own MLA cache, and the
// routed experts of EP rank r. A step's rows [data_parallel_splits[r], [r+1]) run attention on
// device r; every MoE layer routes on each device, sends each (token, slot) row to the rank owning
// its expert (all_to_all_rows, dispatch), runs the local experts, sends the outputs back (combine)
// and sums them in slot order on the token's device, so the result does not depend on N. One
// device is the N = 1 case of the same pass, with no collectives.
//
// Over MPI (LoadOptions::mpi_ranks) the N ranks are processes: each builds the stack for the whole
// topology but holds and runs only its own rank's replica (local(r)); the others' replicas have no
// device and look idle here (ReplicaWork::T = 0, their step known on the host only), and the
// collectives exchange with them. Every process runs the same steps (the same StepInputs).
#pragma once

#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "models/deepseek_v3/blocks.h"
#include "models/deepseek_v3/config.h"
#include "models/deepseek_v3/lora.h"
#include "models/deepseek_v3/weights.h"
#include "parallel/placement.h"
#include "parallel/topology.h"
#include "models/load_options.h"
#include "runtime/model.h"
#include "runtime/ops_mla.h"
#include "runtime/ops_moe.h"
#include "runtime/step_device.h"

namespace clshard::parallel {
class Communicator;
}

namespace clshard::deepseek_v3 {

// One replica's share of a step: its rows as a step of their own, uploaded to its device, and the
// activations of its T tokens (buffers of at least one row, so an idle replica still has spans to
// hand to the collectives).
struct ReplicaWork {
  Device* dev = nullptr;
  StepInputs in;
  DeviceStep st;
  ops::MlaPrefillPlan plan;
  uint32_t T = 0;
  Scratch h, xn, gu;
  MlaScratch mla;
  LoraAdapters::Batch lora;  // the step's adapters on this replica (inactive: none)
};

class DecoderStack {
 public:
  // On opts.devices as `topology` (DP = EP = number of devices, checked there) places them: the
  // expert blocks are `placement` when given (tests and tools that pin the blocks), else the
  // topology's (even, or balanced over measured device throughput). Opens the communicator.
  // `dir` names the checkpoint in errors, `who` the model in messages. Replicas get their layers
  // with set_layers() (loaded for each rank's expert block, expert_block()).
  DecoderStack(const DeepseekV3Config& cfg, const std::filesystem::path& dir,
               const LoadOptions& opts, const parallel::Topology& topology,
               std::optional<parallel::ExpertPlacement> placement, const char* who);
  ~DecoderStack();

  size_t replicas() const { return replicas_.size(); }
  // Whether this process runs replica r (always, unless the ranks are MPI processes).
  bool local(size_t r) const { return replicas_.at(r).dev != nullptr; }
  Device& device(size_t r) const { return *replicas_.at(r).dev; }
  std::vector<Device*> devices() const;  // of the local replicas
  // The routed experts rank r holds: [first, second).
  std::pair<uint32_t, uint32_t> expert_block(size_t r) const {
    return {placement_.first_expert.at(r), placement_.first_expert.at(r + 1)};
  }
  void set_layers(size_t r, std::vector<LayerWeights> layers) {
    replicas_.at(r).layers = std::move(layers);
  }
  const LayerWeights& layer(size_t r, size_t l) const { return replicas_.at(r).layers.at(l); }
  size_t num_layers() const { return replicas_.at(first_local_).layers.size(); }

  const parallel::ExpertPlacement& placement() const { return placement_; }
  const std::vector<double>& measured_throughput() const { return throughput_; }
  const parallel::Communicator* communicator() const { return comm_.get(); }
  const ops::MlaShape& mla() const { return mla_; }

  uint64_t kv_bytes_per_token() const;
  // num_pages pages (plus the null page) per replica, one buffer per layer.
  void allocate_cache(uint32_t num_pages, uint32_t page_size);
  bool has_cache() const { return !replicas_.at(first_local_).cache.empty(); }
  uint32_t num_pages() const { return num_pages_; }
  uint32_t page_size() const { return page_size_; }

  void set_mla_path(ops::MlaPath p) { mla_path_ = p; }
  ops::MlaPath last_mla_path() const { return last_path_; }

  // Splits the step over the replicas (data_parallel_splits), uploads each share, picks one MLA
  // path for the whole step (so each replica computes what one device would) and takes scratch;
  // `input_width` widens `xn` for inputs wider than H (the NextN head's [embedding | hidden]).
  std::vector<ReplicaWork> begin_step(const StepInputs& in, uint32_t vocab,
                                      uint32_t input_width = 0);
  // Every layer over every replica's h; after_layer(l) runs once all replicas finished layer l.
  void run_layers(std::vector<ReplicaWork>& work,
                  const std::function<void(size_t layer)>& after_layer = {});
  // logits = lm_head(final_norm(h[logit rows])) per replica, gathered on device 0 in row order.
  // The buffer is the stack's and stays valid until the next call.
  StepOutputs logits(std::vector<ReplicaWork>& work, const std::vector<const Weight*>& final_norm,
                     const std::vector<const Weight*>& lm_head);
  // A per-replica buffer of rows x width floats that stays valid until the next step (hidden
  // states returned to the caller).
  ReplicaHidden hidden_buffer(size_t r, uint32_t rows, uint32_t width);

  // LoRA: reads and checks opts.lora_adapters against the model (lora.h) once, and gives every
  // local replica its own resident set of at most opts.lora_max_loaded. The drafts' stacks load
  // none (their layers run the base model).
  void load_lora(const LoadOptions& opts);
  uint32_t lora_adapters() const { return replicas_.at(first_local_).lora.count(); }
  uint32_t lora_slots() const { return replicas_.at(first_local_).lora.slots(); }
  const LoraAdapters& lora(size_t r) const { return replicas_.at(r).lora; }

  float eps() const { return float(cfg_.rms_norm_eps); }
  bool fp8_act_quant() const { return fp8_act_quant_; }

 private:
  struct Replica {
    Device* dev = nullptr;
    std::vector<LayerWeights> layers;  // routed experts: this rank's block only
    cl::Mem inv_freq;
    // Paged MLA cache, one buffer per layer: [(num_pages + 1) * page_size, kv_lora + rope] f32.
    std::vector<cl::Mem> cache;
    cl::Mem hidden;  // hidden states returned by the last step
    size_t hidden_capacity = 0;
    LoraAdapters lora;
  };

  void attention(size_t l, ReplicaWork& w, Replica& rep);
  // Every replica's h += routed experts + shared expert of its xn, for MoE layer `layer`.
  void moe(size_t layer, std::vector<ReplicaWork>& work);
  // moe() on a single device with grouped experts: no host round trip (ops_moe.h's device plan).
  void moe_on_device(size_t layer, ReplicaWork& w);
  // The grouped experts g over the plan's rows: gate and up with the SwiGLU, then down, into out
  // [plan.rows, H]. Row r reads x row src_token[r] with x_rows (x_count tokens), else x row r.
  void grouped_experts(Device& dev, const ops::GroupedExperts& g, const ops::GroupedPlan& plan,
                       const cl::Mem& x, const cl::Mem* x_rows, uint32_t x_count,
                       const cl::Mem& out) const;

  DeepseekV3Config cfg_;
  std::vector<Replica> replicas_;  // replica r = device r = EP rank r (dev null: another process)
  size_t first_local_ = 0;
  parallel::ExpertPlacement placement_;
  std::vector<double> throughput_;
  std::unique_ptr<parallel::Communicator> comm_;  // when more than one device
  ops::MlaShape mla_;
  MlaParams mla_params_;
  ops::RouterConfig router_;
  ReplicaLogits logits_;
  ops::MlaPath mla_path_ = ops::MlaPath::Auto, last_path_ = ops::MlaPath::Auto;
  // FP8 weights: activations fake-quantized per token per 128 columns before each FP8 linear
  // (LoadOptions::quantize_fp8_activations, as MAX runs FP8 checkpoints), or kept f32 (default).
  bool fp8_act_quant_ = false;
  ComputeDType compute_ = ComputeDType::F32;  // model.compute_dtype: the dense and expert GEMMs
  uint32_t num_pages_ = 0, page_size_ = 0;
};

}  // namespace clshard::deepseek_v3
