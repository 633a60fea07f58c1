// The batch job's files: the input's two shapes and its error records, the output in input order
// with its OpenAI shape, resume after a kill (torn last line, journal), and the progress display.
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>

#include "runtime/engine/batch_io.h"
#include "runtime/engine/progress.h"
#include "tests/test_util.h"

namespace clshard {
namespace {

namespace fs = std::filesystem;

std::string slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

void write_file(const fs::path& p, const std::string& text) { std::ofstream(p, std::ios::binary) << text; }

BatchInput parse(const std::string& text) { return parse_batch_input(text, SamplingDefaults{}); }

// The single error of a one-line input.
std::string error_of(const std::string& line) {
  BatchInput in = parse(line + "\n");
  EXPECT_TRUE(in.requests.empty());
  if (in.errors.size() != 1) return "(" + std::to_string(in.errors.size()) + " errors)";
  EXPECT_EQ(in.errors[0].line, 1u);
  return in.errors[0].message;
}

// ---------------------------------------------------------------------------------------------
// Input

TEST(BatchInput, PlainShapes) {
  SamplingDefaults defaults;
  defaults.temperature = 0.5f;
  defaults.max_tokens = 64;
  defaults.stop = {"###"};
  BatchInput in = parse_batch_input(
      "{\"id\": \"a\", \"prompt\": \"Hello\"}\n"
      "{\"id\": 17, \"prompt_token_ids\": [1, 2, 3], \"temperature\": 0, \"top_k\": 5, \"top_p\": 0.9,"
      " \"min_p\": 0.1, \"seed\": 99, \"max_tokens\": 8, \"stop\": \"\\n\", \"stop_token_ids\": [7]}\n"
      "{\"prompt\": \"no id\", \"top_k\": 0, \"stop\": [], \"temperature\": null}\n"
      "{\"id\": \"chat\", \"messages\": [{\"role\": \"system\", \"content\": \"Be brief.\"},"
      " {\"role\": \"user\", \"content\": [{\"type\": \"text\", \"text\": \"Hi \"}, {\"type\": \"text\", \"text\": \"there\"}]}]}\n",
      defaults);
  ASSERT_TRUE(in.errors.empty()) << in.errors[0].message;
  ASSERT_EQ(in.requests.size(), 4u);

  const BatchRequest& a = in.requests[0];
  EXPECT_EQ(a.id, "a");
  EXPECT_FALSE(a.id_is_number);
  EXPECT_EQ(a.line, 1u);
  EXPECT_EQ(a.prompt, std::optional<std::string>("Hello"));
  EXPECT_FALSE(a.prompt_token_ids || a.messages || a.openai_shape);
  EXPECT_EQ(a.sampling, defaults);

  const BatchRequest& b = in.requests[1];
  EXPECT_EQ(b.id, "17");
  EXPECT_TRUE(b.id_is_number);
  EXPECT_EQ(b.prompt_token_ids, (std::vector<int32_t>{1, 2, 3}));
  EXPECT_FLOAT_EQ(b.sampling.temperature, 0.0f);
  EXPECT_EQ(b.sampling.top_k, 5);
  EXPECT_FLOAT_EQ(b.sampling.top_p, 0.9f);
  EXPECT_FLOAT_EQ(b.sampling.min_p, 0.1f);
  EXPECT_EQ(b.sampling.seed, 99u);
  EXPECT_EQ(b.sampling.max_tokens, 8);
  EXPECT_EQ(b.sampling.stop, (std::vector<std::string>{"\n"}));
  EXPECT_EQ(b.sampling.stop_token_ids, (std::vector<int32_t>{7}));

  // No id: the line number. top_k 0 is "no top-k"; an empty stop list clears the defaults; null
  // keeps the default.
  const BatchRequest& c = in.requests[2];
  EXPECT_EQ(c.id, "3");
  EXPECT_TRUE(c.id_is_number);
  EXPECT_EQ(c.sampling.top_k, -1);
  EXPECT_TRUE(c.sampling.stop.empty());
  EXPECT_FLOAT_EQ(c.sampling.temperature, 0.5f);

  const BatchRequest& d = in.requests[3];
  ASSERT_TRUE(d.is_chat());
  ASSERT_EQ(d.messages->size(), 2u);
  EXPECT_EQ((*d.messages)[0].role, "system");
  EXPECT_EQ((*d.messages)[0].content, "Be brief.");
  EXPECT_EQ((*d.messages)[1].role, "user");
  EXPECT_EQ((*d.messages)[1].content, "Hi there");
  EXPECT_FALSE(d.openai_shape);
}

TEST(BatchInput, OpenAIShapes) {
  BatchInput in = parse(
      R"({"custom_id": "c1", "method": "POST", "url": "/v1/completions", "body": {"model": "x", "prompt": "Once", "max_tokens": 5, "temperature": 0.2, "top_p": 0.5, "seed": 1, "stop": ["a", "b"], "n": 1, "stream": false, "user": "u"}})"
      "\n"
      R"({"custom_id": "c2", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 7}})"
      "\n"
      R"({"custom_id": "c3", "body": {"prompt": [5, 6, 7]}})"
      "\n");
  ASSERT_TRUE(in.errors.empty()) << in.errors[0].message;
  ASSERT_EQ(in.requests.size(), 3u);
  const BatchRequest& c1 = in.requests[0];
  EXPECT_TRUE(c1.openai_shape);
  EXPECT_EQ(c1.id, "c1");
  EXPECT_EQ(c1.prompt, std::optional<std::string>("Once"));
  EXPECT_EQ(c1.sampling.max_tokens, 5);
  EXPECT_FLOAT_EQ(c1.sampling.temperature, 0.2f);
  EXPECT_FLOAT_EQ(c1.sampling.top_p, 0.5f);
  EXPECT_EQ(c1.sampling.seed, 1u);
  EXPECT_EQ(c1.sampling.stop, (std::vector<std::string>{"a", "b"}));
  const BatchRequest& c2 = in.requests[1];
  ASSERT_TRUE(c2.is_chat());
  EXPECT_EQ((*c2.messages)[0].content, "Hi");
  EXPECT_EQ(c2.sampling.max_tokens, 7);
  // The completions API takes token ids as the prompt.
  EXPECT_EQ(in.requests[2].prompt_token_ids, (std::vector<int32_t>{5, 6, 7}));
}

TEST(BatchInput, LinesAreCountedAsInTheFile) {
  // Blank lines are skipped but counted; CRLF endings and a UTF-8 BOM are accepted; a last line
  // without a newline is read.
  BatchInput in = parse("\xEF\xBB\xBF{\"id\": \"x\", \"prompt\": \"p\"}\r\n\n   \n{\"prompt\": \"q\"}\r\n{\"prompt\": \"r\"}");
  ASSERT_TRUE(in.errors.empty()) << in.errors[0].message;
  ASSERT_EQ(in.requests.size(), 3u);
  EXPECT_EQ(in.requests[0].line, 1u);
  EXPECT_EQ(in.requests[0].prompt, std::optional<std::string>("p"));
  EXPECT_EQ(in.requests[1].line, 4u);
  EXPECT_EQ(in.requests[1].id, "4");
  EXPECT_EQ(in.requests[2].line, 5u);
  EXPECT_EQ(in.requests[2].prompt, std::optional<std::string>("r"));
}

TEST(BatchInput, BadLinesBecomeErrorsAndTheRestGoesOn) {
  BatchInput in = parse(
      "{\"id\": \"ok1\", \"prompt\": \"fine\"}\n"
      "{\"id\": \"broken\", \"prompt\": }\n"
      "{\"id\": \"ok2\", \"prompt\": \"fine\"}\n"
      "{\"id\": \"ok1\", \"prompt\": \"again\"}\n"
      "{\"id\": \"t\", \"prompt\": \"x\", \"temperature\": \"hot\"}\n"
      "{\"prompt\": \"no id, bad top_p\", \"top_p\": 2}\n");
  ASSERT_EQ(in.requests.size(), 2u);
  EXPECT_EQ(in.requests[0].id, "ok1");
  EXPECT_EQ(in.requests[1].id, "ok2");
  ASSERT_EQ(in.errors.size(), 4u);
  EXPECT_EQ(in.errors[0].line, 2u);
  EXPECT_EQ(in.errors[0].id, "");  // unreadable line: no id
  EXPECT_EQ(in.errors[0].message,
            "invalid JSON at column 28: syntax error while parsing value - unexpected '}'; expected '[', '{', or a literal");
  EXPECT_EQ(in.errors[1].line, 4u);
  EXPECT_EQ(in.errors[1].id, "ok1");
  EXPECT_EQ(in.errors[1].message, "id: duplicate id \"ok1\" (first used by line 1)");
  EXPECT_EQ(in.errors[2].line, 5u);
  EXPECT_EQ(in.errors[2].id, "t");
  EXPECT_EQ(in.errors[2].message, "temperature: expected a number >= 0, got \"hot\"");
  EXPECT_EQ(in.errors[3].line, 6u);
  EXPECT_EQ(in.errors[3].id, "");
  EXPECT_EQ(in.errors[3].message, "top_p: expected a number in (0, 1], got 2");
}

TEST(BatchInput, ErrorMessages) {
  EXPECT_EQ(error_of("[1, 2]"), "expected a JSON object, got a list");
  EXPECT_EQ(error_of("{\"id\": 1}"), "no prompt: give one of prompt, prompt_token_ids or messages");
  EXPECT_EQ(error_of("{\"prompt\": \"a\", \"prompt_token_ids\": [1]}"),
            "give only one of prompt, prompt_token_ids, messages");
  EXPECT_EQ(error_of("{\"prompt_token_ids\": []}"), "prompt_token_ids: is empty (a prompt needs at least one token)");
  EXPECT_EQ(error_of("{\"prompt_token_ids\": [1, -4]}"),
            "prompt_token_ids[1]: expected a token id (an integer >= 0), got -4");
  EXPECT_EQ(error_of("{\"prompt_token_ids\": [1, 2.5]}"),
            "prompt_token_ids[1]: expected a token id (an integer >= 0), got 2.5");
  EXPECT_EQ(error_of("{\"prompt_token_ids\": \"1 2\"}"), "prompt_token_ids: expected a list of token ids, got a string");
  EXPECT_EQ(error_of("{\"prompt\": \"\"}"), "prompt: is empty");
  EXPECT_EQ(error_of("{\"prompt\": [1, 2]}"), "prompt: expected a string (one prompt per line), got [1,2]");
  EXPECT_EQ(error_of("{\"id\": 1.5, \"prompt\": \"a\"}"), "id: expected a string or an integer, got 1.5");
  EXPECT_EQ(error_of("{\"id\": \"\", \"prompt\": \"a\"}"), "id: is empty");
  EXPECT_EQ(error_of("{\"prompt\": \"a\", \"max_token\": 5}"),
            "unknown field \"max_token\" (expected: id, prompt, prompt_token_ids, messages, temperature, top_k, "
            "top_p, min_p, seed, max_tokens, stop, stop_token_ids, frequency_penalty, presence_penalty, "
            "repetition_penalty, logprobs, top_logprobs, n, ignore_eos, response_format, regex, lora)");
  EXPECT_EQ(error_of("{\"prompt\": \"a\", \"max_tokens\": 0}"), "max_tokens: expected a positive integer, got 0");
  EXPECT_EQ(error_of("{\"prompt\": \"a\", \"top_k\": 2.0}"),
            "top_k: expected an integer >= -1 (-1 or 0: no top-k), got 2.0");
  EXPECT_EQ(error_of("{\"prompt\": \"a\", \"seed\": -3}"), "seed: expected an integer >= 0, got -3");
  EXPECT_EQ(error_of("{\"prompt\": \"a\", \"temperature\": true}"), "temperature: expected a number >= 0, got true");
  EXPECT_EQ(error_of("{\"prompt\": \"a\", \"min_p\": 1.5}"), "min_p: expected a number in [0, 1], got 1.5");
  EXPECT_EQ(error_of("{\"prompt\": \"a\", \"stop\": [\"x\", 3]}"), "stop[1]: expected a non-empty string, got 3");
  EXPECT_EQ(error_of("{\"prompt\": \"a\", \"stop\": 3}"), "stop: expected a string or a list of strings, got 3");
  EXPECT_EQ(error_of("{\"prompt\": \"a\", \"stop_token_ids\": [\"x\"]}"),
            "stop_token_ids[0]: expected a token id (an integer >= 0), got \"x\"");
  EXPECT_EQ(error_of("{\"messages\": []}"), "messages: is empty");
  EXPECT_EQ(error_of("{\"messages\": [{\"role\": \"user\"}]}"), "messages[0].content: missing");
  EXPECT_EQ(error_of("{\"messages\": [{\"content\": \"x\"}]}"), "messages[0].role: expected a non-empty string, got nothing");
  EXPECT_EQ(error_of("{\"messages\": [{\"role\": \"user\", \"content\": \"x\", \"name\": \"n\"}]}"),
            "messages[0]: unknown field \"name\" (expected: role, content)");
  EXPECT_EQ(error_of("{\"messages\": [{\"role\": \"user\", \"content\": [{\"type\": \"image_url\"}]}]}"),
            "messages[0].content[0]: expected a text part {\"type\": \"text\", \"text\": ...}, got {\"type\":\"image_url\"}");
  EXPECT_EQ(error_of("{\"messages\": \"hi\"}"), "messages: expected a list of {\"role\", \"content\"} objects, got a string");
  // Invalid UTF-8 is invalid JSON.
  EXPECT_EQ(error_of("{\"prompt\": \"\xff\"}").substr(0, 27), "invalid JSON at column 13: ");
}

TEST(BatchInput, OpenAIErrorMessages) {
  EXPECT_EQ(error_of(R"({"body": {"prompt": "a"}})"), "custom_id: missing (the OpenAI batch shape needs one per line)");
  EXPECT_EQ(error_of(R"({"custom_id": 5, "body": {"prompt": "a"}})"), "custom_id: expected a string, got 5");
  EXPECT_EQ(error_of(R"({"custom_id": "c"})"), "body: missing");
  EXPECT_EQ(error_of(R"({"custom_id": "c", "body": []})"), "body: expected an object, got a list");
  EXPECT_EQ(error_of(R"({"custom_id": "c", "method": "GET", "body": {"prompt": "a"}})"), "method: expected \"POST\", got \"GET\"");
  EXPECT_EQ(error_of(R"({"custom_id": "c", "url": "/v1/embeddings", "body": {"prompt": "a"}})"),
            "url: expected \"/v1/completions\" or \"/v1/chat/completions\", got \"/v1/embeddings\"");
  EXPECT_EQ(error_of(R"({"custom_id": "c", "url": "/v1/chat/completions", "body": {"prompt": "a"}})"),
            "body: url /v1/chat/completions needs body.messages");
  EXPECT_EQ(error_of(R"({"custom_id": "c", "url": "/v1/completions", "body": {"messages": [{"role": "user", "content": "a"}]}})"),
            "body: url /v1/completions needs body.prompt (body.messages goes to /v1/chat/completions)");
  EXPECT_EQ(error_of(R"({"custom_id": "c", "body": {"prompt": "a", "n": 200}})"),
            "body.n: expected an integer in [1, 128], got 200");
  EXPECT_EQ(error_of(R"({"custom_id": "c", "body": {"prompt": "a", "stream": true}})"),
            "body.stream: expected false (a batch job does not stream), got true");
  EXPECT_EQ(error_of(R"({"custom_id": "c", "body": {"prompt": "a", "logit_bias": {}}})"),
            "body.logit_bias: unsupported field (supported: prompt, messages, max_completion_tokens, model, "
            "stream, user, temperature, top_k, top_p, min_p, seed, max_tokens, stop, stop_token_ids, "
            "frequency_penalty, presence_penalty, repetition_penalty, logprobs, top_logprobs, n, ignore_eos, "
            "response_format, regex)");
  EXPECT_EQ(error_of(R"({"custom_id": "c", "body": {"prompt": "a", "max_tokens": 3, "max_completion_tokens": 4}})"),
            "body: give max_tokens or max_completion_tokens, not both");
  EXPECT_EQ(error_of(R"({"custom_id": "c", "body": {"prompt": ["a", "b"]}})"),
            "body.prompt: expected a string or a list of token ids (one prompt per line), got [\"a\",\"b\"]");
  EXPECT_EQ(error_of(R"({"custom_id": "c", "body": {}})"),
            "body: no prompt: give one of body.prompt, body.prompt_token_ids or body.messages");
  EXPECT_EQ(error_of(R"({"custom_id": "c", "extra": 1, "body": {"prompt": "a"}})"),
            "unknown field \"extra\" (an OpenAI batch line has custom_id, method, url, body)");
  EXPECT_EQ(error_of(R"({"custom_id": "c", "body": {"prompt": "a", "top_p": 0}})"),
            "body.top_p: expected a number in (0, 1], got 0");
  BatchInput in = parse(R"({"custom_id": "c", "body": {"prompt": "a", "top_p": 0}})" "\n");
  EXPECT_EQ(in.errors[0].id, "c");
  EXPECT_TRUE(in.errors[0].openai_shape);
}

TEST(BatchInput, ImplicitIdsThatCollide) {
  // Line 2 has no id and would take 2, which line 1 already uses; line 4 uses 3, which line 3
  // took as its line number.
  BatchInput in = parse(
      "{\"id\": 2, \"prompt\": \"a\"}\n{\"prompt\": \"b\"}\n{\"prompt\": \"c\"}\n{\"id\": \"3\", \"prompt\": \"d\"}\n");
  ASSERT_EQ(in.requests.size(), 2u);
  EXPECT_EQ(in.requests[0].id, "2");
  EXPECT_EQ(in.requests[1].id, "3");
  EXPECT_EQ(in.requests[1].line, 3u);
  ASSERT_EQ(in.errors.size(), 2u);
  EXPECT_EQ(in.errors[0].line, 2u);
  EXPECT_EQ(in.errors[0].message, "id: none given, and the line number 2 is already the id of line 1");
  EXPECT_EQ(in.errors[1].line, 4u);
  EXPECT_EQ(in.errors[1].message,
            "id: duplicate id \"3\" (first used by line 3, which has no id and took its line number)");
}

TEST(BatchInput, UnreadableFile) {
  fs::path dir = test::temp_dir("batch_input_missing");
  try {
    read_batch_input(dir / "none.jsonl", SamplingDefaults{});
    FAIL() << "expected an error";
  } catch (const std::runtime_error& e) {
    EXPECT_EQ(std::string(e.what()),
              "cannot read the job's input " + (dir / "none.jsonl").string() + ": No such file or directory");
  }
}

// ---------------------------------------------------------------------------------------------
// Output

CompletionRecord record(const std::string& text, std::vector<int32_t> ids, FinishReason why, uint64_t prompt) {
  CompletionRecord r;
  r.text = text;
  r.completion_tokens = ids.size();
  r.token_ids = std::move(ids);
  r.finish_reason = why;
  r.prompt_tokens = prompt;
  return r;
}

const char* kFourRequests =
    "{\"id\": \"a\", \"prompt\": \"1\"}\n"
    "{\"id\": 7, \"prompt\": \"2\"}\n"
    "not json\n"
    "{\"id\": \"c\", \"prompt\": \"3\"}\n"
    "{\"prompt\": \"4\"}\n";

const std::string kLineA =
    R"({"id":"a","line":1,"text":"x","token_ids":[5],"finish_reason":"stop","prompt_tokens":2,"completion_tokens":1})" "\n";
const std::string kLine7 =
    R"({"id":7,"line":2,"text":"yy","token_ids":[6,6],"finish_reason":"length","prompt_tokens":3,"completion_tokens":2})" "\n";
const std::string kLine3 =
    R"({"id":null,"line":3,"error":"invalid JSON at column 2: syntax error while parsing value - invalid literal; last read: 'no'"})" "\n";
const std::string kLineC = R"j({"id":"c","line":4,"error":"prompt longer than model.max_length (4096)"})j" "\n";
const std::string kLine5 =
    R"({"id":5,"line":5,"text":"","token_ids":[],"finish_reason":"stop","prompt_tokens":1,"completion_tokens":0})" "\n";

TEST(BatchOutput, WritesInInputOrderWhateverTheOrderOfCompletion) {
  fs::path dir = test::temp_dir("batch_output_order");
  fs::path out = dir / "sub" / "out.jsonl";  // directories are created
  BatchInput in = parse(kFourRequests);
  ASSERT_EQ(in.requests.size(), 4u);
  ASSERT_EQ(in.errors.size(), 1u);

  BatchOutputWriter w(out, in);
  EXPECT_TRUE(w.resumed_ids().empty());
  EXPECT_EQ(w.requests_to_run(in).size(), 4u);
  EXPECT_EQ(w.records_total(), 5u);
  EXPECT_EQ(slurp(out), "");

  // The last request finishes first: it waits, in memory and in the journal.
  w.complete("5", record("", {}, FinishReason::Stop, 1));
  EXPECT_EQ(slurp(out), "");
  EXPECT_EQ(slurp(pending_journal_path(out)), kLine5);
  // The first: it goes out at once.
  w.complete("a", record("x", {5}, FinishReason::Stop, 2));
  EXPECT_EQ(slurp(out), kLineA);
  // Line 2 is done: line 3 (an input error) follows it without being asked for.
  w.complete("7", record("yy", {6, 6}, FinishReason::Length, 3));
  EXPECT_EQ(slurp(out), kLineA + kLine7 + kLine3);
  EXPECT_EQ(w.records_written(), 3u);
  EXPECT_FALSE(w.done());
  // A request that fails at run time gets an error record; then the waiting line 5 goes out.
  w.error("c", "prompt longer than model.max_length (4096)");
  EXPECT_EQ(slurp(out), kLineA + kLine7 + kLine3 + kLineC + kLine5);
  EXPECT_TRUE(w.done());
  EXPECT_EQ(w.error_records(), 2u);
  EXPECT_FALSE(fs::exists(pending_journal_path(out)));  // nothing waits any more

  EXPECT_THROW(w.complete("a", record("x", {5}, FinishReason::Stop, 2)), std::logic_error);
  EXPECT_THROW(w.complete("zzz", record("x", {5}, FinishReason::Stop, 2)), std::invalid_argument);

  OutputState st = read_output_state(out);
  EXPECT_EQ(st.records, 5u);
  EXPECT_EQ(st.error_records, 2u);
  EXPECT_EQ(st.ids, (std::set<std::string>{"a", "7", "c", "5"}));  // the null id is no id
  EXPECT_EQ(st.valid_bytes, st.file_bytes);
}

// The disk fills while a record is written (here a file size limit, as `ulimit -f` sets): the
// error names the output, and the file holds whole records only, so a rerun resumes cleanly.
TEST(BatchOutputDeathTest, AFullDiskLeavesOnlyWholeRecords) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  fs::path dir = test::temp_dir("batch_output_full");
  fs::path out = dir / "out.jsonl";
  EXPECT_EXIT(
      {
        std::signal(SIGXFSZ, SIG_IGN);  // as clshard's main() does
        BatchInput in = parse(kFourRequests);
        BatchOutputWriter w(out, in, BatchOutputOptions{true, false, ""});
        w.complete("a", record("x", {5}, FinishReason::Stop, 2));  // fits
        struct rlimit limit = {};
        limit.rlim_cur = slurp(out).size() + 40;  // the next record does not fit
        limit.rlim_max = RLIM_INFINITY;
        setrlimit(RLIMIT_FSIZE, &limit);
        try {
          w.complete("7", record(std::string(200, 'y'), {6, 6}, FinishReason::Length, 3));
        } catch (const std::exception& e) {
          limit.rlim_cur = RLIM_INFINITY;  // the limit holds for the captured stderr too
          setrlimit(RLIMIT_FSIZE, &limit);
          std::fprintf(stderr, "%s\n", e.what());
          std::exit(slurp(out) == kLineA ? 7 : 8);  // 7: the file ends with the whole record a
        }
        std::exit(9);
      },
      ::testing::ExitedWithCode(7),
      "writing .*out.jsonl: File too large \\(the records written so far are intact; free space "
      "and rerun to resume\\)");
}

TEST(BatchOutput, FinishingTwiceWhileWaitingIsAnError) {
  fs::path dir = test::temp_dir("batch_output_twice");
  BatchInput in = parse(kFourRequests);
  BatchOutputWriter w(dir / "out.jsonl", in, BatchOutputOptions{true, false, ""});
  w.complete("c", record("z", {1}, FinishReason::Stop, 1));
  EXPECT_THROW(w.error("c", "again"), std::logic_error);
}

TEST(BatchOutput, OpenAIShape) {
  fs::path dir = test::temp_dir("batch_output_openai");
  BatchInput in = parse(
      R"({"custom_id": "comp", "url": "/v1/completions", "body": {"prompt": "Once"}})" "\n"
      R"({"custom_id": "chat", "url": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content": "Hi"}]}})" "\n"
      R"({"custom_id": "bad", "body": {"prompt": "x", "n": 0}})" "\n");
  BatchOutputOptions opts;
  opts.model_name = "llama3-tiny";
  BatchOutputWriter w(dir / "out.jsonl", in, opts);
  w.complete("comp", record(" upon", {11, 12}, FinishReason::Length, 2));
  w.complete("chat", record("Hello!", {21}, FinishReason::Stop, 9));
  EXPECT_EQ(slurp(dir / "out.jsonl"),
            R"({"id":"comp","custom_id":"comp","line":1,"text":" upon","token_ids":[11,12],"finish_reason":"length",)"
            R"("prompt_tokens":2,"completion_tokens":2,"response":{"status_code":200,"body":{"object":"text_completion",)"
            R"("model":"llama3-tiny","choices":[{"index":0,"text":" upon","finish_reason":"length"}],)"
            R"("usage":{"prompt_tokens":2,"completion_tokens":2,"total_tokens":4}}}})" "\n"
            R"({"id":"chat","custom_id":"chat","line":2,"text":"Hello!","token_ids":[21],"finish_reason":"stop",)"
            R"("prompt_tokens":9,"completion_tokens":1,"response":{"status_code":200,"body":{"object":"chat.completion",)"
            R"("model":"llama3-tiny","choices":[{"index":0,"message":{"role":"assistant","content":"Hello!"},)"
            R"("finish_reason":"stop"}],"usage":{"prompt_tokens":9,"completion_tokens":1,"total_tokens":10}}}})" "\n"
            R"({"id":"bad","custom_id":"bad","line":3,"error":"body.n: expected an integer in [1, 128], got 0","response":null})" "\n");
}

