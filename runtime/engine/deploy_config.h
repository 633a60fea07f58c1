// The deployment file: one YAML schema for every command that runs a model (run, generate, bench,
// plan). Every key has a default except model.path; unknown keys, wrong types and out-of-range
// values are errors naming the file, the line and the key path, e.g.
//   deploy.yaml:7: batch.max_batch_size: expected a positive integer, got "lots"
// configs/example.yaml shows every key with its default and meaning.
//
// Relative paths (model.path, speculative.draft_model, job.input, job.output) are resolved against
// the directory of the YAML file, so a deployment means the same thing from any working directory.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "runtime/device_manager.h"
#include "runtime/dtype.h"
#include "runtime/engine/sampling.h"

namespace clshard {

// The dtype the weights are used in. auto: whatever the checkpoint's config.json says.
enum class ModelDType { Auto, F32, BF16, FP8 };
const char* to_string(ModelDType d);

struct ModelSection {
  std::filesystem::path path;           // model directory in Hugging Face layout (required)
  ModelDType dtype = ModelDType::Auto;
  std::optional<int64_t> max_length;    // longest sequence (prompt + completion); unset: the model's
  // fp8_activations: f32 (default: FP8 weights dequantized in the kernels, activations exact) |
  // fp8 (activations fake-quantized per token per 128 columns before each FP8 linear, as MAX).
  bool quantize_fp8_activations = false;
  // compute_dtype: f32 (default) | bf16 (prefill GEMMs of bf16 weights round activations to bf16
  // and sum in f32, as llama.cpp's bf16 path: faster where the CPU has bf16 dot products).
  ComputeDType compute_dtype = ComputeDType::F32;
  // mmap: true (default) reads the weights where the checkpoint's files are mapped; false reads the
  // files into the process's own memory at load (llama.cpp's --no-mmap: slower start, pages that
  // do not depend on the page cache's; runtime/file_mapping.h).
  bool mmap = true;
  bool operator==(const ModelSection&) const = default;
};

// The `devices:` section is the device manager's own selection.
using DeviceSection = DeviceSelection;

// How experts are spread over the expert-parallel ranks: even (equal contiguous blocks) or
// balanced (blocks sized by measured per-device throughput).
enum class Placement { Even, Balanced };
const char* to_string(Placement p);

struct ParallelSection {
  int data = 1;    // data-parallel replicas
  int expert = 1;  // expert-parallel ranks
  int tensor = 1;  // tensor-parallel shards per replica
  Placement placement = Placement::Even;
  bool operator==(const ParallelSection&) const = default;
};

// How the ranks of a deployment reach each other: local (every device in this process) or mpi
// (one process per rank under mpirun; needs a build with OpenMPI).
enum class ClusterTransport { Local, Mpi };
const char* to_string(ClusterTransport t);

struct ClusterSection {
  ClusterTransport transport = ClusterTransport::Local;
  bool operator==(const ClusterSection&) const = default;
};

struct KvCacheSection {
  // Tokens per KV page. Our kernels need a multiple of 16; MAX itself requires multiples of 128 on
  // GPUs, so 128 is the default and the value to keep for GPU deployments.
  int page_size = 128;
  // Share of each device's memory after the weights given to KV pages (the steps' activations
  // come out of the rest). Deployment::open waits for the pool's first use, so a pool the device
  // refuses is a load-time error naming this key.
  double memory_fraction = 0.9;
  int64_t pages = 0;  // pages per replica; 0: derive from memory_fraction
  // Reuse the KV pages of prompt prefixes already computed (runtime/engine/scheduler.h).
  bool prefix_caching = true;
  // The caches' element type: F32 (default) or BF16 (half the memory; stores round to nearest
  // even, attention reads bf16). Llama's paged K/V cache and DeepSeek-V3's MLA latent cache.
  DType dtype = DType::F32;
  bool operator==(const KvCacheSection&) const = default;
};

struct BatchSection {
  int max_batch_size = 32;            // requests in one step (per replica)
  int max_batch_input_tokens = 2048;  // new tokens in one step (prefill chunks + decode rows)
  bool operator==(const BatchSection&) const = default;
};

// The sampling defaults of the deployment; a request's own fields override them. The fields
// mirror SamplingParams (runtime/engine/sampling.h) plus the per-request limits.
struct SamplingDefaults {
  float temperature = 1.0f;  // >= 0; 0 means greedy
  int32_t top_k = -1;        // -1: the whole vocabulary (0 is read as -1, as in MAX)
  float top_p = 1.0f;        // (0, 1], applied within the top-k
  float min_p = 0.0f;        // [0, 1]: drop tokens with p < min_p * p_max
  uint64_t seed = 0;         // a request without its own seed uses this one
  int32_t max_tokens = 256;  // completion tokens at most
  std::vector<std::string> stop;        // stop strings (not included in the output text)
  std::vector<int32_t> stop_token_ids;  // stop tokens besides the checkpoint's EOS
  // Penalties (runtime/engine/sampling.h has the rules).
  float frequency_penalty = 0.0f;   // [-2, 2]
  float presence_penalty = 0.0f;    // [-2, 2]
  float repetition_penalty = 1.0f;  // > 0; 1 = off
  // Deployment only: which distribution logprobs describe.
  LogprobsMode logprobs_mode = LogprobsMode::Raw;
  // Per request only (a batch line or an API request; not keys of the deployment file).
  bool logprobs = false;
  int32_t top_logprobs = 0;  // [0, 20]
  int32_t n = 1;             // completions; choice i samples with choice_seed(seed, i)
  bool ignore_eos = false;
  bool operator==(const SamplingDefaults&) const = default;
};

// Speculative decoding: a draft proposes K tokens per step, the target verifies them in the same
// step (runtime/engine.h). mtp: DeepSeek's NextN/MTP layer; eagle3: an Eagle3 draft checkpoint.
enum class SpeculativeMethod { None, Mtp, Eagle3 };
const char* to_string(SpeculativeMethod m);
// strict: exact acceptance (greedy, or rejection sampling against the request's distribution);
// relaxed_thinking: MAX's relaxed rule for rows inside a <think> block, strict elsewhere.
enum class SpeculativeAcceptance { Strict, RelaxedThinking };

struct SpeculativeSection {
  SpeculativeMethod method = SpeculativeMethod::None;
  int num_speculative_tokens = 0;     // K draft tokens per step; >= 1 unless method is none
  std::filesystem::path draft_model;  // eagle3: required; mtp: the checkpoint's MTP layer if empty
  SpeculativeAcceptance acceptance = SpeculativeAcceptance::Strict;
  int relaxed_topk = 10;              // relaxed_thinking: the draft is among the top k
  double relaxed_delta = 0.6;         // and within delta of the top-1 probability
  bool operator==(const SpeculativeSection&) const = default;
};

// LoRA adapters (Hugging Face PEFT directories) a request may name in its `lora` field; the base
// weights are never modified. Every declared adapter is read at start; at most max_loaded are
// resident on a device, the others uploaded when a request needs them (least recently used out).
struct LoraSection {
  std::vector<std::pair<std::string, std::filesystem::path>> adapters;  // name -> dir, file order
  int max_rank = 64;   // an adapter of a higher rank is an error
  int max_loaded = 8;  // adapters resident on a device at once (others wait to be uploaded)
  bool operator==(const LoraSection&) const = default;
};

struct JobSection {
  std::filesystem::path input;   // prompts, JSONL; empty: no batch job in this file
  std::filesystem::path output;  // completions, JSONL; empty: <input minus .jsonl>.completions.jsonl
  bool operator==(const JobSection&) const = default;
};

// `clshard serve`: the OpenAI-compatible HTTP server (runtime/serve/).
struct ServeSection {
  std::string host = "127.0.0.1";  // the address to bind; 0.0.0.0 serves every interface
  int port = 8000;                 // 0: any free port (printed when listening)
  // Requests accepted but not yet running (waiting for a batch row or KV pages); one more is
  // answered 429 at once.
  int max_waiting = 64;
  std::string api_key;             // empty: no key; else /v1/* needs "Authorization: Bearer KEY"
  double request_deadline_s = 600; // a request not finished by then is cancelled (0: no deadline)
  double shutdown_deadline_s = 30; // SIGINT/SIGTERM: running requests get this long, then cancelled
  std::string model_name;          // the name clients give as `model`; empty: model.path's folder
  int max_connections = 512;       // HTTP connections served at once (one thread each)
  bool operator==(const ServeSection&) const = default;
};

struct DeployConfig {
  ModelSection model;
  DeviceSection devices;
  ParallelSection parallel;
  ClusterSection cluster;
  KvCacheSection kv_cache;
  BatchSection batch;
  SamplingDefaults sampling;
  SpeculativeSection speculative;
  LoraSection lora;
  JobSection job;
  ServeSection serve;

