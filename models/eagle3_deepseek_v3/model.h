// The Eagle3 draft over a DeepSeek-V3 target (max-reference.md §6, MAX's Eagle3MLADraft and
// Eagle3MHADraft), one decoder layer:
//   fused = fc(aux)  when the hidden rows are the target's captures (fc_in = 3H, or 2H for an MHA
//                    draft trained so), else the rows themselves (the draft's own H-wide output)
//   x     = [input_layernorm(embed(tokens)) | hidden_norm(fused)]      [T, 2H], target's embed
//   h     = fused + o_proj(attention(x))     MLA (Eagle3DeepseekV3ForCausalLM) over a one-layer
//                                            MLA cache, or GQA with half-split YaRN RoPE
//                                            (LlamaForCausalLMEagle3) over an MHA cache
//   h    += MLP(post_attention_layernorm(h))                            dense SwiGLU
//   logits = lm_head(norm(h))     draft vocabulary, spread over the target's ids by d2t when
//                                 smaller (the rest -inf)
// StepOutputs::hidden is h (before `norm`) at the logits rows: the next draft step's input.
//
// Data parallel as the target: device r holds replica r (all the draft's weights, its own cache
// of kv_num_pages() pages in the target's page ids); a step's rows [data_parallel_splits[r],
// [r+1]) run on device r with hidden[r]; the logits rows are gathered on device 0 in row order.
#pragma once

#include <filesystem>
#include <memory>
#include <vector>

#include "models/deepseek_v3/blocks.h"
#include "models/eagle3_deepseek_v3/config.h"
#include "models/eagle3_deepseek_v3/weights.h"
#include "models/load_options.h"
#include "runtime/model.h"
#include "runtime/ops_mla.h"
#include "runtime/safetensors.h"

namespace clshard::parallel {
class Communicator;
}

namespace clshard::eagle3_deepseek_v3 {

class Eagle3Draft : public DraftModel {
 public:
  // The target checkpoint gives the embedding and the dimensions the draft must match; one
  // replica per device of opts.devices (parallel.data must equal their count).
  Eagle3Draft(const std::filesystem::path& target_dir, const std::filesystem::path& draft_dir,
              const LoadOptions& opts);
  ~Eagle3Draft() override;

  const DraftInfo& info() const override { return info_; }
  uint64_t kv_bytes_per_token() const override;
  // num_pages pages (plus the null page) per replica, as the target's.
  void allocate_kv_cache(uint32_t num_pages, uint32_t page_size) override;
  // The logits buffer (device 0) is the model's until the next forward; the hidden rows are new
  // buffers each step, so a step may read the previous step's.
  StepOutputs forward(const StepInputs& step, const std::vector<ReplicaHidden>& hidden,
                      uint32_t hidden_width) override;

  const Eagle3Config& config() const { return cfg_; }
  DraftKind kind() const { return cfg_.kind; }
  const VocabMap& vocab_map() const { return layout_.vocab; }
  std::vector<Device*> devices() const;
  uint32_t kv_num_pages() const { return num_pages_; }
  uint32_t kv_page_size() const { return page_size_; }
  // MLA drafts: Auto (default) picks the path per step as the target does; tests force one.
  void set_mla_path(ops::MlaPath p) { mla_path_ = p; }
  ops::MlaPath last_mla_path() const { return last_path_; }

 private:
  struct Replica {
    Device* dev = nullptr;
    Eagle3Weights w;
    cl::Mem inv_freq;
    cl::Mem draft_of_target;  // int[vocab] when the vocabulary map is not the identity
    cl::Mem cache;            // one layer: MLA rows, or K and V blocks per page (MHA)
  };
  struct Work;

  void attention(Work& w, Replica& rep, bool accumulate);

  Eagle3Config cfg_;
  deepseek_v3::DeepseekV3Config target_;
  DraftLayout layout_;
  std::unique_ptr<WeightStore> store_, target_store_;  // keep the mappings under the weights
  std::vector<Replica> replicas_;
  std::unique_ptr<parallel::Communicator> comm_;
  deepseek_v3::ReplicaLogits logits_;
  DraftInfo info_;
  deepseek_v3::MlaParams mla_;  // kind Mla
  bool fp8_act_quant_ = false;
  ops::MlaPath mla_path_ = ops::MlaPath::Auto, last_path_ = ops::MlaPath::Auto;
  uint32_t num_pages_ = 0, page_size_ = 0;
};

// The Eagle3 draft in draft_dir for the DeepSeek-V3 target in target_dir: the MLA or the MHA kind
// by the draft's config.json architectures. Errors name the file and key that do not fit.
std::unique_ptr<Eagle3Draft> load(const std::filesystem::path& target_dir,
                                  const std::filesystem::path& draft_dir, const LoadOptions& opts);

}  // namespace clshard::eagle3_deepseek_v3