TEST(BatchOutput, TextCutInsideAUtf8CharacterStillWrites) {
  fs::path dir = test::temp_dir("batch_output_utf8");
  BatchInput in = parse("{\"id\": \"u\", \"prompt\": \"p\"}\n");
  BatchOutputWriter w(dir / "out.jsonl", in);
  // Two of the three bytes of U+4E16: one U+FFFD for the cut sequence (Unicode's "maximal
  // subpart" rule), not one per byte.
  w.complete("u", record("ok \xE4\xB8", {1, 2}, FinishReason::Length, 1));
  EXPECT_EQ(slurp(dir / "out.jsonl"),
            "{\"id\":\"u\",\"line\":1,\"text\":\"ok \xEF\xBF\xBD\",\"token_ids\":[1,2],"
            "\"finish_reason\":\"length\",\"prompt_tokens\":1,\"completion_tokens\":2}\n");
}

TEST(BatchOutput, ResumeSkipsWhatIsWrittenAndCutsATornLine) {
  fs::path dir = test::temp_dir("batch_output_resume");
  fs::path out = dir / "out.jsonl";
  // A killed run: lines 1 and 2 written, line 3's error record half written.
  write_file(out, kLineA + kLine7 + kLine3.substr(0, 20));
  OutputState st = read_output_state(out);
  EXPECT_EQ(st.ids, (std::set<std::string>{"a", "7"}));
  EXPECT_EQ(st.records, 2u);
  EXPECT_EQ(st.valid_bytes, kLineA.size() + kLine7.size());
  EXPECT_EQ(st.file_bytes, kLineA.size() + kLine7.size() + 20);
  EXPECT_EQ(completed_ids(out), (std::set<std::string>{"a", "7"}));

  BatchInput in = parse(kFourRequests);
  BatchOutputWriter w(out, in);
  EXPECT_EQ(w.resumed_ids(), (std::set<std::string>{"a", "7"}));
  std::vector<const BatchRequest*> left = w.requests_to_run(in);
  ASSERT_EQ(left.size(), 2u);
  EXPECT_EQ(left[0]->id, "c");
  EXPECT_EQ(left[1]->id, "5");
  EXPECT_FALSE(w.should_run(in.requests[0]));
  // The torn line is gone and line 3's error record is written again, whole.
  EXPECT_EQ(slurp(out), kLineA + kLine7 + kLine3);
  EXPECT_THROW(w.complete("a", record("x", {5}, FinishReason::Stop, 2)), std::invalid_argument);
  w.complete("5", record("", {}, FinishReason::Stop, 1));
  w.error("c", "prompt longer than model.max_length (4096)");
  EXPECT_EQ(slurp(out), kLineA + kLine7 + kLine3 + kLineC + kLine5);
  EXPECT_TRUE(w.done());
}

