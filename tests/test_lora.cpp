// LoRA adapters on Llama 3 (runtime/ops_lora.h, models/llama3/lora.h), against merged weights:
//   * a request running an adapter gives, at every position, the logits of a checkpoint whose
//     weights the test merged (W + (alpha / r) B A, computed in double) within 1e-4, for adapters
//     the test writes (random A and B; rank 4 on q/v/o/down_proj, rank 16 on all seven targets,
//     rank 72 on q/o/down_proj, past the one-launch kernel's 64, in both kernel shapes: the GPU
//     one forced on PoCL);
//   * ops::lora alone in both shapes against a double-precision reference, at ranks 16, 72 and
//     200, within the bound of its f32 sums; the GPU shape's pair is its own (other bits);
//   * a mixed batch (three adapters and the base model in one step) gives each row the logits it
//     gets alone, and through the engine the greedy tokens it gets alone;
//   * bad input: an adapter for another base model (shapes, layers), a rank above max_rank, a
//     malformed or incomplete adapter_config.json, an unsupported target module, and (in the batch
//     job) an unknown adapter name, which becomes an error record while the job goes on.
#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <cstring>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>

#include "models/registry.h"
#include "runtime/device.h"
#include "runtime/engine/engine.h"
#include "runtime/ops_lora.h"
#include "runtime/safetensors.h"
#include "tests/lora_adapters.h"
#include "tests/test_util.h"

