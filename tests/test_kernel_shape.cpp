// devices.kernel_shape: a deployment that forces the GPU-shaped kernels (work-groups of lanes)
// runs them on the first OpenCL device (PoCL's CPU device here), and whole models still give the reference logits (Meta's and
// DeepSeek's own code, ../shared/reference) within the CPU shape's tolerance, on the prefill path
// and on the decode path (one token per step over the paged cache).
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>
#include <sstream>

#include "runtime/device.h"
#include "runtime/engine/deploy_config.h"
#include "runtime/engine/deployment.h"
#include "runtime/engine/generation.h"
#include "runtime/kernel_tuning.h"
#include "runtime/program_cache.h"
#include "tests/reference_cases.h"
#include "tests/test_util.h"

namespace clshard {
namespace {

constexpr float kTolerance = 1e-3f;  // the reference README's fp32-engine tolerance (max abs)

Deployment open_with_shape(const test::RefCase& rc, const std::string& shape) {
  const std::string yaml = "model: {path: \"" + rc.checkpoint.string() +
                           "\"}\n"
                           "devices: {kernel_shape: " +
                           shape +
                           "}\n"
                           "kv_cache: {page_size: 16, pages: 64}\n";
  return Deployment::open(parse_deploy_config(yaml, "deploy.yaml"));
}

// auto: the device's own shape (the chunked kernels on CPU devices, work-groups elsewhere); cpu
// forces the chunked kernels on any device.
TEST(KernelShapeKey, AutoKeepsEachDevicesShapeAndCpuForcesTheChunkedOne) {
  const test::RefCase rc = test::load_case("llama3-tiny-f32/short");
  for (const std::string shape : {"auto", "cpu"}) {
    Deployment d = open_with_shape(rc, shape);
    ASSERT_GE(d.devices->size(), 1u);
    for (Device* dev : d.devices->devices()) {
      const bool cpu = dev->info().kind == DeviceKind::Cpu;
      EXPECT_EQ(dev->kernel_shape(),
                shape == "cpu" || cpu ? KernelShape::Chunks : KernelShape::WorkGroups)
          << shape << " on " << dev->label();
    }
  }
}

// A launch that names no local size runs one work-item per group on CPUs and wherever the CPU
// shape runs (a GPU forced to it too: the packed GEMM's panel in local memory is a work-item's
// own), and leaves the choice to the driver only for the GPU shape on other devices.
TEST(KernelShapeLaunch, TheCpuShapeRunsSingleWorkItemGroupsOnAnyDevice) {
  for (DeviceKind kind : {DeviceKind::Cpu, DeviceKind::Gpu, DeviceKind::Accelerator}) {
    EXPECT_TRUE(single_work_item_groups(kind, KernelShape::Chunks)) << device_kind_name(kind);
    EXPECT_EQ(single_work_item_groups(kind, KernelShape::WorkGroups), kind == DeviceKind::Cpu)
        << device_kind_name(kind);
  }
}

class ForcedGpuShape : public ::testing::TestWithParam<std::string> {};

// Every position of every sequence in one ragged prefill, then the decode path: within the
// reference tolerance, and within it of the CPU shape's own logits.
TEST_P(ForcedGpuShape, WholeModelMatchesTheReferenceAndTheCpuShape) {
  const test::RefCase rc = test::load_case(GetParam());
  std::vector<std::vector<float>> cpu_logits;
  {
    Deployment d = open_with_shape(rc, "cpu");
    cpu_logits = all_position_logits(*d.model, rc.sequences(), 16);
  }
  Deployment d = open_with_shape(rc, "gpu");
  for (Device* dev : d.devices->devices())
    ASSERT_EQ(dev->kernel_shape(), KernelShape::WorkGroups) << dev->label();
  const auto prefill = all_position_logits(*d.model, rc.sequences(), 16);
  ASSERT_EQ(prefill.size(), rc.seqs.size());
  double worst_ref = 0, worst_cpu = 0, worst_decode = 0;
  for (size_t i = 0; i < rc.seqs.size(); ++i) {
    const double ref = test::max_abs_diff(prefill[i], rc.seqs[i].logits);
    const double cpu = test::max_abs_diff(prefill[i], cpu_logits[i]);
    EXPECT_LT(ref, kTolerance) << rc.id << " " << i;
    EXPECT_LT(cpu, kTolerance) << rc.id << " " << i;
    worst_ref = std::max(worst_ref, ref);
    worst_cpu = std::max(worst_cpu, cpu);
  }
  const auto decode = test::prefill_then_decode(*d.model, rc);
  for (size_t i = 0; i < rc.seqs.size(); ++i) {
    const double ref = test::max_abs_diff(decode[i], rc.seqs[i].logits);
    EXPECT_LT(ref, kTolerance) << rc.id << " " << i;
    worst_decode = std::max(worst_decode, ref);
  }
  std::printf("[ measured ] %s, gpu shape: prefill %.3g from the reference, %.3g from the cpu "
              "shape; decode %.3g from the reference\n",
              rc.id.c_str(), worst_ref, worst_cpu, worst_decode);
}

// Sets an environment variable for one scope.
struct EnvScope {
  std::string name, saved;
  bool had;
  EnvScope(const std::string& n, const std::string& value) : name(n) {
    const char* v = std::getenv(n.c_str());
    had = v != nullptr;
    if (had) saved = v;
    setenv(n.c_str(), value.c_str(), 1);
  }
  ~EnvScope() {
    if (had) setenv(name.c_str(), saved.c_str(), 1);
    else unsetenv(name.c_str());
  }
};

// The tuning file in the kernel cache directory: an entry for a device replaces the built-in
// row's fields it names, for that device only; saving twice keeps one entry; bad entries are
// errors naming the file, the entry and the field.
// A kernel file's #include lines are replaced by the embedded files, theirs too: linear_bf16.cl
// includes bf16_packed.cl and bf16_amx_stream.cl, which both include amx.cl (its guard keeps one
// definition per program). The program text keeps no #include line, and each file is named by a
// #line directive where its text begins.
TEST(KernelSource, IncludesNestAndLeaveNoIncludeLine) {
  const std::string src = kernel_source("linear_bf16.cl");
  EXPECT_EQ(src.find("\n#include \""), std::string::npos);
  for (const char* file : {"bf16_tile.cl", "bf16_packed.cl", "bf16_amx_stream.cl", "amx.cl"})
    EXPECT_NE(src.find(std::string("#line 1 \"") + file + "\""), std::string::npos) << file;
  const size_t first = src.find("} AmxTileConfig;");
  ASSERT_NE(first, std::string::npos);
  EXPECT_NE(src.find("} AmxTileConfig;", first + 1), std::string::npos)
      << "amx.cl's text is in both includes; its #ifndef guard keeps one definition";
  EXPECT_THROW(kernel_source("no_such_file.cl"), std::runtime_error);
}

// The lines of `text`, each without its newline.
std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> out;
  std::string line;
  std::istringstream in(text);
  while (std::getline(in, line)) out.push_back(line);
  return out;
}

// The kernels defined in `text`: the name after "void" on each line that starts "kernel " (or on
// the line after, past an __attribute__).
std::vector<std::string> kernels_in(const std::vector<std::string>& lines) {
  static const std::regex name(R"(\bvoid\s+(\w+)\s*\()");
  std::vector<std::string> out;
  for (size_t i = 0; i < lines.size(); ++i) {
    if (!lines[i].starts_with("kernel ")) continue;
    const std::string head = lines[i] + (i + 1 < lines.size() ? "\n" + lines[i + 1] : "");
    std::smatch m;
    if (std::regex_search(head, m, name)) out.push_back(m[1]);
  }
  return out;
}

// A program of one kernel: for every kernel of every kernels_cl/ file, the text asked for that
// kernel defines that one, line for line where the whole file's text has a line (the compiler's
// line numbers unchanged), each line the whole text's or empty, and every preprocessor line but
// #pragma kept (a #define in a body left out still serves the kernels after it). A kernel the
// file lacks is an error naming both.
TEST(KernelSource, OneKernelKeepsItsTextAndEveryDirective) {
  size_t kernels = 0;
  for (const auto& [file, text] : embedded_kernels()) {
    const std::vector<std::string> whole = lines_of(kernel_source(file));
    for (const std::string& kernel : kernels_in(whole)) {
      ++kernels;
      const std::vector<std::string> one = lines_of(kernel_source(file, kernel));
      EXPECT_EQ(kernels_in(one), std::vector<std::string>{kernel}) << file;
      ASSERT_EQ(one.size(), whole.size()) << file << " " << kernel;
      for (size_t i = 0; i < one.size(); ++i) {
        const bool directive = whole[i].find_first_not_of(" \t") != std::string::npos &&
                               whole[i][whole[i].find_first_not_of(" \t")] == '#' &&
                               whole[i].find("#pragma") == std::string::npos;
        if (directive || !one[i].empty()) {
          EXPECT_EQ(one[i], whole[i]) << file << " " << kernel << " line " << i;
        }
      }
    }
  }
  EXPECT_GE(kernels, 60u) << "every kernels_cl/ file's kernels were looked at";
  try {
    kernel_source("norm.cl", "no_such_kernel");
    ADD_FAILURE() << "a kernel norm.cl lacks was built";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "kernels_cl/norm.cl has no kernel no_such_kernel");
  }
}