TEST(BatchOutput, ResumeRecoversRecordsThatWaitedInTheJournal) {
  fs::path dir = test::temp_dir("batch_output_journal");
  fs::path out = dir / "out.jsonl";
  BatchInput in = parse(kFourRequests);
  {
    // Lines 4 and 5 finish while line 1 is still running; then the job dies.
    BatchOutputWriter w(out, in);
    w.complete("5", record("", {}, FinishReason::Stop, 1));
    w.error("c", "prompt longer than model.max_length (4096)");
    EXPECT_EQ(slurp(out), "");
  }
  EXPECT_EQ(slurp(pending_journal_path(out)), kLine5 + kLineC);
  EXPECT_EQ(completed_ids(out), (std::set<std::string>{"c", "5"}));

  // The rerun moves them into the output (in line order), and runs the rest after them.
  BatchOutputWriter w(out, in);
  EXPECT_EQ(w.resumed_ids(), (std::set<std::string>{"c", "5"}));
  EXPECT_FALSE(fs::exists(pending_journal_path(out)));
  EXPECT_EQ(slurp(out), kLineC + kLine5);
  EXPECT_EQ(w.records_total(), 3u);  // a, 7, and line 3's input error
  w.complete("7", record("yy", {6, 6}, FinishReason::Length, 3));
  w.complete("a", record("x", {5}, FinishReason::Stop, 2));
  EXPECT_EQ(slurp(out), kLineC + kLine5 + kLineA + kLine7 + kLine3);
  EXPECT_TRUE(w.done());

  // A third run finds everything done, and writes nothing: the input error of line 3 is matched
  // by its line, since it has no id.
  BatchOutputWriter again(out, in);
  EXPECT_TRUE(again.done());
  EXPECT_TRUE(again.requests_to_run(in).empty());
  EXPECT_EQ(slurp(out), kLineC + kLine5 + kLineA + kLine7 + kLine3);
}