namespace clshard {
namespace {

namespace fs = std::filesystem;

fs::path base_dir() { return test::reference_dir() / "ckpt" / "llama3-tiny-f32"; }

// The tiny checkpoint's shapes: hidden 128, 4 heads of 32 (2 kv heads), FFN 384, 2 layers.
using Shape = test::LoraShape;
using test::TestAdapter;
std::map<std::string, Shape> module_shapes() {
  return {{"q_proj", {128, 128}},   {"k_proj", {128, 64}}, {"v_proj", {128, 64}},
          {"o_proj", {128, 128}},   {"gate_proj", {128, 384}}, {"up_proj", {128, 384}},
          {"down_proj", {384, 128}}};
}
std::string module_path(int layer, const std::string& m) {
  const bool attn = m == "q_proj" || m == "k_proj" || m == "v_proj" || m == "o_proj";
  return "model.layers." + std::to_string(layer) + (attn ? ".self_attn." : ".mlp.") + m;
}

// A PEFT adapter with random A and B for `modules` in every layer.
TestAdapter write_adapter(const fs::path& dir, int rank, double alpha,
                          const std::vector<std::string>& modules, uint32_t seed,
                          std::map<std::string, Shape> shapes = module_shapes(), int layers = 2) {
  std::vector<std::pair<std::string, Shape>> paths;
  for (int l = 0; l < layers; ++l)
    for (const auto& m : modules) paths.push_back({module_path(l, m), shapes.at(m)});
  return test::write_peft_adapter(dir, rank, alpha, modules, paths, seed, "llama3-tiny");
}

// A copy of the base checkpoint with the adapter merged: W + (alpha / r) B A, in double.
fs::path write_merged(const fs::path& dir, const TestAdapter& a) {
  fs::create_directories(dir);
  for (const char* f : {"config.json", "generation_config.json"})
    fs::copy_file(base_dir() / f, dir / f, fs::copy_options::overwrite_existing);
  WeightStore base(base_dir());
  std::vector<TensorToWrite> out;
  const double scale = a.alpha / a.rank;
  for (const std::string& name : base.names()) {
    const TensorView& t = base.get(name);
    EXPECT_EQ(t.dtype, DType::F32);
    std::vector<float> w(size_t(t.numel()));
    std::memcpy(w.data(), t.data, t.bytes);
    const std::string path = name.substr(0, name.size() - std::string(".weight").size());
    if (auto it = a.weights.find(path); it != a.weights.end()) {
      const auto& [A, B] = it->second;
      const int64_t n_out = t.dim(0), n_in = t.dim(1);
      for (int64_t o = 0; o < n_out; ++o)
        for (int64_t i = 0; i < n_in; ++i) {
          double d = 0;
          for (int j = 0; j < a.rank; ++j) d += double(B[o * a.rank + j]) * A[j * n_in + i];
          w[o * n_in + i] = float(double(w[o * n_in + i]) + scale * d);
        }
    }
    out.push_back({name, DType::F32, t.shape, test::f32_bytes(w)});
  }
  write_safetensors(dir / "model.safetensors", out);
  return dir;
}

std::unique_ptr<CausalLM> load_with(const std::vector<std::pair<std::string, fs::path>>& adapters,
                                    const fs::path& dir = base_dir(), uint32_t max_rank = 16) {
  return test::load_with_adapters(dir, adapters, max_rank);
}

using test::logits_of;
using test::max_diff;
using test::sequence;

struct Rig {
  fs::path root = test::temp_dir("lora");
  TestAdapter r4, r16, r8;
  fs::path r4_dir = root / "r4", r16_dir = root / "r16", r8_dir = root / "r8";
  Rig() {
    r4 = write_adapter(r4_dir, 4, 8.0, {"q_proj", "v_proj", "o_proj", "down_proj"}, 1);
    r16 = write_adapter(r16_dir, 16, 32.0,
                        {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                         "down_proj"},
                        2);
    r8 = write_adapter(r8_dir, 8, 4.0, {"k_proj", "gate_proj", "up_proj"}, 3);
  }
};

TEST(Lora, LogitsEqualTheMergedCheckpointsWithin1e4) {
  Rig rig;
  auto model = load_with({{"r4", rig.r4_dir}, {"r16", rig.r16_dir}});
  EXPECT_EQ(model->num_lora_adapters(), 2u);
  auto base = load_model(base_dir(), LoadOptions{{&test::default_device()}, std::nullopt});
  const std::vector<std::vector<int32_t>> seqs = {sequence(1, 21)};
  const auto base_logits = logits_of(*base, seqs, {0})[0];
  for (uint32_t id : {1u, 2u}) {
    const TestAdapter& a = id == 1 ? rig.r4 : rig.r16;
    auto merged = load_model(write_merged(rig.root / ("merged" + std::to_string(id)), a),
                             LoadOptions{{&test::default_device()}, std::nullopt});
    const auto want = logits_of(*merged, seqs, {0})[0];
    const auto got = logits_of(*model, seqs, {id})[0];
    EXPECT_LE(max_diff(got, want), 1e-4f) << "adapter " << id;
    // The adapter matters: the merged model's logits are far from the base model's.
    EXPECT_GT(max_diff(want, base_logits), 1e-2f) << "adapter " << id;
  }
  // Without an adapter the model with adapters loaded is the base model.
  EXPECT_LE(max_diff(logits_of(*model, seqs, {0})[0], base_logits), 0.0f);
}

// Ranks above 64 take the shrink / expand pair instead of the one-launch kernel: the same merged
// equality, with a rank-72 adapter beside a rank-4 one (slots padded to 72), in both kernel shapes
// (the GPU one on PoCL: the adapted and the merged model alike).
class LoraRanksAbove64 : public test::BothShapes {};

TEST_P(LoraRanksAbove64, EqualTheMergedCheckpointToo) {
  Rig rig;
  const TestAdapter r72 =
      write_adapter(rig.root / "r72", 72, 16.0, {"q_proj", "o_proj", "down_proj"}, 9);
  auto model = load_with({{"r4", rig.r4_dir}, {"r72", rig.root / "r72"}}, base_dir(), 128);
  const std::vector<std::vector<int32_t>> seqs = {sequence(6, 13)};
  for (uint32_t id : {1u, 2u}) {
    auto merged = load_model(write_merged(rig.root / ("merged_big" + std::to_string(id)),
                                          id == 1 ? rig.r4 : r72),
                             LoadOptions{{&test::default_device()}, std::nullopt});
    EXPECT_LE(max_diff(logits_of(*model, seqs, {id})[0], logits_of(*merged, seqs, {0})[0]), 1e-4f)
        << "adapter " << id;
  }
}
INSTANTIATE_TEST_SUITE_P(Shapes, LoraRanksAbove64, test::both_shapes(), test::ShapeParamName());

TEST(Lora, AMixedBatchGivesEachRowWhatItGetsAlone) {
  Rig rig;
  auto model = load_with({{"r4", rig.r4_dir}, {"r16", rig.r16_dir}, {"r8", rig.r8_dir}});
  const std::vector<std::vector<int32_t>> seqs = {sequence(1, 9), sequence(2, 17), sequence(3, 5),
                                                  sequence(4, 12), sequence(5, 7)};
  const std::vector<uint32_t> ids = {2, 0, 3, 1, 2};
  const auto together = logits_of(*model, seqs, ids);
  for (size_t b = 0; b < seqs.size(); ++b) {
    const auto alone = logits_of(*model, {seqs[b]}, {ids[b]})[0];
    EXPECT_LE(max_diff(together[b], alone), 1e-5f) << "row " << b << " adapter " << ids[b];
  }
  // Through the engine: the greedy tokens of each request run alone.
  auto generate = [&](const std::vector<size_t>& which) {
    SchedulerLimits lim;
    lim.page_size = 16;
    lim.total_pages = 32;
    lim.prefix_caching = true;
    model->allocate_kv_cache(lim.total_pages, lim.page_size);
    Engine engine(*model, nullptr, lim);
    std::map<uint64_t, size_t> index;
    for (size_t b : which) {
      GenerationRequest r;
      r.prompt = seqs[b];
      r.sampling.temperature = 0;
      r.max_tokens = 8;
      r.adapter_id = ids[b];
      index[engine.submit(r)] = b;
    }
    std::map<size_t, std::vector<int32_t>> out;
    while (engine.has_work())
      for (auto& res : engine.step()) out[index.at(res.handle)] = res.token_ids;
    return out;
  };
  const auto all = generate({0, 1, 2, 3, 4});
  for (size_t b = 0; b < seqs.size(); ++b)
    EXPECT_EQ(all.at(b), generate({b}).at(b)) << "row " << b;
  // An id past the loaded adapters is refused at submit.
  SchedulerLimits lim;
  lim.page_size = 16;
  lim.total_pages = 32;
  Engine engine(*model, nullptr, lim);
  GenerationRequest r;
  r.prompt = seqs[0];
  r.adapter_id = 4;
  try {
    engine.submit(r);
    ADD_FAILURE() << "adapter id 4 accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_STREQ(e.what(), "LoRA adapter id 4 but the model has 3 adapter(s)");
  }
}

std::string load_error(const std::vector<std::pair<std::string, fs::path>>& adapters,
                       uint32_t max_rank = 16) {
  try {
    load_with(adapters, base_dir(), max_rank);
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(Lora, BadAdaptersAreClearErrors) {
  const fs::path root = test::temp_dir("lora_bad");
  // Another base model: a hidden size of 64.
  auto shapes = module_shapes();
  shapes["q_proj"] = {64, 64};
  write_adapter(root / "other", 4, 8, {"q_proj"}, 1, shapes);
  EXPECT_EQ(load_error({{"other", root / "other"}}),
            "LoRA adapter 'other': base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight "
            "is [4, 64] and base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight [64, "
            "4], but the base model's q_proj takes 128 inputs and gives 128 outputs (an adapter "
            "for another base model?)");
  // ... with more layers.
  write_adapter(root / "deeper", 4, 8, {"v_proj"}, 1, module_shapes(), 3);
  EXPECT_EQ(load_error({{"deeper", root / "deeper"}}),
            "LoRA adapter 'deeper': base_model.model.model.layers.2.self_attn.v_proj.lora_A.weight: "
            "layer 2, but the base model has 2 layers (an adapter for another base model?)");
  // Rank above max_rank.
  write_adapter(root / "r32", 32, 8, {"q_proj"}, 1);
  EXPECT_EQ(load_error({{"r32", root / "r32"}}),
            "LoRA adapter 'r32': " + (root / "r32" / "adapter_config.json").string() +
                ": \"r\": rank 32 is above lora.max_rank 16");
  // An unsupported module.
  write_adapter(root / "emb", 4, 8, {"q_proj"}, 1);
  std::ofstream(root / "emb" / "adapter_config.json")
      << R"({"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "embed_tokens"]})";
  EXPECT_EQ(load_error({{"emb", root / "emb"}}),
            "LoRA adapter 'emb': " + (root / "emb" / "adapter_config.json").string() +
                ": \"target_modules\": module 'embed_tokens' is not supported (supported: q_proj, "
                "k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj)");
  // Malformed and incomplete adapter_config.json.
  write_adapter(root / "bad", 4, 8, {"q_proj"}, 1);
  std::ofstream(root / "bad" / "adapter_config.json") << R"({"r": 4, "lora_alpha": )";
  const std::string bad = load_error({{"bad", root / "bad"}});
  EXPECT_EQ(bad.rfind("LoRA adapter 'bad': " + (root / "bad" / "adapter_config.json").string(), 0),
            0u)
      << bad;
  std::ofstream(root / "bad" / "adapter_config.json")
      << R"({"r": "four", "lora_alpha": 8, "target_modules": ["q_proj"]})";
  EXPECT_EQ(load_error({{"bad", root / "bad"}}),
            "LoRA adapter 'bad': " + (root / "bad" / "adapter_config.json").string() +
                ": \"r\": expected a positive integer, got \"four\"");
  std::ofstream(root / "bad" / "adapter_config.json") << R"({"r": 4, "target_modules": "q_proj"})";
  EXPECT_EQ(load_error({{"bad", root / "bad"}}),
            "LoRA adapter 'bad': " + (root / "bad" / "adapter_config.json").string() +
                ": \"lora_alpha\": expected a number (missing)");
  EXPECT_EQ(load_error({{"none", root / "missing"}}),
            "LoRA adapter 'none': " + (root / "missing" / "adapter_config.json").string() +
                " does not exist");
}

// The batch job: a line naming an unknown adapter becomes an error record, the others run, and a
// line with an adapter gives the greedy tokens the engine gives it.
TEST(Lora, TheBatchJobRunsAdaptersPerLineAndReportsUnknownNames) {
  Rig rig;
  const fs::path dir = test::temp_dir("lora_job");
  std::ofstream(dir / "prompts.jsonl")
      << R"({"id": "a", "prompt_token_ids": [5, 6, 7, 8, 9], "lora": "r16"})" << "\n"
      << R"({"id": "b", "prompt_token_ids": [5, 6, 7, 8, 9], "lora": "nope"})" << "\n"
      << R"({"id": "c", "prompt_token_ids": [5, 6, 7, 8, 9]})" << "\n"
      << R"({"id": "d", "prompt_token_ids": [5, 6, 7, 8, 9], "lora": "r4"})" << "\n";
  std::ofstream(dir / "deploy.yaml")
      << "model:\n  path: " << base_dir().string() << "\ndevices:\n  type: cpu\n"
      << "kv_cache:\n  page_size: 16\n  pages: 32\n"
      << "sampling:\n  temperature: 0\n  max_tokens: 6\n"
      << "lora:\n  adapters:\n    r4: " << rig.r4_dir.string() << "\n    r16: "
      << rig.r16_dir.string() << "\n  max_rank: 16\n"
      << "job:\n  input: prompts.jsonl\n  output: out.jsonl\n";
  std::string out, err;
  ASSERT_EQ(test::run_clshard({"run", (dir / "deploy.yaml").string()}, &out, &err), 0) << err;
  std::ifstream in(dir / "out.jsonl");
  std::map<std::string, nlohmann::json> recs;
  for (std::string line; std::getline(in, line);) {
    auto j = nlohmann::json::parse(line);
    recs[j["id"].get<std::string>()] = j;
  }
  ASSERT_EQ(recs.size(), 4u) << err;
  EXPECT_EQ(recs["b"]["error"],
            "lora: unknown LoRA adapter 'nope' (the deployment declares: r4, r16)");
  auto model = load_with({{"r4", rig.r4_dir}, {"r16", rig.r16_dir}});
  auto greedy = [&](uint32_t id) {
    SchedulerLimits lim;
    lim.page_size = 16;
    lim.total_pages = 32;
    model->allocate_kv_cache(lim.total_pages, lim.page_size);
    Engine engine(*model, nullptr, lim);
    GenerationRequest r;
    r.prompt = {5, 6, 7, 8, 9};
    r.sampling.temperature = 0;
    r.max_tokens = 6;
    r.adapter_id = id;
    engine.submit(r);
    std::vector<int32_t> t;
    while (engine.has_work())
      for (auto& res : engine.step()) t = res.token_ids;
    return t;
  };
  EXPECT_EQ(recs["a"]["token_ids"].get<std::vector<int32_t>>(), greedy(2));
  EXPECT_EQ(recs["c"]["token_ids"].get<std::vector<int32_t>>(), greedy(0));
  EXPECT_EQ(recs["d"]["token_ids"].get<std::vector<int32_t>>(), greedy(1));
  EXPECT_NE(greedy(2), greedy(0));
}

// `clshard plan` counts the adapters: two adapters (ranks 4 and 16) in slots of rank 16 over the
// union of their modules: 2 x 16 x (q 256 + k 192 + v 192 + o 256 + gate 512 + up 512 + down 512)
// x 2 layers x 4 bytes.
TEST(Lora, PlanCountsTheAdapters) {
  Rig rig;
  const fs::path dir = test::temp_dir("lora_plan");
  std::ofstream(dir / "deploy.yaml")
      << "model:\n  path: " << base_dir().string() << "\ndevices:\n  type: cpu\n"
      << "lora:\n  adapters:\n    r4: " << rig.r4_dir.string() << "\n    r16: "
      << rig.r16_dir.string() << "\n  max_rank: 16\n";
  std::string out, err;
  ASSERT_EQ(test::run_clshard({"plan", (dir / "deploy.yaml").string(), "--device-memory", "1",
                               "--json"},
                              &out, &err),
            0)
      << err;
  const auto j = nlohmann::json::parse(out);
  EXPECT_EQ(j["devices"][0]["lora"].get<uint64_t>(), 2u * 16u * 2432u * 2u * 4u);
  // lora.max_loaded 1: one slot per module on the device, half of that; the text says so too.
  std::ofstream(dir / "deploy.yaml", std::ios::app) << "  max_loaded: 1\n";
  ASSERT_EQ(test::run_clshard({"plan", (dir / "deploy.yaml").string(), "--device-memory", "1",
                               "--json"},
                              &out, &err),
            0)
      << err;
  EXPECT_EQ(nlohmann::json::parse(out)["devices"][0]["lora"].get<uint64_t>(),
            16u * 2432u * 2u * 4u);
  ASSERT_EQ(test::run_clshard({"plan", (dir / "deploy.yaml").string(), "--device-memory", "1"},
                              &out, &err),
            0)
      << err;
  EXPECT_NE(out.find("lora: 2 adapter(s), at most 1 resident (lora.max_loaded), " +
                     std::to_string(16u * 2432u * 2u * 4u) + " bytes on every device"),
            std::string::npos)
      << out;
}

// ops::lora itself over a stack of three slots: K = 333 inputs, N = 257 outputs (four work-groups
// of 64 and one output more), seven tokens of every slot and of none, at ranks padded to 16 (the
// one-launch kernel), 72 and 200 (the shrink / expand pair; 200 leaves lora_expand_wg a partial
// pass of 32 rank columns), slot 1 at 3/8 of the padded rank and slot 2 at rank 0.
struct LoraRun {
  std::vector<float> y;
  std::vector<double> want, bound;  // bound 0: a token the adapters must leave alone
};
LoraRun run_lora(uint32_t max_rank) {
  Device& dev = test::default_device();
  const uint32_t K = 333, N = 257, T = 7, slots = 3;
  const std::vector<uint32_t> rank = {max_rank, max_rank * 3 / 8, 0};
  const std::vector<float> scale = {0.75f, -2.0f, 1.5f};
  const std::vector<int32_t> slot = {0, -1, 1, 2, 0, 1, -1};
  const float alpha = 0.5f;
  std::mt19937 rng(max_rank);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  auto random = [&](size_t n) {
    std::vector<float> v(n);
    for (auto& e : v) e = u(rng);
    return v;
  };
  const auto A = random(size_t(slots) * max_rank * K), B = random(size_t(slots) * N * max_rank);
  const auto x = random(size_t(T) * K), y0 = random(size_t(T) * N);
  auto upload = [&](const void* p, size_t bytes) {
    cl::Mem m = dev.alloc(bytes);
    dev.write(m, p, bytes);
    return m;
  };
  LoraStack stack;
  stack.A = upload(A.data(), A.size() * 4);
  stack.B = upload(B.data(), B.size() * 4);
  stack.rank = upload(rank.data(), rank.size() * 4);
  stack.scale = upload(scale.data(), scale.size() * 4);
  stack.slots = slots;
  stack.max_rank = max_rank;
  stack.in = K;
  stack.out = N;
  const cl::Mem xm = upload(x.data(), x.size() * 4), ym = upload(y0.data(), y0.size() * 4);
  const cl::Mem sm = upload(slot.data(), slot.size() * 4);
  const cl::Mem vm = dev.alloc(size_t(T) * max_rank * 4);
  ops::lora(dev, xm, 0, K, stack, sm, vm, ym, 0, N, T, alpha);
  LoraRun r;
  r.y.resize(y0.size());
  dev.read(ym, r.y.data(), r.y.size() * 4);
  r.want.assign(y0.begin(), y0.end());
  r.bound.assign(y0.size(), 0.0);
  for (uint32_t t = 0; t < T; ++t) {
    if (slot[t] < 0 || rank[size_t(slot[t])] == 0) continue;
    const uint32_t s = uint32_t(slot[t]), rs = rank[s];
    std::vector<double> v(rs), v_mag(rs);
    for (uint32_t j = 0; j < rs; ++j)
      for (uint32_t k = 0; k < K; ++k) {
        const double p = double(A[(size_t(s) * max_rank + j) * K + k]) * x[size_t(t) * K + k];
        v[j] += p;
        v_mag[j] += std::abs(p);
      }
    const double c = double(alpha) * scale[s];
    for (uint32_t n = 0; n < N; ++n) {
      double sum = 0, mag = 0;
      for (uint32_t j = 0; j < rs; ++j) {
        const double b = B[(size_t(s) * N + n) * max_rank + j];
        sum += b * v[j];
        mag += std::abs(b) * v_mag[j];
      }
      const size_t i = size_t(t) * N + n;
      r.want[i] += c * sum;
      // f32 sums of K, then rs terms, and the final FMA: within (K + rs + 2) epsilons of the
      // magnitudes they add.
      r.bound[i] = (K + rs + 2) * double(FLT_EPSILON) * (std::abs(c) * mag + std::abs(y0[i]));
    }
  }
  return r;
}

// In both kernel shapes (the GPU one on PoCL): each output of a token with an adapter is within
// its bound of the double-precision y + alpha * scale * B A x, and moved by it; tokens of no
// adapter and of the rank-0 slot keep their y bit for bit.
class LoraKernels : public test::BothShapes {};

TEST_P(LoraKernels, EveryTokenGetsItsSlotsProductWithinTheSumsBound) {
  for (uint32_t max_rank : {16u, 72u, 200u}) {
    const LoraRun r = run_lora(max_rank);
    size_t adapted = 0;
    for (size_t i = 0; i < r.y.size(); ++i) {
      if (r.bound[i] == 0) {
        EXPECT_EQ(r.y[i], float(r.want[i])) << "max_rank " << max_rank << ", output " << i;
        continue;
      }
      ASSERT_LE(std::abs(r.y[i] - r.want[i]), r.bound[i])
          << "max_rank " << max_rank << ", output " << i;
      ++adapted;
    }
    EXPECT_EQ(adapted, size_t(4 * 257)) << "tokens 0, 2, 4 and 5 have an adapter of rank > 0";
  }
}
INSTANTIATE_TEST_SUITE_P(Shapes, LoraKernels, test::both_shapes(), test::ShapeParamName());

// The GPU shape runs its own pair past rank 64 (lora_shrink_wg's tree sums give other bits than
// lora_shrink's sequential ones in some outputs) and the one-launch kernel up to it (the same bits
// in both shapes).
TEST(LoraKernelShapes, TheGpuShapeRunsItsOwnPairPastRank64) {
  for (uint32_t max_rank : {16u, 72u}) {
    std::vector<float> y[2];
    for (int g = 0; g < 2; ++g) {
      test::ShapeScope scope(test::default_device(),
                             g ? KernelShape::WorkGroups : KernelShape::Chunks);
      y[g] = run_lora(max_rank).y;
    }
    size_t differ = 0;
    for (size_t i = 0; i < y[0].size(); ++i) differ += y[0][i] != y[1][i];
    if (max_rank <= 64)
      EXPECT_EQ(differ, 0u);
    else
      EXPECT_GT(differ, y[0].size() / 20) << "of " << y[0].size();
  }
}

}  // namespace
}  // namespace clshard
