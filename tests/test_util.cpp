#include "tests/test_util.h"

#include <stdlib.h>
#include <sys/wait.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <random>
#include <stdexcept>

#include "runtime/device.h"
#include "runtime/device_manager.h"
#include "runtime/text/tokenizer.h"

#ifndef CLSHARD_SOURCE_DIR
#define CLSHARD_SOURCE_DIR "."
#endif
#ifndef CLSHARD_BINARY_DIR
#define CLSHARD_BINARY_DIR "."
#endif

namespace clshard::test {

namespace {
// The compiled kernels (ours and PoCL's) of every test process and of the clshard processes the
// tests start live in the build tree, so a second run skips every compile and nothing is written
// under $HOME. Set here, before any OpenCL call, and not only by ctest: gtest_discover_tests
// (CMake 3.25) passes just the first entry of a list-valued ENVIRONMENT property, so the suite's
// processes had CLSHARD_SHARED_DIR but neither cache directory, and wrote to ~/.cache; a direct
// run of clshard_tests gets them too. A value the caller set is kept.
const bool kBuildTreeCaches = [] {
  setenv("CLSHARD_KERNEL_CACHE", CLSHARD_BINARY_DIR "/kernel-cache", 0);
  setenv("POCL_CACHE_DIR", CLSHARD_BINARY_DIR "/pocl-cache", 0);
  return true;
}();
}  // namespace

std::filesystem::path shared_dir() {
  if (const char* d = std::getenv("CLSHARD_SHARED_DIR"); d && *d) return d;
  return std::filesystem::path(CLSHARD_SOURCE_DIR) / ".." / "shared";
}
std::filesystem::path reference_dir() { return shared_dir() / "reference"; }
std::filesystem::path tokenizers_dir() { return shared_dir() / "tokenizers"; }

const nlohmann::json& reference_index() {
  static const nlohmann::json index = [] {
    std::ifstream in(reference_dir() / "index.json");
    if (!in) throw std::runtime_error("cannot open " + (reference_dir() / "index.json").string());
    return nlohmann::json::parse(in);
  }();
  return index;
}

std::filesystem::path temp_dir(const std::string& name) {
  // ctest runs tests in parallel processes: each test gets its own folder, so two tests that
  // ask for the same name (a shared fixture's model) never remove each other's files.
  std::string owner = "no-test";
  if (const auto* info = ::testing::UnitTest::GetInstance()->current_test_info())
    owner = std::string(info->test_suite_name()) + "." + info->name();
  std::replace(owner.begin(), owner.end(), '/', '_');
  auto p = std::filesystem::path(CLSHARD_BINARY_DIR) / "test-tmp" / owner / name;
  std::filesystem::remove_all(p);
  std::filesystem::create_directories(p);
  return p;
}

size_t regions_mapping_files_of(const std::filesystem::path& dir) {
  const std::string prefix = std::filesystem::canonical(dir).string() + "/";
  std::ifstream maps("/proc/self/maps");
  size_t n = 0;
  for (std::string line; std::getline(maps, line);)
    if (line.find(prefix) != std::string::npos) ++n;
  return n;
}

std::filesystem::path default_job_model() {
  const auto dir = std::filesystem::path(CLSHARD_BINARY_DIR) / "test-models" / "dsv3-mtp-trained";
  if (std::filesystem::is_regular_file(dir / "model.safetensors")) return dir;
  std::filesystem::create_directories(dir.parent_path());
  const auto src = shared_dir() / "models" / "dsv3-mtp-trained";
  std::string err;
  if (run_program({"python3", std::string(CLSHARD_SOURCE_DIR) + "/scripts/bf16_checkpoint.py",
                   src.string(), dir.string()},
                  nullptr, &err) != 0 ||
      !std::filesystem::is_regular_file(dir / "model.safetensors"))
    throw std::runtime_error("making the default job's bf16 checkpoint from " + src.string() +
                             " failed: " + err);
  return dir;
}

std::vector<float> read_f32(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  if (!in) throw std::runtime_error("cannot open " + p.string());
  in.seekg(0, std::ios::end);
  std::vector<float> v(size_t(in.tellg()) / sizeof(float));
  in.seekg(0);
  in.read(reinterpret_cast<char*>(v.data()), std::streamsize(v.size() * sizeof(float)));
  return v;
}

const Tokenizer& llama3_tokenizer() {
  static const Tokenizer t = Tokenizer::from_dir(tokenizers_dir() / "llama3");
  return t;
}

const Tokenizer& deepseek_v3_tokenizer() {
  static const Tokenizer t = Tokenizer::from_dir(tokenizers_dir() / "deepseek_v3");
  return t;
}

DeviceSelection cpu_devices(const std::string& split, bool all) {
  DeviceSelection sel;
  sel.type = "cpu";
  sel.split = split;
  sel.all = all;
  return sel;
}

bool x86_pocl(const Device& dev) {
#if defined(__x86_64__)
  return dev.info().platform.find("Portable Computing Language") != std::string::npos &&
         dev.info().kind == DeviceKind::Cpu;
#else
  (void)dev;
  return false;
#endif
}

Device& default_device() {
  static DeviceManager manager(DeviceSelection{});
  return manager[0];
}

Device& cpu_device() {
  if (default_device().is_cpu()) return default_device();
  static DeviceManager manager(cpu_devices(""));
  return manager[0];
}

namespace {
std::string slurp(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}
std::string quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) {
    if (c == '\'') q += "'\\''";
    else q += c;
  }
  return q + "'";
}
}  // namespace

