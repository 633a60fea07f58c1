// DeepSeek-V3 DP + EP with one rank per process over MPI (`mpirun -np N clshard logits --mpi`)
// against the same command in one process, on the shared grouped-FP8 reference checkpoint and the
// ragged8 sequences; and a rank that stops answering mid-step. Built when CMake found OpenMPI.
#ifdef CLSHARD_HAVE_MPI

#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <fstream>
#include <regex>

#include <nlohmann/json.hpp>

#include "tests/test_util.h"

namespace clshard {
namespace {

#ifndef CLSHARD_MPIRUN
#define CLSHARD_MPIRUN "mpirun"
#endif

std::string join(const std::vector<int32_t>& ids) {
  std::string s;
  for (size_t i = 0; i < ids.size(); ++i) s += (i ? "," : "") + std::to_string(ids[i]);
  return s;
}

// `clshard logits` of the ragged8 case, under mpirun -np `np` with --mpi (np > 0) or in one
// process (np = 0); extra environment as "NAME=value" before the command.
std::vector<std::string> logits_command(int np, const std::filesystem::path& out,
                                        const std::vector<std::string>& env = {}) {
  std::vector<std::string> argv = {"env", "OMPI_ALLOW_RUN_AS_ROOT=1",
                                   "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1"};
  argv.insert(argv.end(), env.begin(), env.end());
  if (np > 0) {
    for (std::string a : {CLSHARD_MPIRUN, "--oversubscribe", "--allow-run-as-root", "-np"})
      argv.push_back(a);
    argv.push_back(std::to_string(np));
  }
  argv.push_back(CLSHARD_EXE);
  for (std::string a : {"logits", "--model"}) argv.push_back(a);
  argv.push_back((test::reference_dir() / "ckpt" / "deepseek-v3-tiny-grouped-fp8").string());
  for (std::string a : {"--page-size", "16", "--out"}) argv.push_back(a);
  argv.push_back(out.string());
  if (np > 0) argv.push_back("--mpi");
  for (const auto& c : test::reference_index()["cases"]) {
    if (c["id"] != "deepseek-v3-tiny-grouped-fp8/ragged8") continue;
    for (const auto& s : c["sequences"]) {
      argv.push_back("--tokens");
      argv.push_back(join(s["tokens"].get<std::vector<int32_t>>()));
    }
  }
  return argv;
}

std::vector<std::vector<float>> read_logits(const std::filesystem::path& dir) {
  auto manifest = nlohmann::json::parse(std::ifstream(dir / "manifest.json"));
  std::vector<std::vector<float>> seqs;
  for (const auto& s : manifest["sequences"])
    seqs.push_back(test::read_f32(dir / s["file"].get<std::string>()));
  return seqs;
}

TEST(MpiLogits, ProcessesGiveTheSingleProcessLogits) {
  const auto one_dir = test::temp_dir("mpi_logits_one");
  std::string out, err;
  ASSERT_EQ(test::run_program(logits_command(0, one_dir), &out, &err), 0) << err;
  const auto want = read_logits(one_dir);
  ASSERT_EQ(want.size(), 8u);
  for (int np : {2, 4}) {
    const auto dir = test::temp_dir("mpi_logits_np" + std::to_string(np));
    ASSERT_EQ(test::run_program(logits_command(np, dir), &out, &err), 0) << err;
    const auto got = read_logits(dir);
    ASSERT_EQ(got.size(), want.size());
    float worst = 0;
    size_t differing = 0;
    for (size_t i = 0; i < want.size(); ++i) {
      ASSERT_EQ(got[i].size(), want[i].size()) << "sequence " << i;
      for (size_t j = 0; j < want[i].size(); ++j) {
        worst = std::max(worst, std::abs(got[i][j] - want[i][j]));
        differing += got[i][j] != want[i][j];
      }
    }
    EXPECT_LE(worst, 1e-5f) << np << " processes";
    std::cout << "[ mpi np=" << np << " ] max |diff| vs one process " << worst << ", "
              << differing << " values not bitwise equal\n";
  }
}

// Rank 1 stops (SIGSTOP) as it opens the second exchange of the first MoE layer: rank 0 ends with
// the error naming the collective, the epoch and the rank within the deadline, and the job ends.
TEST(MpiLogits, ARankThatStopsAnsweringEndsTheStepWithANamedError) {
  const auto dir = test::temp_dir("mpi_logits_stall");
  std::string out, err;
  const auto start = std::chrono::steady_clock::now();
  const int rc = test::run_program(
      logits_command(2, dir, {"CLSHARD_TEST_MPI_STOP=1:2", "CLSHARD_MPI_TIMEOUT_MS=2000"}), &out,
      &err);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_NE(rc, 0);
  EXPECT_TRUE(std::regex_search(
      err, std::regex("all_to_all_rows\\(MoE dispatch\\): MPI rank 0 of 2 at epoch 2: rank 1 did "
                      "not answer within 2000 ms")))
      << err;
  EXPECT_FALSE(std::filesystem::exists(dir / "manifest.json"));
  EXPECT_LT(seconds, 40.0);
}

}  // namespace
}  // namespace clshard

#endif  // CLSHARD_HAVE_MPI