TEST(BatchOutput, AKilledJobLosesOnlyTheRequestsInFlight) {
  fs::path dir = test::temp_dir("batch_output_sigkill");
  fs::path out = dir / "out.jsonl";
  BatchInput in = parse(kFourRequests);
  pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    // The job: line 5 finishes early (it waits), line 1 finishes (it is written); then the
    // process dies with no chance to flush or clean up.
    BatchOutputWriter w(out, in);
    w.complete("5", record("", {}, FinishReason::Stop, 1));
    w.complete("a", record("x", {5}, FinishReason::Stop, 2));
    ::raise(SIGKILL);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFSIGNALED(status));
  EXPECT_EQ(WTERMSIG(status), SIGKILL);
  EXPECT_EQ(slurp(out), kLineA);
  EXPECT_EQ(slurp(pending_journal_path(out)), kLine5);

  // Only lines 2 and 4 (in flight at the kill) run again.
  BatchOutputWriter w(out, in);
  std::vector<const BatchRequest*> left = w.requests_to_run(in);
  ASSERT_EQ(left.size(), 2u);
  EXPECT_EQ(left[0]->id, "7");
  EXPECT_EQ(left[1]->id, "c");
  w.error("c", "prompt longer than model.max_length (4096)");
  w.complete("7", record("yy", {6, 6}, FinishReason::Length, 3));
  EXPECT_EQ(slurp(out), kLineA + kLine5 + kLine7 + kLine3 + kLineC);
  EXPECT_TRUE(w.done());
}