int run_clshard(const std::vector<std::string>& args, std::string* out, std::string* err) {
#ifdef CLSHARD_EXE
  std::vector<std::string> argv = {CLSHARD_EXE};
#else
  std::vector<std::string> argv = {"clshard"};
#endif
  argv.insert(argv.end(), args.begin(), args.end());
  return run_program(argv, out, err);
}

int run_program(const std::vector<std::string>& argv, std::string* out, std::string* err) {
  std::string cmd;
  for (const auto& a : argv) cmd += (cmd.empty() ? "" : " ") + quote(a);
  static int counter = 0;
  auto dir = std::filesystem::path(CLSHARD_BINARY_DIR) / "test-tmp";
  std::filesystem::create_directories(dir);
  auto o = dir / ("run" + std::to_string(::getpid()) + "_" + std::to_string(counter) + ".out");
  auto e = dir / ("run" + std::to_string(::getpid()) + "_" + std::to_string(counter++) + ".err");
  cmd += " >" + quote(o.string()) + " 2>" + quote(e.string()) + " </dev/null";
  int status = std::system(cmd.c_str());
  if (out) *out = slurp(o);
  if (err) *err = slurp(e);
  std::filesystem::remove(o);
  std::filesystem::remove(e);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

cl::Mem upload_bytes(Device& dev, const void* data, size_t bytes) {
  cl::Mem m = dev.alloc(bytes);
  if (bytes) dev.write(m, data, bytes);
  return m;
}

std::vector<float> download(Device& dev, const cl::Mem& m, size_t n) {
  std::vector<float> v(n);
  if (n) dev.read(m, v.data(), n * sizeof(float));
  return v;
}

std::vector<float> random_vec(size_t n, uint32_t seed, float scale) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> d(-scale, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

std::vector<float> random_logits(uint32_t rows, uint32_t vocab, uint32_t seed, float scale) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, scale);
  std::vector<float> v(size_t(rows) * vocab);
  for (float& x : v) x = normal(rng);
  return v;
}

std::vector<uint64_t> seeds_from(uint64_t first, uint32_t rows) {
  std::vector<uint64_t> s(rows);
  for (uint32_t r = 0; r < rows; ++r) s[r] = first + r * 0x9E3779B97F4A7C15ull;
  return s;
}

