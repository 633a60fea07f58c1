// The deployment YAML schema: defaults, every key, path resolution, and the exact messages of each
// kind of error (file, line, key path, what was expected).
#include <gtest/gtest.h>

#include <fstream>
#include <stdexcept>
#include <string>

#include "runtime/engine/batch_io.h"
#include "runtime/engine/deploy_config.h"
#include "tests/test_util.h"

#ifndef CLSHARD_SOURCE_DIR
#define CLSHARD_SOURCE_DIR "."
#endif

namespace clshard {
namespace {

namespace fs = std::filesystem;

DeployConfig parse(const std::string& yaml) { return parse_deploy_config(yaml, "deploy.yaml"); }

// The message parse() throws, or "" when it does not throw.
std::string error_of(const std::string& yaml) {
  try {
    parse(yaml);
  } catch (const std::runtime_error& e) {
    return e.what();
  }
  return "";
}

TEST(DeployConfig, MinimalFileKeepsEveryDefault) {
  DeployConfig c = parse("model:\n  path: /models/tiny\n");
  EXPECT_EQ(c.source, "deploy.yaml");
  EXPECT_EQ(c.model.path, fs::path("/models/tiny"));
  EXPECT_EQ(c.model.dtype, ModelDType::Auto);
  EXPECT_EQ(c.model.compute_dtype, ComputeDType::F32);
  EXPECT_TRUE(c.model.mmap);
  EXPECT_FALSE(c.model.max_length.has_value());
  EXPECT_EQ(c.devices.platform, "");
  EXPECT_EQ(c.devices.type, "any");
  EXPECT_TRUE(c.devices.ids.empty());
  EXPECT_FALSE(c.devices.all);
  EXPECT_EQ(c.devices.split, "");
  EXPECT_FALSE(c.devices.kernel_shape.has_value());  // auto: by device type
  EXPECT_EQ(c.parallel, ParallelSection{});
  EXPECT_EQ(c.parallel.data, 1);
  EXPECT_EQ(c.parallel.expert, 1);
  EXPECT_EQ(c.parallel.tensor, 1);
  EXPECT_EQ(c.parallel.placement, Placement::Even);
  EXPECT_EQ(c.kv_cache.page_size, 128);
  EXPECT_DOUBLE_EQ(c.kv_cache.memory_fraction, 0.9);
  EXPECT_EQ(c.kv_cache.pages, 0);
  EXPECT_EQ(c.batch.max_batch_size, 32);
  EXPECT_EQ(c.batch.max_batch_input_tokens, 2048);
  EXPECT_FLOAT_EQ(c.sampling.temperature, 1.0f);
  EXPECT_EQ(c.sampling.top_k, -1);
  EXPECT_FLOAT_EQ(c.sampling.top_p, 1.0f);
  EXPECT_FLOAT_EQ(c.sampling.min_p, 0.0f);
  EXPECT_EQ(c.sampling.seed, 0u);
  EXPECT_EQ(c.sampling.max_tokens, 256);
  EXPECT_TRUE(c.sampling.stop.empty());
  EXPECT_TRUE(c.sampling.stop_token_ids.empty());
  EXPECT_EQ(c.speculative.method, SpeculativeMethod::None);
  EXPECT_EQ(c.speculative.num_speculative_tokens, 0);
  EXPECT_TRUE(c.speculative.draft_model.empty());
  EXPECT_TRUE(c.job.input.empty());
  EXPECT_TRUE(c.job.output.empty());
  EXPECT_EQ(c.key_lines.size(), 2u);  // model, model.path
  EXPECT_EQ(c.key_lines.at("model.path"), 2);
  EXPECT_EQ(c.known_device_count(), std::optional<size_t>(1));
}

TEST(DeployConfig, EveryKeySet) {
  const std::string yaml = R"(model:
  path: /m
  dtype: bf16
  max_length: 4096
  compute_dtype: bf16
  mmap: false
devices:
  platform: "Portable Computing"
  type: cpu
  split: 2
  kernel_shape: gpu
parallel: {data: 2, expert: 2, tensor: 1, placement: balanced}
kv_cache:
  page_size: 64
  pages: 1000
batch:
  max_batch_size: 64
  max_batch_input_tokens: 8192
sampling:
  temperature: 0.7
  top_k: 40
  top_p: 0.95
  min_p: 0.05
  seed: 18446744073709551615
  max_tokens: 100
  stop: ["\n\n", "END"]
  stop_token_ids: [128001, 128009]
speculative:
  method: eagle3
  num_speculative_tokens: 3
  draft_model: /drafts/eagle
job:
  input: /data/in.jsonl
  output: /data/out.jsonl
)";
  DeployConfig c = parse(yaml);
  EXPECT_EQ(c.model.dtype, ModelDType::BF16);
  EXPECT_EQ(c.model.compute_dtype, ComputeDType::BF16);
  EXPECT_FALSE(c.model.mmap);
  EXPECT_EQ(c.model.max_length, std::optional<int64_t>(4096));
  EXPECT_EQ(c.devices.platform, "Portable Computing");
  EXPECT_EQ(c.devices.type, "cpu");
  EXPECT_EQ(c.devices.split, "2");
  EXPECT_EQ(c.devices.kernel_shape, std::optional<KernelShape>(KernelShape::WorkGroups));
  EXPECT_EQ(c.known_device_count(), std::optional<size_t>(2));
  EXPECT_EQ(c.parallel, (ParallelSection{2, 2, 1, Placement::Balanced}));
  EXPECT_EQ(c.kv_cache, (KvCacheSection{64, 0.9, 1000}));
  EXPECT_EQ(c.batch, (BatchSection{64, 8192}));
  EXPECT_FLOAT_EQ(c.sampling.temperature, 0.7f);
  EXPECT_EQ(c.sampling.top_k, 40);
  EXPECT_FLOAT_EQ(c.sampling.top_p, 0.95f);
  EXPECT_FLOAT_EQ(c.sampling.min_p, 0.05f);
  EXPECT_EQ(c.sampling.seed, 18446744073709551615ull);
  EXPECT_EQ(c.sampling.max_tokens, 100);
  EXPECT_EQ(c.sampling.stop, (std::vector<std::string>{"\n\n", "END"}));
  EXPECT_EQ(c.sampling.stop_token_ids, (std::vector<int32_t>{128001, 128009}));
  EXPECT_EQ(c.speculative.method, SpeculativeMethod::Eagle3);
  EXPECT_EQ(c.speculative.num_speculative_tokens, 3);
  EXPECT_EQ(c.speculative.draft_model, fs::path("/drafts/eagle"));
  EXPECT_EQ(c.job.input, fs::path("/data/in.jsonl"));
  EXPECT_EQ(c.job.output, fs::path("/data/out.jsonl"));
  EXPECT_EQ(c.key_lines.at("devices.kernel_shape"), 11);
  EXPECT_EQ(c.key_lines.at("parallel.placement"), 12);
  EXPECT_EQ(c.key_lines.at("sampling.stop_token_ids"), 27);
  EXPECT_EQ(c.where("batch.max_batch_size"), "deploy.yaml:17: batch.max_batch_size");
  EXPECT_EQ(c.where("model.max_length"), "deploy.yaml:4: model.max_length");
  EXPECT_EQ(c.where("devices.ids"), "deploy.yaml: devices.ids");
}

TEST(DeployConfig, SmallValueForms) {
  // top_k 0 means no top-k, as in MAX; a single stop string is a list of one; a null value keeps
  // the default; an empty section keeps every default.
  DeployConfig c = parse(
      "model: {path: m, max_length: null}\nsampling:\n  top_k: 0\n  stop: \"###\"\n  max_tokens:\n"
      "batch:\n");
  EXPECT_EQ(c.sampling.top_k, -1);
  EXPECT_EQ(c.sampling.stop, (std::vector<std::string>{"###"}));
  EXPECT_EQ(c.sampling.max_tokens, 256);
  EXPECT_FALSE(c.model.max_length.has_value());
  EXPECT_EQ(c.batch, BatchSection{});
  EXPECT_EQ(c.key_lines.at("sampling.max_tokens"), 5);
  EXPECT_EQ(c.key_lines.at("batch"), 6);
  // +1 and 1e-1 are YAML numbers too.
  DeployConfig d = parse("model: {path: m}\nsampling: {temperature: 1e-1, top_p: +0.5, top_k: +3}\n");
  EXPECT_FLOAT_EQ(d.sampling.temperature, 0.1f);
  EXPECT_FLOAT_EQ(d.sampling.top_p, 0.5f);
  EXPECT_EQ(d.sampling.top_k, 3);
}

TEST(DeployConfig, RelativePathsResolveAgainstTheFilesDirectory) {
  const std::string yaml =
      "model: {path: ../models/tiny}\njob: {input: prompts/p.jsonl}\n"
      "speculative: {method: eagle3, num_speculative_tokens: 2, draft_model: /abs/draft}\n";
  DeployConfig c = parse_deploy_config(yaml, "d.yaml", "/srv/configs");
  EXPECT_EQ(c.model.path, fs::path("/srv/models/tiny"));
  EXPECT_EQ(c.job.input, fs::path("/srv/configs/prompts/p.jsonl"));
  // The default output sits next to the input.
  EXPECT_EQ(c.job.output, fs::path("/srv/configs/prompts/p.completions.jsonl"));
  EXPECT_EQ(c.speculative.draft_model, fs::path("/abs/draft"));  // absolute paths stay

  // Without a base directory, paths stay as written (relative to the working directory).
  DeployConfig w = parse_deploy_config(yaml, "d.yaml");
  EXPECT_EQ(w.model.path, fs::path("../models/tiny"));

  // load_deploy_config uses the file's own directory.
  fs::path dir = test::temp_dir("deploy_config_paths");
  fs::create_directories(dir / "configs");
  std::ofstream(dir / "configs" / "d.yaml") << yaml;
  DeployConfig l = load_deploy_config(dir / "configs" / "d.yaml");
  EXPECT_EQ(l.model.path, (dir / "models" / "tiny").lexically_normal());
  EXPECT_EQ(l.job.input, (dir / "configs" / "prompts" / "p.jsonl").lexically_normal());
  EXPECT_EQ(l.source, (dir / "configs" / "d.yaml").string());
}

TEST(DeployConfig, DefaultOutputNameForInputsWithoutJsonlSuffix) {
  EXPECT_EQ(parse("model: {path: m}\njob: {input: prompts.txt}\n").job.output,
            fs::path("prompts.txt.completions.jsonl"));
}

TEST(DeployConfig, UnreadableFile) {
  fs::path dir = test::temp_dir("deploy_config_missing");
  try {
    load_deploy_config(dir / "nope.yaml");
    FAIL() << "expected an error";
  } catch (const std::runtime_error& e) {
    EXPECT_EQ(std::string(e.what()), "cannot read deployment file " + (dir / "nope.yaml").string());
  }
}

TEST(DeployConfig, UnknownKeys) {
  EXPECT_EQ(error_of("model:\n  path: m\n  pth: x\n"),
            "deploy.yaml:3: model.pth: unknown key (expected one of: path, dtype, max_length, fp8_activations, compute_dtype, mmap)");
  EXPECT_EQ(error_of("model: {path: m}\nbatches: {}\n"),
            "deploy.yaml:2: batches: unknown key (expected one of: model, devices, parallel, cluster, kv_cache, "
            "batch, sampling, speculative, lora, job, serve)");
  EXPECT_EQ(error_of("model: {path: m}\nsampling:\n  temperature: 1\n  top-p: 0.5\n"),
            "deploy.yaml:4: sampling.top-p: unknown key (expected one of: temperature, top_k, top_p, "
            "min_p, seed, max_tokens, stop, stop_token_ids, frequency_penalty, presence_penalty, "
            "repetition_penalty, logprobs_mode)");
  EXPECT_EQ(error_of("model: {path: m}\ndevices: {gpu: 1}\n"),
            "deploy.yaml:2: devices.gpu: unknown key (expected one of: platform, type, ids, all, split, "
            "kernel_shape)");
}

TEST(DeployConfig, WrongTypes) {
  EXPECT_EQ(error_of("model: {path: m}\n\n\n\n\nbatch:\n  max_batch_size: lots\n"),
            "deploy.yaml:7: batch.max_batch_size: expected a positive integer, got \"lots\"");
  // Quoted numbers are strings in YAML.
  EXPECT_EQ(error_of("model: {path: m}\nbatch: {max_batch_size: \"32\"}\n"),
            "deploy.yaml:2: batch.max_batch_size: expected a positive integer, got \"32\"");
  EXPECT_EQ(error_of("model: {path: m}\nbatch: {max_batch_size: 3.5}\n"),
            "deploy.yaml:2: batch.max_batch_size: expected a positive integer, got \"3.5\"");
  EXPECT_EQ(error_of("model: {path: m}\nbatch: {max_batch_size: [1]}\n"),
            "deploy.yaml:2: batch.max_batch_size: expected a positive integer, got a list");
  EXPECT_EQ(error_of("model: {path: [a, b]}\n"), "deploy.yaml:1: model.path: expected a string, got a list");
  EXPECT_EQ(error_of("model: {path: m}\nsampling: {temperature: warm}\n"),
            "deploy.yaml:2: sampling.temperature: expected a number >= 0, got \"warm\"");
  EXPECT_EQ(error_of("model: {path: m}\ndevices: {all: yes}\n"),
            "deploy.yaml:2: devices.all: expected true or false, got \"yes\"");
  EXPECT_EQ(error_of("model: {path: m}\ndevices: {ids: 0}\n"),
            "deploy.yaml:2: devices.ids: expected a list, got \"0\"");
  EXPECT_EQ(error_of("model: {path: m}\nsampling:\n  stop_token_ids: [1, two]\n"),
            "deploy.yaml:3: sampling.stop_token_ids[1]: expected a token id (an integer >= 0), got \"two\"");
  EXPECT_EQ(error_of("model: {path: m}\nsampling:\n  stop:\n    - a\n    - ''\n"),
            "deploy.yaml:5: sampling.stop[1]: expected a non-empty string, got \"\"");
  EXPECT_EQ(error_of("model: {path: m}\nsampling: {seed: -1}\n"),
            "deploy.yaml:2: sampling.seed: expected an integer >= 0, got \"-1\"");
  EXPECT_EQ(error_of("model: {path: m}\nbatch: 32\n"), "deploy.yaml:2: batch: expected a mapping of keys, got \"32\"");
  EXPECT_EQ(error_of("- model\n- batch\n"),
            "deploy.yaml:1: (top level): expected a mapping of sections (model, devices, parallel, cluster, kv_cache, "
            "batch, sampling, speculative, lora, job, serve), got a list");
}

TEST(DeployConfig, Choices) {
  EXPECT_EQ(error_of("model: {path: m, dtype: fp16}\n"),
            "deploy.yaml:1: model.dtype: expected one of auto | f32 | bf16 | fp8, got \"fp16\"");
  EXPECT_EQ(error_of("model:\n  path: m\n  compute_dtype: fp16\n"),
            "deploy.yaml:3: model.compute_dtype: expected one of f32 | bf16, got \"fp16\"");
  EXPECT_EQ(error_of("model:\n  path: m\n  mmap: no\n"),
            "deploy.yaml:3: model.mmap: expected true or false, got \"no\"");
  EXPECT_EQ(error_of("model: {path: m}\ndevices: {type: GPU}\n"),
            "deploy.yaml:2: devices.type: expected one of cpu | gpu | accelerator | any, got \"GPU\"");
  EXPECT_EQ(error_of("model: {path: m}\ndevices:\n  type: cpu\n  kernel_shape: workgroups\n"),
            "deploy.yaml:4: devices.kernel_shape: expected one of auto | cpu | gpu, got \"workgroups\"");
  EXPECT_EQ(parse("model: {path: m}\ndevices: {kernel_shape: cpu}\n").devices.kernel_shape,
            std::optional<KernelShape>(KernelShape::Chunks));
  EXPECT_FALSE(parse("model: {path: m}\ndevices: {kernel_shape: auto}\n").devices.kernel_shape);
  EXPECT_EQ(error_of("model: {path: m}\nparallel: {placement: random}\n"),
            "deploy.yaml:2: parallel.placement: expected one of even | balanced, got \"random\"");
  EXPECT_EQ(error_of("model: {path: m}\nspeculative: {method: medusa}\n"),
            "deploy.yaml:2: speculative.method: expected one of none | mtp | eagle3, got \"medusa\"");
  EXPECT_EQ(error_of("model: {path: m}\ndevices: {type: cpu, split: threads}\n"),
            "deploy.yaml:2: devices.split: expected \"\" (no split), cores, numa or a positive number of "
            "sub-devices, got \"threads\"");
  EXPECT_EQ(error_of("model: {path: m}\ndevices: {type: cpu, split: 0}\n"),
            "deploy.yaml:2: devices.split: expected \"\" (no split), cores, numa or a positive number of "
            "sub-devices, got \"0\"");
}

TEST(DeployConfig, OutOfRange) {
  EXPECT_EQ(error_of("model: {path: m}\nsampling: {top_p: 1.5}\n"),
            "deploy.yaml:2: sampling.top_p: expected a number in (0, 1], got \"1.5\"");
  EXPECT_EQ(error_of("model: {path: m}\nsampling: {top_p: 0}\n"),
            "deploy.yaml:2: sampling.top_p: expected a number in (0, 1], got \"0\"");
  EXPECT_EQ(error_of("model: {path: m}\nsampling: {temperature: -0.1}\n"),
            "deploy.yaml:2: sampling.temperature: expected a number >= 0, got \"-0.1\"");
  EXPECT_EQ(error_of("model: {path: m}\nsampling: {temperature: .inf}\n"),
            "deploy.yaml:2: sampling.temperature: expected a number >= 0, got \".inf\"");
  EXPECT_EQ(error_of("model: {path: m}\nsampling: {min_p: 2}\n"),
            "deploy.yaml:2: sampling.min_p: expected a number in [0, 1], got \"2\"");
  EXPECT_EQ(error_of("model: {path: m}\nsampling: {top_k: -2}\n"),
            "deploy.yaml:2: sampling.top_k: expected an integer >= -1 (-1 or 0: no top-k), got \"-2\"");
  EXPECT_EQ(error_of("model: {path: m}\nsampling: {max_tokens: 0}\n"),
            "deploy.yaml:2: sampling.max_tokens: expected a positive integer, got \"0\"");
  EXPECT_EQ(error_of("model: {path: m}\nkv_cache: {page_size: 100}\n"),
            "deploy.yaml:2: kv_cache.page_size: expected a positive multiple of 16, got \"100\"");
  EXPECT_EQ(error_of("model: {path: m}\nkv_cache: {page_size: 0}\n"),
            "deploy.yaml:2: kv_cache.page_size: expected a positive multiple of 16, got \"0\"");
  EXPECT_EQ(error_of("model: {path: m}\nkv_cache: {memory_fraction: 0}\n"),
            "deploy.yaml:2: kv_cache.memory_fraction: expected a number in (0, 1], got \"0\"");
  EXPECT_EQ(error_of("model: {path: m}\nkv_cache: {memory_fraction: 1.01}\n"),
            "deploy.yaml:2: kv_cache.memory_fraction: expected a number in (0, 1], got \"1.01\"");
  EXPECT_EQ(error_of("model: {path: m}\nkv_cache: {pages: -1}\n"),
            "deploy.yaml:2: kv_cache.pages: expected an integer >= 0 (0: derive from memory_fraction), got \"-1\"");
  EXPECT_EQ(error_of("model: {path: m}\nbatch: {max_batch_input_tokens: 99999999999}\n"),
            "deploy.yaml:2: batch.max_batch_input_tokens: expected a positive integer (at most 2147483647), "
            "got \"99999999999\"");
  EXPECT_EQ(error_of("model: {path: m}\nparallel: {data: 0}\n"),
            "deploy.yaml:2: parallel.data: expected a positive integer, got \"0\"");
  EXPECT_EQ(error_of("model: {path: m, max_length: -5}\n"),
            "deploy.yaml:1: model.max_length: expected a positive integer, got \"-5\"");
  EXPECT_EQ(error_of("model: {path: m}\ndevices: {ids: [0, -1]}\n"),
            "deploy.yaml:2: devices.ids[1]: expected a device index (an integer >= 0), got \"-1\"");
}

TEST(DeployConfig, DuplicateKeysAndInvalidYaml) {
  EXPECT_EQ(error_of("model: {path: m}\nbatch:\n  max_batch_size: 8\n  max_batch_size: 16\n"),
            "deploy.yaml:4: batch.max_batch_size: duplicate key (first set at line 3)");
  EXPECT_EQ(error_of("model: {path: m}\nmodel: {path: n}\n"), "deploy.yaml:2: model: duplicate key (first set at line 1)");
  EXPECT_EQ(error_of("model: {path: m}\ndevices: {ids: [1, 1]}\n"),
            "deploy.yaml:2: devices.ids[1]: device 1 is listed twice");
  EXPECT_EQ(error_of("model: {path: m}\nsampling: {stop: [a, b\nbatch: {}\n"),
            "deploy.yaml:3: invalid YAML: end of sequence flow not found");
  // Deep flow nesting is refused before yaml-cpp recurses through it (fuzzing: 100 levels took
  // over 30 s); brackets inside quotes and comments do not count, and 32 levels still parse.
  EXPECT_EQ(error_of("model: {path: m}\nsampling:\n  stop: " + std::string(40, '[') + "\n"),
            "deploy.yaml:3: invalid YAML: flow collections ([ ] or { }) nested deeper than 32 "
            "levels");
  const std::string quoted = "'" + std::string(40, '[') + "'";
  EXPECT_EQ(error_of("model: {path: m}  # " + std::string(40, '{') + "\nsampling: {stop: [" +
                     quoted + ", \"]" + std::string(40, '[') + "\"]}\n"),
            "");
  EXPECT_EQ(error_of("model: {path: m}\nx: " + std::string(32, '[') + std::string(32, ']') + "\n"),
            "deploy.yaml:2: x: unknown key (expected one of: model, devices, parallel, cluster, "
            "kv_cache, batch, sampling, speculative, lora, job, serve)");
}

TEST(DeployConfig, ModelPathIsRequired) {
  EXPECT_EQ(error_of(""), "deploy.yaml: model.path: required (the model directory, Hugging Face layout)");
  EXPECT_EQ(error_of("batch: {max_batch_size: 4}\n"),
            "deploy.yaml: model.path: required (the model directory, Hugging Face layout)");
  EXPECT_EQ(error_of("\nmodel:\n  path:\n"),
            "deploy.yaml:3: model.path: required (the model directory, Hugging Face layout)");
}

TEST(DeployConfig, KeysThatMustAgree) {
  EXPECT_EQ(error_of("model: {path: m}\ndevices:\n  all: true\n  ids: [0, 1]\n"),
            "deploy.yaml:4: devices.ids: cannot be combined with devices.all: true (all takes every matching device)");
  EXPECT_EQ(error_of("model: {path: m}\ndevices: {type: gpu, split: cores}\n"),
            "deploy.yaml:2: devices.split: only CPU devices split into sub-devices, but devices.type is gpu");
  EXPECT_EQ(error_of("model: {path: m}\nkv_cache:\n  pages: 64\n  memory_fraction: 0.5\n"),
            "deploy.yaml:4: kv_cache.memory_fraction: give kv_cache.pages or kv_cache.memory_fraction, not both "
            "(pages: 64 fixes the page count)");
  // pages: 0 means "derive", so it goes with a fraction.
  EXPECT_EQ(parse("model: {path: m}\nkv_cache: {pages: 0, memory_fraction: 0.5}\n").kv_cache.memory_fraction, 0.5);
  EXPECT_EQ(error_of("model: {path: m}\njob: {output: o.jsonl}\n"), "deploy.yaml:2: job.output: set, but job.input is not");
  EXPECT_EQ(error_of("model: {path: m}\njob: {input: a.jsonl, output: ./a.jsonl}\n"),
            "deploy.yaml:2: job.output: is the same file as job.input");
}

TEST(DeployConfig, Speculative) {
  EXPECT_EQ(error_of("model: {path: m}\nspeculative:\n  num_speculative_tokens: 3\n"),
            "deploy.yaml:3: speculative.num_speculative_tokens: set, but speculative.method is none");
  EXPECT_EQ(error_of("model: {path: m}\nspeculative:\n  draft_model: d\n"),
            "deploy.yaml:3: speculative.draft_model: set, but speculative.method is none");
  EXPECT_EQ(error_of("model: {path: m}\nspeculative:\n  method: mtp\n"),
            "deploy.yaml:3: speculative.method: method mtp needs speculative.num_speculative_tokens >= 1");
  EXPECT_EQ(error_of("model: {path: m}\nspeculative:\n  method: eagle3\n  num_speculative_tokens: 2\n"),
            "deploy.yaml:3: speculative.method: method eagle3 needs speculative.draft_model (the Eagle3 draft checkpoint)");
  EXPECT_EQ(error_of("model: {path: m}\nspeculative: {method: mtp, num_speculative_tokens: 65}\n"),
            "deploy.yaml:2: speculative.num_speculative_tokens: expected an integer >= 0 (at most 16), got \"65\"");

  EXPECT_EQ(error_of("model: {path: m}\nspeculative: {method: mtp, num_speculative_tokens: 2, acceptance: loose}\n"),
            "deploy.yaml:2: speculative.acceptance: expected one of strict | relaxed_thinking, got \"loose\"");
  EXPECT_EQ(error_of("model: {path: m}\nspeculative: {method: mtp, num_speculative_tokens: 2, relaxed_delta: 2}\n"),
            "deploy.yaml:2: speculative.relaxed_delta: expected a number in [0, 1], got \"2\"");
  EXPECT_EQ(error_of("model: {path: m}\nspeculative:\n  relaxed_topk: 5\n"),
            "deploy.yaml:3: speculative.relaxed_topk: set, but speculative.method is none");

  DeployConfig c = parse("model: {path: m}\nspeculative:\n  method: mtp\n  num_speculative_tokens: 1\n"
                         "  acceptance: relaxed_thinking\n  relaxed_topk: 5\n  relaxed_delta: 0.25\n");
  EXPECT_EQ(c.speculative.method, SpeculativeMethod::Mtp);
  EXPECT_EQ(c.speculative.num_speculative_tokens, 1);
  EXPECT_TRUE(c.speculative.draft_model.empty());
  EXPECT_EQ(c.speculative.acceptance, SpeculativeAcceptance::RelaxedThinking);
  EXPECT_EQ(c.speculative.relaxed_topk, 5);
  EXPECT_DOUBLE_EQ(c.speculative.relaxed_delta, 0.25);
}

TEST(DeployConfig, ParallelAgainstDevices) {
  // One device by default: data 2 cannot fit, and the file says so before any device opens.
  EXPECT_EQ(error_of("model: {path: m}\nparallel:\n  data: 2\n"),
            "deploy.yaml:3: parallel.data: data (2) * tensor (1) must equal the number of devices, and the "
            "deployment has 1 device");
  EXPECT_EQ(error_of("model: {path: m}\ndevices: {ids: [0, 1, 2]}\nparallel:\n  tensor: 2\n"),
            "deploy.yaml:4: parallel.tensor: data (1) * tensor (2) must equal the number of devices, and the "
            "deployment has 3 devices");
  EXPECT_EQ(error_of("model: {path: m}\ndevices: {ids: [0, 1, 2, 3]}\nparallel: {data: 4, expert: 3}\n"),
            "deploy.yaml:3: parallel.expert: 3 expert-parallel ranks must divide the number of devices (4 devices)");
  EXPECT_EQ(error_of("model: {path: m}\ndevices: {ids: [0, 1]}\n"),
            "deploy.yaml: parallel: data (1) * tensor (1) must equal the number of devices, and the "
            "deployment has 2 devices");

  // Known counts: ids, or a CPU split into N.
  EXPECT_EQ(parse("model: {path: m}\ndevices: {ids: [0, 1]}\nparallel: {data: 2, expert: 2}\n").known_device_count(),
            std::optional<size_t>(2));
  EXPECT_EQ(parse("model: {path: m}\ndevices: {type: cpu, split: 4}\nparallel: {data: 2, tensor: 2}\n").known_device_count(),
            std::optional<size_t>(4));
  // Unknown until the devices open: all, cores, numa, or a split that may not apply (type any).
  DeployConfig all = parse("model: {path: m}\ndevices: {all: true}\nparallel: {data: 8, expert: 8}\n");
  EXPECT_EQ(all.known_device_count(), std::nullopt);
  EXPECT_EQ(parse("model: {path: m}\ndevices: {type: cpu, split: cores}\nparallel: {data: 2}\n").known_device_count(),
            std::nullopt);
  EXPECT_EQ(parse("model: {path: m}\ndevices: {split: 2}\nparallel: {data: 2}\n").known_device_count(), std::nullopt);
  // split is words or a count, so a quoted count is a count.
  EXPECT_EQ(parse("model: {path: m}\ndevices: {type: cpu, split: \"3\"}\nparallel: {data: 3}\n").devices.split, "3");
  EXPECT_NO_THROW(check_device_count(all, 8));
  try {
    check_device_count(all, 6);
    FAIL() << "expected an error";
  } catch (const std::runtime_error& e) {
    EXPECT_EQ(std::string(e.what()),
              "deploy.yaml:3: parallel.data: data (8) * tensor (1) must equal the number of devices, and the "
              "deployment has 6 devices");
  }
}

TEST(DeployConfig, SharedValidators) {
  EXPECT_EQ(check_temperature(0.0), std::nullopt);
  EXPECT_EQ(check_temperature(-1e-9), std::optional<std::string>("a number >= 0"));
  EXPECT_EQ(check_top_p(1.0), std::nullopt);
  EXPECT_EQ(check_top_p(0.0), std::optional<std::string>("a number in (0, 1]"));
  EXPECT_EQ(check_min_p(1.0), std::nullopt);
  EXPECT_EQ(check_top_k(-1), std::nullopt);
  EXPECT_EQ(check_max_tokens(2147483648LL), std::optional<std::string>("a positive integer"));
  EXPECT_EQ(check_stop_token_id(0), std::nullopt);
}

// The shipped files.

fs::path source_dir() { return fs::path(CLSHARD_SOURCE_DIR); }

TEST(DeployConfig, Cluster) {
  EXPECT_EQ(parse("model: {path: m}\n").cluster.transport, ClusterTransport::Local);
  DeployConfig c = parse("model: {path: m}\ncluster:\n  transport: mpi\n");
  EXPECT_EQ(c.cluster.transport, ClusterTransport::Mpi);
  EXPECT_EQ(c.where("cluster.transport"), "deploy.yaml:3: cluster.transport");
  EXPECT_EQ(error_of("model: {path: m}\ncluster: {transport: tcp}\n"),
            "deploy.yaml:2: cluster.transport: expected one of local | mpi, got \"tcp\"");
  EXPECT_EQ(error_of("model: {path: m}\ncluster:\n  transport: mpi\n  nodes: 2\n"),
            "deploy.yaml:4: cluster.nodes: unknown key (expected one of: transport)");
}

// kv_cache.dtype: f32 by default, bf16 or fp8 when asked; anything else names the line and the
// choices.
TEST(DeployConfig, KvCacheDtype) {
  EXPECT_EQ(parse("model: {path: m}\n").kv_cache.dtype, DType::F32);
  EXPECT_EQ(parse("model: {path: m}\nkv_cache: {dtype: bf16}\n").kv_cache.dtype, DType::BF16);
  EXPECT_EQ(parse("model: {path: m}\nkv_cache: {dtype: fp8}\n").kv_cache.dtype, DType::F8_E4M3);
  EXPECT_EQ(parse("model: {path: m}\nkv_cache: {dtype: f32}\n").kv_cache.dtype, DType::F32);
  EXPECT_EQ(error_of("model: {path: m}\nkv_cache:\n  page_size: 16\n  dtype: fp16\n"),
            "deploy.yaml:4: kv_cache.dtype: expected one of f32 | bf16 | fp8, got \"fp16\"");
}

TEST(DeployConfig, ExampleShowsEveryKeyAtItsDefault) {
  DeployConfig c = load_deploy_config(source_dir() / "configs" / "example.yaml");
  for (const std::string& key : deploy_config_keys())
    EXPECT_TRUE(c.has_key(key)) << key << " is missing from configs/example.yaml";
  DeployConfig d;
  EXPECT_EQ(c.model.dtype, d.model.dtype);
  EXPECT_EQ(c.model.max_length, d.model.max_length);
  EXPECT_EQ(c.devices.platform, d.devices.platform);
  EXPECT_EQ(c.devices.type, d.devices.type);
  EXPECT_EQ(c.devices.ids, d.devices.ids);
  EXPECT_EQ(c.devices.all, d.devices.all);
  EXPECT_EQ(c.devices.split, d.devices.split);
  EXPECT_EQ(c.parallel, d.parallel);
  EXPECT_EQ(c.cluster, d.cluster);
  EXPECT_EQ(c.kv_cache, d.kv_cache);
  EXPECT_EQ(c.batch, d.batch);
  EXPECT_EQ(c.sampling, d.sampling);
  EXPECT_EQ(c.speculative, d.speculative);
  EXPECT_EQ(c.model.path, (source_dir() / ".cache" / "models" / "llama3-tiny").lexically_normal());
  EXPECT_EQ(c.job.input, (source_dir() / "configs" / "prompts" / "tiny-prompts.jsonl").lexically_normal());
}

TEST(DeployConfig, TinyCpuDefault) {
  DeployConfig c = load_deploy_config(source_dir() / "configs" / "tiny-cpu.yaml");
  EXPECT_EQ(c.model.path, (source_dir() / ".cache" / "models" / "llama3-tiny").lexically_normal());
  EXPECT_EQ(c.devices.type, "cpu");
  EXPECT_EQ(c.known_device_count(), std::optional<size_t>(1));
  EXPECT_EQ(c.kv_cache.page_size, 16);
  EXPECT_FLOAT_EQ(c.sampling.temperature, 0.0f);
  EXPECT_EQ(c.sampling.max_tokens, 32);
  EXPECT_EQ(c.job.input, (source_dir() / "configs" / "prompts" / "tiny-prompts.jsonl").lexically_normal());
  EXPECT_EQ(c.job.output, (source_dir() / ".cache" / "out" / "tiny-completions.jsonl").lexically_normal());

  // Its prompts: all valid, both shapes, every sampling override kind.
  BatchInput in = read_batch_input(c.job.input, c.sampling);
  EXPECT_TRUE(in.errors.empty()) << (in.errors.empty() ? "" : in.errors[0].message);
  ASSERT_EQ(in.requests.size(), 16u);
  size_t openai = 0, chat = 0, token_ids = 0;
  for (const auto& r : in.requests) {
    openai += r.openai_shape;
    chat += r.is_chat();
    token_ids += r.prompt_token_ids.has_value();
  }
  EXPECT_EQ(openai, 5u);
  EXPECT_EQ(chat, 3u);
  EXPECT_EQ(token_ids, 1u);
  EXPECT_EQ(in.requests[0].id, "greeting");
  EXPECT_EQ(in.requests[0].sampling, c.sampling);  // no overrides: the YAML's defaults
}

}  // namespace
}  // namespace clshard
