// `clshard bench` and scripts/bench-sweep.py as a user drives them: the JSON records and their
// sanity (token counts, phases, percentiles in order), speculative acceptance, the sweep's merged
// JSON and PNG plots, and bad input; plus the pieces underneath (list parsing, percentiles,
// synthetic prompts, GenerationRequest::ignore_eos).
#include <gtest/gtest.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

#include <fstream>
#include <numeric>
#include <set>

#include "models/registry.h"
#include "runtime/engine/bench.h"
#include "runtime/engine/engine.h"
#include "runtime/engine/generation.h"
#include "runtime/safetensors.h"
#include "tests/test_util.h"

namespace clshard {
namespace {

std::string slurp(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

const std::vector<std::string> kRecordKeys = {
    "batch",       "prompt_len",  "gen_len",     "prefill_tok_s", "decode_tok_s",
    "ttft_ms_p50", "ttft_ms_p90", "ttft_ms_p99", "itl_ms_p50",    "itl_ms_p90",
    "itl_ms_p99",  "host_ms_per_step"};

// The figures of one record agree with each other and with the configuration.
void expect_sane_record(const nlohmann::json& r, uint32_t batch, uint32_t prompt, uint32_t gen) {
  for (const auto& k : kRecordKeys) ASSERT_TRUE(r.contains(k)) << k << " in " << r.dump();
  EXPECT_EQ(r["batch"], batch);
  EXPECT_EQ(r["prompt_len"], prompt);
  EXPECT_EQ(r["gen_len"], gen);
  EXPECT_EQ(r["prompt_tokens"].get<uint64_t>(), uint64_t(batch) * prompt);
  EXPECT_EQ(r["output_tokens"].get<uint64_t>(), uint64_t(batch) * gen);
  const double total_ms = 1e3 * r["total_s"].get<double>();
  EXPECT_GT(total_ms, 0);
  EXPECT_NEAR(r["prefill_s"].get<double>() + r["decode_s"].get<double>(),
              r["total_s"].get<double>(), 1e-3);
  EXPECT_GT(r["prefill_tok_s"].get<double>(), 0);
  ASSERT_TRUE(r["decode_tok_s"].is_number()) << r.dump();
  EXPECT_GT(r["decode_tok_s"].get<double>(), 0);
  EXPECT_GT(r["ttft_ms_p50"].get<double>(), 0);
  EXPECT_LE(r["ttft_ms_p50"].get<double>(), r["ttft_ms_p90"].get<double>());
  EXPECT_LE(r["ttft_ms_p90"].get<double>(), r["ttft_ms_p99"].get<double>());
  EXPECT_LE(r["ttft_ms_p99"].get<double>(), total_ms);
  EXPECT_GT(r["itl_ms_p50"].get<double>(), 0);
  EXPECT_LE(r["itl_ms_p50"].get<double>(), r["itl_ms_p90"].get<double>());
  EXPECT_LE(r["itl_ms_p90"].get<double>(), r["itl_ms_p99"].get<double>());
  EXPECT_LE(r["itl_ms_p99"].get<double>(), total_ms);
  EXPECT_GT(r["host_ms_per_step"].get<double>(), 0);
  EXPECT_GT(r["device_ms_per_step"].get<double>(), 0);
}

// The read-bandwidth probe (the roofline of `bench --roofline` and perf/ on a GPU) in both kernel
// shapes on PoCL: it reads every float of the buffer (their sum is exact: 0.5 each, few per
// accumulator), reports its shape and a positive rate, and rounds the size down to whole steps
// (less than one step left out: a step is 4 MiB on a GPU shape of up to 128 compute units, 4.1 MiB
// on an H100's 132).
TEST(DeviceReadBandwidth, BothShapesReadTheWholeBuffer) {
  Device& dev = test::default_device();
  auto name = [](KernelShape s) { return s == KernelShape::Chunks ? "chunks" : "workgroups"; };
  const size_t asked = (size_t(8) << 20) + 12345;
  for (const KernelShape shape : {KernelShape::Chunks, KernelShape::WorkGroups}) {
    test::ShapeScope scope(dev, shape);
    const DeviceReadBandwidth r = measure_device_read_bandwidth(dev, asked, 1, 0.5f);
    EXPECT_EQ(r.shape, shape);
    EXPECT_LE(r.bytes, asked);
    EXPECT_GT(r.bytes + r.step_bytes, asked) << name(shape);
    EXPECT_EQ(r.bytes % r.step_bytes, 0u) << name(shape);
    EXPECT_GE(r.bytes, r.step_bytes) << name(shape);
    EXPECT_EQ(r.sum, double(r.bytes / 4) * 0.5) << name(shape);
    EXPECT_GT(r.gb_s, 0.0);
  }
  test::ShapeScope scope(dev, KernelShape::WorkGroups);
  try {
    measure_device_read_bandwidth(dev, 4096);
    FAIL() << "expected an error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("4096 bytes is less than one pass of the probe"),
              std::string::npos)
        << e.what();
  }
}

// The host read loop (`bench --roofline`, perf/'s STREAM figure) in both its forms reads every
// 64-bit word of every thread's part once per pass (word i holds i + 1: the sum is W (W + 1) / 2
// only when each is read once), for
// thread counts that do and do not divide the size, and the size rounds down to whole 128-byte
// blocks per thread. The rate is only checked to be a rate: positive and below 10 TB/s.
TEST(HostReadBandwidth, BothLoopsReadEveryWord) {
  const size_t asked = (size_t(4) << 20) + 1000;
  for (const HostReadLoop loop : {HostReadLoop::Fastest, HostReadLoop::Portable})
    for (const unsigned threads : {1u, 2u, 3u}) {
      const HostReadBandwidth r = measure_read_bandwidth(threads, asked, 2, loop);
      const std::string what =
          std::string(loop == HostReadLoop::Portable ? "portable" : "fastest") + ", " +
          std::to_string(threads) + " threads";
      EXPECT_EQ(r.bytes, asked / threads / 128 * 128 * threads) << what;
      const uint64_t words = r.bytes / 8;
      EXPECT_EQ(r.sum, words * (words + 1) / 2) << what;
      EXPECT_GT(r.gb_s, 0.0) << what;
      EXPECT_LT(r.gb_s, 1e4) << what;
#if defined(__x86_64__) && defined(__GNUC__)
      const bool avx512 = loop == HostReadLoop::Fastest && __builtin_cpu_supports("avx512f");
#else
      const bool avx512 = false;
#endif
      EXPECT_EQ(r.avx512, avx512) << what;
    }
}

// The FP8 decode loop (the FP8 tile's instructions over the same bytes) runs where the host has
// AVX-512 F and BW, over the bytes the plain loop reads, and nowhere else (no rate); it reads
// denormals as zero on the threads that run it, the caller's among them, whose floating-point
// control word it must give back unchanged.
TEST(HostReadBandwidth, E4m3DecodeLoopRunsOnAvx512HostsAndRestoresTheControlWord) {
  const size_t asked = (size_t(4) << 20) + 1000;
#if defined(__x86_64__) && defined(__GNUC__)
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
  const unsigned csr = _mm_getcsr();
#else
  const bool avx512 = false;
#endif
  for (const unsigned threads : {1u, 2u, 3u}) {
    const HostReadBandwidth r = measure_read_bandwidth(threads, asked, 2, HostReadLoop::E4m3Decode);
    EXPECT_EQ(r.avx512, avx512) << threads << " threads";
    EXPECT_EQ(r.bytes, asked / threads / 128 * 128 * threads) << threads << " threads";
    if (avx512) {
      EXPECT_GT(r.gb_s, 0.0) << threads << " threads";
      EXPECT_LT(r.gb_s, 1e4) << threads << " threads";
    } else {
      EXPECT_EQ(r.gb_s, 0.0) << threads << " threads";
    }
#if defined(__x86_64__) && defined(__GNUC__)
    EXPECT_EQ(_mm_getcsr(), csr) << threads << " threads";
#endif
  }
}

// The loop over memory that is already there reads, from the base rounded up to 128 bytes, whole
// blocks per thread and each word once: over words holding i + 1 from an unaligned base, the sum of
// exactly the words in [start, start + r.bytes), for thread counts that do and do not divide it.
TEST(HostReadBandwidth, OverGivenMemoryReadsEachWordOfWholeBlocksOnce) {
  std::vector<uint64_t> words((size_t(1) << 20) + 77);
  std::iota(words.begin(), words.end(), uint64_t(1));
  const uint64_t* base = words.data() + 3;  // 24 bytes past whatever alignment the vector has
  const size_t bytes = (words.size() - 3) * 8;
  const auto at = reinterpret_cast<uintptr_t>(base);
  const size_t skipped = ((at + 127) / 128 * 128 - at) / 8;  // words before the first block
  for (const HostReadLoop loop : {HostReadLoop::Fastest, HostReadLoop::Portable})
    for (const unsigned threads : {1u, 2u, 3u}) {
      const HostReadBandwidth r = measure_read_bandwidth_of(base, bytes, threads, 2, loop);
      const std::string what =
          std::string(loop == HostReadLoop::Portable ? "portable" : "fastest") + ", " +
          std::to_string(threads) + " threads";
      EXPECT_EQ(r.bytes, (bytes - skipped * 8) / threads / 128 * 128 * threads) << what;
      const uint64_t first = base[skipped], n = r.bytes / 8;  // words first .. first + n - 1
      EXPECT_EQ(r.sum, n * first + n * (n - 1) / 2) << what;
      EXPECT_GT(r.gb_s, 0.0) << what;
    }
  const HostReadBandwidth none = measure_read_bandwidth_of(base, 200, 2);
  EXPECT_EQ(none.bytes, 0u);
  EXPECT_EQ(none.gb_s, 0.0);
}

TEST(Bench, TinyPresetWritesTheRecordsAndTheTable) {
  auto dir = test::temp_dir("bench_tiny");
  std::string out, err;
  ASSERT_EQ(test::run_clshard({"make-model", "--preset", "llama3-tiny", "--out",
                               (dir / "model").string()}, &out, &err), 0) << err;
  const auto json_path = dir / "bench.json";
  ASSERT_EQ(test::run_clshard({"bench", "--model", (dir / "model").string(), "--device-type",
                               "cpu", "--batch", "1,3", "--prompt-len", "8", "--gen-len", "4",
                               "--json", json_path.string()}, &out, &err), 0) << err;
  const auto j = read_json_file(json_path);
  const auto& env = j["environment"];
  ASSERT_FALSE(env["devices"].empty());
  EXPECT_FALSE(env["devices"][0]["driver_version"].get<std::string>().empty());
  EXPECT_FALSE(env["devices"][0]["opencl_version"].get<std::string>().empty());
  EXPECT_TRUE(env.contains("clshard_commit"));
  EXPECT_EQ(env["model"]["architecture"], "LlamaForCausalLM");
  EXPECT_EQ(env["deployment"]["source"], "--model");
  // The start-up time (Deployment::open: weights, tokenizer, kernels) is recorded.
  ASSERT_TRUE(env["startup_s"].is_number());
  EXPECT_GT(env["startup_s"].get<double>(), 0.0);
  ASSERT_EQ(j["records"].size(), 2u);
  expect_sane_record(j["records"][0], 1, 8, 4);
  expect_sane_record(j["records"][1], 3, 8, 4);
  for (const auto& r : j["records"]) {
    // Every prompt fits one step: one prefill step gives each request its first token, then
    // gen_len - 1 decode steps for all of them together.
    EXPECT_EQ(r["steps"], 4);
    EXPECT_EQ(r["decode_tokens"].get<uint64_t>(), r["batch"].get<uint64_t>() * 3);
    EXPECT_FALSE(r.contains("acceptance_rate"));
  }
  // The table: a header and one line per configuration, on stdout; progress on stderr.
  EXPECT_EQ(std::count(out.begin(), out.end(), '\n'), 3) << out;
  EXPECT_EQ(out.rfind("batch  prompt  gen  prefill tok/s  decode tok/s", 0), 0u) << out;
  EXPECT_NE(err.find("bench: warm-up (not measured): batch 3, prompt 8, gen 4"),
            std::string::npos) << err;
  EXPECT_NE(err.find("bench: [2/2] batch 3, prompt 8, gen 4"), std::string::npos) << err;
}

// --roofline on a CPU device: the native loop's rate over fresh memory of the asked size, and over
// the checkpoint's mapped weights (a pass over all of its tensor bytes, less at most a 128-byte
// block per thread and the start's alignment); none of the latter with model.mmap: false, whose
// weights are not read from those pages.
TEST(Bench, RooflineReadsFreshMemoryAndTheCheckpointsPages) {
  auto dir = test::temp_dir("bench_roofline");
  std::string out, err;
  ASSERT_EQ(
      test::run_clshard(
          {"make-model", "--preset", "llama3-tiny", "--out", (dir / "model").string()}, &out, &err),
      0)
      << err;
  uint64_t tensor_bytes = 0;
  {
    const WeightStore store(dir / "model");
    for (const auto& name : store.names()) tensor_bytes += store.get(name).bytes;
  }
  for (const bool mapped : {true, false}) {
    std::ofstream(dir / "d.yaml") << "model:\n  path: " << (dir / "model").string()
                                  << "\n  mmap: " << (mapped ? "true" : "false")
                                  << "\ndevices:\n  type: cpu\n";
    const auto json_path = dir / "bench.json";
    ASSERT_EQ(test::run_clshard({"bench", (dir / "d.yaml").string(), "--batch", "1", "--prompt-len",
                                 "4", "--gen-len", "2", "--no-warmup", "--roofline",
                                 "--roofline-mib", "8", "--json", json_path.string()},
                                &out, &err),
              0)
        << err;
    const auto env = read_json_file(json_path)["environment"];
    const unsigned threads = env["read_bandwidth"]["threads"].get<unsigned>();
    EXPECT_EQ(env["read_bandwidth"]["bytes"].get<uint64_t>(),
              (uint64_t(8) << 20) / threads / 128 * 128 * threads);
    EXPECT_GT(env["read_bandwidth"]["gb_s"].get<double>(), 0.0);
    if (!mapped) {
      EXPECT_FALSE(env.contains("checkpoint_read_bandwidth")) << "model.mmap: false";
      continue;
    }
    ASSERT_TRUE(env.contains("checkpoint_read_bandwidth")) << err;
    const uint64_t read = env["checkpoint_read_bandwidth"]["bytes"].get<uint64_t>();
    EXPECT_LE(read, tensor_bytes);
    EXPECT_GE(read + 128 * (threads + 1), tensor_bytes);
    EXPECT_GT(env["checkpoint_read_bandwidth"]["gb_s"].get<double>(), 0.0);
    EXPECT_NE(err.find("bench: the checkpoint's mapped weights read "), std::string::npos) << err;
  }
}

// MTP speculative decoding on the bundled trained checkpoint: acceptance per draft position.
TEST(Bench, SpeculativeDeploymentReportsAcceptance) {
  auto dir = test::temp_dir("bench_spec");
  const auto model = test::default_job_model();
  const std::string yaml = "model:\n  path: " + model.string() +
                           "\ndevices:\n  type: cpu\nkv_cache:\n  page_size: 16\n"
                           "sampling:\n  temperature: 0.0\n"
                           "speculative:\n  method: mtp\n  num_speculative_tokens: 2\n";
  std::ofstream(dir / "spec.yaml") << yaml;
  std::string out, err;
  ASSERT_EQ(test::run_clshard({"bench", (dir / "spec.yaml").string(), "--batch", "2",
                               "--prompt-len", "8", "--gen-len", "6", "--no-warmup", "--json",
                               (dir / "bench.json").string()}, &out, &err), 0) << err;
  EXPECT_EQ(err.find("warm-up"), std::string::npos) << err;
  const auto j = read_json_file(dir / "bench.json");
  EXPECT_EQ(j["environment"]["deployment"]["file_contents"], yaml);
  EXPECT_EQ(j["environment"]["deployment"]["speculative"]["method"], "mtp");
  ASSERT_EQ(j["records"].size(), 1u);
  const auto& r = j["records"][0];
  expect_sane_record(r, 2, 8, 6);
  const uint64_t drafted = r["drafted"].get<uint64_t>();
  const uint64_t accepted = r["accepted"].get<uint64_t>();
  EXPECT_GT(drafted, 0u);
  EXPECT_GT(accepted, 0u);  // a trained MTP head, greedy: some drafts are right
  EXPECT_LE(accepted, drafted);
  EXPECT_NEAR(r["acceptance_rate"].get<double>(), double(accepted) / double(drafted), 1e-12);
  ASSERT_EQ(r["acceptance_by_position"].size(), 2u);
  for (const auto& a : r["acceptance_by_position"]) {
    EXPECT_GE(a.get<double>(), 0.0);
    EXPECT_LE(a.get<double>(), 1.0);
  }
  EXPECT_GE(r["mean_accepted_length"].get<double>(), 1.0);
  EXPECT_LE(r["mean_accepted_length"].get<double>(), 3.0);
  EXPECT_NE(out.find("accepted (by position)"), std::string::npos) << out;
}

TEST(Bench, BadInputIsAClearError) {
  auto ref = (test::reference_dir() / "ckpt" / "llama3-tiny-f32").string();
  std::string out, err;
  EXPECT_EQ(test::run_clshard({"bench", "--model", ref, "--batch", "1,x"}, &out, &err), 1);
  EXPECT_NE(err.find("clshard: error: --batch: 'x' is not a positive integer (expected a list "
                     "like 1,8,32)"), std::string::npos) << err;
  EXPECT_EQ(test::run_clshard({"bench", "--model", ref, "--prompt-len", "8;16"}, &out, &err), 1);
  EXPECT_NE(err.find("--prompt-len: '8;16' is not a positive integer"), std::string::npos) << err;
  EXPECT_EQ(test::run_clshard({"bench", "--model", ref, "--gen-len", "0"}, &out, &err), 1);
  EXPECT_NE(err.find("--gen-len: '0' is not a positive integer"), std::string::npos) << err;
  EXPECT_EQ(test::run_clshard({"bench", "/nonexistent/deploy.yaml"}, &out, &err), 1);
  EXPECT_NE(err.find("cannot read deployment file /nonexistent/deploy.yaml"), std::string::npos)
      << err;
  EXPECT_EQ(test::run_clshard({"bench"}, &out, &err), 1);
  EXPECT_NE(err.find("bench: name the model with a deployment file or with --model DIR"),
            std::string::npos) << err;
  // A configuration longer than the deployment's max_length, before anything runs.
  auto dir = test::temp_dir("bench_bad");
  std::ofstream(dir / "short.yaml") << "model:\n  path: " << ref
                                    << "\n  max_length: 64\ndevices:\n  type: cpu\n";
  EXPECT_EQ(test::run_clshard({"bench", (dir / "short.yaml").string(), "--prompt-len", "16,60",
                               "--gen-len", "8"}, &out, &err), 1);
  EXPECT_NE(err.find("bench: prompt 60 + gen 8 tokens exceed the model's max_length 64 (" +
                     (dir / "short.yaml").string() + ":3: model.max_length)"),
            std::string::npos) << err;
  EXPECT_EQ(err.find("bench: [1/"), std::string::npos) << err;
  EXPECT_TRUE(out.empty()) << out;
}

TEST(Bench, SizeListsPercentilesAndPrompts) {
  EXPECT_EQ(parse_size_list("1,8,32", "--batch"), (std::vector<uint32_t>{1, 8, 32}));
  EXPECT_EQ(parse_size_list("7", "--batch"), (std::vector<uint32_t>{7}));
  for (const char* bad : {"", "1,", ",1", "1,,2", "-1", "1.5", " 1", "1e3", "9999999999"})
    EXPECT_THROW(parse_size_list(bad, "--batch"), std::runtime_error) << bad;
  // numpy.percentile([1..10], [50, 90, 99]) = 5.5, 9.1, 9.91
  std::vector<double> v = {10, 9, 8, 7, 6, 5, 4, 3, 2, 1};
  const Percentiles p = percentiles(v);
  EXPECT_DOUBLE_EQ(p.p50, 5.5);
  EXPECT_NEAR(p.p90, 9.1, 1e-12);
  EXPECT_NEAR(p.p99, 9.91, 1e-12);
  EXPECT_EQ(percentiles({4.0}).p99, 4.0);
  EXPECT_EQ(percentiles({}).p50, 0.0);

  const auto a = synthetic_prompt(512, 300, 5, 0, {3, 7});
  EXPECT_EQ(a, synthetic_prompt(512, 300, 5, 0, {3, 7}));
  EXPECT_NE(a, synthetic_prompt(512, 300, 5, 1, {3, 7}));
  EXPECT_NE(a, synthetic_prompt(512, 300, 6, 0, {3, 7}));
  ASSERT_EQ(a.size(), 300u);
  std::set<int32_t> distinct(a.begin(), a.end());
  EXPECT_GT(distinct.size(), 150u);
  for (int32_t t : a) {
    EXPECT_TRUE(t >= 0 && t < 512) << t;
    EXPECT_TRUE(t != 3 && t != 7) << t;
  }
}

// A model whose EOS ids are set by the test (the forward pass is the wrapped model's).
class EosOverride final : public CausalLM {
 public:
  EosOverride(std::unique_ptr<CausalLM> m, int32_t eos) : m_(std::move(m)), info_(m_->info()) {
    info_.eos_token_ids = {eos};
  }
  const ModelInfo& info() const override { return info_; }
  uint64_t kv_bytes_per_token() const override { return m_->kv_bytes_per_token(); }
  void allocate_kv_cache(uint32_t n, uint32_t s) override { m_->allocate_kv_cache(n, s); }
  uint32_t kv_num_pages() const override { return m_->kv_num_pages(); }
  uint32_t kv_page_size() const override { return m_->kv_page_size(); }
  StepOutputs forward(const StepInputs& step) override { return m_->forward(step); }
  std::vector<Device*> devices() const override { return m_->devices(); }
  uint32_t num_replicas() const override { return m_->num_replicas(); }