TEST(BatchOutput, ResumeOffStartsAfresh) {
  fs::path dir = test::temp_dir("batch_output_fresh");
  fs::path out = dir / "out.jsonl";
  write_file(out, kLineA + kLine7);
  write_file(pending_journal_path(out), kLine5);
  BatchInput in = parse(kFourRequests);
  BatchOutputOptions opts;
  opts.resume = false;
  BatchOutputWriter w(out, in, opts);
  EXPECT_TRUE(w.resumed_ids().empty());
  EXPECT_EQ(w.records_total(), 5u);
  EXPECT_EQ(slurp(out), "");
  EXPECT_FALSE(fs::exists(pending_journal_path(out)));
}

TEST(BatchOutput, RefusesToAppendToAFileThatIsNotOurs) {
  fs::path dir = test::temp_dir("batch_output_foreign");
  fs::path out = dir / "out.jsonl";
  write_file(out, kLineA + "# notes\n" + kLine7);
  try {
    read_output_state(out);
    FAIL() << "expected an error";
  } catch (const std::runtime_error& e) {
    EXPECT_EQ(std::string(e.what()),
              out.string() + ":2: not a clshard output record (invalid JSON at column 1: syntax error while parsing "
              "value - invalid literal; last read: '#'); refusing to append to it");
  }
  write_file(out, "{\"text\": \"no id\"}\n");
  EXPECT_THROW(BatchOutputWriter(out, parse(kFourRequests)), std::runtime_error);
}

