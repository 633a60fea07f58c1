// The deployments over MPI against the same work in one process: DeepSeek-V3 DP + EP with one
// rank per process (`mpirun -np N clshard logits --mpi`, `mpirun -np 2 clshard run` with
// cluster.transport: mpi) and with 2 sub-devices in each of 2 processes, on the shared grouped-FP8
// reference checkpoint (the ragged8 and long sequences); Llama 3 data- and tensor-parallel over 2
// processes on the shared Llama reference cases; the batch job; a rank that stops answering or is
// killed mid-step, and the rerun of a killed job. Built when CMake found OpenMPI.
#ifdef CLSHARD_HAVE_MPI

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <map>
#include <regex>
#include <sstream>

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

// The sequences of a shared reference case as --tokens arguments.
std::vector<std::string> case_tokens(const std::string& id) {
  std::vector<std::string> args;
  for (const auto& c : test::reference_index()["cases"]) {
    if (c["id"] != id) continue;
    for (const auto& s : c["sequences"]) {
      args.push_back("--tokens");
      args.push_back(join(s["tokens"].get<std::vector<int32_t>>()));
    }
  }
  if (args.empty()) throw std::runtime_error("no reference case " + id);
  return args;
}

// `env ... [mpirun ... -np np] clshard args...` (np = 0: one process).
std::vector<std::string> command(int np, const std::vector<std::string>& args,
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
  argv.insert(argv.end(), args.begin(), args.end());
  return argv;
}

// The environment of a process whose kernel tuning (a tuning file in its own kernel cache) turns
// the packed GEMM off on this machine's device (dense GEMMs and grouped experts). From
// gemm_bf16_packed_rows rows (128) the bf16 weights' GEMM is the packed one, below them the tiles,
// which sum in another order (README): a data-parallel replica holds a part of a step's rows and
// can take the other GEMM than one device over the whole step, so those runs agree within a
// tolerance. With the tiles at every row count, the route a piece takes (in process, over MPI) must
// leave one device's bits.
std::string tiles_only_env(const std::filesystem::path& dir) {
  const DeviceInfo& info = test::default_device().info();
  std::filesystem::create_directories(dir);
  const nlohmann::json doc = {{"entries",
                               {{{"vendor", info.vendor},
                                 {"name", info.name},
                                 {"tuning",
                                  {{"gemm_bf16_packed_rows", 0},
                                   {"moe_bf16_packed_rows", 0},
                                   {"moe_fp8_packed_rows", 0}}}}}}};
  std::ofstream(dir / "tuning.json") << doc.dump();
  return "CLSHARD_KERNEL_CACHE=" + dir.string();
}

std::filesystem::path checkpoint(const std::string& name) {
  return test::reference_dir() / "ckpt" / name;
}

// A deployment of `ckpt` on CPU devices (`devices_extra`: more keys of devices:) with the given
// parallel: keys, over MPI or in process.
std::filesystem::path write_deployment(const std::filesystem::path& dir, const std::string& name,
                                       const std::string& ckpt, const std::string& parallel,
                                       bool mpi, const std::string& devices_extra = "",
                                       const std::string& more = "") {
  const auto path = dir / (name + ".yaml");
  std::ofstream(path) << "model:\n  path: " << checkpoint(ckpt).string()
                      << "\ndevices:\n  type: cpu\n" << devices_extra << "parallel: " << parallel
                      << "\ncluster:\n  transport: " << (mpi ? "mpi" : "local")
                      << "\nkv_cache:\n  page_size: 16\n" << more;
  return path;
}

struct LogitsDiff {
  float worst = 0;
  size_t differing = 0;  // values not bitwise equal
};

LogitsDiff compare_logits(const std::vector<std::vector<float>>& got,
                          const std::vector<std::vector<float>>& want) {
  LogitsDiff d;
  EXPECT_EQ(got.size(), want.size());
  for (size_t i = 0; i < std::min(got.size(), want.size()); ++i) {
    EXPECT_EQ(got[i].size(), want[i].size()) << "sequence " << i;
    if (got[i].size() != want[i].size()) continue;
    for (size_t j = 0; j < want[i].size(); ++j) {
      d.worst = std::max(d.worst, std::abs(got[i][j] - want[i][j]));
      d.differing += got[i][j] != want[i][j];
    }
  }
  return d;
}

// `clshard logits` of a reference case: args name the model (--model DIR or a deployment file).
std::vector<std::vector<float>> case_logits(int np, std::vector<std::string> args,
                                            const std::string& case_id,
                                            const std::filesystem::path& out,
                                            const std::vector<std::string>& env = {}) {
  args.insert(args.begin(), "logits");
  for (std::string a : {"--page-size", "16", "--out"}) args.push_back(a);
  args.push_back(out.string());
  const auto tokens = case_tokens(case_id);
  args.insert(args.end(), tokens.begin(), tokens.end());
  std::string o, err;
  const int rc = test::run_program(command(np, args, env), &o, &err);
  EXPECT_EQ(rc, 0) << err;
  if (rc != 0) return {};
  return read_logits(out);
}