// The device builds each kernel as a program of its own: the program of bandwidth.cl's read_sum
// (a file of two kernels) holds read_sum alone, and read_sum_wg's another program.
TEST(KernelSource, EachKernelIsAProgramOfItsOwn) {
  Device& dev = test::default_device();
  auto program_of = [&](const char* name) {
    cl::Kernel k = dev.kernel("bandwidth.cl", name);
    cl_program p = nullptr;
    EXPECT_EQ(clGetKernelInfo(k.get(), CL_KERNEL_PROGRAM, sizeof p, &p, nullptr), CL_SUCCESS);
    size_t n = 0;
    EXPECT_EQ(clGetProgramInfo(p, CL_PROGRAM_KERNEL_NAMES, 0, nullptr, &n), CL_SUCCESS);
    std::string names(n, '\0');
    EXPECT_EQ(clGetProgramInfo(p, CL_PROGRAM_KERNEL_NAMES, n, names.data(), nullptr), CL_SUCCESS);
    names.resize(std::strlen(names.c_str()));
    return std::make_pair(p, names);
  };
  const auto [plain, plain_names] = program_of("read_sum");
  const auto [wg, wg_names] = program_of("read_sum_wg");
  EXPECT_EQ(plain_names, "read_sum");
  EXPECT_EQ(wg_names, "read_sum_wg");
  EXPECT_NE(plain, wg);
}

