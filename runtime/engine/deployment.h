// A deployment file brought to life: devices opened, model and tokenizer loaded, KV pages sized
// and allocated, an engine ready. Shared by `run`, `generate`, `logits` and `bench`.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "runtime/device_manager.h"
#include "runtime/engine/batch_io.h"
#include "runtime/engine/deploy_config.h"
#include "runtime/engine/engine.h"
#include "runtime/model.h"
#include "runtime/safetensors.h"
#include "runtime/text/tokenizer.h"

namespace clshard {

// A request's structured-output fields (null when not given) and the names they have in the
// request, for the errors that name them ("response_format", "body.response_format", ...).
struct RequestFormat {
  const nlohmann::ordered_json* response_format = nullptr;
  const std::string* regex = nullptr;
  std::string response_format_field = "response_format", regex_field = "regex";
};

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
  // `progress` is told how a copy of the weights (model.mmap: false) goes; over MPI, rank 0's.
  static Deployment open(const DeployConfig& cfg, const LoadProgress& progress = {});
  std::unique_ptr<Engine> make_engine();
  // The YAML's sampling defaults as the sampler's parameters.
  static SamplingParams sampling_params(const SamplingDefaults& d);
  // A request's LoRA adapter by name: 1 + its index in lora.adapters (the model's adapter id);
  // 0 for none. An unknown name is an error naming the declared ones.
  uint32_t lora_adapter_id(const std::optional<std::string>& name) const;
  // The engine's request for a prompt and a request's fields, as the batch job and the server
  // both build it: the sampler's parameters, max_tokens, stop strings and ids, ignore_eos, the LoRA
  // adapter (lora_adapter_id) and the structured output compiled with the tokenizer
  // (std::invalid_argument naming the field when it is bad, or when there is no tokenizer).
  GenerationRequest generation_request(std::vector<int32_t> prompt, const SamplingDefaults& s,
                                       const std::optional<std::string>& lora,
                                       const RequestFormat& format = {}) const;
  // The engine requests of a request's sampling.n choices: choice i samples with
  // choice_seed(seed, i) (sampling.h); n <= 1 gives the request itself.
  static std::vector<GenerationRequest> choice_requests(const GenerationRequest& g, int32_t n);
  // The engine's log-probabilities with each token's text (decoded alone) and bytes, as the
  // outputs show them (batch_io.h); texts are empty without a tokenizer.
  std::vector<RecordLogprobs> logprobs_text(const std::vector<TokenLogprobs>& lps) const;
  // A request's prompt as token ids: text encoded (special tokens as the tokenizer adds them),
  // messages rendered with the chat template, ids checked against the vocabulary.
  std::vector<int32_t> prompt_ids(const std::optional<std::string>& prompt,
                                  const std::optional<std::vector<int32_t>>& ids,
                                  const std::optional<std::vector<ChatTurn>>& messages) const;
};

}  // namespace clshard
