#include "runtime/engine/deployment.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <stdexcept>

#include "models/registry.h"
#include "parallel/mpi_transport.h"
#include "runtime/engine/structured/response_format.h"
#include "runtime/safetensors.h"
#include "runtime/text/chat_template.h"

namespace clshard {

namespace {

// Weights are used in the dtype the checkpoint stores (bf16 and fp8 are widened or dequantized
// inside the kernels, never converted in memory), so model.dtype can only confirm it.
void check_checkpoint_dtype(const DeployConfig& cfg) {
  if (cfg.model.dtype == ModelDType::Auto) return;
  const auto path = cfg.model.path / "config.json";
  if (!std::filesystem::exists(path)) return;  // load_model reports the missing file
  const auto j = read_json_file(path);
  std::string stored = "bf16";
  if (j.contains("quantization_config")) stored = "fp8";
  else if (j.value("torch_dtype", "") == "float32") stored = "f32";
  else if (j.value("torch_dtype", "") == "float16") stored = "f16";
  const std::string asked = to_string(cfg.model.dtype);
  if (asked != stored)
    throw std::runtime_error(cfg.where("model.dtype") + ": " + asked + " asked, but " +
                             path.string() + " holds " + stored +
                             " weights; clshard uses the checkpoint's own dtype (say auto)");
}

// Allocates the KV pools of the model (and draft) with `pages` pages per replica and waits for
// their first use, so that a pool the device refuses fails here, at load time, naming the keys
// that size it, and not as an unrelated error at the first write of the first step: discrete
// GPUs' drivers reserve a buffer's memory at its first use, not at clCreateBuffer. Measured on an
// H200 through NVIDIA's OpenCL (2026-11-26, llama3-1b, reported global memory 150 GB): pools from
// memory_fraction 0.8 (118 GB) and 0.9 (133 GB) were refused with CL_OUT_OF_RESOURCES after 93-120
// GB had been reserved, 0.5 (74 GB) ran. Retrying smaller in the same process does not help
// there: after the refusal the command queue is invalid (CL_INVALID_COMMAND_QUEUE), so the error
// asks for a smaller pool instead.
void allocate_kv_pools(Deployment& d, const DeployConfig& cfg, uint32_t pages,
                       uint32_t page_size) {
  const uint64_t bytes =
      (d.model->kv_bytes_per_token() + (d.draft ? d.draft->kv_bytes_per_token() : 0)) *
      page_size * pages;
  // Tests stand in for a device that refuses pools above this many bytes (CPU devices do not).
  uint64_t refuse_above = 0;
  if (const char* t = std::getenv("CLSHARD_TEST_REFUSE_KV_BYTES")) refuse_above = std::stoull(t);
  try {
    d.model->allocate_kv_cache(pages, page_size);
    if (d.draft) d.draft->allocate_kv_cache(pages, page_size);
    for (Device* dev : d.model->devices()) dev->finish();
    if (refuse_above && bytes > refuse_above)
      throw cl::Error(CL_OUT_OF_RESOURCES, "reserving the KV pool (CLSHARD_TEST_REFUSE_KV_BYTES)");
  } catch (const cl::Error& e) {
    const bool derived = cfg.kv_cache.pages == 0;
    char fraction[32];
    std::snprintf(fraction, sizeof fraction, "%g", cfg.kv_cache.memory_fraction);
    throw std::runtime_error(
        cfg.where(derived ? "kv_cache.memory_fraction" : "kv_cache.pages") +
        ": the device refused " + std::to_string(pages) + " KV pages per replica (" +
        std::to_string(bytes / 1000000) + " MB) at their first use (" + e.what() +
        "); set a smaller kv_cache.memory_fraction (now " + fraction + ") or kv_cache.pages");
  }
}

}  // namespace

Deployment Deployment::open(const DeployConfig& cfg, const LoadProgress& progress) {
  Deployment d;
  if (cfg.cluster.transport == ClusterTransport::Mpi) {
#ifndef CLSHARD_HAVE_MPI
    throw std::runtime_error(cfg.where("cluster.transport") +
                             ": mpi: this build has no MPI transport (OpenMPI not found at build "
                             "time; install libopenmpi-dev, scripts/setup.sh, and rebuild)");
#else
    parallel::mpi_init(nullptr, nullptr);
    d.mpi_rank = uint32_t(parallel::mpi_world_rank());
    d.mpi_ranks = uint32_t(parallel::mpi_world_size());
#endif
  }
#ifdef CLSHARD_HAVE_MPI
  // N copies of a one-process deployment would each run the whole job into the same files.
  if (d.mpi_ranks == 0 && parallel::mpirun_processes() > 1)
    throw std::runtime_error(cfg.where("cluster.transport") + ": mpirun started " +
                             std::to_string(parallel::mpirun_processes()) +
                             " processes, but the deployment runs in one (transport: local); set "
                             "cluster.transport: mpi (or --mpi with --model)");
#endif
  d.config = cfg;
  d.devices = std::make_unique<DeviceManager>(cfg.devices);
  // Over MPI the selection applies within each process: a CPU split into sub-devices
  // (devices.split) gives each process all of its sub-devices (several ranks per process, the
  // in-process routes between them); otherwise each process runs one rank, on the selection's only
  // device or the one at this process's index among the ranks of its node (one rank per GPU).
  std::vector<Device*> rank_devices = d.devices->devices();
#ifdef CLSHARD_HAVE_MPI
  if (d.mpi_ranks > 0 && cfg.devices.split.empty() && rank_devices.size() > 1) {
    const size_t local = size_t(parallel::mpi_local_rank());
    if (local >= rank_devices.size())
      throw std::runtime_error(cfg.where("devices") + ": this process is rank " +
                               std::to_string(local) + " on its node, the selection gives " +
                               std::to_string(rank_devices.size()) +
                               " device(s); over MPI each rank takes one");
    rank_devices = {rank_devices.at(local)};
  }
#endif
  check_device_count(cfg, d.mpi_ranks > 0 ? size_t(d.mpi_ranks) * rank_devices.size()
                                          : rank_devices.size());
  check_checkpoint_dtype(cfg);
  LoadOptions opts;
  opts.devices = rank_devices;
  if (cfg.model.max_length) opts.max_length = uint32_t(*cfg.model.max_length);
  opts.data_parallel_degree = uint32_t(cfg.parallel.data);
  opts.tensor_parallel_degree = uint32_t(cfg.parallel.tensor);
  opts.expert_parallel_degree = uint32_t(cfg.parallel.expert);
  opts.balanced_experts = cfg.parallel.placement == Placement::Balanced;
  opts.quantize_fp8_activations = cfg.model.quantize_fp8_activations;
  opts.kv_cache_dtype = cfg.kv_cache.dtype;
  opts.compute_dtype = cfg.model.compute_dtype;
  opts.weight_memory = cfg.model.mmap ? WeightMemory::Mapped : WeightMemory::Copied;
  if (d.mpi_rank == 0) opts.load_progress = progress;
  opts.mpi_ranks = d.mpi_ranks;
  opts.mpi_rank = d.mpi_rank;
  for (const auto& [name, dir] : cfg.lora.adapters) opts.lora_adapters.push_back({name, dir});
  opts.lora_max_rank = uint32_t(cfg.lora.max_rank);
  opts.lora_max_loaded = uint32_t(cfg.lora.max_loaded);
  try {
    d.model = load_model(cfg.model.path, opts);
  } catch (const std::exception& e) {
    const std::string what = e.what();
    throw std::runtime_error(
        cfg.where(what.starts_with("LoRA") || what.starts_with("lora.") ? "lora.adapters"
                                                                       : "model.path") +
        ": " + what);
  }
  if (!cfg.lora.adapters.empty() && d.model->num_lora_adapters() != cfg.lora.adapters.size())
    throw std::runtime_error(cfg.where("lora.adapters") + ": LoRA adapters are supported on " +
                             "Llama 3 and DeepSeek-V3 models; " + d.model->info().architecture +
                             " loaded none");
  if (std::filesystem::exists(cfg.model.path / "tokenizer.json"))
    d.tokenizer = Tokenizer::from_dir(cfg.model.path);
  const SpeculativeSection& sp = cfg.speculative;
  if (sp.method != SpeculativeMethod::None && d.mpi_ranks > 0)
    throw std::runtime_error(cfg.where("speculative.method") +
                             ": speculative decoding does not run over MPI yet "
                             "(cluster.transport: mpi)");
  if (sp.method != SpeculativeMethod::None) {
    const std::string key = sp.draft_model.empty() ? "speculative.method" : "speculative.draft_model";
    try {
      d.draft = load_draft(to_string(sp.method), cfg.model.path,
                           sp.draft_model.empty() ? std::nullopt
                                                  : std::optional<std::filesystem::path>(sp.draft_model),
                           opts);
    } catch (const std::exception& e) {
      throw std::runtime_error(cfg.where(key) + ": " + e.what());
    }
  }

  const uint32_t page_size = uint32_t(cfg.kv_cache.page_size);
  const uint32_t max_length = d.model->info().max_seq_len;
  const uint32_t pages =
      plan_kv_pages(*d.model, page_size, cfg.kv_cache.pages, cfg.kv_cache.memory_fraction,
                    uint32_t(cfg.batch.max_batch_size), max_length, d.draft.get());
  allocate_kv_pools(d, cfg, pages, page_size);
  d.limits.max_batch_size = uint32_t(cfg.batch.max_batch_size);
  d.limits.max_batch_input_tokens = uint32_t(cfg.batch.max_batch_input_tokens);
  d.limits.page_size = page_size;
  d.limits.total_pages = pages;
  d.limits.max_length = max_length;
  d.limits.num_speculative_tokens = uint32_t(sp.num_speculative_tokens);
  d.limits.prefix_caching = cfg.kv_cache.prefix_caching;
  return d;
}

std::unique_ptr<Engine> Deployment::make_engine() {
  SpeculativeOptions spec;
  const SpeculativeSection& sp = config.speculative;
  if (draft) {
    spec.num_tokens = uint32_t(sp.num_speculative_tokens);
    spec.relaxed_thinking = sp.acceptance == SpeculativeAcceptance::RelaxedThinking;
    spec.relaxed.top_k = uint32_t(sp.relaxed_topk);
    spec.relaxed.delta = float(sp.relaxed_delta);
  }
  auto engine = std::make_unique<Engine>(*model, tokenizer ? &*tokenizer : nullptr, limits,
                                         draft.get(), spec);
  engine->set_logprobs_mode(config.sampling.logprobs_mode);
  return engine;
}

uint32_t Deployment::lora_adapter_id(const std::optional<std::string>& name) const {
  if (!name) return 0;
  const auto& declared = config.lora.adapters;
  for (size_t i = 0; i < declared.size(); ++i)
    if (declared[i].first == *name) return uint32_t(i + 1);
  std::string names;
  for (const auto& [n, dir] : declared) names += (names.empty() ? "" : ", ") + n;
  throw std::runtime_error("lora: unknown LoRA adapter '" + *name + "' (" +
                           (declared.empty() ? std::string("the deployment declares none")
                                             : "the deployment declares: " + names) +
                           ")");
}

SamplingParams Deployment::sampling_params(const SamplingDefaults& s) {
  SamplingParams p;
  p.temperature = s.temperature;
  p.top_k = s.top_k;
  p.top_p = s.top_p;
  p.min_p = s.min_p;
  p.seed = s.seed;
  p.frequency_penalty = s.frequency_penalty;
  p.presence_penalty = s.presence_penalty;
  p.repetition_penalty = s.repetition_penalty;
  p.logprobs = s.logprobs;
  p.top_logprobs = s.top_logprobs;
  return p;
}

GenerationRequest Deployment::generation_request(std::vector<int32_t> prompt,
                                                 const SamplingDefaults& s,
                                                 const std::optional<std::string>& lora,
                                                 const RequestFormat& format) const {
  GenerationRequest g;
  g.prompt = std::move(prompt);
  g.sampling = sampling_params(s);
  g.max_tokens = uint32_t(s.max_tokens);
  g.stop = s.stop;
  g.stop_token_ids = s.stop_token_ids;
  g.ignore_eos = s.ignore_eos;
  if (format.response_format || format.regex) {
    if (!tokenizer)
      throw std::invalid_argument(
          (format.response_format ? format.response_format_field : format.regex_field) +
          ": structured output needs the checkpoint's tokenizer.json");
    g.constraint = compile_response_format(format.response_format, format.regex, *tokenizer,
                                           format.response_format_field, format.regex_field);
  }
  g.adapter_id = lora_adapter_id(lora);
  return g;
}

std::vector<GenerationRequest> Deployment::choice_requests(const GenerationRequest& g,
                                                           int32_t n) {
  std::vector<GenerationRequest> out;
  for (int32_t i = 0; i < std::max(1, n); ++i) {
    out.push_back(g);
    out.back().sampling.seed = choice_seed(g.sampling.seed, uint32_t(i));
  }
  return out;
}

std::vector<RecordLogprobs> Deployment::logprobs_text(
    const std::vector<TokenLogprobs>& lps) const {
  auto text = [&](int32_t id) -> TokenLogprobText {
    TokenLogprobText t;
    t.token_id = id;
    if (!tokenizer || id < 0) return t;
    try {
      t.token = tokenizer->decode({id});
      t.bytes = tokenizer->token_bytes(id);
    } catch (const std::exception&) {
      t.token.clear();
      t.bytes.clear();
    }
    return t;
  };
  std::vector<RecordLogprobs> out;
  out.reserve(lps.size());
  for (const TokenLogprobs& lp : lps) {
    RecordLogprobs e;
    e.chosen = text(lp.token);
    e.chosen.logprob = lp.logprob;
    for (const TokenLogprob& t : lp.top) {
      e.top.push_back(text(t.token));
      e.top.back().logprob = t.logprob;
    }
    out.push_back(std::move(e));
  }
  return out;
}

std::vector<int32_t> Deployment::prompt_ids(
    const std::optional<std::string>& prompt, const std::optional<std::vector<int32_t>>& ids,
    const std::optional<std::vector<ChatTurn>>& messages) const {
  if (ids) return *ids;
  if (!tokenizer)
    throw std::runtime_error("text prompts need a tokenizer.json in " +
                             config.model.path.string() + " (or give prompt_token_ids)");
  if (prompt) return tokenizer->encode(*prompt, /*add_special_tokens=*/true);
  std::vector<ChatMessage> turns;
  for (const auto& t : *messages) turns.push_back({t.role, t.content});
  // The template writes the BOS text itself.
  return tokenizer->encode(apply_chat_template(*tokenizer, turns, true), false);
}

}  // namespace clshard
