// The batch job end to end through the clshard executable on the tiny default shape: every input
// line gets one output record, bad lines are reported with their line number, and a job killed
// mid-way and rerun ends with exactly what an uninterrupted run writes.
#include <gtest/gtest.h>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <map>
#include <thread>

#include <nlohmann/json.hpp>

#include "tests/test_util.h"

namespace clshard {
namespace {

namespace fs = std::filesystem;

// A tiny checkpoint made once per test process.
fs::path tiny_checkpoint() {
  static fs::path dir = [] {
    auto d = test::temp_dir("batch_job_model");
    std::string err;
    if (test::run_clshard({"make-model", "--preset", "llama3-tiny", "--out", d.string()}, nullptr,
                          &err) != 0)
      throw std::runtime_error("make-model failed: " + err);
    return d;
  }();
  return dir;
}

fs::path write_job(const std::string& name, const std::vector<std::string>& lines,
                   const std::string& extra_yaml = "") {
  auto dir = test::temp_dir(name);
  std::ofstream in(dir / "prompts.jsonl");
  for (const auto& l : lines) in << l << "\n";
  std::ofstream(dir / "deploy.yaml") << "model:\n  path: " << tiny_checkpoint().string()
                                     << "\ndevices:\n  type: cpu\nkv_cache:\n  page_size: 16\n"
                                     << "batch:\n  max_batch_size: 4\n"
                                     << "  max_batch_input_tokens: 64\n"
                                     << "sampling:\n  temperature: 0\n  max_tokens: 8\n"
                                     << extra_yaml << "job:\n  input: prompts.jsonl\n"
                                     << "  output: out/completions.jsonl\n";
  return dir;
}

std::vector<nlohmann::json> read_records(const fs::path& p) {
  std::vector<nlohmann::json> r;
  std::ifstream in(p);
  std::string line;
  while (std::getline(in, line))
    if (!line.empty()) r.push_back(nlohmann::json::parse(line));
  return r;
}

TEST(BatchJob, EveryLineGetsARecordAndBadLinesAreReported) {
  auto dir = write_job(
      "job_basic",
      {R"({"id": "a", "prompt": "Hello there, how are you?"})",
       R"({"id": "b", "prompt_token_ids": [1, 2, 3, 4, 5], "max_tokens": 5})",
       R"({this is not json)",
       R"({"custom_id": "c", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 6}})",
       R"({"id": "d", "prompt_token_ids": [1, 2, 900]})",
       R"({"id": "e", "prompt": "Tell me a story.", "temperature": 0.7, "seed": 3})"});
  std::string out, err;
  ASSERT_EQ(test::run_clshard({"run", (dir / "deploy.yaml").string()}, &out, &err), 0) << err;
  auto recs = read_records(dir / "out" / "completions.jsonl");
  ASSERT_EQ(recs.size(), 6u) << err;
  EXPECT_EQ(recs[0]["id"], "a");
  EXPECT_EQ(recs[0]["completion_tokens"], recs[0]["token_ids"].size());
  EXPECT_GT(recs[0]["prompt_tokens"].get<int>(), 5);
  EXPECT_EQ(recs[1]["id"], "b");
  EXPECT_LE(recs[1]["token_ids"].size(), 5u);
  EXPECT_EQ(recs[1]["prompt_tokens"], 5);
  EXPECT_EQ(recs[2]["line"], 3);
  EXPECT_TRUE(recs[2].contains("error"));
  EXPECT_EQ(recs[3]["custom_id"], "c");
  EXPECT_EQ(recs[3]["response"]["status_code"], 200);
  EXPECT_EQ(recs[4]["id"], "d");
  EXPECT_NE(recs[4]["error"].get<std::string>().find("outside the vocabulary"), std::string::npos)
      << recs[4];
  EXPECT_EQ(recs[5]["id"], "e");
  EXPECT_NE(err.find("done: "), std::string::npos) << "closing summary missing: " << err;
}

TEST(BatchJob, KilledJobResumesToTheSameResult) {
  std::vector<std::string> lines;
  for (int i = 0; i < 48; ++i)
    lines.push_back(R"({"id": "r)" + std::to_string(i) + R"(", "prompt_token_ids": [)" +
                    std::to_string(i % 400 + 1) + ", 7, " + std::to_string(i * 3 % 500 + 1) +
                    R"(], "max_tokens": 120})");
  // The reference: one uninterrupted run.
  auto ref_dir = write_job("job_ref", lines, "");
  std::string out, err;
  ASSERT_EQ(test::run_clshard({"run", (ref_dir / "deploy.yaml").string()}, &out, &err), 0) << err;
  auto want = read_records(ref_dir / "out" / "completions.jsonl");
  ASSERT_EQ(want.size(), lines.size());

  // Kill a second run once it has written some records, then rerun it.
  auto dir = write_job("job_kill", lines, "");
  const auto output = dir / "out" / "completions.jsonl";
  pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    freopen("/dev/null", "w", stderr);
    execl(CLSHARD_EXE, CLSHARD_EXE, "run", (dir / "deploy.yaml").c_str(), (char*)nullptr);
    _exit(127);
  }
  size_t seen = 0;
  for (int i = 0; i < 3000 && seen < 3; ++i) {  // up to 30 s for the first records
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    seen = fs::exists(output) ? read_records(output).size() : 0;
  }
  kill(pid, SIGKILL);
  int status = 0;
  waitpid(pid, &status, 0);
  const size_t before = read_records(output).size();
  ASSERT_GT(before, 0u);
  ASSERT_LT(before, lines.size()) << "the job finished before it could be killed";
  ASSERT_EQ(test::run_clshard({"run", (dir / "deploy.yaml").string()}, &out, &err), 0) << err;
  EXPECT_NE(err.find("already done"), std::string::npos) << err;
  auto got = read_records(output);
  ASSERT_EQ(got.size(), lines.size()) << "lost or duplicated records";
  std::map<std::string, nlohmann::json> by_id;
  for (auto& r : got) {
    EXPECT_FALSE(by_id.count(r["id"].get<std::string>())) << "duplicate " << r["id"];
    by_id[r["id"].get<std::string>()] = r;
  }
  for (auto& w : want) {
    auto& g = by_id.at(w["id"].get<std::string>());
    EXPECT_EQ(g["token_ids"], w["token_ids"]) << w["id"];
    EXPECT_EQ(g["finish_reason"], w["finish_reason"]) << w["id"];
  }
}

}  // namespace
}  // namespace clshard

