// The DeepSeek-V3 forward pass (MAX's DeepseekV3, computed as DeepSeek's inference/model.py):
//   h = embed(tokens); the decoder layers (decoder.h: DP attention + EP MoE over the devices);
//   logits = lm_head(norm(h[rows]))
// Device r holds replica r: the embedding, the layers (its expert block), the final norm and
// lm_head (views of the one mapped checkpoint where the device shares host memory), and its own
// MLA cache of kv_num_pages() pages. A step can also return hidden states (StepInputs::
// return_hidden) for a speculative draft: the last layer's output, the same after the final
// norm (NextN/MTP), or the raw outputs of selected layers concatenated (Eagle3).
#pragma once

#include <filesystem>
#include <memory>
#include <optional>
#include <vector>

#include "models/deepseek_v3/config.h"
#include "models/deepseek_v3/decoder.h"
#include "models/deepseek_v3/weights.h"
#include "models/load_options.h"
#include "parallel/placement.h"
#include "parallel/topology.h"
#include "runtime/model.h"
#include "runtime/ops_mla.h"
#include "runtime/ops_moe.h"
#include "runtime/safetensors.h"

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
  uint32_t kv_num_pages() const override { return stack_.num_pages(); }
  uint32_t kv_page_size() const override { return stack_.page_size(); }
  // The returned logits buffer (on the first device) is the model's and stays valid until the
  // next forward.
  StepOutputs forward(const StepInputs& step) override;
  std::vector<Device*> devices() const override;
  uint32_t num_replicas() const override { return uint32_t(stack_.replicas()); }
  uint32_t num_lora_adapters() const override { return stack_.lora_adapters(); }
  uint32_t max_loaded_lora_adapters() const override { return stack_.lora_slots(); }

  const DeepseekV3Config& config() const { return cfg_; }
  // Replica 0's weights (its routed experts are EP rank 0's block).
  const DeepseekV3Weights& weights() const { return weights_.at(0); }
  const DecoderStack& stack() const { return stack_; }
  const parallel::ExpertPlacement& expert_placement() const { return stack_.placement(); }
  // The per-device throughputs the balanced placement was made from (empty otherwise).
  const std::vector<double>& measured_throughput() const {
    return stack_.measured_throughput();
  }
  // The collectives between the devices (their stats); null on one device.
  const parallel::Communicator* communicator() const { return stack_.communicator(); }
  // Auto (the default) chooses the MLA path per step as MAX does; Decode/Prefill force one, so
  // tests can run both on the same inputs.
  void set_mla_path(ops::MlaPath p) { stack_.set_mla_path(p); }
  ops::MlaPath last_mla_path() const { return stack_.last_mla_path(); }
  // The MTP layers found in the checkpoint (kept on disk for speculative decoding).
  const std::vector<int64_t>& mtp_layers() const { return mtp_layers_; }

 private:
  DeepseekV3Config cfg_;
  std::unique_ptr<WeightStore> store_;  // keeps the mapped files alive under the weights
  DecoderStack stack_;
  std::vector<DeepseekV3Weights> weights_;  // per replica (layers handed to stack_)
  std::vector<int64_t> mtp_layers_;
  ModelInfo info_;
};

}  // namespace clshard::deepseek_v3