// The FP8 tiles (fp8_tile.cl through linear_fp8.cl) build without a warning in the device's log:
// one-row tiles in turn, 4-row tiles over a decoded panel and plain 4-row tiles. An unroll pragma
// the compiler cannot carry out (a loop of a variable count: a copy of the tiles in turn compiled
// with R a variable, a row loop that broke out at `rows`) had made PoCL print "N warnings
// generated." to stderr at each build. The source carries a fresh comment, so that no cache of
// the driver's skips the compile (and its log).
TEST(KernelSource, Fp8TilesBuildWithoutWarnings) {
  Device& dev = test::default_device();
  const std::string src =
      kernel_source("linear_fp8.cl") + "\n// " +
      std::to_string(std::chrono::steady_clock::now().time_since_epoch().count()) + "\n";
  for (const char* options :
       {"-DFP8_DENORM=1 -DTM=1 -DTN=4 -DCOLUMNS_IN_TURN=1 -DGEMV_ROW_PAIRS=1 -DFP8_NAN_WATCH=0 "
        "-DFP8_XS_MAX=4096",
        "-DFP8_DENORM=1 -DTM=4 -DTN=4 -DFP8_NAN_WATCH=0 -DFP8_PANEL_K=2048",
        "-DFP8_DENORM=1 -DTM=4 -DTN=4 -DFP8_NAN_WATCH=1"}) {
    SCOPED_TRACE(options);
    const char* text = src.c_str();
    cl_int err = CL_SUCCESS;
    cl_program p = clCreateProgramWithSource(dev.context(), 1, &text, nullptr, &err);
    ASSERT_EQ(err, CL_SUCCESS);
    cl_device_id id = dev.id();
    err = clBuildProgram(p, 1, &id, options, nullptr, nullptr);
    const std::string log = build_log(p, id);
    clReleaseProgram(p);
    ASSERT_EQ(err, CL_SUCCESS) << log;
    EXPECT_EQ(log.find("warning"), std::string::npos) << log;
  }
}

