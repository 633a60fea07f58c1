// What the engine sees of a model: one forward step over a ragged batch with a paged KV cache, and
// what a speculative-decoding draft adds. Only the interfaces: runtime/ knows no model, and the
// loaders (load_model, load_draft, make_model, plan_checkpoint) are models/registry.h's.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "runtime/step.h"

namespace clshard {

class Device;

struct ModelInfo {
  std::string architecture;  // config.json architectures[0]
  uint32_t vocab_size = 0;
  uint32_t hidden_size = 0;
  uint32_t num_layers = 0;
  uint32_t max_seq_len = 0;
  std::vector<int32_t> eos_token_ids;
  std::optional<int32_t> bos_token_id;
  uint64_t weight_bytes = 0;

  // max_seq_len = max_length when given (MAX's upper_bounded_default): an error past the
  // checkpoint's max_position_embeddings, which max_seq_len holds before the call.
  void cap_max_seq_len(std::optional<uint32_t> max_length, const std::filesystem::path& dir);
  void set_special_tokens(const std::vector<int64_t>& eos, std::optional<int64_t> bos);
};

class CausalLM {
 public:
  virtual ~CausalLM() = default;
  virtual const ModelInfo& info() const = 0;
  // Bytes one token's KV takes over all layers (sizes the page pool).
  virtual uint64_t kv_bytes_per_token() const = 0;
  // (Re)allocates the paged KV cache: num_pages pages of page_size tokens plus the null page.
  virtual void allocate_kv_cache(uint32_t num_pages, uint32_t page_size) = 0;
  virtual uint32_t kv_num_pages() const = 0;
  virtual uint32_t kv_page_size() const = 0;
  // One step: writes the new tokens' KV, returns logits for the positions the step asks for.
  virtual StepOutputs forward(const StepInputs& step) = 0;
  // The devices the model runs on (logits land on the first).
  virtual std::vector<Device*> devices() const = 0;
  // Data-parallel replicas; each has its own KV pages (kv_num_pages() each), and a step says
  // whose rows are whose with data_parallel_splits.
  virtual uint32_t num_replicas() const { return 1; }
  // LoRA adapters loaded (StepInputs::adapter_ids 1 .. this); 0 when the model has none.
  virtual uint32_t num_lora_adapters() const { return 0; }
  // How many of them may be resident at once (lora.max_loaded): a step's rows, and a replica's
  // running requests, run at most this many distinct adapters. 0 when the model has none.
  virtual uint32_t max_loaded_lora_adapters() const { return 0; }
};

// A draft model for speculative decoding (NextN/MTP, Eagle3). It runs on the target's devices with
// the target's replica layout, keeps a one-layer paged cache of its own that shares the target's
// page ids and cache lengths (allocate_kv_cache with the target's page count and size), and reads
// hidden states the target returns (StepOutputs::hidden).
//
// Draft position i reads the token at position i + 1 and a hidden row of position i: at a draft's
// first step after a target step, the target's hidden rows (target_hidden, target_hidden_width
// wide); at the later one-token steps, the draft's own output rows of its previous step
// (hidden_size wide, StepOutputs::hidden of that step). Its logits at position i predict the token
// at i + 2.
struct DraftInfo {
  std::string architecture;     // the draft's own config.json architecture
  uint32_t vocab_size = 0;      // equals the target's
  uint32_t hidden_size = 0;     // width of the draft's own output rows
  ReturnHidden target_hidden = ReturnHidden::AllNormalized;  // what the target step must return
  std::vector<uint32_t> target_layers;  // SelectedLayers: 0-based target layers, in order
  uint32_t target_hidden_width = 0;     // width of those rows (H, or 3H for Eagle3 captures)
  uint64_t weight_bytes = 0;            // the draft's own weights (shared ones not counted)
};

class DraftModel {
 public:
  virtual ~DraftModel() = default;
  virtual const DraftInfo& info() const = 0;
  virtual uint64_t kv_bytes_per_token() const = 0;
  virtual void allocate_kv_cache(uint32_t num_pages, uint32_t page_size) = 0;
  // `step` as the target's (tokens = the inputs described above, data_parallel_splits the same
  // replicas); hidden[r] holds one row per token of replica r's rows, hidden_width wide (equal to
  // info().target_hidden_width or info().hidden_size). Returns logits for the rows the step asks
  // (step.return_logits / logits_per_row) and, per replica, the draft's output rows before its
  // final norm at those same positions. `hidden` may be the output rows of the draft's previous
  // step (the engine feeds them straight back): read them before writing the new ones.
  virtual StepOutputs forward(const StepInputs& step, const std::vector<ReplicaHidden>& hidden,
                              uint32_t hidden_width) = 0;
};

}  // namespace clshard