TEST(MpiLogits, ProcessesGiveTheSingleProcessLogits) {
  // With the tiles at every row count (tiles_only_env): bitwise, the sums running in the same
  // order as in one process (slot-order combine, rank-order gather). With the device's own tuning
  // (the packed GEMM from 128 rows, which ragged8's 8 rows pass together and not all parts of
  // them): within 1e-5.
  const std::string tiles = tiles_only_env(test::temp_dir("mpi_logits_tiles_cache"));
  for (const bool bitwise : {true, false}) {
    const std::vector<std::string> env =
        bitwise ? std::vector<std::string>{tiles} : std::vector<std::string>{};
    const auto one_dir = test::temp_dir("mpi_logits_one");
    std::string out, err;
    ASSERT_EQ(test::run_program(logits_command(0, one_dir, env), &out, &err), 0) << err;
    const auto want = read_logits(one_dir);
    ASSERT_EQ(want.size(), 8u);
    for (int np : {2, 4}) {
      const auto dir = test::temp_dir("mpi_logits_np" + std::to_string(np));
      ASSERT_EQ(test::run_program(logits_command(np, dir, env), &out, &err), 0) << err;
      const LogitsDiff d = compare_logits(read_logits(dir), want);
      EXPECT_LE(d.worst, 1e-5f) << np << " processes";
      if (bitwise) {
        EXPECT_EQ(d.differing, 0u) << np << " processes";
      }
      std::cout << "[ mpi np=" << np << (bitwise ? ", tiles only" : "")
                << " ] max |diff| vs one process " << d.worst << ", " << d.differing
                << " values not bitwise equal\n";
    }
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

// Two processes of 2 sub-devices each (devices.split: 2 within each rank; the topology spans 4
// devices over 2 processes): DeepSeek-V3 DP 4 + EP 4 gives one device's logits on ragged8 and
// long within 1e-5, and with the tiles at every row count (tiles_only_env) bitwise: the sums run
// in the same order (each token's expert outputs combined in slot order on its own device, logits
// gathered in rank order), whichever route a piece took (in process between the sub-devices of a
// process, MPI between the processes).
TEST(MpiLogits, TwoProcessesOfTwoSubDevicesGiveOneDevicesLogits) {
  const auto dir = test::temp_dir("mpi_2x2");
  const std::string ckpt = "deepseek-v3-tiny-grouped-fp8";
  const auto yaml = write_deployment(dir, "dp4ep4", ckpt, "{data: 4, expert: 4}", true,
                                     "  split: 2\n");
  const std::string tiles = tiles_only_env(dir / "tiles_cache");
  for (const bool bitwise : {true, false}) {
    const std::vector<std::string> env =
        bitwise ? std::vector<std::string>{tiles} : std::vector<std::string>{};
    for (std::string id : {"ragged8", "long"}) {
      const std::string case_id = ckpt + "/" + id;
      const auto want =
          case_logits(0, {"--model", checkpoint(ckpt).string()}, case_id, dir / (id + "_one"), env);
      ASSERT_FALSE(want.empty());
      const auto got = case_logits(2, {yaml.string()}, case_id, dir / (id + "_2x2"), env);
      const LogitsDiff d = compare_logits(got, want);
      EXPECT_LE(d.worst, 1e-5f) << case_id;
      if (bitwise) {
        EXPECT_EQ(d.differing, 0u) << case_id;
      }
      std::cout << "[ mpi 2x2 " << case_id << (bitwise ? ", tiles only" : "")
                << " ] max |diff| vs one device " << d.worst << ", " << d.differing
                << " values not bitwise equal\n";
    }
  }
}

// Llama 3 over 2 processes, data-parallel (one replica each) and tensor-parallel (heads, MLP
// columns and vocabulary split, allreduce and the logits columns over MPI): one device's logits
// within 1e-4 on the shared Llama reference cases (ragged8 and long).
TEST(MpiLogits, LlamaDataAndTensorParallelGiveOneDevicesLogits) {
  const auto dir = test::temp_dir("mpi_llama");
  for (std::string case_id : {"llama3-tiny-bf16/ragged8", "llama3-tiny-rope64-bf16/long"}) {
    const std::string ckpt = case_id.substr(0, case_id.find('/'));
    const std::string tag = ckpt.substr(ckpt.size() - 9);
    const auto want = case_logits(0, {"--model", checkpoint(ckpt).string()}, case_id,
                                  dir / (tag + "_one"));
    ASSERT_FALSE(want.empty());
    for (std::string layout : {"data", "tensor"}) {
      const auto yaml =
          write_deployment(dir, tag + "_" + layout, ckpt, "{" + layout + ": 2}", true);
      const auto got = case_logits(2, {yaml.string()}, case_id, dir / (tag + "_" + layout));
      const LogitsDiff d = compare_logits(got, want);
      EXPECT_LE(d.worst, 1e-4f) << case_id << ", " << layout << " parallel";
      std::cout << "[ mpi llama " << layout << ": 2, " << case_id << " ] max |diff| vs one "
                << "device " << d.worst << ", " << d.differing << " values not bitwise equal\n";
    }
  }
}

std::string slurp(const std::filesystem::path& p) {
  std::ifstream in(p);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// The lines of a file, sorted (a resumed job writes its records in another order).
std::vector<std::string> sorted_lines(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string l; std::getline(in, l);) lines.push_back(l);
  std::sort(lines.begin(), lines.end());
  return lines;
}

// Greedy and seeded sampled requests for the tiny Llama checkpoints (vocabulary 512).
void write_llama_prompts(const std::filesystem::path& file, int n) {
  std::ofstream out(file);
  for (int i = 0; i < n; ++i) {
    out << "{\"id\": \"r" << i << "\", \"prompt_token_ids\": [" << 3 + i * 7 % 500 << ", "
        << 11 + i * 13 % 480 << ", " << 29 + i * 5 % 400 << "]";
    if (i % 3 == 1) out << ", \"temperature\": 0.9, \"seed\": " << 40 + i;
    if (i % 3 == 2) out << ", \"temperature\": 0.7, \"top_p\": 0.9, \"seed\": " << 7 * i;
    out << "}\n";
  }
}

const char* kLlamaJob =
    "batch:\n  max_batch_size: 3\n  max_batch_input_tokens: 64\nsampling:\n  temperature: 0\n"
    "  max_tokens: 10\njob:\n  input: prompts.jsonl\n  output: out/completions.jsonl\n";

// The Llama batch job over 2 processes, data- and tensor-parallel, writes the completions the same
// layout writes in one process on 2 sub-devices (greedy and seeded sampled requests).
TEST(MpiRun, LlamaBatchJobWritesTheSameCompletionsAsOneProcess) {
  for (std::string layout : {"data", "tensor"}) {
    const auto dir = test::temp_dir("mpi_run_llama_" + layout);
    write_llama_prompts(dir / "prompts.jsonl", 7);
    std::filesystem::create_directories(dir / "local");
    std::filesystem::create_directories(dir / "mpi");
    std::filesystem::copy_file(dir / "prompts.jsonl", dir / "local" / "prompts.jsonl");
    std::filesystem::copy_file(dir / "prompts.jsonl", dir / "mpi" / "prompts.jsonl");
    const std::string parallel = "{" + layout + ": 2}";
    const auto local = write_deployment(dir / "local", "job", "llama3-tiny-bf16", parallel, false,
                                        "  split: 2\n", kLlamaJob);
    const auto mpi =
        write_deployment(dir / "mpi", "job", "llama3-tiny-bf16", parallel, true, "", kLlamaJob);
    std::string out, err;
    ASSERT_EQ(test::run_program(command(0, {"run", local.string()}), &out, &err), 0) << err;
    ASSERT_EQ(test::run_program(command(2, {"run", mpi.string()}), &out, &err), 0) << err;
    const std::string want = slurp(dir / "local" / "out" / "completions.jsonl");
    EXPECT_EQ(std::count(want.begin(), want.end(), '\n'), 7) << layout;
    EXPECT_EQ(slurp(dir / "mpi" / "out" / "completions.jsonl"), want) << layout;
  }
}

// Llama data-parallel over 2 processes: rank 1 is killed (SIGKILL) as it opens its 14th exchange
// (of 20: one logits gather per step), mid-job. The job ends (mpirun ends rank 0) within the
// deadline; every line already in the output is a whole record (JSON ending in a newline) equal to
// the uninterrupted run's record of that id, some but not all of the 9; the rerun of the same
// command resumes (skips those ids) and ends with the uninterrupted run's records.
TEST(MpiRun, AJobWhoseRankIsKilledResumesToTheUninterruptedOutput) {
  const auto dir = test::temp_dir("mpi_run_killed");
  for (std::string run : {"whole", "killed"}) {
    std::filesystem::create_directories(dir / run);
    write_llama_prompts(dir / run / "prompts.jsonl", 9);
    write_deployment(dir / run, "job", "llama3-tiny-bf16", "{data: 2}", true, "", kLlamaJob);
  }
  const auto job = [&](const std::string& run) {
    return std::vector<std::string>{"run", (dir / run / "job.yaml").string()};
  };
  std::string out, err;
  ASSERT_EQ(test::run_program(command(2, job("whole")), &out, &err), 0) << err;
  const std::string whole = slurp(dir / "whole" / "out" / "completions.jsonl");
  ASSERT_EQ(std::count(whole.begin(), whole.end(), '\n'), 9);
  std::map<std::string, std::string> want;
  for (const auto& line : sorted_lines(whole))
    want[nlohmann::json::parse(line)["id"].get<std::string>()] = line;

  const auto start = std::chrono::steady_clock::now();
  const int rc = test::run_program(
      command(2, job("killed"), {"CLSHARD_TEST_MPI_STOP=1:14:kill", "CLSHARD_MPI_TIMEOUT_MS=3000"}),
      &out, &err);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_NE(rc, 0);
  EXPECT_TRUE(std::regex_search(err, std::regex("process rank 1 .* exited on signal 9"))) << err;
  EXPECT_LT(seconds, 40.0);
  const std::string partial = slurp(dir / "killed" / "out" / "completions.jsonl");
  EXPECT_TRUE(partial.empty() || partial.back() == '\n') << "a torn last line: " << partial;
  const auto finished = sorted_lines(partial);
  EXPECT_GT(finished.size(), 0u) << "nothing finished before the kill: kill later";
  EXPECT_LT(finished.size(), 9u) << "everything finished before the kill: kill earlier";
  for (const auto& line : finished) {
    const auto id = nlohmann::json::parse(line)["id"].get<std::string>();
    EXPECT_EQ(line, want[id]);
  }
  std::cout << "[ mpi killed rank ] " << finished.size() << " of 9 records finished before the "
            << "kill, job ended after " << seconds << " s\n";

  ASSERT_EQ(test::run_program(command(2, job("killed")), &out, &err), 0) << err;
  EXPECT_NE(err.find("resuming"), std::string::npos) << err;
  EXPECT_EQ(sorted_lines(slurp(dir / "killed" / "out" / "completions.jsonl")),
            sorted_lines(whole));
}

// `clshard generate` over 2 processes (rank 0 drives, rank 1 serves its steps): greedy token ids
// of a Llama data-parallel and a DeepSeek-V3 DP + EP model equal one process's, and speculative
// decoding over MPI is refused with the error naming the key.
TEST(MpiRun, GenerateGivesOneProcessesTokens) {
  const auto dir = test::temp_dir("mpi_generate");
  for (std::string ckpt : {"llama3-tiny-bf16", "deepseek-v3-tiny-grouped-fp8"}) {
    const std::vector<std::string> args = {"generate", "--model", checkpoint(ckpt).string(),
                                           "--tokens", "5,17,300,41", "--tokens", "9,8",
                                           "--max-new-tokens", "6"};
    std::string want, got, err;
    ASSERT_EQ(test::run_program(command(0, args), &want, &err), 0) << err;
    auto mpi_args = args;
    mpi_args.push_back("--mpi");
    ASSERT_EQ(test::run_program(command(2, mpi_args), &got, &err), 0) << err;
    EXPECT_EQ(std::count(want.begin(), want.end(), '\n'), 2) << want;
    EXPECT_EQ(got, want) << ckpt;
  }
  const auto yaml = write_deployment(dir, "spec", "deepseek-v3-tiny-grouped-fp8",
                                     "{data: 2, expert: 2}", true, "",
                                     "speculative:\n  method: mtp\n  num_speculative_tokens: 2\n");
  std::string out, err;
  EXPECT_NE(test::run_program(command(2, {"generate", yaml.string(), "--tokens", "5,6"}), &out,
                              &err),
            0);
  EXPECT_NE(err.find("spec.yaml:11: speculative.method: speculative decoding does not run over "
                     "MPI yet (cluster.transport: mpi)"),
            std::string::npos)
      << err;
}

// `clshard plan` of 2 processes of 2 sub-devices each says so.
TEST(MpiPlan, TwoProcessesOfTwoSubDevices) {
  const auto dir = test::temp_dir("mpi_plan");
  const auto yaml = write_deployment(dir, "dp4ep4", "deepseek-v3-tiny-grouped-fp8",
                                     "{data: 4, expert: 4}", true, "  split: 2\n");
  std::string out, err;
  ASSERT_EQ(test::run_clshard({"plan", yaml.string(), "--device-memory", "1"}, &out, &err), 0)
      << err;
  EXPECT_NE(out.find("layout: 4 devices over 2 MPI rank(s) of 2 sub-devices each (`mpirun -np "
                     "2`; device i below is rank i / 2's sub-device i % 2), data 4, tensor 1, "
                     "expert 4"),
            std::string::npos)
      << out;
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
