// LoRA adapters on DeepSeek-V3 (models/deepseek_v3/lora.h, runtime/ops_lora.h), against merged
// weights, on the shared reference checkpoint deepseek-v3-tiny-grouped (layer 0 dense, layers 1
// and 2 MoE with a shared expert; q_lora_rank 96):
//   * a request running an adapter gives, at every position, the logits of a checkpoint whose
//     weights the test merged (W + (alpha / r) B A, computed in double, written f32) within 1e-4,
//     for adapters the test writes (random A and B; ranks 4, 8 and 16 over q_a/q_b/kv_a/o_proj,
//     the dense MLP and the shared experts), on the bf16 checkpoint and on the FP8 one (merged
//     into the dequantized weights e4m3(w) * scale_inv: the base GEMM dequantizes exactly those in
//     its kernel, and the adapter's product is added in f32 on top, so the merge is exact in f32;
//     merging back into FP8 weights would not be). A checkpoint the test rewrites with a plain
//     q_proj (no q_lora_rank) checks the q_proj target the same way;
//   * a mixed batch (three adapters and the base in one step) gives each row the logits it gets
//     alone, and through the engine the greedy tokens it gets alone;
//   * lora.max_loaded 1 with requests alternating two adapters gives the tokens max_loaded 2
//     gives, with one adapter resident and the adapters uploaded again as they alternate;
//   * bad input: kv_b_proj, the router, a routed expert, q_proj on a q_lora model, a shape of
//     another base model: errors naming the module.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <map>
#include <random>

#include <nlohmann/json.hpp>

#include "models/deepseek_v3/model.h"
#include "models/registry.h"
#include "runtime/device.h"
#include "runtime/engine/engine.h"
#include "runtime/ops_moe.h"
#include "runtime/safetensors.h"
#include "tests/lora_adapters.h"
#include "tests/test_util.h"