TEST(BatchOutput, TruncateTornTail) {
  fs::path dir = test::temp_dir("batch_output_torn");
  fs::path f = dir / "f.jsonl";
  EXPECT_EQ(truncate_torn_tail(f), 0u);  // missing: nothing to do
  write_file(f, kLineA + "{\"id\": \"b\", \"te");
  EXPECT_EQ(truncate_torn_tail(f), 15u);
  EXPECT_EQ(slurp(f), kLineA);
  EXPECT_EQ(truncate_torn_tail(f), 0u);
  write_file(f, "{\"id\"");
  EXPECT_EQ(truncate_torn_tail(f), 5u);
  EXPECT_EQ(slurp(f), "");
}

// ---------------------------------------------------------------------------------------------
// Progress

struct FakeClock {
  std::chrono::steady_clock::time_point now{};
  void advance(double seconds) {
    now += std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(seconds));
  }
  Progress::Clock fn() {
    return [this] { return now; };
  }
};

TEST(Progress, PlainLinesEveryTenthOrEveryFiveSeconds) {
  FakeClock clock;
  std::ostringstream err;
  Progress p(20, false, err, clock.fn());
  clock.advance(1.0);
  p.update(1, 10, 40);  // 5%: not yet a tenth, not yet 5 s
  EXPECT_EQ(err.str(), "");
  clock.advance(1.0);
  p.update(2, 20, 80);  // 10%
  EXPECT_EQ(err.str(), "progress: 2/20 requests (10%), 20 tokens in, 80 tokens out, 40.0 output tok/s, "
                       "elapsed 0:02, ETA 0:18\n");
  err.str("");
  clock.advance(4.0);
  p.update(2, 20, 100);  // 4 s since the last line, same tenth
  EXPECT_EQ(err.str(), "");
  clock.advance(1.0);
  p.update(2, 20, 120);  // 5 s since the last line
  EXPECT_EQ(err.str(), "progress: 2/20 requests (10%), 20 tokens in, 120 tokens out, 17.1 output tok/s, "
                       "elapsed 0:07, ETA 1:03\n");
  err.str("");
  clock.advance(1.0);
  p.update(9, 90, 400, 1);  // jumps to 45%: one line
  EXPECT_EQ(err.str(), "progress: 9/20 requests (45%), 1 errors, 90 tokens in, 400 tokens out, 50.0 output tok/s, "
                       "elapsed 0:08, ETA 0:10\n");
  err.str("");
  clock.advance(2.0);
  p.update(20, 200, 1000, 1);
  EXPECT_EQ(err.str(), "progress: 20/20 requests (100%), 1 errors, 200 tokens in, 1000 tokens out, "
                       "100.0 output tok/s, elapsed 0:10, ETA 0:00\n");
  err.str("");
  p.finish();
  EXPECT_EQ(err.str(), "done: 20/20 requests, 1 errors, 200 tokens in, 1000 tokens out, 10.0 s wall, "
                       "100.0 output tok/s\n");
  err.str("");
  p.finish();  // once
  p.update(20, 200, 1000, 1);
  EXPECT_EQ(err.str(), "");
}

