// DeepSeek-V3 DP + EP with one rank per process over MPI (`mpirun -np N clshard logits --mpi`,
// `mpirun -np 2 clshard run` with cluster.transport: mpi) against the same work in one process, on
// the shared grouped-FP8 reference checkpoint (the ragged8 sequences); and a rank that stops
// answering mid-step. Built when CMake found OpenMPI.
#ifdef CLSHARD_HAVE_MPI

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <regex>

#include <nlohmann/json.hpp>

#include "runtime/engine/mpi_steps.h"
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
    // The sums run in the same order as in one process (slot-order combine, rank-order gather).
    EXPECT_EQ(differing, 0u) << np << " processes";
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

// N copies of a one-process run under mpirun would race on the same files: an error says what to set.
TEST(MpiLogits, MpirunWithoutMpiInTheDeploymentIsAnError) {
  const auto dir = test::temp_dir("mpi_logits_no_flag");
  auto argv = logits_command(2, dir);
  argv.erase(std::find(argv.begin(), argv.end(), "--mpi"));
  std::string out, err;
  EXPECT_NE(test::run_program(argv, &out, &err), 0);
  EXPECT_NE(err.find("mpirun started 2 processes, but the deployment runs in one (transport: "
                     "local); set cluster.transport: mpi (or --mpi with --model)"),
            std::string::npos)
      << err;
}

// Rank 1 is killed (SIGKILL) as it opens the first MoE dispatch: OpenMPI ends the whole job at
// once (no rank is left waiting), rank 0 writes nothing.
TEST(MpiLogits, AKilledRankEndsTheJob) {
  const auto dir = test::temp_dir("mpi_logits_killed");
  std::string out, err;
  const auto start = std::chrono::steady_clock::now();
  const int rc = test::run_program(
      logits_command(2, dir, {"CLSHARD_TEST_MPI_STOP=1:2:kill", "CLSHARD_MPI_TIMEOUT_MS=2000"}),
      &out, &err);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_NE(rc, 0);
  EXPECT_TRUE(std::regex_search(err, std::regex("process rank 1 .* exited on signal 9"))) << err;
  EXPECT_FALSE(std::filesystem::exists(dir / "manifest.json"));
  EXPECT_LT(seconds, 40.0);
}

// The batch job over 2 processes writes the completions the same job writes in one process on 2
// sub-devices (greedy and sampled requests alike), and the serialized steps round-trip.
TEST(MpiRun, BatchJobWritesTheSameCompletionsAsOneProcess) {
  const auto dir = test::temp_dir("mpi_run");
  std::ofstream(dir / "prompts.jsonl")
      << R"({"id": "a", "prompt_token_ids": [35, 171, 486, 429]})" "\n"
      << R"({"id": "b", "prompt_token_ids": [455, 121, 348, 488, 371, 485], "max_tokens": 5})" "\n"
      << R"({"id": "c", "prompt_token_ids": [7, 8, 9]})" "\n"
      << R"({"id": "d", "prompt_token_ids": [100, 200, 300, 400, 401, 402, 403]})" "\n"
      << R"({"id": "e", "prompt_token_ids": [12], "temperature": 0.8, "seed": 5})" "\n";
  for (std::string transport : {"local", "mpi"}) {
    std::ofstream(dir / (transport + ".yaml"))
        << "model:\n  path: "
        << (test::reference_dir() / "ckpt" / "deepseek-v3-tiny-grouped-fp8").string()
        << "\ndevices:\n  type: cpu\n" << (transport == "local" ? "  split: 2\n" : "")
        << "parallel:\n  data: 2\n  expert: 2\ncluster:\n  transport: " << transport
        << "\nkv_cache:\n  page_size: 16\nbatch:\n  max_batch_size: 4\n"
        << "  max_batch_input_tokens: 64\nsampling:\n  temperature: 0\n  max_tokens: 8\n"
        << "job:\n  input: prompts.jsonl\n  output: out_" << transport << "/completions.jsonl\n";
  }
  std::string out, err;
  ASSERT_EQ(test::run_clshard({"run", (dir / "local.yaml").string()}, &out, &err), 0) << err;
  std::vector<std::string> argv = {"env", "OMPI_ALLOW_RUN_AS_ROOT=1",
                                   "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1", CLSHARD_MPIRUN,
                                   "--oversubscribe", "--allow-run-as-root", "-np", "2",
                                   CLSHARD_EXE, "run", (dir / "mpi.yaml").string()};
  ASSERT_EQ(test::run_program(argv, &out, &err), 0) << err;
  auto slurp = [](const std::filesystem::path& p) {
    std::ifstream in(p);
    return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  };
  const std::string want = slurp(dir / "out_local" / "completions.jsonl");
  EXPECT_EQ(std::count(want.begin(), want.end(), '\n'), 5);
  EXPECT_EQ(slurp(dir / "out_mpi" / "completions.jsonl"), want);
}

TEST(MpiRun, StepsRoundTrip) {
  StepInputs s;
  s.tokens = {5, 6, 7};
  s.input_row_offsets = {0, 2, 3};
  s.cache_lengths = {4, 0};
  s.lookup_table = {1, 9, 2, 9};
  s.pages_per_row = 2;
  s.return_logits = ReturnLogits::Variable;
  s.return_n_logits = 2;
  s.logits_per_row = {2, 1};
  s.return_hidden = ReturnHidden::SelectedLayers;
  s.hidden_layers = {0, 3};
  s.data_parallel_splits = {0, 1, 2};
  const StepInputs t = deserialize_step(serialize_step(s));
  EXPECT_EQ(t.tokens, s.tokens);
  EXPECT_EQ(t.input_row_offsets, s.input_row_offsets);
  EXPECT_EQ(t.cache_lengths, s.cache_lengths);
  EXPECT_EQ(t.lookup_table, s.lookup_table);
  EXPECT_EQ(t.pages_per_row, s.pages_per_row);
  EXPECT_EQ(t.return_logits, s.return_logits);
  EXPECT_EQ(t.return_n_logits, s.return_n_logits);
  EXPECT_EQ(t.logits_per_row, s.logits_per_row);
  EXPECT_EQ(t.return_hidden, s.return_hidden);
  EXPECT_EQ(t.hidden_layers, s.hidden_layers);
  EXPECT_EQ(t.data_parallel_splits, s.data_parallel_splits);
}

}  // namespace
}  // namespace clshard

#endif  // CLSHARD_HAVE_MPI