namespace clshard {
namespace {

namespace fs = std::filesystem;

fs::path ckpt(const std::string& name) { return test::reference_dir() / "ckpt" / name; }

// deepseek-v3-tiny-grouped: hidden 128, q_lora 96, 4 heads of qk 48 and v 32, kv_lora 64 + rope
// 16, dense FFN 256 on layer 0, one shared expert of 64 on layers 1 and 2.
using Shape = test::LoraShape;
using test::TestAdapter;
std::map<std::string, Shape> module_shapes(int layer) {
  const int64_t F = layer == 0 ? 256 : 64;
  return {{"q_a_proj", {128, 96}},  {"q_b_proj", {96, 192}},  {"q_proj", {128, 192}},
          {"kv_a_proj_with_mqa", {128, 80}}, {"o_proj", {128, 128}},
          {"gate_proj", {128, F}}, {"up_proj", {128, F}},      {"down_proj", {F, 128}}};
}
std::string module_path(int layer, const std::string& m) {
  const bool mlp = m == "gate_proj" || m == "up_proj" || m == "down_proj";
  return "model.layers." + std::to_string(layer) +
         (!mlp ? ".self_attn." : layer == 0 ? ".mlp." : ".mlp.shared_experts.") + m;
}

// A PEFT adapter with random A and B for `modules` in every layer of 3 (paths: the layer's
// module_path), or for `paths` as given.
TestAdapter write_adapter(const fs::path& dir, int rank, double alpha,
                          const std::vector<std::string>& modules, uint32_t seed,
                          std::vector<std::pair<std::string, Shape>> paths = {}) {
  if (paths.empty())
    for (int l = 0; l < 3; ++l)
      for (const auto& m : modules) paths.push_back({module_path(l, m), module_shapes(l).at(m)});
  return test::write_peft_adapter(dir, rank, alpha, modules, paths, seed,
                                  "deepseek-v3-tiny-grouped");
}

// A tensor of the checkpoint as doubles: f32 and bf16 as stored, FP8 dequantized with its block
// scales (e4m3(w) * scale_inv[n / 128, k / 128]).
std::vector<double> weight_values(const WeightStore& s, const std::string& name) {
  const TensorView& t = s.get(name);
  std::vector<double> w(size_t(t.numel()));
  if (t.dtype == DType::F32) {
    for (size_t i = 0; i < w.size(); ++i) w[i] = reinterpret_cast<const float*>(t.data)[i];
  } else if (t.dtype == DType::BF16) {
    for (size_t i = 0; i < w.size(); ++i)
      w[i] = bf16_to_f32(reinterpret_cast<const uint16_t*>(t.data)[i]);
  } else if (t.dtype == DType::F8_E4M3) {
    const TensorView& sc = s.get(name + "_scale_inv");
    const int64_t K = t.dim(1), kb = sc.dim(1);
    const auto* scale = reinterpret_cast<const float*>(sc.data);
    for (int64_t n = 0; n < t.dim(0); ++n)
      for (int64_t k = 0; k < K; ++k)
        w[size_t(n * K + k)] = double(reference::e4m3_to_f32(t.data[n * K + k])) *
                               scale[(n / 128) * kb + k / 128];
  } else {
    ADD_FAILURE() << name << ": " << t.describe();
  }
  return w;
}

// A copy of checkpoint `base` in f32 with the adapter merged: W + (alpha / r) B A, in double
// (FP8 weights dequantized first; their scales and the quantization config dropped).
fs::path write_merged(const fs::path& base, const fs::path& dir, const TestAdapter* a) {
  fs::create_directories(dir);
  nlohmann::json cfg = nlohmann::json::parse(std::ifstream(base / "config.json"));
  cfg.erase("quantization_config");
  cfg["torch_dtype"] = "float32";
  std::ofstream(dir / "config.json") << cfg.dump(2);
  fs::copy_file(base / "generation_config.json", dir / "generation_config.json",
                fs::copy_options::overwrite_existing);
  WeightStore store(base);
  std::vector<TensorToWrite> out;
  for (const std::string& name : store.names()) {
    if (name.ends_with("_scale_inv")) continue;
    const TensorView& t = store.get(name);
    std::vector<double> w = weight_values(store, name);
    const std::string path = name.substr(0, name.size() - std::string(".weight").size());
    if (auto it = a ? a->weights.find(path) : decltype(a->weights.end()){};
        a && it != a->weights.end()) {
      const auto& [A, B] = it->second;
      const double scale = a->alpha / a->rank;
      const int64_t n_out = t.dim(0), n_in = t.dim(1);
      for (int64_t o = 0; o < n_out; ++o)
        for (int64_t i = 0; i < n_in; ++i) {
          double d = 0;
          for (int j = 0; j < a->rank; ++j) d += double(B[o * a->rank + j]) * A[j * n_in + i];
          w[size_t(o * n_in + i)] += scale * d;
        }
    }
    std::vector<float> f(w.begin(), w.end());
    out.push_back({name, DType::F32, t.shape, test::f32_bytes(f)});
  }
  write_safetensors(dir / "model.safetensors", out);
  return dir;
}

std::unique_ptr<CausalLM> load_with(const fs::path& dir,
                                    const std::vector<std::pair<std::string, fs::path>>& adapters,
                                    uint32_t max_loaded = 8, uint32_t max_rank = 16) {
  return test::load_with_adapters(dir, adapters, max_rank, max_loaded);
}

using test::logits_of;
using test::max_diff;
using test::sequence;

struct Rig {
  fs::path root = test::temp_dir("lora_dsv3");
  TestAdapter r4, r16, r8;
  fs::path r4_dir = root / "r4", r16_dir = root / "r16", r8_dir = root / "r8";
  Rig() {
    r4 = write_adapter(r4_dir, 4, 8.0, {"q_a_proj", "kv_a_proj_with_mqa", "o_proj", "down_proj"},
                       1);
    r16 = write_adapter(r16_dir, 16, 32.0,
                        {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj", "gate_proj",
                         "up_proj", "down_proj"},
                        2);
    r8 = write_adapter(r8_dir, 8, 4.0, {"q_b_proj", "gate_proj", "up_proj"}, 3);
  }
};

// Adapter logits vs the merged checkpoints', for the rig's adapters on checkpoint `base`.
void expect_merged_logits(const Rig& rig, const fs::path& base, const std::string& tag) {
  auto model = load_with(base, {{"r4", rig.r4_dir}, {"r16", rig.r16_dir}, {"r8", rig.r8_dir}});
  ASSERT_EQ(model->num_lora_adapters(), 3u);
  const std::vector<std::vector<int32_t>> seqs = {sequence(1, 21)};
  // The base as an f32 checkpoint, merged with nothing: the adapters' effect is measured from it.
  auto plain = load_model(write_merged(base, rig.root / (tag + "_plain"), nullptr),
                          LoadOptions{{&test::default_device()}, std::nullopt});
  const auto base_logits = logits_of(*plain, seqs, {0})[0];
  for (uint32_t id : {1u, 2u, 3u}) {
    const TestAdapter& a = id == 1 ? rig.r4 : id == 2 ? rig.r16 : rig.r8;
    auto merged =
        load_model(write_merged(base, rig.root / (tag + "_merged" + std::to_string(id)), &a),
                   LoadOptions{{&test::default_device()}, std::nullopt});
    const auto want = logits_of(*merged, seqs, {0})[0];
    const auto got = logits_of(*model, seqs, {id})[0];
    EXPECT_LE(max_diff(got, want), 1e-4f) << tag << " adapter " << id;
    // The adapter matters: the merged model's logits are far from the base model's.
    EXPECT_GT(max_diff(want, base_logits), 1e-2f) << tag << " adapter " << id;
  }
  // Without an adapter the model with adapters loaded is the base model (its own weights).
  auto bare = load_model(base, LoadOptions{{&test::default_device()}, std::nullopt});
  EXPECT_LE(max_diff(logits_of(*model, seqs, {0})[0], logits_of(*bare, seqs, {0})[0]), 0.0f);
}

TEST(LoraDeepseekV3, LogitsEqualTheMergedCheckpointsWithin1e4OnBf16) {
  Rig rig;
  expect_merged_logits(rig, ckpt("deepseek-v3-tiny-grouped-bf16"), "bf16");
}

TEST(LoraDeepseekV3, LogitsEqualTheMergedCheckpointsWithin1e4OnFp8) {
  Rig rig;
  expect_merged_logits(rig, ckpt("deepseek-v3-tiny-grouped-fp8"), "fp8");
}

// q_proj: the grouped f32 checkpoint rewritten without q_lora_rank (random q_proj [192, 128] in
// place of q_a_proj, its norm and q_b_proj).
TEST(LoraDeepseekV3, QProjWithoutQLoraEqualsTheMergedCheckpoint) {
  const fs::path root = test::temp_dir("lora_dsv3_qproj");
  const fs::path base = ckpt("deepseek-v3-tiny-grouped-f32"), plain = root / "plain";
  fs::create_directories(plain);
  nlohmann::json cfg = nlohmann::json::parse(std::ifstream(base / "config.json"));
  cfg.erase("q_lora_rank");
  std::ofstream(plain / "config.json") << cfg.dump(2);
  fs::copy_file(base / "generation_config.json", plain / "generation_config.json");
  WeightStore store(base);
  std::vector<TensorToWrite> out;
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-0.1f, 0.1f);
  for (const std::string& name : store.names()) {
    if (name.find(".q_a_") != std::string::npos || name.find(".q_b_") != std::string::npos)
      continue;
    const TensorView& t = store.get(name);
    out.push_back({name, t.dtype, t.shape,
                   std::vector<uint8_t>(t.data, t.data + t.bytes)});
  }
  for (int l = 0; l < 3; ++l) {
    std::vector<float> q(192 * 128);
    for (float& x : q) x = u(rng);
    out.push_back(
        {module_path(l, "q_proj") + ".weight", DType::F32, {192, 128}, test::f32_bytes(q)});
  }
  write_safetensors(plain / "model.safetensors", out);
  const TestAdapter a =
      write_adapter(root / "a", 8, 16.0, {"q_proj", "o_proj"}, 5);
  auto model = load_with(plain, {{"a", root / "a"}});
  auto merged = load_model(write_merged(plain, root / "merged", &a),
                           LoadOptions{{&test::default_device()}, std::nullopt});
  auto bare = load_model(plain, LoadOptions{{&test::default_device()}, std::nullopt});
  const std::vector<std::vector<int32_t>> seqs = {sequence(2, 19)};
  const auto want = logits_of(*merged, seqs, {0})[0];
  EXPECT_LE(max_diff(logits_of(*model, seqs, {1})[0], want), 1e-4f);
  EXPECT_GT(max_diff(want, logits_of(*bare, seqs, {0})[0]), 1e-2f);
}

struct GenRequest {
  std::vector<int32_t> prompt;
  uint32_t adapter = 0;
};

// Greedy tokens of each request through the engine, all submitted at once.
std::vector<std::vector<int32_t>> generate(CausalLM& model, const std::vector<GenRequest>& reqs,
                                           uint32_t max_tokens = 8) {
  SchedulerLimits lim;
  lim.page_size = 16;
  lim.total_pages = 64;
  lim.prefix_caching = true;
  model.allocate_kv_cache(lim.total_pages, lim.page_size);
  Engine engine(model, nullptr, lim);
  std::map<uint64_t, size_t> index;
  for (size_t i = 0; i < reqs.size(); ++i) {
    GenerationRequest r;
    r.prompt = reqs[i].prompt;
    r.sampling.temperature = 0;
    r.max_tokens = max_tokens;
    r.adapter_id = reqs[i].adapter;
    index[engine.submit(r)] = i;
  }
  std::vector<std::vector<int32_t>> out(reqs.size());
  while (engine.has_work())
    for (auto& res : engine.step()) out[index.at(res.handle)] = res.token_ids;
  return out;
}

TEST(LoraDeepseekV3, AMixedBatchGivesEachRowWhatItGetsAlone) {
  Rig rig;
  auto model = load_with(ckpt("deepseek-v3-tiny-grouped-bf16"),
                         {{"r4", rig.r4_dir}, {"r16", rig.r16_dir}, {"r8", rig.r8_dir}});
  const std::vector<std::vector<int32_t>> seqs = {sequence(1, 9), sequence(2, 17), sequence(3, 5),
                                                  sequence(4, 12), sequence(5, 7)};
  const std::vector<uint32_t> ids = {2, 0, 3, 1, 2};
  const auto together = logits_of(*model, seqs, ids);
  for (size_t b = 0; b < seqs.size(); ++b) {
    const auto alone = logits_of(*model, {seqs[b]}, {ids[b]})[0];
    EXPECT_LE(max_diff(together[b], alone), 1e-5f) << "row " << b << " adapter " << ids[b];
  }
  std::vector<GenRequest> reqs;
  for (size_t b = 0; b < seqs.size(); ++b) reqs.push_back({seqs[b], ids[b]});
  const auto all = generate(*model, reqs);
  for (size_t b = 0; b < seqs.size(); ++b) {
    EXPECT_EQ(all[b], generate(*model, {reqs[b]})[0]) << "row " << b;
    EXPECT_FALSE(all[b].empty()) << "row " << b;
  }
  // The adapters change what the rows generate.
  EXPECT_NE(generate(*model, {{seqs[0], 2}})[0], generate(*model, {{seqs[0], 0}})[0]);
}

// lora.max_loaded: 1 keeps one adapter on the device; requests alternating two adapters (and the
// base) give the tokens of max_loaded 2: the r4 requests (and the base one) run first, the r16
// requests wait until no r4 request runs, then r16 replaces r4 on the device.
TEST(LoraDeepseekV3, MaxLoadedOneGivesTheTokensOfMaxLoadedTwo) {
  Rig rig;
  const fs::path base = ckpt("deepseek-v3-tiny-grouped-bf16");
  auto one = load_with(base, {{"r4", rig.r4_dir}, {"r16", rig.r16_dir}}, 1);
  auto two = load_with(base, {{"r4", rig.r4_dir}, {"r16", rig.r16_dir}}, 2);
  EXPECT_EQ(one->max_loaded_lora_adapters(), 1u);
  EXPECT_EQ(two->max_loaded_lora_adapters(), 2u);
  std::vector<GenRequest> reqs;
  for (int i = 0; i < 6; ++i) reqs.push_back({sequence(10 + i, 6 + size_t(i)), uint32_t(i % 2 + 1)});
  reqs.push_back({sequence(20, 8), 0});
  const auto got = generate(*one, reqs), want = generate(*two, reqs);
  for (size_t i = 0; i < reqs.size(); ++i) EXPECT_EQ(got[i], want[i]) << "request " << i;
  const auto& set1 = dynamic_cast<deepseek_v3::DeepseekV3Model&>(*one).stack().lora(0);
  const auto& set2 = dynamic_cast<deepseek_v3::DeepseekV3Model&>(*two).stack().lora(0);
  EXPECT_EQ(set1.slots(), 1u);
  EXPECT_EQ(set2.slots(), 2u);
  // max_loaded 2: both uploaded at load, never again. max_loaded 1: r4 at load, then r16 once,
  // when the r4 requests are done; the adapters' device bytes are half.
  EXPECT_EQ(set2.uploads(), 2u);
  EXPECT_EQ(set1.uploads(), 2u);
  EXPECT_EQ(set1.resident(), std::vector<uint32_t>{2u});
  EXPECT_EQ(set1.device_bytes() * 2, set2.device_bytes());
  // One step with both adapters cannot run on one slot: a clear error, not a wrong answer.
  try {
    logits_of(*one, {sequence(1, 5), sequence(2, 5)}, {1, 2});
    ADD_FAILURE() << "two adapters in one step on one slot";
  } catch (const std::invalid_argument& e) {
    EXPECT_STREQ(e.what(), "step: 2 LoRA adapters in one step, but lora.max_loaded is 1");
  }
  // ... while each alone equals max_loaded 2, whichever was resident before (each swap uploads).
  for (uint32_t id : {2u, 1u, 2u})
    EXPECT_LE(max_diff(logits_of(*one, {sequence(3, 9)}, {id})[0],
                       logits_of(*two, {sequence(3, 9)}, {id})[0]),
              0.0f)
        << "adapter " << id;
  EXPECT_EQ(set1.uploads(), 4u);
  EXPECT_EQ(set2.uploads(), 2u);
}

std::string load_error(const fs::path& dir, uint32_t max_rank = 16) {
  try {
    load_with(ckpt("deepseek-v3-tiny-grouped-bf16"), {{"bad", dir}}, 8, max_rank);
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(LoraDeepseekV3, UnsupportedModulesAreClearErrorsNamingThem) {
  const fs::path root = test::temp_dir("lora_dsv3_bad");
  const std::string supported =
      " (supported: q_a_proj, q_b_proj, q_proj, kv_a_proj_with_mqa, o_proj, gate_proj, up_proj, "
      "down_proj)";
  const std::string a = "base_model.model.model.layers.";
  // kv_b_proj in target_modules.
  write_adapter(root / "kvb", 4, 8, {"kv_b_proj"}, 1, {{"model.layers.0.self_attn.kv_b_proj", {64, 256}}});
  EXPECT_EQ(load_error(root / "kvb"),
            "LoRA adapter 'bad': " + (root / "kvb" / "adapter_config.json").string() +
                ": \"target_modules\": module 'kv_b_proj' is not supported: MLA absorbs kv_b_proj "
                "into the query and the output" + supported);
  // ... or only in the tensors.
  write_adapter(root / "kvb2", 4, 8, {"o_proj"}, 1, {{"model.layers.0.self_attn.kv_b_proj", {64, 256}}});
  EXPECT_EQ(load_error(root / "kvb2"),
            "LoRA adapter 'bad': " + (root / "kvb2" / "adapter_model.safetensors").string() +
                ": " + a +
                "0.self_attn.kv_b_proj.lora_A.weight: module 'kv_b_proj' is not supported: MLA "
                "absorbs kv_b_proj into the query and the output" + supported);
  // The router.
  write_adapter(root / "gate", 4, 8, {"gate"}, 1, {{"model.layers.1.mlp.gate", {128, 16}}});
  EXPECT_EQ(load_error(root / "gate"),
            "LoRA adapter 'bad': " + (root / "gate" / "adapter_config.json").string() +
                ": \"target_modules\": module 'gate' is not supported: the MoE router (mlp.gate) "
                "takes no adapter" + supported);
  // A routed expert (PEFT's gate_proj matches the experts' too).
  write_adapter(root / "expert", 4, 8, {"gate_proj"}, 1,
                {{"model.layers.0.mlp.gate_proj", {128, 256}},
                 {"model.layers.1.mlp.experts.3.gate_proj", {128, 64}}});
  EXPECT_EQ(load_error(root / "expert"),
            "LoRA adapter 'bad': " + a +
                "1.mlp.experts.3.gate_proj.lora_A.weight: module model.layers.1.mlp.experts.3."
                "gate_proj is a routed expert: LoRA on routed experts is not supported (only the "
                "dense and shared-expert MLPs)");
  // q_proj on a model with q_lora_rank.
  write_adapter(root / "q", 4, 8, {"q_proj"}, 1, {{"model.layers.2.self_attn.q_proj", {128, 192}}});
  EXPECT_EQ(load_error(root / "q"),
            "LoRA adapter 'bad': " + a +
                "2.self_attn.q_proj.lora_A.weight: the base model has q_lora_rank: its query is "
                "q_a_proj and q_b_proj, not q_proj");
  // mlp.* on an MoE layer.
  write_adapter(root / "moe_mlp", 4, 8, {"up_proj"}, 1, {{"model.layers.1.mlp.up_proj", {128, 64}}});
  EXPECT_EQ(load_error(root / "moe_mlp"),
            "LoRA adapter 'bad': " + a +
                "1.mlp.up_proj.lora_A.weight: layer 1 is an MoE layer (from layer 1 on): its MLP "
                "targets are mlp.shared_experts.*");
  // Another base model's shape.
  write_adapter(root / "other", 4, 8, {"q_b_proj"}, 1, {{"model.layers.0.self_attn.q_b_proj", {96, 384}}});
  EXPECT_EQ(load_error(root / "other"),
            "LoRA adapter 'bad': " + a + "0.self_attn.q_b_proj.lora_A.weight is [4, 96] and " + a +
                "0.self_attn.q_b_proj.lora_B.weight [384, 4], but the base model's q_b_proj takes "
                "96 inputs and gives 192 outputs (an adapter for another base model?)");
  // A layer past the model's (its MTP layer, say).
  write_adapter(root / "deep", 4, 8, {"o_proj"}, 1, {{"model.layers.3.self_attn.o_proj", {128, 128}}});
  EXPECT_EQ(load_error(root / "deep"),
            "LoRA adapter 'bad': " + a +
                "3.self_attn.o_proj.lora_A.weight: layer 3, but the base model has 3 layers (an "
                "adapter for another base model, or its MTP layer?)");
}

// The deployment: a DeepSeek-V3 batch job with a `lora` field per line, max_loaded 1, writes the
// greedy tokens the engine gives each adapter.
TEST(LoraDeepseekV3, TheBatchJobRunsAdaptersPerLineWithMaxLoadedOne) {
  Rig rig;
  const fs::path base = ckpt("deepseek-v3-tiny-grouped-bf16");
  const fs::path dir = test::temp_dir("lora_dsv3_job");
  std::ofstream(dir / "prompts.jsonl")
      << R"({"id": "a", "prompt_token_ids": [5, 6, 7, 8, 9], "lora": "r16"})" << "\n"
      << R"({"id": "b", "prompt_token_ids": [5, 6, 7, 8, 9], "lora": "r4"})" << "\n"
      << R"({"id": "c", "prompt_token_ids": [5, 6, 7, 8, 9]})" << "\n"
      << R"({"id": "d", "prompt_token_ids": [5, 6, 7, 8, 9], "lora": "r16"})" << "\n";
  std::ofstream(dir / "deploy.yaml")
      << "model:\n  path: " << base.string() << "\ndevices:\n  type: cpu\n"
      << "kv_cache:\n  page_size: 16\n  pages: 32\n"
      << "sampling:\n  temperature: 0\n  max_tokens: 6\n"
      << "lora:\n  adapters:\n    r4: " << rig.r4_dir.string() << "\n    r16: "
      << rig.r16_dir.string() << "\n  max_rank: 16\n  max_loaded: 1\n"
      << "job:\n  input: prompts.jsonl\n  output: out.jsonl\n";
  std::string out, err;
  ASSERT_EQ(test::run_clshard({"run", (dir / "deploy.yaml").string()}, &out, &err), 0) << err;
  std::ifstream in(dir / "out.jsonl");
  std::map<std::string, std::vector<int32_t>> tokens;
  for (std::string line; std::getline(in, line);) {
    auto j = nlohmann::json::parse(line);
    tokens[j["id"].get<std::string>()] = j["token_ids"].get<std::vector<int32_t>>();
  }
  ASSERT_EQ(tokens.size(), 4u) << err;
  auto model = load_with(base, {{"r4", rig.r4_dir}, {"r16", rig.r16_dir}});
  const std::vector<int32_t> prompt = {5, 6, 7, 8, 9};
  EXPECT_EQ(tokens["a"], generate(*model, {{prompt, 2}}, 6)[0]);
  EXPECT_EQ(tokens["b"], generate(*model, {{prompt, 1}}, 6)[0]);
  EXPECT_EQ(tokens["c"], generate(*model, {{prompt, 0}}, 6)[0]);
  EXPECT_EQ(tokens["d"], tokens["a"]);
  EXPECT_NE(tokens["a"], tokens["c"]);
}

}  // namespace
}  // namespace clshard
