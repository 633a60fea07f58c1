// `clshard tune` (runtime/kernel_tune.h) on PoCL in quick mode: the entry it writes to
// tuning.json in a temporary kernel cache directory names the device, holds a candidate value for
// every tuned field and is what lookup_kernel_tuning reads back; --dry-run writes nothing; field
// names and shapes it cannot tune are refused with their message before any timing.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include "runtime/device.h"
#include "runtime/kernel_tune.h"
#include "runtime/kernel_tuning.h"
#include "tests/test_util.h"

namespace clshard {
namespace {

// Points CLSHARD_KERNEL_CACHE (read by this process and inherited by clshard) at `dir` for one
// scope.
struct KernelCacheScope {
  std::optional<std::string> saved;
  explicit KernelCacheScope(const std::filesystem::path& dir) {
    if (const char* v = std::getenv("CLSHARD_KERNEL_CACHE")) saved = v;
    setenv("CLSHARD_KERNEL_CACHE", dir.c_str(), 1);
  }
  ~KernelCacheScope() {
    if (saved) setenv("CLSHARD_KERNEL_CACHE", saved->c_str(), 1);
    else unsetenv("CLSHARD_KERNEL_CACHE");
  }
};

const std::vector<uint64_t>& candidates(const std::string& field) {
  for (const TuneField& f : tunable_fields())
    if (f.field == field) return f.candidates;
  throw std::runtime_error("no tunable field " + field);
}

// Runs `clshard tune` with args in its own kernel cache dir; returns the parsed tuning.json (null
// when none was written) and the output.
struct TuneRun {
  int rc = -1;
  std::string out, err;
  std::filesystem::path dir;
  nlohmann::json file;
};
TuneRun run_tune(const std::string& name, std::vector<std::string> args) {
  TuneRun r;
  r.dir = test::temp_dir(name);
  KernelCacheScope scope(r.dir);
  args.insert(args.begin(), {"tune", "--device-type", "cpu", "--device", "0", "--quick"});
  r.rc = test::run_clshard(args, &r.out, &r.err);
  std::ifstream in(r.dir / "tuning.json");
  if (in) r.file = nlohmann::json::parse(in);
  return r;
}

TEST(KernelTune, QuickRunWritesTheDevicesEntryInBothShapes) {
  const DeviceInfo& info = test::default_device().info();
  struct Case {
    const char* shape;
    std::vector<std::string> fields;
  };
  for (const Case& c : {Case{"gpu", {"norm_wg", "route_wg"}}, Case{"cpu", {"gemm_bf16_rows"}}}) {
    SCOPED_TRACE(c.shape);
    std::string list;
    for (const std::string& f : c.fields) list += (list.empty() ? "" : ",") + f;
    const TuneRun r = run_tune(std::string("tune_") + c.shape,
                               {"--kernel-shape", c.shape, "--fields", list});
    ASSERT_EQ(r.rc, 0) << r.err;
    // Progress per field with its timings, then the choices and where they went.
    for (const std::string& f : c.fields)
      EXPECT_NE(r.out.find("  " + f + " ("), std::string::npos) << r.out;
    EXPECT_NE(r.out.find(" ms"), std::string::npos) << r.out;
    EXPECT_NE(r.out.find("chosen: "), std::string::npos) << r.out;
    EXPECT_NE(r.out.find("tuning.json"), std::string::npos) << r.out;

    ASSERT_TRUE(r.file.is_object()) << "no tuning.json in " << r.dir;
    ASSERT_EQ(r.file["entries"].size(), 1u) << r.file.dump();
    const auto& e = r.file["entries"][0];
    EXPECT_EQ(e["vendor"], info.vendor);
    EXPECT_EQ(e["name"], info.name);
    KernelTuning want = builtin_kernel_tuning(info);
    for (const std::string& f : c.fields) {
      ASSERT_TRUE(e["tuning"].contains(f)) << e.dump();
      const uint64_t v = e["tuning"][f].get<uint64_t>();
      const auto& cand = candidates(f);
      // The chosen value is a candidate, or the built-in value it started from when no candidate
      // beat it by 2%.
      EXPECT_TRUE(std::find(cand.begin(), cand.end(), v) != cand.end() ||
                  v == kernel_tuning_field(want, f))
          << f << " = " << v;
      EXPECT_NE(r.out.find("chosen: "), std::string::npos);
      EXPECT_NE(r.out.find(f + " " + std::to_string(v)), std::string::npos) << r.out;
      set_kernel_tuning_field(want, f, v);
    }
    // The other fields keep the built-in row; lookup_kernel_tuning reads the entry back.
    KernelCacheScope scope(r.dir);
    EXPECT_TRUE(lookup_kernel_tuning(info) == want);
  }
}

TEST(KernelTune, DryRunWritesNothing) {
  const TuneRun r = run_tune("tune_dry", {"--kernel-shape", "cpu", "--fields", "gemm_bf16_rows",
                                          "--dry-run"});
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.out.find("chosen: gemm_bf16_rows "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("--dry-run: "), std::string::npos) << r.out;
  EXPECT_FALSE(std::filesystem::exists(r.dir / "tuning.json"));
}

TEST(KernelTune, UnknownAndUntunableFieldsAreRefusedWithTheirMessage) {
  const std::string cpu_fields =
      "gemv_stream_k, fp8_stream_k, weight_prefetch, stream_prefetch, stream_prefetch_l1, "
      "gemv_stream_prefetch, gemv_row_pairs, linear_batch_tm, gemm_bf16_dot, gemm_bf16_tm, "
      "gemm_bf16_tn, gemm_bf16_batch_tm, gemm_bf16_batch_tn, gemm_bf16_rows, "
      "gemm_bf16_packed_rows, gemm_bf16_packed_tm, gemm_bf16_packed_nv, gemm_bf16_packed_kp, "
      "gemm_bf16_packed_wf32, moe_bf16_packed_rows, moe_fp8_packed_rows, gemm_bf16_amx_stream_na";
  struct Case {
    std::vector<std::string> args;
    std::string message;
  };
  const Case cases[] = {
      {{"--fields", "gemm_bf16_tm,no_such_field"},
       "clshard: error: tune: unknown field 'no_such_field' (tunable in the cpu kernel shape: " +
           cpu_fields + ")\n"},
      {{"--fields", "split_scratch_bytes"},
       "clshard: error: tune: field 'split_scratch_bytes' has no candidate values to time "
       "(tunable in the cpu kernel shape: " + cpu_fields + ")\n"},
      {{"--fields", "attn_wg"},
       "clshard: error: tune: field 'attn_wg' is read by the gpu kernel shape only, and this run "
       "tunes the cpu shape (--kernel-shape gpu)\n"},
      {{"--kernel-shape", "gpu", "--fields", "gemm_bf16_tm"},
       "clshard: error: tune: field 'gemm_bf16_tm' is read by the cpu kernel shape only, and this "
       "run tunes the gpu shape (--kernel-shape cpu)\n"},
      {{"--kernel-shape", "vector"},
       "clshard: error: --kernel-shape: expected auto, cpu or gpu, got 'vector'\n"},
  };
  for (const Case& c : cases) {
    const TuneRun r = run_tune("tune_errors", c.args);
    EXPECT_EQ(r.rc, 1);
    EXPECT_EQ(r.err, c.message);
    EXPECT_FALSE(std::filesystem::exists(r.dir / "tuning.json"));
  }
}

// The field table: every tunable field is a KernelTuning field and its candidates are positive.
TEST(KernelTune, TunableFieldsAreKernelTuningFields) {
  const auto& all = kernel_tuning_fields();
  for (const TuneField& f : tunable_fields()) {
    EXPECT_NE(std::find(all.begin(), all.end(), f.field), all.end()) << f.field;
    EXPECT_FALSE(f.candidates.empty()) << f.field;
    for (uint64_t v : f.candidates)  // positive, as the tuning file holds them (0: never, off)
      EXPECT_TRUE(v > 0 || kernel_tuning_zero_allowed(f.field)) << f.field;
  }
}

}  // namespace
}  // namespace clshard
