// Shared helpers for tests: where ../shared is, the reference index, a device to run on.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "runtime/cl.h"
#include "runtime/device.h"
#include "runtime/device_manager.h"
#include "runtime/model.h"

namespace clshard {
class Device;
class Tokenizer;
}

namespace clshard::test {

std::filesystem::path shared_dir();      // $CLSHARD_SHARED_DIR or <source>/../shared
std::filesystem::path reference_dir();   // shared_dir()/reference
std::filesystem::path tokenizers_dir();  // shared_dir()/tokenizers
const nlohmann::json& reference_index(); // reference/index.json
// A fresh empty dir under the build tree, in a folder of the running test's own.
std::filesystem::path temp_dir(const std::string& name);
// How many regions of this process map a file of `dir` (/proc/self/maps).
size_t regions_mapping_files_of(const std::filesystem::path& dir);

// The default job's checkpoint (what scripts/quickstart.sh writes into configs/models/): the
// trained model of ../shared/models/dsv3-mtp-trained with its f32 tensors rounded to bf16 by
// scripts/bf16_checkpoint.py, made once per build tree (under test-models/) by the first test
// that asks; the script's rename makes concurrent test processes agree on one copy.
std::filesystem::path default_job_model();

// Raw little-endian float32 file.
std::vector<float> read_f32(const std::filesystem::path& p);

// The shipped Llama 3 and DeepSeek-V3 tokenizers, loaded once per process (several MB each).
const Tokenizer& llama3_tokenizer();
const Tokenizer& deepseek_v3_tokenizer();

// The CPU device(s), split as asked ("" for whole), or every CPU device with all = true.
DeviceSelection cpu_devices(const std::string& split, bool all = false);

// The first OpenCL device (PoCL's CPU device here), shared by the tests of one process.
Device& default_device();
// The first CPU device: default_device() where that is one, else one opened for it (what tests of
// CPU-only behaviour use, so that on a machine without a CPU device they fail naming the want).
Device& cpu_device();

// Sets a device's kernel shape for one scope (the GPU shape runs on PoCL too), and puts the
// device's own shape back at the end of it.
class ShapeScope {
 public:
  ShapeScope(Device& dev, KernelShape shape) : dev_(dev), saved_(dev.kernel_shape()) {
    dev.set_kernel_shape(shape);
  }
  ~ShapeScope() { dev_.set_kernel_shape(saved_); }
  ShapeScope(const ShapeScope&) = delete;
  ShapeScope& operator=(const ShapeScope&) = delete;

 private:
  Device& dev_;
  KernelShape saved_;
};

// A test suite run in both kernel shapes on default_device() (the GPU shape forced on PoCL):
//   class Suite : public test::BothShapes {};
//   INSTANTIATE_TEST_SUITE_P(Shapes, Suite, test::both_shapes(), test::ShapeParamName());
class BothShapes : public ::testing::TestWithParam<KernelShape> {
 protected:
  void SetUp() override { scope_.emplace(default_device(), GetParam()); }
  void TearDown() override { scope_.reset(); }

 private:
  std::optional<ShapeScope> scope_;
};
inline auto both_shapes() {
  return ::testing::Values(KernelShape::Chunks, KernelShape::WorkGroups);
}
struct ShapeParamName {
  std::string operator()(const ::testing::TestParamInfo<KernelShape>& info) const {
    return kernel_shape_name(info.param);
  }
};

// Sets a device's kernel tuning row for one scope, and puts the device's own row back at the end.
class TuningScope {
 public:
  TuningScope(Device& dev, const KernelTuning& tuning) : dev_(dev), saved_(dev.tuning()) {
    dev.set_tuning(tuning);
  }
  ~TuningScope() { dev_.set_tuning(saved_); }
  TuningScope(const TuningScope&) = delete;
  TuningScope& operator=(const TuningScope&) = delete;

 private:
  Device& dev_;
  KernelTuning saved_;
};

// The device's tuning with gemm_bf16_dot 1 for one scope: bf16 compute's kernels with vdpbf16ps
// wherever the host has it, also where the device's own row turns it off for speed (the Xeons',
// kernel_tuning.cpp), so that their tests still run them there.
inline KernelTuning with_bf16_dot(KernelTuning t) {
  t.gemm_bf16_dot = 1;
  return t;
}
class DotProductScope {
 public:
  explicit DotProductScope(Device& dev) : scope_(dev, with_bf16_dot(dev.tuning())) {}

 private:
  TuningScope scope_;
};

// Whether the prefetch hints apply to `dev` (ops::weight_prefetch_option): PoCL's CPU device on an
// x86 host.
bool x86_pocl(const Device& dev);

// Runs the clshard executable with args; returns its exit code, stdout and stderr in out/err.
int run_clshard(const std::vector<std::string>& args, std::string* out = nullptr,
                std::string* err = nullptr);
// Runs argv[0] (a path or a name on PATH) with the rest as arguments, the same way.
int run_program(const std::vector<std::string>& argv, std::string* out = nullptr,
                std::string* err = nullptr);

// ---- device buffers and token statistics (sampling and acceptance tests) -----------------------

// A new buffer on `dev` holding `bytes` from `data`; upload(dev, v) for a vector.
cl::Mem upload_bytes(Device& dev, const void* data, size_t bytes);
template <typename T>
cl::Mem upload(Device& dev, const std::vector<T>& v) {
  return upload_bytes(dev, v.data(), v.size() * sizeof(T));
}

// rows x vocab logits from N(0, scale), reproducible from `seed`.
// n floats read back from `m`.
std::vector<float> download(Device& dev, const cl::Mem& m, size_t n);

// n values uniform in [-scale, scale) from std::mt19937(seed): the kernel tests' random inputs.
std::vector<float> random_vec(size_t n, uint32_t seed, float scale = 1.0f);

std::vector<float> random_logits(uint32_t rows, uint32_t vocab, uint32_t seed, float scale = 3.0f);

// `rows` well-spread step seeds starting at `first`.
std::vector<uint64_t> seeds_from(uint64_t first, uint32_t rows);

// Pearson chi-square upper critical value at significance 1e-4 (Wilson-Hilferty; z = 3.719).
double chi2_critical(int dof);

// The sampled tokens' frequencies match `expected` (a distribution over token ids): no token
// outside its support, every frequency within 0.02 of its probability (4+ standard errors at
// 10,000 draws), and a chi-square statistic below the 1e-4 critical value, with tokens expected
// fewer than 5 times pooled into one bin. Reports through gtest's EXPECT/ASSERT.
void expect_matches_distribution(const std::vector<int32_t>& tokens,
                                 const std::vector<float>& expected, const char* what);

// LoRA tests (test_lora*.cpp): every position's logits of each sequence, all rows in one step with
// no cache, row b running adapter adapters[b] (0: the base model); the largest |a - b|; a
// deterministic token sequence of length n for a seed.
std::vector<std::vector<float>> logits_of(CausalLM& model,
                                          const std::vector<std::vector<int32_t>>& seqs,
                                          const std::vector<uint32_t>& adapters);
float max_diff(const std::vector<float>& a, const std::vector<float>& b);
std::vector<int32_t> sequence(int seed, size_t n);

}  // namespace clshard::test
