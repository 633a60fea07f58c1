// The command line as a user drives it: the stable `logits` interface checked against the
// reference, make-model, generate, devices, and errors with exit codes.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>

#include "runtime/safetensors.h"
#include "tests/reference_cases.h"
#include "tests/test_util.h"

namespace clshard {
namespace {

std::string join(const std::vector<int32_t>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? "," : "") + std::to_string(v[i]);
  return s;
}

TEST(Cli, DevicesListsTheCpuDevice) {
  std::string out, err;
  ASSERT_EQ(test::run_clshard({"devices"}, &out, &err), 0) << err;
  EXPECT_NE(out.find("type:           cpu"), std::string::npos) << out;
  EXPECT_NE(out.find("compute units:"), std::string::npos);
  EXPECT_NE(out.find("locality:       NUMA node(s)"), std::string::npos);
}

// `clshard logits` writes raw f32 logits per sequence that match Meta's reference.
TEST(Cli, LogitsCommandMatchesReference) {
  auto manifest_path = test::reference_dir() / "cases" / "llama3-tiny-bf16.short" / "manifest.json";
  auto manifest = nlohmann::json::parse(std::ifstream(manifest_path));
  auto out_dir = test::temp_dir("cli_logits");
  std::vector<std::string> args = {"logits", "--model",
                                   (test::reference_dir() / "ckpt" / "llama3-tiny-bf16").string(),
                                   "--out", out_dir.string(), "--page-size", "16"};
  for (const auto& s : manifest["sequences"]) {
    args.push_back("--tokens");
    args.push_back(join(s["sequence"].get<std::vector<int32_t>>()));
  }
  std::string out, err;
  ASSERT_EQ(test::run_clshard(args, &out, &err), 0) << err;
  auto written = read_json_file(out_dir / "manifest.json");
  ASSERT_EQ(written["sequences"].size(), manifest["sequences"].size());
  for (size_t i = 0; i < manifest["sequences"].size(); ++i) {
    const auto& ref = manifest["sequences"][i];
    auto want = test::read_f32(manifest_path.parent_path() / ref["logits_raw"].get<std::string>());
    auto got = test::read_f32(out_dir / written["sequences"][i]["file"].get<std::string>());
    ASSERT_EQ(got.size(), want.size());
    EXPECT_EQ(written["sequences"][i]["shape"][1].get<int>(), 512);
    float worst = 0;
    for (size_t j = 0; j < got.size(); ++j) worst = std::max(worst, std::abs(got[j] - want[j]));
    EXPECT_LT(worst, 1e-3f) << "sequence " << i;
  }
}

// `clshard logits --head mtp | eagle3` writes the draft head's logits (S - 1 rows per sequence),
// matching the `kind: mtp` and `kind: eagle3` reference cases; the manifest says which head.
TEST(Cli, DraftHeadLogitsMatchReference) {
  for (const char* id : {"deepseek-v3-tiny-grouped-bf16/short.mtp",
                         "deepseek-v3-tiny-grouped-fp8/short.eagle3",
                         "deepseek-v3-tiny-grouped-bf16/short.eagle3mha"}) {
    const auto rc = test::load_draft_case(id);
    auto out_dir = test::temp_dir("cli_draft_logits");
    std::vector<std::string> args = {"logits", "--model", rc.target.string(), "--out",
                                     out_dir.string(), "--page-size", "16", "--head", rc.kind};
    if (rc.kind == "eagle3") {
      args.push_back("--draft-model");
      args.push_back(rc.draft.string());
    }
    for (const auto& seq : rc.seqs) {
      args.push_back("--tokens");
      args.push_back(join(seq.tokens));
    }
    std::string out, err;
    ASSERT_EQ(test::run_clshard(args, &out, &err), 0) << err;
    auto written = read_json_file(out_dir / "manifest.json");
    EXPECT_EQ(written["head"], rc.kind);
    ASSERT_EQ(written["sequences"].size(), rc.seqs.size());
    for (size_t i = 0; i < rc.seqs.size(); ++i) {
      auto got = test::read_f32(out_dir / written["sequences"][i]["file"].get<std::string>());
      EXPECT_EQ(written["sequences"][i]["shape"][0].get<size_t>(), rc.seqs[i].tokens.size() - 1);
      EXPECT_LT(test::max_abs_diff(got, rc.seqs[i].draft_logits), 1e-3f) << id << " seq " << i;
    }
  }
  std::string err;
  EXPECT_NE(test::run_clshard({"logits", "--model", "x", "--out", "y", "--tokens", "1,2",
                               "--head", "eagle3"}, nullptr, &err), 0);
  EXPECT_NE(err.find("--head eagle3 needs --draft-model DIR"), std::string::npos) << err;
}

TEST(Cli, MakeModelThenGenerateIsDeterministic) {
  auto dir = test::temp_dir("cli_make_model");
  std::string out, err;
  ASSERT_EQ(test::run_clshard({"make-model", "--preset", "llama3-tiny", "--out", dir.string(),
                               "--dtype", "bf16", "--seed", "7"},
                              &out, &err),
            0)
      << err;
  for (const char* f : {"config.json", "generation_config.json", "model.safetensors",
                        "tokenizer.json", "tokenizer_config.json"})
    EXPECT_TRUE(std::filesystem::exists(dir / f)) << f;
  WeightStore w(dir);
  EXPECT_EQ(w.get("model.embed_tokens.weight").shape, (std::vector<int64_t>{512, 128}));
  EXPECT_EQ(w.get("model.embed_tokens.weight").dtype, DType::BF16);
  auto tok = read_json_file(dir / "tokenizer.json");
  EXPECT_EQ(tok["model"]["vocab"].size() + tok["added_tokens"].size(), 512u);

  std::string a, b;
  ASSERT_EQ(test::run_clshard({"generate", "--model", dir.string(), "--tokens", "1,2,3",
                               "--max-new-tokens", "6"},
                              &a, &err),
            0)
      << err;
  ASSERT_EQ(test::run_clshard({"generate", "--model", dir.string(), "--tokens", "1,2,3",
                               "--max-new-tokens", "6"},
                              &b, &err),
            0);
  EXPECT_EQ(a, b);
  EXPECT_EQ(std::count(a.begin(), a.end(), ','), 5) << a;
  EXPECT_EQ(err.find("into memory"), std::string::npos) << "a mapped load reads nothing: " << err;

  // model.mmap: false reads the weights into memory at load, its progress on stderr (a pipe here:
  // plain lines), and generates the same tokens.
  const auto yaml = dir / "deploy.yaml";
  std::ofstream(yaml) << "model: {path: \"" << dir.string() << "\", mmap: false}\n";
  std::string c;
  ASSERT_EQ(
      test::run_clshard({"generate", yaml.string(), "--tokens", "1,2,3", "--max-new-tokens", "6"},
                        &c, &err),
      0)
      << err;
  EXPECT_EQ(c, a);
  char mb[16];  // the file is a few MB
  std::snprintf(mb, sizeof mb, "%.2f",
                double(std::filesystem::file_size(dir / "model.safetensors")) / 1e6);
  EXPECT_NE(
      err.find("reading " + dir.string() + " into memory: 0.00 of " + mb + " MB (0%), ETA ?\n"),
      std::string::npos)
      << err;
  EXPECT_NE(err.find("read " + dir.string() + " into memory: " + mb + " MB in "), std::string::npos)
      << err;
}

// A run that compiles kernels from source (nothing in clshard's kernel cache) says so on stderr,
// once, naming the cache; the next run over the same cache does not, and both give the same
// tokens.
TEST(Cli, AFirstRunSaysItCompilesKernelsOnce) {
  const auto cache = test::temp_dir("cli_kernel_cache");
  const std::vector<std::string> run = {
      "env", "CLSHARD_KERNEL_CACHE=" + cache.string(), CLSHARD_EXE, "generate", "--model",
      (test::reference_dir() / "ckpt" / "llama3-tiny-bf16").string(), "--tokens", "1,2,3",
      "--max-new-tokens", "4"};
  std::string first, second, err;
  ASSERT_EQ(test::run_program(run, &first, &err), 0) << err;
  const std::string said = "clshard: compiling OpenCL kernels for ";
  ASSERT_NE(err.find(said), std::string::npos) << err;
  EXPECT_EQ(err.find(said), err.rfind(said)) << "said more than once: " << err;
  EXPECT_NE(err.find("; they are kept in " + cache.string() + "\n"), std::string::npos) << err;
  EXPECT_FALSE(std::filesystem::is_empty(cache));
  ASSERT_EQ(test::run_program(run, &second, &err), 0) << err;
  EXPECT_EQ(err.find("compiling"), std::string::npos) << "a warm cache compiles nothing: " << err;
  EXPECT_EQ(first, second);
}

TEST(Cli, ErrorsAreClearAndExitNonZero) {
  std::string out, err;
  EXPECT_EQ(test::run_clshard({"generate", "--model", "/nonexistent", "--tokens", "1,2"}, &out,
                              &err),
            1);
  EXPECT_NE(err.find("/nonexistent: model directory not found"), std::string::npos) << err;
  auto ref = (test::reference_dir() / "ckpt" / "llama3-tiny-f32").string();
  EXPECT_EQ(test::run_clshard({"generate", "--model", ref, "--tokens", "1,x,2"}, &out, &err), 1);
  EXPECT_NE(err.find("--tokens: 'x' is not a token id"), std::string::npos) << err;
  EXPECT_EQ(test::run_clshard({"generate", "--model", ref, "--tokens", "1,600"}, &out, &err), 1);
  EXPECT_NE(err.find("token 600 at index 1 is outside the vocabulary of 512"), std::string::npos)
      << err;
  EXPECT_EQ(test::run_clshard({"make-model", "--preset", "nope", "--out",
                               test::temp_dir("cli_no_preset").string()},
                              &out, &err),
            1);
  EXPECT_NE(err.find("unknown preset 'nope'"), std::string::npos) << err;
  EXPECT_NE(test::run_clshard({"frobnicate"}, &out, &err), 0);
}

}  // namespace
}  // namespace clshard