 private:
  std::unique_ptr<CausalLM> m_;
  ModelInfo info_;
};

// ignore_eos: the request runs to max_tokens through EOS tokens; without it, the same request
// stops at the first EOS (the token greedy decoding produces third).
TEST(Bench, IgnoreEosRunsToMaxTokens) {
  auto base = load_model(test::reference_dir() / "ckpt" / "llama3-tiny-f32",
                         LoadOptions{{&test::default_device()}, std::nullopt});
  const std::vector<int32_t> prompt = {5, 17, 99, 3};
  const auto greedy = greedy_generate(*base, {prompt}, 8, 16)[0];
  EosOverride model(std::move(base), greedy[2]);
  SchedulerLimits lim;
  lim.page_size = 16;
  lim.total_pages = 4;
  lim.max_length = 64;
  model.allocate_kv_cache(lim.total_pages, lim.page_size);
  for (bool ignore : {false, true}) {
    Engine engine(model, nullptr, lim);
    GenerationRequest r;
    r.prompt = prompt;
    r.sampling.temperature = 0;
    r.max_tokens = 8;
    r.ignore_eos = ignore;
    engine.submit(r);
    std::vector<GenerationResult> done;
    while (engine.has_work())
      for (auto& g : engine.step()) done.push_back(std::move(g));
    ASSERT_EQ(done.size(), 1u);
    const size_t first_eos =
        std::find(greedy.begin(), greedy.end(), greedy[2]) - greedy.begin();
    if (ignore) {
      EXPECT_EQ(done[0].token_ids, greedy);
      EXPECT_EQ(done[0].reason, EndReason::Length);
    } else {
      EXPECT_EQ(done[0].token_ids, std::vector<int32_t>(greedy.begin(),
                                                         greedy.begin() + first_eos));
      EXPECT_EQ(done[0].reason, EndReason::Stop);
    }
  }
}

bool is_png(const std::filesystem::path& p) {
  const std::string s = slurp(p);
  return s.size() > 8 && s.compare(0, 8, "\x89PNG\r\n\x1a\n") == 0;
}

// scripts/bench-sweep.py on configs/bench/tiny.yaml (llama3-tiny on 1 device and as 2 data-
// parallel replicas on 2 sub-devices): the merged JSON and its three plots.
TEST(BenchSweep, TinyGridMergesTheRunsAndDrawsThePlots) {
  auto dir = test::temp_dir("bench_sweep");
  const std::string src = CLSHARD_SOURCE_DIR;
  std::string out, err;
  ASSERT_EQ(test::run_program({"python3", src + "/scripts/bench-sweep.py",
                               src + "/configs/bench/tiny.yaml", "--out", dir.string(),
                               "--clshard", CLSHARD_EXE, "--set",
                               "model.path=" + (dir / "llama3-tiny").string()},
                              &out, &err), 0) << err;
  const auto j = read_json_file(dir / "sweep.json");
  EXPECT_TRUE(j["failed"].empty());
  ASSERT_EQ(j["runs"].size(), 2u);
  EXPECT_EQ(j["runs"][0]["name"], "llama3-tiny-1dev");
  EXPECT_EQ(j["runs"][0]["devices"], 1);
  EXPECT_EQ(j["runs"][1]["name"], "llama3-tiny-dp2");
  EXPECT_EQ(j["runs"][1]["devices"], 2);
  EXPECT_EQ(j["runs"][1]["environment"]["deployment"]["replicas"], 2);
  for (const auto& run : j["runs"]) {
    EXPECT_EQ(run["group"], "llama3-tiny");
    ASSERT_EQ(run["records"].size(), 2u);
    expect_sane_record(run["records"][0], 1, 16, 4);
    expect_sane_record(run["records"][1], 4, 16, 4);
  }
  for (const char* png : {"throughput.png", "scaling.png", "latency.png"}) {
    EXPECT_TRUE(is_png(dir / png)) << png;
    EXPECT_GT(std::filesystem::file_size(dir / png), 10000u) << png;  // axes, lines and labels
  }
  EXPECT_NE(out.find("== llama3-tiny-dp2"), std::string::npos) << out;

  // A grid naming a deployment file that is not there: exit 2, the file and the entry named.
  std::ofstream(dir / "bad.yaml") << "bench: {batch: [1], prompt_len: [4], gen_len: [2]}\n"
                                     "deployments:\n  - {name: x, file: missing.yaml}\n";
  EXPECT_EQ(test::run_program({"python3", src + "/scripts/bench-sweep.py",
                               (dir / "bad.yaml").string(), "--clshard", CLSHARD_EXE},
                              &out, &err), 2);
  EXPECT_NE(err.find("bench-sweep: error: " + (dir / "bad.yaml").string() +
                     ": deployments[0].file: no such file: " + (dir / "missing.yaml").string()),
            std::string::npos) << err;
  std::ofstream(dir / "bad2.yaml") << "bench: {batch: [1, x], prompt_len: [4], gen_len: [2]}\n"
                                      "deployments:\n  - {name: x, file: bad.yaml}\n";
  EXPECT_EQ(test::run_program({"python3", src + "/scripts/bench-sweep.py",
                               (dir / "bad2.yaml").string(), "--clshard", CLSHARD_EXE},
                              &out, &err), 2);
  EXPECT_NE(err.find("bad2.yaml: bench.batch: expected a positive integer or a list of them, "
                     "got [1, 'x']"), std::string::npos) << err;
}

}  // namespace
}  // namespace clshard