TEST(Progress, TerminalBarIsRedrawnInPlaceAtMostTenTimesASecond) {
  FakeClock clock;
  std::ostringstream err;
  Progress p(4, true, err, clock.fn());
  clock.advance(0.5);
  p.update(0, 5, 0);  // the first update draws
  EXPECT_EQ(err.str(), "\r[..............................] 0/4 requests | 0.0 tok/s | ETA ?\x1b[K");
  err.str("");
  clock.advance(0.05);
  p.update(1, 10, 20);  // 50 ms later: throttled
  EXPECT_EQ(err.str(), "");
  clock.advance(0.45);
  p.update(1, 10, 30);
  EXPECT_EQ(err.str(), "\r[#######.......................] 1/4 requests | 30.0 tok/s | ETA 0:03\x1b[K");
  err.str("");
  clock.advance(0.01);
  p.update(4, 40, 101, 2);  // the last request always draws
  EXPECT_EQ(err.str(), "\r[##############################] 4/4 requests (2 errors) | 100.0 tok/s | ETA 0:00\x1b[K");
  err.str("");
  clock.advance(0.99);
  p.finish();
  EXPECT_EQ(err.str(),
            "\r[##############################] 4/4 requests (2 errors) | 50.5 tok/s | ETA 0:00\x1b[K\n"
            "done: 4/4 requests, 2 errors, 40 tokens in, 101 tokens out, 2.0 s wall, 50.5 output tok/s\n");
}