namespace clshard {
namespace {

// The real DeepSeek-V3 on 8 GPUs of 141 GB, DP 8 x EP 8, planned from config.json alone.
TEST(Cli, PlanOfTheEightGpuDeepSeekDeployment) {
  const auto src = std::filesystem::path(CLSHARD_SOURCE_DIR);
  std::string out, err;
  ASSERT_EQ(test::run_clshard({"plan", (src / "configs" / "deepseek-v3-8gpu-dp8-ep8.yaml").string(),
                               "--config", (src / "configs" / "deepseek-v3-config.json").string(),
                               "--device-memory", "131.3", "--devices", "8", "--json"},
                              &out, &err),
            0)
      << err;
  auto j = nlohmann::json::parse(out);
  const double main = j["checkpoint"]["parameters"]["main"].get<double>();
  EXPECT_NEAR(main / 671e9, 1.0, 0.005);
  ASSERT_EQ(j["devices"].size(), 8u);
  const uint64_t all_weights = j["checkpoint"]["weights"]["bytes_main"].get<uint64_t>();
  const uint64_t routed = j["checkpoint"]["weights"]["routed_expert_bytes_main"].get<uint64_t>();
  for (const auto& d : j["devices"]) {
    EXPECT_EQ(d["experts"], 32);
    EXPECT_TRUE(d["fits"].get<bool>());
    EXPECT_EQ(d["weights"].get<uint64_t>(), all_weights - routed + routed / 8);
    EXPECT_GT(d["kv_pages"].get<uint64_t>(), 100u);
  }
  // The same deployment on GPUs of 80 GB does not fit: the plan says so.
  ASSERT_EQ(test::run_clshard({"plan", (src / "configs" / "deepseek-v3-8gpu-dp8-ep8.yaml").string(),
                               "--config", (src / "configs" / "deepseek-v3-config.json").string(),
                               "--device-memory", "74.5", "--devices", "8"},
                              &out, &err),
            0)
      << err;
  EXPECT_NE(out.find("DOES NOT FIT"), std::string::npos) << out;
  // Parallel degrees the model cannot use are errors naming the key.
  EXPECT_EQ(test::run_clshard({"plan", (src / "configs" / "deepseek-v3-8gpu-dp8-ep8.yaml").string(),
                               "--config", (src / "configs" / "deepseek-v3-config.json").string(),
                               "--device-memory", "131.3", "--devices", "16"},
                              &out, &err),
            1);
  EXPECT_NE(err.find("parallel.data"), std::string::npos) << err;
}

// The same model on 2 nodes x 8 GPUs over MPI, DP 16 x EP 16: 16 ranks of one GPU each, half the
// routed experts per GPU of the one-node layout; the text plan says how to launch it.
TEST(Cli, PlanOfTheTwoNodeMpiDeepSeekDeployment) {
  const auto src = std::filesystem::path(CLSHARD_SOURCE_DIR);
  const auto file = (src / "configs" / "deepseek-v3-2node-dp16-ep16.yaml").string();
  const auto config = (src / "configs" / "deepseek-v3-config.json").string();
  std::string out, err;
  ASSERT_EQ(test::run_clshard({"plan", file, "--config", config, "--device-memory", "131.3",
                               "--json"},
                              &out, &err),
            0)
      << err;
  auto j = nlohmann::json::parse(out);
  ASSERT_EQ(j["devices"].size(), 16u);
  const uint64_t all_weights = j["checkpoint"]["weights"]["bytes_main"].get<uint64_t>();
  const uint64_t routed = j["checkpoint"]["weights"]["routed_expert_bytes_main"].get<uint64_t>();
  for (size_t r = 0; r < 16; ++r) {
    const auto& d = j["devices"][r];
    EXPECT_EQ(d["replica"], r);
    EXPECT_EQ(d["experts"], 16);
    EXPECT_TRUE(d["fits"].get<bool>());
    EXPECT_EQ(d["weights"].get<uint64_t>(), all_weights - routed + routed / 16);
  }
  ASSERT_EQ(test::run_clshard({"plan", file, "--config", config, "--device-memory", "131.3"},
                              &out, &err),
            0)
      << err;
  EXPECT_NE(out.find("16 MPI rank(s) of one device each (`mpirun -np 16`"), std::string::npos)
      << out;
}

}  // namespace
}  // namespace clshard
