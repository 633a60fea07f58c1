// The request features of the batch job (penalties, logprobs, n, ignore_eos): job lines parsed
// with errors naming the field and line, the output record's logprobs and choices, and a job run
// end to end where n choices equal n single requests with the documented seeds.
#include <gtest/gtest.h>

#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include "runtime/engine/batch_io.h"
#include "runtime/engine/deploy_config.h"
#include "runtime/engine/sampling.h"
#include "tests/test_util.h"

namespace clshard {
namespace {

namespace fs = std::filesystem;

BatchInput parse(const std::string& text) { return parse_batch_input(text, SamplingDefaults{}); }

TEST(BatchRequestFeatures, FieldsAreRead) {
  const BatchInput in = parse(
      R"({"id": 1, "prompt": "a", "frequency_penalty": 0.5, "presence_penalty": -1.5,)"
      R"( "repetition_penalty": 1.2, "logprobs": true, "top_logprobs": 4, "n": 3,)"
      R"( "ignore_eos": true, "seed": 7})" "\n"
      R"({"id": 2, "prompt": "b", "logprobs": 5})" "\n"
      R"({"custom_id": "c", "url": "/v1/chat/completions", "body": {"messages":)"
      R"( [{"role": "user", "content": "x"}], "logprobs": true, "top_logprobs": 2, "n": 2}})" "\n");
  ASSERT_TRUE(in.errors.empty()) << in.errors[0].message;
  ASSERT_EQ(in.requests.size(), 3u);
  const SamplingDefaults& a = in.requests[0].sampling;
  EXPECT_EQ(a.frequency_penalty, 0.5f);
  EXPECT_EQ(a.presence_penalty, -1.5f);
  EXPECT_EQ(a.repetition_penalty, 1.2f);
  EXPECT_TRUE(a.logprobs);
  EXPECT_EQ(a.top_logprobs, 4);
  EXPECT_EQ(a.n, 3);
  EXPECT_TRUE(a.ignore_eos);
  // The completions API's integer form: logprobs with that many top tokens.
  EXPECT_TRUE(in.requests[1].sampling.logprobs);
  EXPECT_EQ(in.requests[1].sampling.top_logprobs, 5);
  EXPECT_EQ(in.requests[1].sampling.n, 1);
  EXPECT_EQ(in.requests[2].sampling.top_logprobs, 2);
  EXPECT_EQ(in.requests[2].sampling.n, 2);
}

TEST(BatchRequestFeatures, ErrorsNameTheLineAndTheField) {
  const BatchInput in = parse(
      R"({"id": "ok", "prompt": "a"})" "\n"
      R"({"id": "p", "prompt": "a", "frequency_penalty": 2.5})" "\n"
      R"({"id": "t", "prompt": "a", "logprobs": true, "top_logprobs": 25})" "\n"
      R"({"id": "r", "prompt": "a", "repetition_penalty": 0})" "\n"
      R"({"id": "n", "prompt": "a", "n": 0})" "\n"
      R"({"id": "e", "prompt": "a", "ignore_eos": 1})" "\n"
      R"({"id": "l", "prompt": "a", "logprobs": 21})" "\n"
      R"({"id": "q", "prompt": "a", "top_logprobs": 3})" "\n"
      R"({"custom_id": "b", "body": {"prompt": "a", "presence_penalty": "high"}})" "\n"
      R"({"custom_id": "c", "body": {"prompt": "a", "top_logprobs": 2}})" "\n");
  ASSERT_EQ(in.requests.size(), 1u);
  ASSERT_EQ(in.errors.size(), 9u);
  const std::vector<std::pair<size_t, std::string>> want = {
      {2, "frequency_penalty: expected a number in [-2, 2], got 2.5"},
      {3, "top_logprobs: expected an integer in [0, 20], got 25"},
      {4, "repetition_penalty: expected a number > 0, got 0"},
      {5, "n: expected an integer in [1, 128], got 0"},
      {6, "ignore_eos: expected true or false, got 1"},
      {7, "logprobs: expected true, false or an integer in [0, 20], got 21"},
      {8, "top_logprobs: needs logprobs: true"},
      {9, "body.presence_penalty: expected a number in [-2, 2], got \"high\""},
      {10, "body.top_logprobs: needs body.logprobs: true"},
  };
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(in.errors[i].line, want[i].first);
    EXPECT_EQ(in.errors[i].message, want[i].second);
  }
}

TEST(BatchRequestFeatures, RecordsCarryLogprobsAndChoices) {
  const fs::path dir = test::temp_dir("penalties_batch_records");
  const BatchInput in = parse(
      R"({"id": "a", "prompt": "x"})" "\n"
      R"({"custom_id": "c", "url": "/v1/chat/completions", "body": {"messages":)"
      R"( [{"role": "user", "content": "x"}]}})" "\n"
      R"({"custom_id": "d", "url": "/v1/completions", "body": {"prompt": "x"}})" "\n");
  BatchOutputWriter w(dir / "out.jsonl", in);
  CompletionRecord one;
  one.text = "hi";
  one.token_ids = {5, 6};
  one.prompt_tokens = 1;
  one.completion_tokens = 2;
  one.logprobs = std::vector<RecordLogprobs>{
      {{5, "h", -0.5f}, {{5, "h", -0.5f}, {9, "z", -1.0f}}},
      {{6, "i", -0.25f}, {{6, "i", -0.25f}, {1, "", -2.0f}}}};
  CompletionRecord two = one;
  two.text = "yo";
  two.token_ids = {7};
  two.completion_tokens = 1;
  two.logprobs = std::vector<RecordLogprobs>{{{7, "yo", -0.125f}, {}}};
  CompletionRecord both = one;
  both.choices = {one, two};
  both.completion_tokens = 3;
  w.complete("a", both);
  w.complete("c", both);
  w.complete("d", two);
  std::ifstream f(dir / "out.jsonl");
  std::string line;
  std::vector<nlohmann::json> recs;
  while (std::getline(f, line)) recs.push_back(nlohmann::json::parse(line));
  ASSERT_EQ(recs.size(), 3u);
  EXPECT_EQ(recs[0]["logprobs"].dump(),
            R"([{"logprob":-0.5,"token":"h","token_id":5,"top_logprobs":[{"logprob":-0.5,)"
            R"("token":"h","token_id":5},{"logprob":-1.0,"token":"z","token_id":9}]},)"
            R"({"logprob":-0.25,"token":"i","token_id":6,"top_logprobs":[{"logprob":-0.25,)"
            R"("token":"i","token_id":6},{"logprob":-2.0,"token":"","token_id":1}]}])");
  ASSERT_EQ(recs[0]["choices"].size(), 2u);
  EXPECT_EQ(recs[0]["completion_tokens"], 3);
  EXPECT_EQ(recs[0]["choices"][1]["text"], "yo");
  EXPECT_EQ(recs[0]["choices"][1]["index"], 1);
  EXPECT_EQ(recs[0]["choices"][1]["token_ids"], nlohmann::json::array({7}));
  EXPECT_EQ(recs[0]["choices"][1]["logprobs"][0]["logprob"], -0.125);
  // OpenAI's chat shape.
  const auto& chat = recs[1]["response"]["body"];
  ASSERT_EQ(chat["choices"].size(), 2u);
  EXPECT_EQ(chat["choices"][0]["logprobs"]["content"][1].dump(),
            R"({"bytes":[105],"logprob":-0.25,"token":"i","top_logprobs":[{"bytes":[105],)"
            R"("logprob":-0.25,"token":"i"},{"bytes":[],"logprob":-2.0,"token":""}]})");
  EXPECT_EQ(chat["choices"][1]["message"]["content"], "yo");
  EXPECT_EQ(chat["usage"]["completion_tokens"], 3);
  // OpenAI's completions shape.
  EXPECT_EQ(recs[2]["response"]["body"]["choices"][0]["logprobs"].dump(),
            R"({"text_offset":[0],"token_logprobs":[-0.125],"tokens":["yo"],"top_logprobs":[{}]})");
}

TEST(DeploySamplingKeys, PenaltiesAndLogprobsModeAreReadAndChecked) {
  const DeployConfig c = parse_deploy_config(
      "model: {path: m}\nsampling:\n  frequency_penalty: 0.25\n  presence_penalty: -0.5\n"
      "  repetition_penalty: 1.1\n  logprobs_mode: processed\n",
      "deploy.yaml");
  EXPECT_EQ(c.sampling.frequency_penalty, 0.25f);
  EXPECT_EQ(c.sampling.presence_penalty, -0.5f);
  EXPECT_EQ(c.sampling.repetition_penalty, 1.1f);
  EXPECT_EQ(c.sampling.logprobs_mode, LogprobsMode::Processed);
  EXPECT_EQ(parse_deploy_config("model: {path: m}\n", "deploy.yaml").sampling.logprobs_mode,
            LogprobsMode::Raw);
  auto error_of = [](const std::string& yaml) -> std::string {
    try {
      parse_deploy_config(yaml, "deploy.yaml");
    } catch (const std::exception& e) {
      return e.what();
    }
    return "";
  };
  EXPECT_EQ(error_of("model: {path: m}\nsampling:\n  presence_penalty: 3\n"),
            "deploy.yaml:3: sampling.presence_penalty: expected a number in [-2, 2], got \"3\"");
  EXPECT_EQ(error_of("model: {path: m}\nsampling:\n  repetition_penalty: -1\n"),
            "deploy.yaml:3: sampling.repetition_penalty: expected a number > 0, got \"-1\"");
  EXPECT_EQ(error_of("model: {path: m}\nsampling:\n  logprobs_mode: cooked\n"),
            "deploy.yaml:3: sampling.logprobs_mode: expected one of raw | processed, got "
            "\"cooked\"");
}

// A tiny checkpoint made once per test process.
fs::path tiny_checkpoint() {
  static fs::path dir = [] {
    auto d = test::temp_dir("penalties_batch_model");
    std::string err;
    if (test::run_clshard({"make-model", "--preset", "llama3-tiny", "--out", d.string()}, nullptr,
                          &err) != 0)
      throw std::runtime_error("make-model failed: " + err);
    return d;
  }();
  return dir;
}

std::vector<nlohmann::json> run_job(const std::string& name,
                                    const std::vector<std::string>& lines) {
  auto dir = test::temp_dir(name);
  std::ofstream in(dir / "prompts.jsonl");
  for (const auto& l : lines) in << l << "\n";
  in.close();
  std::ofstream(dir / "deploy.yaml") << "model:\n  path: " << tiny_checkpoint().string()
                                     << "\ndevices:\n  type: cpu\nkv_cache:\n  page_size: 16\n"
                                     << "batch:\n  max_batch_size: 8\n"
                                     << "  max_batch_input_tokens: 64\n"
                                     << "sampling:\n  temperature: 1.0\n  max_tokens: 8\n"
                                     << "job:\n  input: prompts.jsonl\n"
                                     << "  output: out.jsonl\n";
  std::string out, err;
  EXPECT_EQ(test::run_clshard({"run", (dir / "deploy.yaml").string()}, &out, &err), 0) << err;
  std::vector<nlohmann::json> recs;
  std::ifstream f(dir / "out.jsonl");
  std::string line;
  while (std::getline(f, line)) recs.push_back(nlohmann::json::parse(line));
  return recs;
}

TEST(BatchRequestFeatures, NChoicesEqualSingleRequestsWithTheDocumentedSeeds) {
  const uint64_t seed = 41;
  std::vector<std::string> lines = {
      R"({"id": "n3", "prompt_token_ids": [5, 6, 7, 8], "n": 3, "seed": 41, "logprobs": true,)"
      R"( "top_logprobs": 2, "presence_penalty": 0.5})"};
  for (uint32_t i = 0; i < 3; ++i)
    lines.push_back(R"({"id": "single)" + std::to_string(i) +
                    R"(", "prompt_token_ids": [5, 6, 7, 8], "seed": )" +
                    std::to_string(choice_seed(seed, i)) +
                    R"(, "logprobs": true, "top_logprobs": 2, "presence_penalty": 0.5})");
  const auto recs = run_job("penalties_batch_n", lines);
  ASSERT_EQ(recs.size(), 4u);
  const auto& choices = recs[0]["choices"];
  ASSERT_EQ(choices.size(), 3u) << recs[0];
  size_t total = 0;
  for (size_t i = 0; i < 3; ++i) {
    SCOPED_TRACE(i);
    EXPECT_EQ(choices[i]["token_ids"], recs[1 + i]["token_ids"]);
    EXPECT_EQ(choices[i]["text"], recs[1 + i]["text"]);
    EXPECT_EQ(choices[i]["logprobs"], recs[1 + i]["logprobs"]);
    ASSERT_EQ(choices[i]["logprobs"].size(), choices[i]["token_ids"].size());
    EXPECT_EQ(choices[i]["logprobs"][0]["top_logprobs"].size(), 2u);
    total += choices[i]["token_ids"].size();
  }
  EXPECT_EQ(recs[0]["completion_tokens"], total);
  EXPECT_EQ(recs[0]["token_ids"], choices[0]["token_ids"]);
  // The choices really differ (temperature 1 on a broad distribution).
  EXPECT_NE(choices[0]["token_ids"], choices[1]["token_ids"]);
  EXPECT_NE(choices[1]["token_ids"], choices[2]["token_ids"]);
}

}  // namespace
}  // namespace clshard
