#include "models/deepseek_v3_nextn/model.h"

#include "models/deepseek_v3/model.h"

#include <stdexcept>
#include <string>

#include "runtime/device.h"
#include "runtime/ops.h"
#include "runtime/ops_mla.h"
#include "runtime/ops_moe.h"

namespace clshard::deepseek_v3_nextn {

DeepseekV3NextN::DeepseekV3NextN(const std::filesystem::path& target_dir,
                                 const std::optional<std::filesystem::path>& nextn_dir,
                                 const LoadOptions& opts)
    : cfg_(NextNConfig::locate(target_dir, nextn_dir)),
      stack_(cfg_.target, cfg_.weights_dir, opts,
             parallel::Topology(deepseek_v3::DeepseekV3Model::kLayout, opts.degrees(),
                                opts.devices.size(), "DeepSeek-V3 NextN"),
             std::nullopt, "deepseek_v3_nextn") {
  // The target's files stay mapped, the NextN block's among them when it ships inside them: a copy
  // here would be a second one of the whole target beside the target model's. model.mmap applies
  // to a NextN directory of its own.
  target_store_ = std::make_unique<WeightStore>(target_dir);
  const WeightStore* block = target_store_.get();
  if (nextn_dir) {
    block_store_ =
        std::make_unique<WeightStore>(*nextn_dir, opts.weight_memory, opts.load_progress);
    block = block_store_.get();
  }
  for (size_t r = 0; r < stack_.replicas(); ++r) {
    const auto [first, end] = stack_.expert_block(r);
    weights_.push_back(load_weights(cfg_, *target_store_, *block, stack_.device(r), first, end));
    stack_.set_layers(r, {weights_.back().layer});
  }
  const auto& c = cfg_.target;
  info_.architecture = "DeepseekV3NextN";
  info_.vocab_size = uint32_t(c.vocab_size);
  info_.hidden_size = uint32_t(c.hidden_size);
  info_.target_hidden = ReturnHidden::AllNormalized;
  info_.target_hidden_width = uint32_t(c.hidden_size);
  // The block's own tensors (the embedding and lm_head are the target's).
  for (const auto& name : block->names())
    if (name.compare(0, cfg_.prefix.size(), cfg_.prefix) == 0 &&
        name.find("embed_tokens") == std::string::npos &&
        name.find("shared_head.head") == std::string::npos)
      info_.weight_bytes += block->get(name).bytes;
}

DeepseekV3NextN::~DeepseekV3NextN() = default;

StepOutputs DeepseekV3NextN::forward(const StepInputs& in, const std::vector<ReplicaHidden>& hidden,
                                     uint32_t hidden_width) {
  const size_t N = stack_.replicas();
  const uint32_t H = info_.hidden_size, V = info_.vocab_size;
  if (hidden_width != H)
    throw std::invalid_argument("NextN draft: hidden rows are " + std::to_string(hidden_width) +
                                " wide, the block reads " + std::to_string(H));
  std::vector<deepseek_v3::ReplicaWork> work = stack_.begin_step(in, V, 2 * H);
  if (hidden.size() != N)
    throw std::invalid_argument("NextN draft: hidden states for " +
                                std::to_string(hidden.size()) + " replica(s), the draft has " +
                                std::to_string(N));
  const float eps = stack_.eps();
  for (size_t r = 0; r < N; ++r) {
    deepseek_v3::ReplicaWork& w = work[r];
    if (hidden[r].count != w.T)
      throw std::invalid_argument("NextN draft: replica " + std::to_string(r) + " has " +
                                  std::to_string(w.T) + " tokens but " +
                                  std::to_string(hidden[r].count) + " hidden rows");
    if (w.T == 0) continue;
    const NextNWeights& nw = weights_[r];
    Device& dev = *w.dev;
    ops::embedding(dev, w.st.token_ids, w.T, nw.embed, w.h.mem(), 1.0f);
    ops::rmsnorm(dev, w.h.mem(), 0, H, nullptr, nw.enorm, w.xn.mem(), 0, 2 * H, w.T, H, eps);
    ops::rmsnorm(dev, hidden[r].rows, 0, H, nullptr, nw.hnorm, w.xn.mem(), H, 2 * H, w.T, H, eps);
    ops::linear_any(dev, w.xn.mem(), 0, 2 * H, nw.eh_proj.w, &nw.eh_proj.scale_inv, w.h.mem(), 0,
                    H, w.T, 1.0f, false, stack_.fp8_act_quant());
  }
  stack_.run_layers(work);
  // The block's output before shared_head_norm at the logit rows: the next draft step's hidden.
  std::vector<ReplicaHidden> out_hidden;
  for (size_t r = 0; r < N; ++r) {
    deepseek_v3::ReplicaWork& w = work[r];
    const uint32_t rows = uint32_t(w.st.logit_token_indices.size());
    out_hidden.push_back(stack_.hidden_buffer(r, rows, H));
    if (rows > 0)
      ops::gather_rows(*w.dev, w.h.mem(), H, w.st.logit_rows, rows, H, out_hidden.back().rows, H);
  }
  std::vector<const Weight*> norm, head;
  for (const auto& nw : weights_) {
    norm.push_back(&nw.shared_head_norm);
    head.push_back(&nw.lm_head);
  }
  StepOutputs out = stack_.logits(work, norm, head);
  out.hidden = std::move(out_hidden);
  out.hidden_width = H;
  return out;
}

}  // namespace clshard::deepseek_v3_nextn