TEST(KernelTuningFile, AnEntryOverridesTheBuiltInRowForItsDeviceOnly) {
  const auto dir = test::temp_dir("kernel_tuning_file");
  EnvScope env("CLSHARD_KERNEL_CACHE", dir.string());
  const DeviceInfo info = test::default_device().info();
  DeviceInfo other = info;
  other.name += " (another)";
  EXPECT_EQ(kernel_tuning_file(), dir / "tuning.json");
  EXPECT_EQ(lookup_kernel_tuning(info), builtin_kernel_tuning(info));  // no file yet

  KernelTuning t = builtin_kernel_tuning(info);
  t.attn_wg = 32;
  t.mla_heads = 2;
  t.blas_gemm_rows = 0;  // saved and read back as 0 (never)
  ASSERT_NE(t, builtin_kernel_tuning(info));
  save_kernel_tuning(info, t);
  EXPECT_EQ(lookup_kernel_tuning(info), t);
  EXPECT_EQ(lookup_kernel_tuning(other), builtin_kernel_tuning(other));
  t.attn_wg = 128;
  save_kernel_tuning(info, t);
  EXPECT_EQ(lookup_kernel_tuning(info), t);
  {
    std::ifstream in(kernel_tuning_file());
    const auto doc = nlohmann::json::parse(in);
    EXPECT_EQ(doc["entries"].size(), 1u);
    EXPECT_EQ(doc["entries"][0]["tuning"]["attn_wg"], 128);
  }

  // A partial entry: the fields it names, the built-in row for the rest.
  auto write = [&](const nlohmann::json& tuning) {
    std::ofstream(kernel_tuning_file())
        << nlohmann::json{{"entries", {{{"vendor", info.vendor}, {"name", info.name}, {"tuning", tuning}}}}}.dump();
  };
  write({{"rope_wg", 32}});
  KernelTuning want = builtin_kernel_tuning(info);
  want.rope_wg = 32;
  EXPECT_EQ(lookup_kernel_tuning(info), want);

  auto error_of = [&] {
    try {
      lookup_kernel_tuning(info);
    } catch (const std::runtime_error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  const std::string prefix = kernel_tuning_file().string() + ": entries[0].tuning.";
  write({{"attn_wg", 0}});
  EXPECT_EQ(error_of().rfind(prefix + "attn_wg: expected one of the fields (norm_wg, ", 0), 0u)
      << error_of();
  EXPECT_NE(error_of().find("with a positive integer (blas_gemm_rows, gemm_bf16_packed_rows, "
                            "moe_bf16_packed_rows, moe_fp8_packed_rows, gemm_bf16_amx_stream_rows, "
                            "gemm_f32_amx_rows: 0 for never; "
                            "weight_prefetch, "
                            "stream_prefetch, stream_prefetch_l1, gemv_stream_prefetch, "
                            "gemv_row_pairs, gemm_bf16_dot, gemm_bf16_gemv, gemm_bf16_amx, "
                            "gemm_bf16_packed_wf32: 0 for off), got 0"),
            std::string::npos)
      << error_of();
  write({{"blas_gemm_rows", 0}});  // the fields whose 0 is a value (never, off)
  want = builtin_kernel_tuning(info);
  want.blas_gemm_rows = 0;
  EXPECT_EQ(lookup_kernel_tuning(info), want);
  write({{"gemm_bf16_packed_rows", 0}});
  want = builtin_kernel_tuning(info);
  want.gemm_bf16_packed_rows = 0;
  EXPECT_EQ(lookup_kernel_tuning(info), want);
  write({{"weight_prefetch", 0}});
  want = builtin_kernel_tuning(info);
  want.weight_prefetch = 0;
  EXPECT_EQ(lookup_kernel_tuning(info), want);
  write({{"stream_prefetch", 0}});
  want = builtin_kernel_tuning(info);
  want.stream_prefetch = 0;
  EXPECT_EQ(lookup_kernel_tuning(info), want);
  write({{"stream_prefetch_l1", 0}});
  want = builtin_kernel_tuning(info);
  want.stream_prefetch_l1 = 0;
  EXPECT_EQ(lookup_kernel_tuning(info), want);
  write({{"gemv_stream_prefetch", 0}});
  want = builtin_kernel_tuning(info);
  want.gemv_stream_prefetch = 0;
  EXPECT_EQ(lookup_kernel_tuning(info), want);
  write({{"gemv_row_pairs", 0}});
  want = builtin_kernel_tuning(info);
  want.gemv_row_pairs = 0;
  EXPECT_EQ(lookup_kernel_tuning(info), want);
  write({{"gemm_bf16_dot", 0},
         {"gemm_bf16_gemv", 0},
         {"gemm_bf16_amx", 0},
         {"gemm_f32_amx_rows", 0}});
  want = builtin_kernel_tuning(info);
  want.gemm_f32_amx_rows = 0;
  want.gemm_bf16_dot = want.gemm_bf16_gemv = want.gemm_bf16_amx = 0;
  EXPECT_EQ(lookup_kernel_tuning(info), want);
  write({{"warp_size", 32}});
  EXPECT_EQ(error_of().rfind(prefix + "warp_size: expected one of the fields", 0), 0u) << error_of();
  std::ofstream(kernel_tuning_file()) << "{\"entries\": [";
  EXPECT_EQ(error_of().rfind(kernel_tuning_file().string() + ": not JSON", 0), 0u) << error_of();
}

INSTANTIATE_TEST_SUITE_P(Cases, ForcedGpuShape,
                         ::testing::Values("llama3-tiny-bf16/short", "llama3-tiny-rope64-bf16/long",
                                           "deepseek-v3-tiny-bf16/short",
                                           "deepseek-v3-tiny-grouped-bf16/short",
                                           "deepseek-v3-tiny-fp8/short",
                                           "deepseek-v3-tiny-grouped-fp8/short"),
                         [](const auto& info) {
                           std::string n = info.param;
                           for (char& c : n)
                             if (!isalnum(static_cast<unsigned char>(c))) c = '_';
                           return n;
                         });

// The built-in table: a row for named devices wins over its vendor's default (the Hopper row,
// measured on an H200 and an H100), and a device of another type never takes a GPU row.
TEST(KernelTuningTable, TheHopperRowWinsOverNvidiasDefault) {
  DeviceInfo h200;
  h200.kind = DeviceKind::Gpu;
  h200.vendor = "NVIDIA Corporation";
  h200.name = "NVIDIA H200";
  DeviceInfo h100 = h200, rtx = h200;
  h100.name = "NVIDIA H100 80GB HBM3";
  rtx.name = "NVIDIA GeForce RTX 4090";
  const KernelTuning a = builtin_kernel_tuning(h200), b = builtin_kernel_tuning(h100),
                     c = builtin_kernel_tuning(rtx);
  EXPECT_EQ(a, b);
  EXPECT_EQ(a.attn_wg, 256u);
  EXPECT_EQ(a.attn_split, 256u);
  EXPECT_EQ(a.mla_tile, 16u);
  EXPECT_EQ(a.prefill_wg, 256u);
  EXPECT_EQ(a.linear_rows, KernelTuning{}.linear_rows);  // not timed on prefill GEMMs: the default
  EXPECT_EQ(a.linear_vector, 4u);
  EXPECT_EQ(c.linear_vector, KernelTuning{}.linear_vector);
  EXPECT_EQ(c.attn_wg, 128u);
  EXPECT_EQ(c.prefill_wg, 128u);
  EXPECT_EQ(c.attn_split, KernelTuning{}.attn_split);
  DeviceInfo cpu = h200;
  cpu.kind = DeviceKind::Cpu;
  EXPECT_NE(builtin_kernel_tuning(cpu), a);
}

// The CPU rows: PoCL on an AVX-512 EPYC that its LLVM calls skylake-avx512 takes 4x6 bf16 GEMM
// tiles (8x4 at decode batches) on top of the CPU default; another EPYC (no AVX-512 BF16: the
// portable micro-kernel, which 4x6 slows) keeps 4x4 for both; both prefetch FP8 streams.
TEST(KernelTuningTable, TheAvx512EpycRowWidensTheBf16GemmTile) {
  DeviceInfo zen5;
  zen5.kind = DeviceKind::Cpu;
  zen5.vendor = "AuthenticAMD";
  zen5.name = "pthread-skylake-avx512-AMD EPYC 9B45";
  DeviceInfo zen3 = zen5;
  zen3.name = "pthread-znver3-AMD EPYC 7B13";
  const KernelTuning a = builtin_kernel_tuning(zen5), b = builtin_kernel_tuning(zen3);
  EXPECT_EQ(a.gemm_bf16_tn, 6u);
  EXPECT_EQ(a.gemm_bf16_batch_tm, 8u);
  EXPECT_EQ(a.gemm_bf16_batch_tn, 4u);
  EXPECT_EQ(a.norm_wg, b.norm_wg);  // the CPU default's forced-GPU-shape fields stay
  EXPECT_EQ(b.gemm_bf16_tn, KernelTuning{}.gemm_bf16_tn);
  EXPECT_EQ(b.gemm_bf16_tn, 4u);
  EXPECT_EQ(b.gemm_bf16_batch_tm, 4u);
  EXPECT_EQ(b.gemm_bf16_batch_tn, 4u);
  // The FP8 stream prefetch is the CPU default's (measured on Zen 5 and on a Xeon), so every CPU
  // row has it.
  EXPECT_EQ(b.stream_prefetch, 8192u);
  EXPECT_EQ(a.stream_prefetch, 8192u);
  // Its L1 companion: the CPU default (measured on the Xeon only), off in the Zen 5 row.
  EXPECT_EQ(b.stream_prefetch_l1, 1024u);
  EXPECT_EQ(a.stream_prefetch_l1, 0u);
  // The bf16 / f32 GEMVs' stream prefetch: the CPU default, which the Zen 5 row turns off.
  EXPECT_EQ(b.gemv_stream_prefetch, 8192u);
  EXPECT_EQ(a.gemv_stream_prefetch, 0u);
  // Their rows in pairs likewise (measured on the Xeon only).
  EXPECT_EQ(b.gemv_row_pairs, 1u);
  EXPECT_EQ(a.gemv_row_pairs, 0u);
}

}  // namespace
}  // namespace clshard