  // Where the file came from, and the 1-based line of every key it sets ("batch.max_batch_size"),
  // so that checks made later (against devices, against the model) can point at the line too.
  std::string source;
  std::map<std::string, int> key_lines;

  // "deploy.yaml:12: parallel.data" when the file sets the key, "deploy.yaml: parallel.data" when
  // the value is the default. Prefix for error messages about a key.
  std::string where(const std::string& key_path) const;
  bool has_key(const std::string& key_path) const { return key_lines.count(key_path) != 0; }

  // The number of devices the `devices:` section selects when that is known without opening them:
  // ids (or the first device) unsplit, or split into N on a CPU. Unknown (nullopt) for all: true
  // and for split: cores | numa.
  std::optional<size_t> known_device_count() const;
};

// Reads and validates a deployment file. Relative paths are resolved against its directory.
DeployConfig load_deploy_config(const std::filesystem::path& file);

// Parses YAML text; `file_name_for_errors` names it in messages and becomes DeployConfig::source.
// Relative paths are resolved against `base_dir` (left as written when base_dir is empty).
DeployConfig parse_deploy_config(const std::string& yaml_text,
                                 const std::string& file_name_for_errors,
                                 const std::filesystem::path& base_dir = {});

// The parallel degrees against the devices actually opened, by the rules every model layout
// shares (parallel::check_degrees: data * tensor must equal the device count, and expert must
// divide it); the model's own layout is checked when it loads. Throws std::runtime_error naming
// the file, line and key. parse_deploy_config already runs this when known_device_count() is
// known.
void check_device_count(const DeployConfig& cfg, size_t device_count);

// Every key path of the schema ("model.path", ...), in the order configs/example.yaml shows them.
const std::vector<std::string>& deploy_config_keys();

// Validators shared with the per-request fields of the batch input (runtime/engine/batch_io.cpp). Each
// returns what was expected ("a number in (0, 1]") when the value is out of range, else nothing.
std::optional<std::string> check_temperature(double v);
std::optional<std::string> check_top_k(int64_t v);
std::optional<std::string> check_top_p(double v);
std::optional<std::string> check_min_p(double v);
std::optional<std::string> check_max_tokens(int64_t v);
std::optional<std::string> check_stop_token_id(int64_t v);
std::optional<std::string> check_penalty(double v);             // frequency/presence: [-2, 2]
std::optional<std::string> check_repetition_penalty(double v);  // > 0
std::optional<std::string> check_top_logprobs(int64_t v);       // [0, 20]
std::optional<std::string> check_n(int64_t v);                  // [1, kMaxChoices]
inline constexpr int32_t kMaxChoices = 128;

}  // namespace clshard