double chi2_critical(int dof) {
  const double z = 3.719, k = dof;
  const double t = 1.0 - 2.0 / (9.0 * k) + z * std::sqrt(2.0 / (9.0 * k));
  return k * t * t * t;
}

void expect_matches_distribution(const std::vector<int32_t>& tokens,
                                 const std::vector<float>& expected, const char* what) {
  SCOPED_TRACE(what);
  const double n = double(tokens.size());
  std::vector<double> count(expected.size(), 0.0);
  for (int32_t t : tokens) {
    ASSERT_GE(t, 0);
    ASSERT_LT(size_t(t), expected.size());
    ASSERT_GT(expected[t], 0.0f) << "token " << t << " is outside the kept set";
    count[t] += 1.0;
  }
  double max_diff = 0.0, chi2 = 0.0, pooled_obs = 0.0, pooled_exp = 0.0;
  int bins = 0;
  for (size_t i = 0; i < expected.size(); ++i) {
    max_diff = std::max(max_diff, std::abs(count[i] / n - expected[i]));
    const double e = expected[i] * n;
    if (e == 0.0) continue;
    if (e < 5.0) {
      pooled_obs += count[i];
      pooled_exp += e;
      continue;
    }
    chi2 += (count[i] - e) * (count[i] - e) / e;
    ++bins;
  }
  if (pooled_exp > 0.0) {
    chi2 += (pooled_obs - pooled_exp) * (pooled_obs - pooled_exp) / std::max(pooled_exp, 1.0);
    ++bins;
  }
  EXPECT_LT(max_diff, 0.02);
  if (bins > 1) {
    EXPECT_LT(chi2, chi2_critical(bins - 1)) << bins << " bins";
  }
}

std::vector<std::vector<float>> logits_of(CausalLM& model,
                                          const std::vector<std::vector<int32_t>>& seqs,
                                          const std::vector<uint32_t>& adapters) {
  const uint32_t page = 16;
  StepInputs in;
  in.input_row_offsets = {0};
  uint32_t pages_per_row = 1;
  for (const auto& s : seqs)
    pages_per_row = std::max(pages_per_row, uint32_t((s.size() + page - 1) / page));
  in.pages_per_row = pages_per_row;
  uint32_t next_page = 0;
  for (size_t b = 0; b < seqs.size(); ++b) {
    in.tokens.insert(in.tokens.end(), seqs[b].begin(), seqs[b].end());
    in.input_row_offsets.push_back(uint32_t(in.tokens.size()));
    in.cache_lengths.push_back(0);
    for (uint32_t p = 0; p < pages_per_row; ++p) in.lookup_table.push_back(next_page++);
  }
  in.return_logits = ReturnLogits::All;
  if (std::any_of(adapters.begin(), adapters.end(), [](uint32_t a) { return a; }))
    in.adapter_ids = adapters;
  model.allocate_kv_cache(next_page, page);
  StepOutputs out = model.forward(in);
  const auto all = out.read_logits();
  std::vector<std::vector<float>> rows;
  for (size_t b = 0; b < seqs.size(); ++b)
    rows.emplace_back(all.begin() + size_t(out.logit_offsets[b]) * out.vocab,
                      all.begin() + size_t(out.logit_offsets[b + 1]) * out.vocab);
  return rows;
}

float max_diff(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  float d = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) d = std::max(d, std::abs(a[i] - b[i]));
  return d;
}

std::vector<int32_t> sequence(int seed, size_t n) {
  std::vector<int32_t> s;
  for (size_t j = 0; j < n; ++j) s.push_back(int32_t((seed * 83 + j * 29) % 500 + 3));
  return s;
}

}  // namespace clshard::test

namespace {
// Multi-device tests split the CPU into up to 4 sub-devices; PoCL gives a device at most as many
// threads as POCL_MAX_PTHREAD_COUNT, read once when the platform starts (before any test runs).
const bool kPthreads = [] { return setenv("POCL_MAX_PTHREAD_COUNT", "4", 0) == 0; }();
}  // namespace
