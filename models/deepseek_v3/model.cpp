#include "models/deepseek_v3/model.h"

#include <algorithm>
#include <iostream>
#include <stdexcept>

#include "runtime/device.h"
#include "runtime/ops.h"
#include "runtime/ops_moe.h"
#include "runtime/step_device.h"

namespace clshard::deepseek_v3 {

DeepseekV3Model::DeepseekV3Model(const std::filesystem::path& dir, const LoadOptions& opts,
                                 std::optional<parallel::ExpertPlacement> placement)
    : DeepseekV3Model(
          dir, opts,
          parallel::Topology(kLayout, opts.degrees(), opts.ranks(), kName, opts.processes()),
          std::move(placement)) {}

DeepseekV3Model::DeepseekV3Model(const std::filesystem::path& dir, const LoadOptions& opts,
                                 const parallel::Topology& topology,
                                 std::optional<parallel::ExpertPlacement> placement)
    : cfg_(DeepseekV3Config::from_dir(dir)),
      stack_(cfg_, dir, opts, topology, std::move(placement), "deepseek_v3") {
  store_ = std::make_unique<WeightStore>(dir, opts.weight_memory, opts.load_progress);
  for (size_t r = 0; r < stack_.replicas(); ++r) {
    if (!stack_.local(r)) {  // another process loads it
      weights_.emplace_back();
      continue;
    }
    const auto [first, end] = stack_.expert_block(r);
    weights_.push_back(load_weights(cfg_, *store_, stack_.device(r), first, end));
    stack_.set_layers(r, weights_.back().layers);
  }
  mtp_layers_ = mtp_layers_present(cfg_, *store_);
  stack_.load_lora(opts);

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

std::vector<Device*> DeepseekV3Model::devices() const { return stack_.devices(); }

uint64_t DeepseekV3Model::kv_bytes_per_token() const { return stack_.kv_bytes_per_token(); }

void DeepseekV3Model::allocate_kv_cache(uint32_t num_pages, uint32_t page_size) {
  stack_.allocate_cache(num_pages, page_size);
}

StepOutputs DeepseekV3Model::forward(const StepInputs& in) {
  const size_t N = stack_.replicas();
  const uint32_t H = info_.hidden_size, V = info_.vocab_size;
  std::vector<ReplicaWork> work = stack_.begin_step(in, V);

  // Hidden states for a draft: per replica one row per token, in step order.
  const ReturnHidden want = in.return_hidden;
  uint32_t width = H;
  std::vector<uint32_t> capture_at;  // layer -> column block, for SelectedLayers
  if (want == ReturnHidden::SelectedLayers) {
    if (in.hidden_layers.empty())
      throw std::invalid_argument("step: return_hidden = SelectedLayers with no hidden_layers");
    capture_at.assign(size_t(cfg_.num_hidden_layers), UINT32_MAX);
    for (size_t j = 0; j < in.hidden_layers.size(); ++j) {
      const uint32_t l = in.hidden_layers[j];
      if (l >= uint32_t(cfg_.num_hidden_layers))
        throw std::invalid_argument("step: hidden layer " + std::to_string(l) +
                                    " is outside the model's " +
                                    std::to_string(cfg_.num_hidden_layers) + " layers");
      capture_at[l] = uint32_t(j);
    }
    width = uint32_t(in.hidden_layers.size()) * H;
  }
  std::vector<ReplicaHidden> hidden;
  std::vector<Scratch> last_rows(N);  // LastPerRow: each row's last token, per replica
  for (size_t r = 0; r < N && want != ReturnHidden::None; ++r) {
    uint32_t rows = work[r].T;
    if (want == ReturnHidden::LastPerRow) {
      std::vector<uint32_t> last;
      const auto& off = work[r].in.input_row_offsets;
      for (size_t b = 0; b + 1 < off.size(); ++b)
        if (off[b + 1] > off[b]) last.push_back(off[b + 1] - 1);
      rows = uint32_t(last.size());
      last_rows[r] = Scratch(*work[r].dev, std::max<size_t>(rows, 1) * 4);
      if (rows > 0) work[r].dev->write(last_rows[r].mem(), last.data(), rows * 4);
    }
    hidden.push_back(stack_.hidden_buffer(r, rows, width));
  }

  for (size_t r = 0; r < N; ++r)
    if (work[r].T > 0)
      ops::embedding(*work[r].dev, work[r].st.token_ids, work[r].T, weights_[r].embed,
                     work[r].h.mem(), 1.0f);
  stack_.run_layers(work, [&](size_t l) {
    if (want != ReturnHidden::SelectedLayers || capture_at[l] == UINT32_MAX) return;
    for (size_t r = 0; r < N; ++r)
      if (work[r].T > 0)
        ops::copy_rows(*work[r].dev, work[r].h.mem(), 0, H, hidden[r].rows, capture_at[l] * H,
                       width, work[r].T, H);
  });
  for (size_t r = 0; r < N; ++r) {
    ReplicaWork& w = work[r];
    if (w.T == 0) continue;
    if (want == ReturnHidden::All)
      ops::copy_rows(*w.dev, w.h.mem(), 0, H, hidden[r].rows, 0, H, w.T, H);
    else if (want == ReturnHidden::LastPerRow && hidden[r].count > 0)
      ops::gather_rows(*w.dev, w.h.mem(), H, last_rows[r].mem(), hidden[r].count, H,
                       hidden[r].rows, H);
    else if (want == ReturnHidden::AllNormalized)
      ops::rmsnorm(*w.dev, w.h.mem(), 0, H, nullptr, weights_[r].final_norm, hidden[r].rows, 0, H,
                   w.T, H, stack_.eps());
  }
  std::vector<const Weight*> norm, head;
  for (const auto& w : weights_) {
    norm.push_back(&w.final_norm);
    head.push_back(&w.lm_head);
  }
  StepOutputs out = stack_.logits(work, norm, head);
  out.hidden = std::move(hidden);
  out.hidden_width = want == ReturnHidden::None ? 0 : width;
  return out;
}

}  // namespace clshard::deepseek_v3