TEST(Progress, EmptyJobAndDurations) {
  FakeClock clock;
  std::ostringstream err;
  Progress p(0, false, err, clock.fn());
  p.finish();
  EXPECT_EQ(err.str(), "done: 0/0 requests, 0 errors, 0 tokens in, 0 tokens out, 0.0 s wall, 0.0 output tok/s\n");
  EXPECT_EQ(Progress::format_duration(0), "0:00");
  EXPECT_EQ(Progress::format_duration(7.4), "0:07");
  EXPECT_EQ(Progress::format_duration(754), "12:34");
  EXPECT_EQ(Progress::format_duration(3723), "1:02:03");
}

// A copy of the weights (model.mmap: false) on stderr: in a log, a line at the start, each 10% and
// every 5 s, then the closing line with the rate; a new directory starts over.
TEST(LoadProgressPrinter, PlainLinesThenTheClosingRate) {
  FakeClock clock;
  std::ostringstream err;
  const LoadProgress p = load_progress_printer(err, false, clock.fn());
  const uint64_t total = 10'000'000'000ull;
  p("ckpt", 0, total);
  EXPECT_EQ(err.str(), "reading ckpt into memory: 0.00 of 10.00 GB (0%), ETA ?\n");
  err.str("");
  clock.advance(1.0);
  p("ckpt", total / 20, total);  // 5%: not yet a tenth, not yet 5 s
  EXPECT_EQ(err.str(), "");
  clock.advance(1.0);
  p("ckpt", total / 10, total);
  EXPECT_EQ(err.str(), "reading ckpt into memory: 1.00 of 10.00 GB (10%), ETA 0:18\n");
  err.str("");
  clock.advance(5.0);
  p("ckpt", total * 3 / 20, total);  // 5 s since the last line, same tenth
  EXPECT_EQ(err.str(), "reading ckpt into memory: 1.50 of 10.00 GB (15%), ETA 0:40\n");
  err.str("");
  clock.advance(3.0);
  p("ckpt", total, total);
  EXPECT_EQ(err.str(), "read ckpt into memory: 10.00 GB in 10.0 s (1.0 GB/s)\n");
  err.str("");
  p("draft", 0, 250'000'000ull);  // below 1 GB: in MB
  EXPECT_EQ(err.str(), "reading draft into memory: 0.00 of 250.00 MB (0%), ETA ?\n");
}

// On a terminal: one line redrawn in place at most ten times a second, cleared for the closing one.
TEST(LoadProgressPrinter, TerminalLineRedrawnInPlace) {
  FakeClock clock;
  std::ostringstream err;
  const LoadProgress p = load_progress_printer(err, true, clock.fn());
  const uint64_t total = 4'000'000'000ull;
  p("ckpt", 0, total);
  EXPECT_EQ(err.str(), "\rreading ckpt into memory: 0.00 of 4.00 GB (0%), ETA ?\x1b[K");
  err.str("");
  clock.advance(0.05);
  p("ckpt", total / 8, total);  // 50 ms later: throttled
  EXPECT_EQ(err.str(), "");
  clock.advance(0.05);
  p("ckpt", total / 4, total);
  EXPECT_EQ(err.str(), "\rreading ckpt into memory: 1.00 of 4.00 GB (25%), ETA 0:00\x1b[K");
  err.str("");
  clock.advance(1.9);
  p("ckpt", total, total);
  EXPECT_EQ(err.str(), "\r\x1b[Kread ckpt into memory: 4.00 GB in 2.0 s (2.0 GB/s)\n");
}

}  // namespace
}  // namespace clshard
