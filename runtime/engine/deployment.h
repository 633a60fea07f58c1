// A deployment file brought to life: devices opened, model and tokenizer loaded, KV pages sized
// and allocated, an engine ready. Shared by `run`, `generate`, `logits` and `bench`.
#pragma once

#include <memory>
#include <optional>

#include "runtime/device_manager.h"
#include "runtime/engine/batch_io.h"
#include "runtime/engine/deploy_config.h"
#include "runtime/engine/engine.h"
#include "runtime/model.h"
#include "runtime/text/tokenizer.h"

namespace clshard {

struct Deployment {
  DeployConfig config;
  std::unique_ptr<DeviceManager> devices;
  std::unique_ptr<CausalLM> model;
  std::unique_ptr<DraftModel> draft;  // speculative decoding (speculative.method)
  std::optional<Tokenizer> tokenizer;  // when the checkpoint has tokenizer.json
  SchedulerLimits limits;
  // cluster.transport: mpi — this process's rank and the ranks (processes); 0 ranks in process.
  // Rank 0 reads the job and writes the output.
  uint32_t mpi_rank = 0, mpi_ranks = 0;

  // Opens and loads everything the file names. Errors name the file and key where they can.
  static Deployment open(const DeployConfig& cfg);
  std::unique_ptr<Engine> make_engine();
  // The YAML's sampling defaults as the sampler's parameters.
  static SamplingParams sampling_params(const SamplingDefaults& d);
  // A request's LoRA adapter by name: 1 + its index in lora.adapters (the model's adapter id);
  // 0 for none. An unknown name is an error naming the declared ones.
  uint32_t lora_adapter_id(const std::optional<std::string>& name) const;
  // A request's prompt as token ids: text encoded (special tokens as the tokenizer adds them),
  // messages rendered with the chat template, ids checked against the vocabulary.
  std::vector<int32_t> prompt_ids(const std::optional<std::string>& prompt,
                                  const std::optional<std::vector<int32_t>>& ids,
                                  const std::optional<std::vector<ChatTurn>>& messages) const;
};

}  // namespace clshard