namespace clshard {
namespace {

TEST(BatchJob, ModelDtypeMustMatchTheCheckpoint) {
  auto dir = write_job("job_dtype", {R"({"id": "a", "prompt_token_ids": [1, 2]})"});
  std::string yaml;
  {
    std::ifstream in(dir / "deploy.yaml");
    yaml.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  yaml.replace(yaml.find("model:\n"), 7, "model:\n  dtype: fp8\n");
  std::ofstream(dir / "deploy.yaml") << yaml;
  std::string out, err;
  EXPECT_EQ(test::run_clshard({"run", (dir / "deploy.yaml").string()}, &out, &err), 1);
  EXPECT_NE(err.find("deploy.yaml:2: model.dtype: fp8 asked, but"), std::string::npos) << err;
  EXPECT_NE(err.find("holds f32 weights"), std::string::npos) << err;
}

}  // namespace
}  // namespace clshard

namespace clshard {
namespace {

// The whole path from a deployment file to DeepSeek-V3 over two devices (data-parallel attention,
// expert-parallel MoE, FP8 weights with quantized activations): the same completions as one
// device.
TEST(BatchJob, DeepSeekOnTwoDevicesFromYamlEqualsOneDevice) {
  auto model = test::temp_dir("job_dsv3_model");
  std::string out, err;
  ASSERT_EQ(test::run_clshard({"make-model", "--preset", "dsv3-tiny", "--dtype", "fp8", "--out",
                               model.string()},
                              &out, &err),
            0)
      << err;
  std::vector<std::string> lines;
  for (int i = 0; i < 7; ++i)
    lines.push_back(R"({"id": "q)" + std::to_string(i) + R"(", "prompt_token_ids": [)" +
                    std::to_string(i * 11 % 200 + 1) + ", 5, " + std::to_string(i * 29 % 300 + 2) +
                    R"(], "max_tokens": 9})");
  auto run = [&](const std::string& name, const std::string& parallel) {
    auto dir = test::temp_dir(name);
    std::ofstream in(dir / "prompts.jsonl");
    for (const auto& l : lines) in << l << "\n";
    in.close();
    std::ofstream(dir / "deploy.yaml")
        << "model:\n  path: " << model.string() << "\n  fp8_activations: fp8\n" << parallel
        << "kv_cache:\n  page_size: 16\nbatch:\n  max_batch_size: 4\nsampling:\n"
        << "  temperature: 0\njob:\n  input: prompts.jsonl\n  output: out.jsonl\n";
    std::string o, e;
    EXPECT_EQ(test::run_clshard({"run", (dir / "deploy.yaml").string()}, &o, &e), 0) << e;
    return read_records(dir / "out.jsonl");
  };
  auto one = run("job_dsv3_one", "devices:\n  type: cpu\n");
  auto two = run("job_dsv3_two",
                 "devices:\n  type: cpu\n  split: \"2\"\nparallel:\n  data: 2\n  expert: 2\n");
  ASSERT_EQ(one.size(), lines.size());
  ASSERT_EQ(two.size(), lines.size());
  for (size_t i = 0; i < lines.size(); ++i) {
    EXPECT_EQ(two[i]["id"], one[i]["id"]);
    EXPECT_EQ(two[i]["token_ids"], one[i]["token_ids"]) << one[i]["id"];
    EXPECT_EQ(two[i]["token_ids"].size(), 9u);
  }
}

}  // namespace
}  // namespace clshard

namespace clshard {
namespace {

// The default job (README command 1, configs/dsv3-mtp-cpu.yaml: the bundled trained checkpoint
// with MTP speculation) through the executable: every prompt gets a record, the summary reports
// accepted drafts, and the greedy records equal the same job without speculation (the two sampled
// prompts too: acceptance draws what plain sampling draws for the same seed).
TEST(BatchJob, DefaultJobWithMtpEqualsPlainDecoding) {
  const auto cfg = std::filesystem::path(CLSHARD_SOURCE_DIR) / "configs" / "dsv3-mtp-cpu.yaml";
  std::string text;
  {
    std::ifstream in(cfg);
    text.assign(std::istreambuf_iterator<char>(in), {});
  }
  auto run = [&](const std::string& name, bool speculative) {
    auto dir = test::temp_dir(name);
    std::string yaml = text;
    auto replace = [&](const std::string& from, const std::string& to) {
      const size_t at = yaml.find(from);
      ASSERT_NE(at, std::string::npos) << from;
      yaml.replace(at, from.size(), to);
    };
    replace("path: models/dsv3-mtp-trained", "path: " + test::default_job_model().string());
    replace("input: prompts/english-prompts.jsonl",
            "input: " + (cfg.parent_path() / "prompts" / "english-prompts.jsonl").string());
    replace("output: ../.cache/out/english-completions.jsonl", "output: out.jsonl");
    if (!speculative) replace("  method: mtp\n  num_speculative_tokens: 2\n", "  method: none\n");
    std::ofstream(dir / "deploy.yaml") << yaml;
    std::string o, e;
    EXPECT_EQ(test::run_clshard({"run", (dir / "deploy.yaml").string()}, &o, &e), 0) << e;
    return std::pair{read_records(dir / "out.jsonl"), e};
  };
  const auto [spec, spec_log] = run("job_default_mtp", true);
  const auto [plain, plain_log] = run("job_default_plain", false);
  ASSERT_EQ(spec.size(), 12u);
  ASSERT_EQ(plain.size(), 12u);
  for (size_t i = 0; i < spec.size(); ++i) {
    EXPECT_EQ(spec[i]["id"], plain[i]["id"]);
    EXPECT_EQ(spec[i]["token_ids"], plain[i]["token_ids"]) << spec[i]["id"];
    EXPECT_EQ(spec[i]["text"], plain[i]["text"]);
  }
  EXPECT_NE(spec_log.find("speculative: drafted "), std::string::npos) << spec_log;
  EXPECT_EQ(plain_log.find("speculative: drafted "), std::string::npos) << plain_log;
}

}  // namespace
}  // namespace clshard
