// The OpenAI-compatible server (runtime/serve/): request parsing and errors, the `serve:` section,
// Prometheus metrics, and the server itself in-process on loopback with a random llama3-tiny
// checkpoint: streaming gives the tokens of the non-streaming answer and of the batch job, 64
// concurrent streams each get their own tokens, overload answers 429 while /health keeps
// answering, a client that goes away frees its pages, graceful stop.
#include <gtest/gtest.h>
#include <unistd.h>

#include <httplib.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <cstring>
#include <fstream>
#include <future>
#include <map>
#include <random>
#include <regex>
#include <set>
#include <sstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "models/registry.h"
#include "runtime/engine/batch_job.h"
#include "runtime/engine/deployment.h"
#include "runtime/safetensors.h"
#include "runtime/serve/http_server.h"
#include "runtime/serve/metrics.h"
#include "runtime/serve/openai_api.h"
#include "tests/test_util.h"

namespace clshard {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using serve::ApiError;
using serve::Endpoint;

// ---- the serve: section ------------------------------------------------------------------------

std::string config_error(const std::string& yaml) {
  try {
    parse_deploy_config(yaml, "d.yaml");
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(ServeConfig, KeysAndDefaults) {
  DeployConfig c = parse_deploy_config(
      "model: {path: m}\n"
      "serve:\n"
      "  host: 0.0.0.0\n"
      "  port: 0\n"
      "  max_waiting: 3\n"
      "  api_key: sk-test\n"
      "  request_deadline_s: 2.5\n"
      "  shutdown_deadline_s: 0\n"
      "  model_name: tiny\n"
      "  max_connections: 16\n",
      "d.yaml");
  EXPECT_EQ(c.serve.host, "0.0.0.0");
  EXPECT_EQ(c.serve.port, 0);
  EXPECT_EQ(c.serve.max_waiting, 3);
  EXPECT_EQ(c.serve.api_key, "sk-test");
  EXPECT_DOUBLE_EQ(c.serve.request_deadline_s, 2.5);
  EXPECT_DOUBLE_EQ(c.serve.shutdown_deadline_s, 0.0);
  EXPECT_EQ(c.serve.model_name, "tiny");
  EXPECT_EQ(c.serve.max_connections, 16);
  EXPECT_EQ(c.where("serve.port"), "d.yaml:4: serve.port");

  DeployConfig d = parse_deploy_config("model: {path: m}\n", "d.yaml");
  EXPECT_EQ(d.serve.host, "127.0.0.1") << "loopback unless told otherwise";
  EXPECT_EQ(d.serve.port, 8000);
  EXPECT_EQ(d.serve.max_waiting, 64);
  EXPECT_EQ(d.serve.api_key, "");

  DeployConfig example = load_deploy_config(fs::path(CLSHARD_SOURCE_DIR) / "configs" /
                                            "example.yaml");
  EXPECT_EQ(example.serve, ServeSection{}) << "configs/example.yaml shows the defaults";
}

TEST(ServeConfig, ErrorsNameFileLineAndKey) {
  EXPECT_EQ(config_error("model: {path: m}\nserve:\n  port: 70000\n"),
            "d.yaml:3: serve.port: expected a TCP port (0 to 65535; 0: any free port) (at most "
            "65535), got \"70000\"");
  EXPECT_EQ(config_error("model: {path: m}\nserve:\n  max_waiting: -1\n"),
            "d.yaml:3: serve.max_waiting: expected an integer >= 0, got \"-1\"");
  EXPECT_EQ(config_error("model: {path: m}\nserve:\n  request_deadline_s: soon\n"),
            "d.yaml:3: serve.request_deadline_s: expected a number of seconds >= 0, got \"soon\"");
  EXPECT_EQ(config_error("model: {path: m}\nserve:\n  hots: 1.2.3.4\n"),
            "d.yaml:3: serve.hots: unknown key (expected one of: host, port, max_waiting, "
            "api_key, request_deadline_s, shutdown_deadline_s, model_name, max_connections)");
  EXPECT_EQ(config_error("model: {path: m}\nserve:\n  host: \"\"\n"),
            "d.yaml:3: serve.host: expected an address to bind (127.0.0.1, 0.0.0.0, ...), got "
            "\"\"");
  EXPECT_EQ(config_error("model: {path: m}\nserve:\n  max_connections: 2\n"),
            "d.yaml:3: serve.max_connections: expected an integer in [4, 65536], got \"2\"");
}

// ---- request bodies ----------------------------------------------------------------------------

ApiError parse_error(Endpoint e, const std::string& body) {
  try {
    serve::parse_api_request(e, body, SamplingDefaults{});
  } catch (const ApiError& err) {
    return err;
  }
  return ApiError(0, "", "(no error)");
}

TEST(OpenAiApi, ReadsCompletionAndChatBodies) {
  SamplingDefaults defaults;
  defaults.max_tokens = 7;
  auto c = serve::parse_api_request(
      Endpoint::Completions,
      R"({"model": "m", "prompt": "hi", "temperature": 0.5, "top_p": 0.9, "seed": 42,
          "stop": ["\n"], "stream": true, "stream_options": {"include_usage": true},
          "user": "u", "n": 1, "echo": false, "return_token_ids": true})",
      defaults);
  EXPECT_EQ(c.model, "m");
  EXPECT_EQ(c.prompt, std::optional<std::string>("hi"));
  EXPECT_FLOAT_EQ(c.sampling.temperature, 0.5f);
  EXPECT_FLOAT_EQ(c.sampling.top_p, 0.9f);
  EXPECT_EQ(c.sampling.seed, 42u);
  EXPECT_EQ(c.sampling.max_tokens, 7) << "the deployment's default";
  EXPECT_EQ(c.sampling.stop, std::vector<std::string>{"\n"});
  EXPECT_TRUE(c.stream);
  EXPECT_TRUE(c.include_usage);
  EXPECT_TRUE(c.return_token_ids);

  auto ids = serve::parse_api_request(Endpoint::Completions,
                                      R"({"model": "m", "prompt": [1, 2, 3], "max_tokens": 4})",
                                      defaults);
  EXPECT_EQ(ids.prompt_token_ids, std::optional<std::vector<int32_t>>({1, 2, 3}));
  EXPECT_EQ(ids.sampling.max_tokens, 4);

  auto chat = serve::parse_api_request(
      Endpoint::ChatCompletions,
      R"({"model": "m", "messages": [{"role": "system", "content": "be brief"},
          {"role": "user", "content": [{"type": "text", "text": "a"},
                                       {"type": "text", "text": "b"}]}],
          "max_completion_tokens": 5})",
      defaults);
  ASSERT_TRUE(chat.messages);
  EXPECT_EQ(*chat.messages, json::parse(R"([{"role": "system", "content": "be brief"},
                                            {"role": "user", "content": "ab"}])"));
  EXPECT_EQ(chat.sampling.max_tokens, 5);
}

TEST(OpenAiApi, BadRequestsNameTheField) {
  auto e =
      parse_error(Endpoint::Completions, R"({"model": "m", "prompt": "x", "temperature": -1})");
  EXPECT_EQ(e.status, 400);
  EXPECT_EQ(e.param, "temperature");
  EXPECT_STREQ(e.what(), "temperature: expected a number >= 0, got -1");
  EXPECT_EQ(e.body().dump(),
            R"({"error":{"message":"temperature: expected a number >= 0, got -1",)"
            R"("type":"invalid_request_error","param":"temperature","code":null}})");

  e = parse_error(Endpoint::Completions, R"({"model": "m", "prompt": "x", "logit_bias": {}})");
  EXPECT_EQ(e.param, "logit_bias");
  EXPECT_EQ(
      std::string(e.what()).rfind("logit_bias: unsupported field (supported: model, prompt", 0),
      0u)
      << e.what();
  e = parse_error(Endpoint::Completions, R"({"prompt": "x"})");
  EXPECT_STREQ(e.what(), "model: required (the served model's name)");
  e = parse_error(Endpoint::ChatCompletions, R"({"model": "m"})");
  EXPECT_STREQ(e.what(), "messages: required");
  e = parse_error(Endpoint::ChatCompletions, R"({"model": "m", "messages": [{"role": 1}]})");
  EXPECT_EQ(e.param, "messages[0].role");
  EXPECT_STREQ(e.what(), "messages[0].role: expected a non-empty string, got 1");
  e = parse_error(Endpoint::ChatCompletions,
                  R"({"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 0})");
  EXPECT_STREQ(e.what(), "n: expected an integer in [1, 128], got 0");
  e = parse_error(Endpoint::Completions,
                  R"({"model": "m", "prompt": "x", "stream_options": {"include_usage": true}})");
  EXPECT_STREQ(e.what(), "stream_options: only allowed with stream: true");
  e = parse_error(Endpoint::Completions, R"({"model": "m", "prompt": [1, -2]})");
  EXPECT_STREQ(e.what(), "prompt[1]: expected a token id (an integer >= 0), got -2");
  e = parse_error(Endpoint::Completions, R"({"model": "m", "prompt": "x", "max_tokens": 0})");
  EXPECT_STREQ(e.what(), "max_tokens: expected a positive integer, got 0");
  e = parse_error(Endpoint::Completions, R"({"model": "m", "prompt": "x",)");
  EXPECT_EQ(e.status, 400);
  EXPECT_EQ(std::string(e.what()).rfind("the body is not valid JSON", 0), 0u) << e.what();
}

// The request features: structured output kept as given (key order too), logprobs in each
// endpoint's own form, penalties, n, seed, stop; and the 400s that name the field.
TEST(OpenAiApi, RequestFeatures) {
  auto c = serve::parse_api_request(
      Endpoint::Completions,
      R"({"model": "m", "prompt": "x", "logprobs": 3, "n": 4, "seed": 9, "stop": "\n",
          "frequency_penalty": 0.5, "presence_penalty": -0.25, "repetition_penalty": 1.3,
          "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema":
            {"type": "object", "properties": {"z": {"type": "integer"}, "a": {"type": "null"}}}}},
          "regex": null})",
      SamplingDefaults{});
  EXPECT_TRUE(c.sampling.logprobs);
  EXPECT_EQ(c.sampling.top_logprobs, 3);
  EXPECT_EQ(c.sampling.n, 4);
  EXPECT_EQ(c.sampling.seed, 9u);
  EXPECT_EQ(c.sampling.stop, std::vector<std::string>{"\n"});
  EXPECT_FLOAT_EQ(c.sampling.frequency_penalty, 0.5f);
  EXPECT_FLOAT_EQ(c.sampling.presence_penalty, -0.25f);
  EXPECT_FLOAT_EQ(c.sampling.repetition_penalty, 1.3f);
  ASSERT_TRUE(c.response_format);
  EXPECT_EQ(c.response_format->dump(),
            R"({"type":"json_schema","json_schema":{"name":"p","schema":{"type":"object",)"
            R"("properties":{"z":{"type":"integer"},"a":{"type":"null"}}}}})")
      << "the schema's key order is kept";
  EXPECT_FALSE(c.regex);

  auto chat = serve::parse_api_request(
      Endpoint::ChatCompletions,
      R"({"model": "m", "messages": [{"role": "user", "content": "x"}], "logprobs": true,
          "top_logprobs": 2, "regex": "[a-z]+", "max_completion_tokens": 3})",
      SamplingDefaults{});
  EXPECT_TRUE(chat.sampling.logprobs);
  EXPECT_EQ(chat.sampling.top_logprobs, 2);
  EXPECT_EQ(chat.regex, std::optional<std::string>("[a-z]+"));
  EXPECT_EQ(chat.sampling.max_tokens, 3);

  const std::string msgs = R"("model": "m", "messages": [{"role": "user", "content": "x"}])";
  struct Case {
    Endpoint endpoint;
    std::string body, param, message;
  };
  const std::vector<Case> cases = {
      {Endpoint::ChatCompletions, "{" + msgs + R"(, "logprobs": 2})", "logprobs",
       "logprobs: expected true or false (the number of top tokens goes in top_logprobs), got 2"},
      {Endpoint::ChatCompletions, "{" + msgs + R"(, "top_logprobs": 2})", "top_logprobs",
       "top_logprobs: needs logprobs: true"},
      {Endpoint::ChatCompletions, "{" + msgs + R"(, "logprobs": true, "top_logprobs": 21})",
       "top_logprobs", "top_logprobs: expected an integer in [0, 20], got 21"},
      {Endpoint::Completions, R"({"model": "m", "prompt": "x", "logprobs": true})", "logprobs",
       "logprobs: expected the number of top tokens to return (an integer in [0, 20]), got true"},
      {Endpoint::Completions, R"({"model": "m", "prompt": "x", "logprobs": 21})", "logprobs",
       "logprobs: expected true, false or an integer in [0, 20], got 21"},
      {Endpoint::ChatCompletions, "{" + msgs + R"(, "response_format": "json"})",
       "response_format",
       "response_format: expected an object like {\"type\": \"json_object\"}, got \"json\""},
      {Endpoint::ChatCompletions, "{" + msgs + R"(, "regex": 5})", "regex",
       "regex: expected a string (a pattern the whole output must match), got 5"},
      {Endpoint::ChatCompletions, "{" + msgs + R"(, "frequency_penalty": 3})",
       "frequency_penalty", "frequency_penalty: expected a number in [-2, 2], got 3"},
      {Endpoint::ChatCompletions, "{" + msgs + R"(, "n": 129})", "n",
       "n: expected an integer in [1, 128], got 129"},
      {Endpoint::ChatCompletions, "{" + msgs + R"(, "seed": -1})", "seed",
       "seed: expected an integer >= 0, got -1"},
      {Endpoint::ChatCompletions, "{" + msgs + R"(, "stop": [""]})", "stop",
       "stop[0]: expected a non-empty string, got \"\""},
      // A body nested past the JSON depth limit (a schema 20,000 levels deep overflowed the
      // stack when copied: tests/fuzz/regressions/api_request).
      {Endpoint::ChatCompletions,
       "{" + msgs + R"(, "response_format": )" + std::string(200, '[') + std::string(200, ']') +
           "}",
       "", "the body is not valid JSON: JSON nested deeper than 128 levels"},
  };
  for (const Case& k : cases) {
    const ApiError e = parse_error(k.endpoint, k.body);
    EXPECT_EQ(e.status, 400) << k.body;
    EXPECT_EQ(e.param, k.param) << k.body;
    EXPECT_EQ(std::string(e.what()), k.message) << k.body;
  }
  const ApiError tl = parse_error(Endpoint::Completions,
                                  R"({"model": "m", "prompt": "x", "top_logprobs": 2})");
  EXPECT_EQ(tl.param, "top_logprobs");
  EXPECT_EQ(std::string(tl.what()).rfind("top_logprobs: unsupported field", 0), 0u) << tl.what();
}

// Log-probabilities in OpenAI's shapes, in responses and stream chunks.
TEST(OpenAiApi, LogprobsShapes) {
  // Token 11 is the last byte of "é" (a byte-level token that is part of a UTF-8 character): its
  // text is U+FFFD, its bytes its own.
  std::vector<RecordLogprobs> lps(2);
  lps[0].chosen = {7, "Hi", -0.5f, ""};
  lps[0].top = {{7, "Hi", -0.5f, ""}, {9, " x", -1.25f, ""}};
  lps[1].chosen = {11, "\xEF\xBF\xBD", -2.0f, "\xA9"};
  lps[1].top = {{11, "\xEF\xBF\xBD", -2.0f, "\xA9"}};
  serve::ApiRequest req;
  req.endpoint = Endpoint::ChatCompletions;
  serve::ResponseMeta meta{"chatcmpl-1", 7, "m"};
  EXPECT_EQ(json::parse(
                serve::stream_chunk(req, meta, 1, "Hi", {}, false, std::nullopt, &lps).dump()),
            json::parse(
            R"({"id":"chatcmpl-1","object":"chat.completion.chunk","created":7,"model":"m",)"
            R"("choices":[{"index":1,"delta":{"content":"Hi"},"logprobs":{"content":[)"
            R"({"token":"Hi","logprob":-0.5,"bytes":[72,105],"top_logprobs":[)"
            R"({"token":"Hi","logprob":-0.5,"bytes":[72,105]},)"
            R"({"token":" x","logprob":-1.25,"bytes":[32,120]}]},)"
            R"({"token":"�","logprob":-2.0,"bytes":[169],"top_logprobs":[)"
            R"({"token":"�","logprob":-2.0,"bytes":[169]}]}]},"finish_reason":null}]})"));
  req.endpoint = Endpoint::Completions;
  serve::ChoiceOutput choice{"Hi\xC3\xA9", {7, 11}, EndReason::Stop, lps};
  const json r = json::parse(
      serve::response_json(req, {"cmpl-1", 7, "m"}, {choice}, {3, 2}).dump());
  EXPECT_EQ(r["choices"][0]["logprobs"],
            json::parse(R"({"tokens": ["Hi", "�"], "token_logprobs": [-0.5, -2.0],
                            "top_logprobs": [{"Hi": -0.5, " x": -1.25}, {"�": -2.0}],
                            "text_offset": [0, 2]})"));
  // A stream chunk's offsets continue from the text sent before it.
  const json chunk = json::parse(
      serve::stream_chunk(req, {"cmpl-1", 7, "m"}, 0, "x", {}, false, std::nullopt, &lps, 5)
          .dump());
  EXPECT_EQ(chunk["choices"][0]["logprobs"]["text_offset"], json::parse("[5, 7]"));
}

TEST(OpenAiApi, ChunksAndResponses) {
  serve::ApiRequest req;
  req.endpoint = Endpoint::ChatCompletions;
  req.include_usage = true;
  serve::ResponseMeta meta{"chatcmpl-1", 7, "m"};
  EXPECT_EQ(serve::stream_chunk(req, meta, 0, "Hi", {}, true, std::nullopt).dump(),
            R"({"id":"chatcmpl-1","object":"chat.completion.chunk","created":7,"model":"m",)"
            R"("choices":[{"index":0,"delta":{"role":"assistant","content":"Hi"},)"
            R"("logprobs":null,"finish_reason":null}],"usage":null})");
  EXPECT_EQ(serve::stream_chunk(req, meta, 0, "", {}, false, EndReason::Stop).dump(),
            R"({"id":"chatcmpl-1","object":"chat.completion.chunk","created":7,"model":"m",)"
            R"("choices":[{"index":0,"delta":{},"logprobs":null,"finish_reason":"stop"}],)"
            R"("usage":null})");
  EXPECT_EQ(serve::usage_chunk(req, meta, {3, 4}).dump(),
            R"({"id":"chatcmpl-1","object":"chat.completion.chunk","created":7,"model":"m",)"
            R"("choices":[],"usage":{"prompt_tokens":3,"completion_tokens":4,"total_tokens":7}})");
  req.endpoint = Endpoint::Completions;
  req.include_usage = false;
  EXPECT_EQ(serve::response_json(req, {"cmpl-1", 7, "m"}, {{"ab", {1, 2}, EndReason::Length}},
                                 {3, 2})
                .dump(),
            R"({"id":"cmpl-1","object":"text_completion","created":7,"model":"m",)"
            R"("choices":[{"index":0,"text":"ab","logprobs":null,"finish_reason":"length"}],)"
            R"("usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5}})");
  EXPECT_TRUE(std::regex_match(serve::new_response_id(Endpoint::Completions),
                               std::regex("cmpl-[0-9a-f]{24}")));
}

// ---- metrics -----------------------------------------------------------------------------------

TEST(ServeMetrics, PrometheusText) {
  serve::Histogram h({0.1, 1.0});
  h.observe(0.05);
  h.observe(0.1);
  h.observe(0.5);
  h.observe(3.0);
  std::string out;
  h.render(out, "x_seconds", "What x is.");
  EXPECT_EQ(out,
            "# HELP x_seconds What x is.\n# TYPE x_seconds histogram\n"
            "x_seconds_bucket{le=\"0.1\"} 2\nx_seconds_bucket{le=\"1\"} 3\n"
            "x_seconds_bucket{le=\"+Inf\"} 4\nx_seconds_sum 3.65\nx_seconds_count 4\n");
  serve::ServerMetrics m;
  serve::EngineGauges g;
  g.running = 2;
  g.waiting = 5;
  g.kv_pages_used = 3;
  g.kv_pages_total = 12;
  m.set_gauges(g);
  m.request_rejected("queue_full");
  m.request_finished("stop", 0.2);
  m.add_generation_tokens(9);
  const std::string text = m.render();
  for (const char* line :
       {"clshard_requests_running 2\n", "clshard_requests_waiting 5\n",
        "clshard_kv_pages_used 3\n", "clshard_kv_cache_usage_ratio 0.25\n",
        "clshard_generation_tokens_total 9\n",
        "clshard_requests_rejected_total{reason=\"queue_full\"} 1\n",
        "clshard_requests_finished_total{outcome=\"stop\"} 1\n",
        "clshard_requests_finished_total{outcome=\"cancelled\"} 0\n",
        "# TYPE clshard_time_to_first_token_seconds histogram\n",
        "# TYPE clshard_inter_token_latency_seconds histogram\n"})
    EXPECT_NE(text.find(line), std::string::npos) << line;
  EXPECT_EQ(text.find("spec_decode"), std::string::npos) << "only when speculative";
}

// ---- the server, in-process on loopback --------------------------------------------------------

const fs::path& tiny_checkpoint() {
  static const fs::path dir = [] {
    fs::path d = fs::path(CLSHARD_BINARY_DIR) / "test-models" / "server-llama3-tiny";
    if (!fs::exists(d / "config.json")) {
      // ctest runs each test in a process of its own, several at once: written aside, then
      // renamed into place (a process that loses the race drops its copy).
      fs::path tmp = d;
      tmp += ".tmp-" + std::to_string(::getpid());
      make_model("llama3-tiny", tmp, MakeModelOptions{});
      std::error_code ec;
      fs::rename(tmp, d, ec);
      if (ec) fs::remove_all(tmp);
    }
    return d;
  }();
  return dir;
}

DeployConfig tiny_config(const std::string& serve_yaml = "",
                         const std::string& batch_yaml = "{max_batch_size: 64, "
                                                         "max_batch_input_tokens: 2048}") {
  return parse_deploy_config("model: {path: " + tiny_checkpoint().string() +
                                 "}\n"
                                 "devices: {type: cpu}\n"
                                 "kv_cache: {page_size: 16, pages: 512}\n"
                                 "batch: " +
                                 batch_yaml +
                                 "\n"
                                 "sampling: {temperature: 0.0, max_tokens: 16}\n"
                                 "serve: {port: 0" +
                                 serve_yaml + "}\n",
                             "server-test.yaml");
}

struct Reply {
  int status = 0;  // 0: no response (connection error)
  std::string body;
  httplib::Headers headers;
};

std::vector<std::string> adapter_names(const DeployConfig& cfg) {
  std::vector<std::string> names;
  for (const auto& [name, dir] : cfg.lora.adapters) names.push_back(name);
  return names;
}

// A loopback server on a free port, the model loaded.
class LiveServer {
 public:
  explicit LiveServer(const DeployConfig& cfg, bool attach = true)
      : cfg_(cfg), server_(cfg.serve, "llama3-tiny", cfg.sampling, adapter_names(cfg)) {
    port_ = server_.bind();
    server_.start();
    if (attach) this->attach();
  }
  void attach() { server_.attach(std::make_unique<Deployment>(Deployment::open(cfg_))); }
  int port() const { return port_; }
  serve::OpenAiServer& server() { return server_; }

  Reply get(const std::string& path, const httplib::Headers& h = {}) const {
    httplib::Client cli("127.0.0.1", port_);
    cli.set_read_timeout(30, 0);
    auto r = cli.Get(path.c_str(), h);
    if (!r) return {};
    return {r->status, r->body, r->headers};
  }
  Reply post(const std::string& path, const json& body, const httplib::Headers& h = {}) const {
    httplib::Client cli("127.0.0.1", port_);
    cli.set_read_timeout(60, 0);
    auto r = cli.Post(path.c_str(), h, body.dump(), "application/json");
    if (!r) return {};
    return {r->status, r->body, r->headers};
  }
  // A streaming POST: the body's bytes as they come; on_data returning false closes the
  // connection (a client that goes away).
  Reply post_stream(const std::string& path, const json& body,
                    std::function<bool(const std::string&)> on_data = {}) const {
    httplib::Client cli("127.0.0.1", port_);
    cli.set_read_timeout(60, 0);
    httplib::Request req;
    req.method = "POST";
    req.path = path;
    req.body = body.dump();
    req.set_header("Content-Type", "application/json");
    std::string all;
    req.content_receiver = [&](const char* data, size_t n, uint64_t, uint64_t) {
      all.append(data, n);
      return on_data ? on_data(all) : true;
    };
    auto r = cli.send(req);
    Reply out;
    out.body = all;
    if (r) {
      out.status = r->status;
      out.headers = r->headers;
    }
    return out;
  }
  double metric(const std::string& name) const {
    Reply r = get("/metrics");
    std::smatch m;
    std::regex re("\n" + std::regex_replace(name, std::regex(R"([{}"])"), R"(\$&)") +
                  " ([0-9.e+-]+)\n");
    if (!std::regex_search(r.body, m, re)) return -1;
    return std::stod(m[1]);
  }

 private:
  DeployConfig cfg_;
  serve::OpenAiServer server_;
  int port_ = 0;
};

// After a client went away mid-request: within 15 s the server has cancelled that one request and
// holds no KV page.
void expect_one_cancelled_and_pages_back(const LiveServer& s) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(15);
  double used = -1, cancelled = 0;
  while (std::chrono::steady_clock::now() < deadline) {
    used = s.metric("clshard_kv_pages_used");
    cancelled = s.metric("clshard_requests_finished_total{outcome=\"cancelled\"}");
    if (used == 0 && cancelled == 1) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_EQ(used, 0) << "KV pages back within 15 s of the disconnect";
  EXPECT_EQ(cancelled, 1);
}

// The data: events of a stream, parsed; [DONE] must come last.
struct Sse {
  std::vector<json> chunks;
  bool done = false;
  std::string text;
  std::vector<int32_t> token_ids;
  std::string finish_reason;
  json usage;
};

Sse parse_sse(const std::string& body, bool chat) {
  Sse s;
  size_t pos = 0;
  while (pos < body.size()) {
    size_t end = body.find("\n\n", pos);
    EXPECT_NE(end, std::string::npos) << "an event without its blank line: " << body.substr(pos);
    if (end == std::string::npos) break;
    std::string ev = body.substr(pos, end - pos);
    pos = end + 2;
    if (ev.rfind(":", 0) == 0) continue;  // a comment (keep-alive)
    EXPECT_EQ(ev.rfind("data: ", 0), 0u) << ev;
    std::string data = ev.substr(6);
    EXPECT_FALSE(s.done) << "an event after [DONE]";
    if (data == "[DONE]") {
      s.done = true;
      continue;
    }
    json j = json::parse(data);
    s.chunks.push_back(j);
    if (j.contains("usage") && !j["usage"].is_null()) s.usage = j["usage"];
    for (const auto& c : j["choices"]) {
      s.text += chat ? c["delta"].value("content", "") : c["text"].get<std::string>();
      if (c.contains("token_ids"))
        for (int32_t t : c["token_ids"]) s.token_ids.push_back(t);
      if (!c["finish_reason"].is_null()) s.finish_reason = c["finish_reason"];
    }
  }
  return s;
}

json completion_body(const std::string& prompt, uint64_t seed, int max_tokens, bool stream) {
  json b = {{"model", "llama3-tiny"}, {"prompt", prompt},         {"temperature", 1.0},
            {"seed", seed},           {"max_tokens", max_tokens}, {"return_token_ids", true}};
  if (stream) b["stream"] = true;
  return b;
}

TEST(Server, HealthModelsAndErrors) {
  DeployConfig cfg = tiny_config(", api_key: sk-test");
  LiveServer s(cfg, /*attach=*/false);
  const httplib::Headers auth = {{"Authorization", "Bearer sk-test"}};
  Reply h = s.get("/health");
  EXPECT_EQ(h.status, 503) << "not ready before the model has loaded";
  EXPECT_EQ(json::parse(h.body)["status"], "loading");
  Reply early = s.post("/v1/completions", {{"model", "llama3-tiny"}, {"prompt", "a"}}, auth);
  EXPECT_EQ(early.status, 503);
  EXPECT_EQ(json::parse(early.body)["error"]["code"], "model_loading");
  s.attach();
  EXPECT_EQ(s.get("/health").status, 200);

  Reply models = s.get("/v1/models", auth);
  ASSERT_EQ(models.status, 200);
  json m = json::parse(models.body);
  EXPECT_EQ(m["object"], "list");
  ASSERT_EQ(m["data"].size(), 1u);
  EXPECT_EQ(m["data"][0]["id"], "llama3-tiny");

  Reply noauth = s.post("/v1/completions", {{"model", "llama3-tiny"}, {"prompt", "a"}});
  EXPECT_EQ(noauth.status, 401);
  EXPECT_EQ(json::parse(noauth.body)["error"]["code"], "invalid_api_key");
  Reply wrongauth = s.post("/v1/completions", {{"model", "llama3-tiny"}, {"prompt", "a"}},
                           {{"Authorization", "Bearer nope"}});
  EXPECT_EQ(wrongauth.status, 401);
  EXPECT_EQ(s.get("/v1/models").status, 401);
  EXPECT_EQ(s.get("/health").status, 200) << "health needs no key";

  Reply other = s.post("/v1/completions", {{"model", "gpt-4"}, {"prompt", "a"}}, auth);
  EXPECT_EQ(other.status, 404);
  json oe = json::parse(other.body)["error"];
  EXPECT_EQ(oe["code"], "model_not_found");
  EXPECT_EQ(oe["param"], "model");

  Reply bad = s.post("/v1/chat/completions",
                     {{"model", "llama3-tiny"},
                      {"messages", {{{"role", "user"}, {"content", "x"}}}},
                      {"top_p", 2}},
                     auth);
  EXPECT_EQ(bad.status, 400);
  json be = json::parse(bad.body)["error"];
  EXPECT_EQ(be["type"], "invalid_request_error");
  EXPECT_EQ(be["param"], "top_p");
  EXPECT_EQ(be["message"], "top_p: expected a number in (0, 1], got 2");

  Reply outside = s.post("/v1/completions", {{"model", "llama3-tiny"}, {"prompt", {1, 99999}}},
                         auth);
  EXPECT_EQ(outside.status, 400);
  EXPECT_EQ(json::parse(outside.body)["error"]["message"],
            "prompt[1]: token 99999 is outside the vocabulary of 512");

  Reply too_long = s.post("/v1/completions",
                          {{"model", "llama3-tiny"}, {"prompt", "a"}, {"max_tokens", 100000}},
                          auth);
  EXPECT_EQ(too_long.status, 400);
  EXPECT_EQ(json::parse(too_long.body)["error"]["param"], "max_tokens");

  Reply nowhere = s.get("/v2/nothing", auth);
  EXPECT_EQ(nowhere.status, 404);
  EXPECT_EQ(json::parse(nowhere.body)["error"]["message"], "no route GET /v2/nothing");

  Reply metrics = s.get("/metrics");
  EXPECT_EQ(metrics.status, 200);
  EXPECT_EQ(s.metric("clshard_requests_rejected_total{reason=\"unauthorized\"}"), 3);
  EXPECT_EQ(s.metric("clshard_requests_rejected_total{reason=\"model_not_found\"}"), 1);
}

// Streaming gives the non-streaming answer's tokens and text, and the batch job's, for the same
// seed (temperature 1: every token is a seeded draw).
TEST(Server, StreamingEqualsNonStreamingEqualsBatchJob) {
  const std::vector<std::string> prompts = {"The quick brown fox", "Once upon a time",
                                            "tokens: 1 2 3"};
  // The batch job first.
  const fs::path dir = test::temp_dir("server-vs-batch");
  {
    std::ofstream in(dir / "in.jsonl");
    for (size_t i = 0; i < prompts.size(); ++i)
      in << json{{"custom_id", "r" + std::to_string(i)},
                 {"method", "POST"},
                 {"url", "/v1/completions"},
                 {"body", {{"model", "llama3-tiny"}, {"prompt", prompts[i]}, {"temperature", 1.0},
                           {"seed", 100 + i}, {"max_tokens", 20}}}}
                .dump()
         << "\n";
  }
  DeployConfig job_cfg = tiny_config();
  job_cfg.job.input = dir / "in.jsonl";
  job_cfg.job.output = dir / "out.jsonl";
  std::vector<std::vector<int32_t>> batch_tokens(prompts.size());
  {
    Deployment d = Deployment::open(job_cfg);
    std::ostringstream log;
    run_batch_job(d, log);
    std::ifstream out(dir / "out.jsonl");
    std::string line;
    while (std::getline(out, line)) {
      json j = json::parse(line);
      const size_t i = std::stoul(j["id"].get<std::string>().substr(1));
      batch_tokens[i] = j["token_ids"].get<std::vector<int32_t>>();
    }
  }

  LiveServer s(tiny_config());
  for (size_t i = 0; i < prompts.size(); ++i) {
    Reply whole = s.post("/v1/completions", completion_body(prompts[i], 100 + i, 20, false));
    ASSERT_EQ(whole.status, 200) << whole.body;
    json w = json::parse(whole.body);
    const auto whole_ids = w["choices"][0]["token_ids"].get<std::vector<int32_t>>();
    EXPECT_EQ(whole_ids, batch_tokens[i]) << "prompt " << i;

    json body = completion_body(prompts[i], 100 + i, 20, true);
    body["stream_options"] = {{"include_usage", true}};
    Reply streamed = s.post_stream("/v1/completions", body);
    ASSERT_EQ(streamed.status, 200);
    EXPECT_EQ(streamed.headers.find("Content-Type")->second, "text/event-stream");
    Sse sse = parse_sse(streamed.body, false);
    EXPECT_TRUE(sse.done) << "ends with data: [DONE]";
    EXPECT_EQ(sse.token_ids, whole_ids) << "prompt " << i;
    EXPECT_EQ(sse.text, w["choices"][0]["text"]);
    EXPECT_EQ(sse.finish_reason, w["choices"][0]["finish_reason"]);
    EXPECT_EQ(sse.usage, w["usage"]);
    EXPECT_EQ(sse.chunks.back()["choices"].size(), 0u) << "the usage chunk comes last";
  }

  // Chat, greedy: the same through both paths, and a stop string cut the same way.
  json chat = {{"model", "llama3-tiny"},
               {"messages", {{{"role", "user"}, {"content", "Say something"}}}},
               {"max_tokens", 24},
               {"return_token_ids", true}};
  Reply whole = s.post("/v1/chat/completions", chat);
  ASSERT_EQ(whole.status, 200) << whole.body;
  json w = json::parse(whole.body);
  EXPECT_EQ(w["object"], "chat.completion");
  EXPECT_EQ(w["choices"][0]["message"]["role"], "assistant");
  chat["stream"] = true;
  Sse sse = parse_sse(s.post_stream("/v1/chat/completions", chat).body, true);
  EXPECT_EQ(sse.text, w["choices"][0]["message"]["content"]);
  EXPECT_EQ(sse.token_ids, w["choices"][0]["token_ids"].get<std::vector<int32_t>>());
  EXPECT_EQ(sse.chunks.front()["choices"][0]["delta"]["role"], "assistant");
  const std::string text = w["choices"][0]["message"]["content"];
  if (text.size() >= 6) {
    // A stop string from the middle of the greedy answer: the text ends before it, streamed or
    // not (the stream holds back what could be the start of a stop string).
    // Whole UTF-8 characters: from a character's first byte, two characters.
    size_t from = text.size() / 2, to = from + 1;
    while (from > 0 && (uint8_t(text[from]) & 0xC0) == 0x80) --from;
    for (int chars = 0; to < text.size(); ++to)
      if ((uint8_t(text[to]) & 0xC0) != 0x80 && ++chars == 2) break;
    const std::string stop = text.substr(from, to - from);
    chat["stop"] = stop;
    chat["stream"] = false;
    json ws = json::parse(s.post("/v1/chat/completions", chat).body);
    chat["stream"] = true;
    Sse ss = parse_sse(s.post_stream("/v1/chat/completions", chat).body, true);
    EXPECT_EQ(ws["choices"][0]["message"]["content"], text.substr(0, text.find(stop)));
    EXPECT_EQ(ss.text, ws["choices"][0]["message"]["content"]);
    EXPECT_EQ(ws["choices"][0]["finish_reason"], "stop");
    EXPECT_EQ(ss.finish_reason, "stop");
  }
}

TEST(Server, SixtyFourConcurrentStreamsGetTheirOwnTokens) {
  LiveServer s(tiny_config());
  const int clients = 64;
  auto prompt = [](int i) { return "client " + std::to_string(i) + " says"; };
  std::vector<std::future<Reply>> whole, streamed;
  for (int i = 0; i < clients; ++i)
    whole.push_back(std::async(std::launch::async, [&, i] {
      return s.post("/v1/completions", completion_body(prompt(i), 1000 + i, 12, false));
    }));
  std::vector<std::vector<int32_t>> expected(clients);
  for (int i = 0; i < clients; ++i) {
    Reply r = whole[i].get();
    ASSERT_EQ(r.status, 200) << r.body;
    expected[i] = json::parse(r.body)["choices"][0]["token_ids"].get<std::vector<int32_t>>();
  }
  for (int i = 0; i < clients; ++i)
    streamed.push_back(std::async(std::launch::async, [&, i] {
      return s.post_stream("/v1/completions", completion_body(prompt(i), 1000 + i, 12, true));
    }));
  std::set<std::vector<int32_t>> distinct;
  for (int i = 0; i < clients; ++i) {
    Reply r = streamed[i].get();
    ASSERT_EQ(r.status, 200) << r.body;
    Sse sse = parse_sse(r.body, false);
    EXPECT_TRUE(sse.done);
    EXPECT_EQ(sse.token_ids, expected[i]) << "client " << i;
    distinct.insert(sse.token_ids);
  }
  EXPECT_GT(distinct.size(), size_t(clients / 2)) << "different seeds, different completions";
  EXPECT_EQ(s.metric("clshard_requests_finished_total{outcome=\"length\"}") +
                s.metric("clshard_requests_finished_total{outcome=\"stop\"}"),
            2 * clients);
  EXPECT_EQ(s.metric("clshard_kv_pages_used"), 0);
}

// Per-choice token ids and texts of a stream with n choices.
std::map<int, std::pair<std::vector<int32_t>, std::string>> stream_choices(const std::string& body,
                                                                           bool chat) {
  std::map<int, std::pair<std::vector<int32_t>, std::string>> out;
  for (const json& chunk : parse_sse(body, chat).chunks)
    for (const json& c : chunk["choices"]) {
      auto& [ids, text] = out[c["index"].get<int>()];
      if (c.contains("token_ids"))
        for (int32_t t : c["token_ids"]) ids.push_back(t);
      text += chat ? c["delta"].value("content", "") : c["text"].get<std::string>();
    }
  return out;
}

// Structured output through the server: a json_schema response that parses and validates, a
// regex, n choices (each its own seed, choice 0 the n = 1 answer, streamed the same), and the 400s
// of schemas and patterns the compiler refuses, naming the field.
TEST(Server, StructuredOutputAndChoices) {
  LiveServer s(tiny_config());
  const json schema = json::parse(R"({"type": "object", "properties": {
      "name": {"type": "string", "maxLength": 6}, "n": {"type": "integer"},
      "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
      "required": ["name", "n"], "additionalProperties": false})");
  json chat = {{"model", "llama3-tiny"},
               {"messages", {{{"role", "user"}, {"content", "Give me JSON"}}}},
               {"temperature", 1.0},
               {"seed", 3},
               {"n", 3},
               {"max_tokens", 200},
               {"return_token_ids", true},
               {"response_format",
                {{"type", "json_schema"}, {"json_schema", {{"name", "thing"}, {"schema", schema}}}}}};
  Reply r = s.post("/v1/chat/completions", chat);
  ASSERT_EQ(r.status, 200) << r.body;
  json j = json::parse(r.body);
  ASSERT_EQ(j["choices"].size(), 3u);
  size_t tokens = 0;
  std::set<std::string> texts;
  for (size_t i = 0; i < 3; ++i) {
    const json& c = j["choices"][i];
    EXPECT_EQ(c["index"], i);
    EXPECT_EQ(c["finish_reason"], "stop") << "the output completes well within 200 tokens";
    const std::string text = c["message"]["content"];
    texts.insert(text);
    const json v = json::parse(text);  // throws (fails the test) when it does not parse
    ASSERT_TRUE(v.is_object()) << text;
    ASSERT_TRUE(v.contains("name") && v["name"].is_string()) << text;
    EXPECT_LE(v["name"].get<std::string>().size(), 6u * 4) << text;  // 6 characters, UTF-8
    ASSERT_TRUE(v.contains("n") && v["n"].is_number_integer()) << text;
    for (const auto& [k, val] : v.items()) EXPECT_TRUE(k == "name" || k == "n" || k == "tags");
    if (v.contains("tags")) {
      ASSERT_TRUE(v["tags"].is_array());
      EXPECT_LE(v["tags"].size(), 3u);
      for (const json& t : v["tags"]) EXPECT_TRUE(t == "a" || t == "b") << text;
    }
    tokens += c["token_ids"].size();
  }
  EXPECT_GT(texts.size(), 1u) << "three choices, three seeds";
  EXPECT_EQ(j["usage"]["completion_tokens"], tokens) << "usage counts every choice";

  // Choice 0 is the answer of the same request with n = 1; the stream gives each choice the
  // tokens of the whole answer.
  json one = chat;
  one["n"] = 1;
  json j1 = json::parse(s.post("/v1/chat/completions", one).body);
  EXPECT_EQ(j1["choices"][0]["token_ids"], j["choices"][0]["token_ids"]);
  chat["stream"] = true;
  auto streamed = stream_choices(s.post_stream("/v1/chat/completions", chat).body, true);
  ASSERT_EQ(streamed.size(), 3u);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(streamed[i].first, j["choices"][i]["token_ids"].get<std::vector<int32_t>>()) << i;
    EXPECT_EQ(streamed[i].second, j["choices"][i]["message"]["content"]) << i;
  }

  // The regex extension on completions.
  json rx = completion_body("Code:", 11, 40, false);
  rx["regex"] = "[0-9]{3}-[a-z]{2}";
  Reply rr = s.post("/v1/completions", rx);
  ASSERT_EQ(rr.status, 200) << rr.body;
  const std::string code = json::parse(rr.body)["choices"][0]["text"];
  EXPECT_TRUE(std::regex_match(code, std::regex("[0-9]{3}-[a-z]{2}"))) << code;

  // What the compiler refuses: 400, the field and the JSON path in it.
  struct Case {
    json extra;
    std::string param, message;
  };
  const std::vector<Case> cases = {
      {json::parse(R"({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
          "schema": {"type": "object", "properties": {"age": {"type": "integer",
          "minimum": 0}}}}}})"),
       "response_format",
       "response_format.json_schema.schema.properties.age: unsupported keyword 'minimum'"},
      {json::parse(R"({"response_format": {"type": "yaml"}})"), "response_format", ""},
      {json::parse(R"({"regex": "a(b"})"), "regex", "regex: at offset 3: missing ')'"},
      {json{{"regex", "[0-9]+"},
            {"response_format", {{"type", "json_schema"}, {"json_schema", {{"schema", schema}}}}}},
       "regex", "regex: cannot be combined with a response_format of type json_schema"},
  };
  for (const Case& k : cases) {
    json body = completion_body("x", 1, 8, false);
    for (const auto& [key, v] : k.extra.items()) body[key] = v;
    Reply e = s.post("/v1/completions", body);
    EXPECT_EQ(e.status, 400) << e.body;
    const json err = json::parse(e.body)["error"];
    EXPECT_EQ(err["type"], "invalid_request_error");
    EXPECT_EQ(err["param"], k.param) << err;
    if (!k.message.empty()) {
      EXPECT_EQ(err["message"], k.message);
    } else {
      EXPECT_EQ(err["message"].get<std::string>().rfind("response_format.type: ", 0), 0u) << err;
    }
  }
  EXPECT_EQ(s.metric("clshard_kv_pages_used"), 0);
}

// Penalties and logprobs: the stream gives exactly the tokens (and log-probabilities) of the
// non-streaming answer for the same seed, and both are the batch job's for the same request.
TEST(Server, PenaltiesAndLogprobsStreamEqualsWholeAndBatchJob) {
  const json sampling = {{"temperature", 1.0},        {"seed", 77},
                         {"max_tokens", 24},          {"frequency_penalty", 0.8},
                         {"presence_penalty", 0.5},   {"repetition_penalty", 1.3}};
  json chat = {{"model", "llama3-tiny"},
               {"messages", {{{"role", "user"}, {"content", "Repeat after me: la la la"}}}},
               {"logprobs", true},
               {"top_logprobs", 3}};
  json completion = {{"model", "llama3-tiny"}, {"prompt", "la la la la"}, {"logprobs", 2}};
  for (const auto& [k, v] : sampling.items()) chat[k] = completion[k] = v;

  const fs::path dir = test::temp_dir("server-penalties-vs-batch");
  {
    std::ofstream in(dir / "in.jsonl");
    in << json{{"custom_id", "chat"}, {"url", "/v1/chat/completions"}, {"body", chat}}.dump()
       << "\n"
       << json{{"custom_id", "cmpl"}, {"url", "/v1/completions"}, {"body", completion}}.dump()
       << "\n";
  }
  DeployConfig job_cfg = tiny_config();
  job_cfg.job.input = dir / "in.jsonl";
  job_cfg.job.output = dir / "out.jsonl";
  std::map<std::string, json> batch;
  {
    Deployment d = Deployment::open(job_cfg);
    std::ostringstream log;
    run_batch_job(d, log);
    std::ifstream out(dir / "out.jsonl");
    for (std::string line; std::getline(out, line);) {
      json j = json::parse(line);
      ASSERT_FALSE(j.contains("error")) << j;
      batch[j["custom_id"]] = j;
    }
  }
  ASSERT_EQ(batch.size(), 2u);

  // Log-probabilities agree within 1e-5 (the same computation; the batch job's run may batch the
  // two requests together).
  auto near = [](const json& a, const json& b, const std::string& what) {
    ASSERT_EQ(a.size(), b.size()) << what;
    for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(a[i].get<double>(), b[i].get<double>(), 1e-5)
        << what << "[" << i << "]";
  };
  auto chat_lps = [](const json& content) {
    std::vector<double> v;
    for (const json& e : content) {
      v.push_back(e["logprob"]);
      for (const json& t : e["top_logprobs"]) v.push_back(t["logprob"]);
    }
    return json(v);
  };
  auto chat_tokens = [](const json& content) {
    std::vector<std::string> v;
    for (const json& e : content) {
      v.push_back(e["token"]);
      for (const json& t : e["top_logprobs"]) v.push_back(t["token"]);
    }
    return v;
  };

  LiveServer s(tiny_config());
  chat["return_token_ids"] = completion["return_token_ids"] = true;
  // Chat.
  Reply whole = s.post("/v1/chat/completions", chat);
  ASSERT_EQ(whole.status, 200) << whole.body;
  const json w = json::parse(whole.body)["choices"][0];
  const json b = batch["chat"]["response"]["body"]["choices"][0];
  EXPECT_EQ(w["token_ids"], batch["chat"]["token_ids"]);
  EXPECT_EQ(w["message"]["content"], b["message"]["content"]);
  const json& content = w["logprobs"]["content"];
  ASSERT_EQ(content.size(), w["token_ids"].size());
  for (const json& e : content) {
    EXPECT_EQ(e["top_logprobs"].size(), 3u);
    EXPECT_LE(e["logprob"].get<double>(), 0.0);
    EXPECT_TRUE(e["bytes"].is_array());
    EXPECT_GE(e["top_logprobs"][0]["logprob"].get<double>(),
              e["top_logprobs"][2]["logprob"].get<double>());
  }
  EXPECT_EQ(chat_tokens(content), chat_tokens(b["logprobs"]["content"]));
  near(chat_lps(content), chat_lps(b["logprobs"]["content"]), "chat vs batch");

  chat["stream"] = true;
  const std::string sbody = s.post_stream("/v1/chat/completions", chat).body;
  Sse sse = parse_sse(sbody, true);
  EXPECT_TRUE(sse.done);
  EXPECT_EQ(sse.token_ids, w["token_ids"].get<std::vector<int32_t>>());
  EXPECT_EQ(sse.text, w["message"]["content"]);
  json streamed_content = json::array();
  for (const json& c : sse.chunks)
    for (const json& ch : c["choices"])
      if (!ch["logprobs"].is_null())
        for (const json& e : ch["logprobs"]["content"]) streamed_content.push_back(e);
  EXPECT_EQ(chat_tokens(streamed_content), chat_tokens(content));
  near(chat_lps(streamed_content), chat_lps(content), "chat stream vs whole");

  // Completions: logprobs: 2.
  Reply cw = s.post("/v1/completions", completion);
  ASSERT_EQ(cw.status, 200) << cw.body;
  const json c = json::parse(cw.body)["choices"][0];
  const json cb = batch["cmpl"]["response"]["body"]["choices"][0];
  EXPECT_EQ(c["token_ids"], batch["cmpl"]["token_ids"]);
  EXPECT_EQ(c["text"], cb["text"]);
  const json& lp = c["logprobs"];
  ASSERT_EQ(lp["tokens"].size(), c["token_ids"].size());
  EXPECT_EQ(lp["tokens"], cb["logprobs"]["tokens"]);
  EXPECT_EQ(lp["text_offset"], cb["logprobs"]["text_offset"]);
  near(lp["token_logprobs"], cb["logprobs"]["token_logprobs"], "completions vs batch");
  for (const json& top : lp["top_logprobs"]) EXPECT_LE(top.size(), 2u);
  completion["stream"] = true;
  Sse cs = parse_sse(s.post_stream("/v1/completions", completion).body, false);
  EXPECT_EQ(cs.token_ids, c["token_ids"].get<std::vector<int32_t>>());
  EXPECT_EQ(cs.text, c["text"]);
  json tokens = json::array(), token_lps = json::array(), offsets = json::array(),
       tops = json::array();
  for (const json& chunk : cs.chunks)
    for (const json& ch : chunk["choices"])
      if (!ch["logprobs"].is_null())
        for (size_t i = 0; i < ch["logprobs"]["tokens"].size(); ++i) {
          tokens.push_back(ch["logprobs"]["tokens"][i]);
          token_lps.push_back(ch["logprobs"]["token_logprobs"][i]);
          offsets.push_back(ch["logprobs"]["text_offset"][i]);
          tops.push_back(ch["logprobs"]["top_logprobs"][i]);
        }
  EXPECT_EQ(tokens, lp["tokens"]);
  EXPECT_EQ(offsets, lp["text_offset"]) << "offsets run on across chunks";
  near(token_lps, lp["token_logprobs"], "completions stream vs whole");
  ASSERT_EQ(tops.size(), lp["top_logprobs"].size());
}

// A PEFT adapter with random A and B on every q_proj and v_proj of the tiny checkpoint.
void write_test_adapter(const fs::path& dir, const fs::path& checkpoint) {
  const json cfg = json::parse(std::ifstream(checkpoint / "config.json"));
  const int64_t hidden = cfg["hidden_size"], layers = cfg["num_hidden_layers"];
  const int64_t heads = cfg["num_attention_heads"];
  const int64_t kv = cfg.value("num_key_value_heads", heads) * (hidden / heads);
  const int64_t rank = 8;
  fs::create_directories(dir);
  std::ofstream(dir / "adapter_config.json")
      << json{{"r", rank}, {"lora_alpha", 16}, {"target_modules", {"q_proj", "v_proj"}},
              {"peft_type", "LORA"}}
             .dump();
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> u(-0.3f, 0.3f);
  std::vector<TensorToWrite> tensors;
  auto add = [&](const std::string& name, int64_t rows, int64_t cols) {
    std::vector<uint8_t> bytes(size_t(rows * cols) * 4);
    for (size_t i = 0; i < bytes.size(); i += 4) {
      const float x = u(rng);
      std::memcpy(bytes.data() + i, &x, 4);
    }
    tensors.push_back({name, DType::F32, {rows, cols}, std::move(bytes)});
  };
  for (int64_t l = 0; l < layers; ++l)
    for (const auto& [m, out] : std::vector<std::pair<std::string, int64_t>>{{"q_proj", hidden},
                                                                             {"v_proj", kv}}) {
      const std::string base =
          "base_model.model.model.layers." + std::to_string(l) + ".self_attn." + m;
      add(base + ".lora_A.weight", rank, hidden);
      add(base + ".lora_B.weight", out, rank);
    }
  write_safetensors(dir / "adapter_model.safetensors", tensors);
}

// `model` may name a LoRA adapter of the deployment: /v1/models lists it beside the base model,
// a request naming it runs on it (the batch job's tokens for a line with that `lora`), and an
// unknown name stays 404.
TEST(Server, ModelNamesALoraAdapter) {
  const fs::path dir = test::temp_dir("server-lora");
  write_test_adapter(dir / "tuned", tiny_checkpoint());
  DeployConfig cfg = parse_deploy_config(
      "model: {path: " + tiny_checkpoint().string() +
          "}\n"
          "devices: {type: cpu}\n"
          "kv_cache: {page_size: 16, pages: 128}\n"
          "sampling: {temperature: 0.0, max_tokens: 12}\n"
          "lora: {adapters: {tuned: " + (dir / "tuned").string() + "}, max_rank: 8}\n"
          "serve: {port: 0}\n",
      "server-lora.yaml");
  {
    std::ofstream in(dir / "in.jsonl");
    in << R"({"id": "t", "prompt": "The adapter says", "lora": "tuned"})" << "\n"
       << R"({"id": "b", "prompt": "The adapter says"})" << "\n";
  }
  DeployConfig job_cfg = cfg;
  job_cfg.job.input = dir / "in.jsonl";
  job_cfg.job.output = dir / "out.jsonl";
  std::map<std::string, std::vector<int32_t>> batch;
  {
    Deployment d = Deployment::open(job_cfg);
    std::ostringstream log;
    run_batch_job(d, log);
    std::ifstream out(dir / "out.jsonl");
    for (std::string line; std::getline(out, line);) {
      json j = json::parse(line);
      ASSERT_FALSE(j.contains("error")) << j;
      batch[j["id"]] = j["token_ids"].get<std::vector<int32_t>>();
    }
  }
  ASSERT_NE(batch["t"], batch["b"]) << "the adapter changes the greedy tokens";

  LiveServer s(cfg);
  json models = json::parse(s.get("/v1/models").body);
  ASSERT_EQ(models["data"].size(), 2u);
  EXPECT_EQ(models["data"][0]["id"], "llama3-tiny");
  EXPECT_TRUE(models["data"][0]["parent"].is_null());
  EXPECT_EQ(models["data"][1]["id"], "tuned");
  EXPECT_EQ(models["data"][1]["parent"], "llama3-tiny");

  for (const auto& [name, id] : std::vector<std::pair<std::string, std::string>>{
           {"tuned", "t"}, {"llama3-tiny", "b"}}) {
    json body = {{"model", name}, {"prompt", "The adapter says"}, {"return_token_ids", true}};
    Reply r = s.post("/v1/completions", body);
    ASSERT_EQ(r.status, 200) << r.body;
    const json j = json::parse(r.body);
    EXPECT_EQ(j["model"], name);
    EXPECT_EQ(j["choices"][0]["token_ids"].get<std::vector<int32_t>>(), batch[id]) << name;
    body["stream"] = true;
    EXPECT_EQ(parse_sse(s.post_stream("/v1/completions", body).body, false).token_ids, batch[id])
        << name << ", streamed";
  }
  Reply unknown = s.post("/v1/completions", {{"model", "tuned2"}, {"prompt", "x"}});
  EXPECT_EQ(unknown.status, 404);
  EXPECT_EQ(json::parse(unknown.body)["error"]["message"],
            "The model `tuned2` does not exist (this server serves `llama3-tiny`, `tuned`).");
}

// A client that gives up waiting for a whole (non-streaming) answer and closes its connection
// cancels the request: its pages go back and it does not run to max_tokens.
TEST(Server, ClientGoneBeforeTheWholeAnswerFreesItsPages) {
  LiveServer s(tiny_config());
  json body = completion_body("a long story", 5, 2000, false);
  body["ignore_eos"] = true;  // it runs 2000 tokens unless cancelled
  {
    httplib::Client cli("127.0.0.1", s.port());
    cli.set_read_timeout(0, 300000);  // gives up after 0.3 s, and closes the connection
    auto r = cli.Post("/v1/completions", body.dump(), "application/json");
    EXPECT_FALSE(r) << "2000 tokens do not fit in 0.3 s on this model";
  }
  expect_one_cancelled_and_pages_back(s);
  EXPECT_LT(s.metric("clshard_generation_tokens_total"), 2000) << "it did not run to the end";
  EXPECT_EQ(s.get("/health").status, 200);
}

TEST(Server, OverloadAnswers429AndHealthKeepsAnswering) {
  // 2 rows, 4 waiting: 40 requests at once overflow the queue.
  LiveServer s(tiny_config(", max_waiting: 4", "{max_batch_size: 2, max_batch_input_tokens: 256}"));
  const int n = 40;
  std::atomic<bool> running{true};
  std::atomic<int> health_ok{0}, health_bad{0};
  std::thread health([&] {
    while (running) {
      const auto t0 = std::chrono::steady_clock::now();
      Reply h = s.get("/health");
      const double s_taken =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      (h.status == 200 && s_taken < 2.0 ? health_ok : health_bad)++;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  });
  std::vector<std::future<Reply>> replies;
  for (int i = 0; i < n; ++i)
    replies.push_back(std::async(std::launch::async, [&, i] {
      return s.post("/v1/completions", completion_body("overload " + std::to_string(i), i, 24,
                                                       false));
    }));
  int ok = 0, rejected = 0;
  for (auto& f : replies) {
    Reply r = f.get();
    if (r.status == 429) {
      ++rejected;
      json e = json::parse(r.body)["error"];
      EXPECT_EQ(e["code"], "rate_limit_exceeded");
      EXPECT_EQ(e["message"], "too many requests waiting (serve.max_waiting 4); retry later");
    } else {
      ASSERT_EQ(r.status, 200) << r.body;
      json j = json::parse(r.body);
      EXPECT_EQ(j["usage"]["completion_tokens"], j["choices"][0]["token_ids"].size());
      ++ok;
    }
  }
  running = false;
  health.join();
  EXPECT_GT(rejected, 0);
  EXPECT_GT(ok, 0);
  EXPECT_EQ(ok + rejected, n);
  EXPECT_GT(health_ok.load(), 0);
  EXPECT_EQ(health_bad.load(), 0) << "/health answered 200 within 2 s throughout";
  EXPECT_EQ(s.metric("clshard_requests_rejected_total{reason=\"queue_full\"}"), rejected);
  EXPECT_EQ(s.get("/health").status, 200);
}

TEST(Server, ClientGoneMidStreamFreesItsPages) {
  LiveServer s(tiny_config());
  json body = completion_body("a long story", 5, 400, true);
  body["ignore_eos"] = true;  // it runs 400 tokens unless cancelled
  int chunks = 0;
  Reply r = s.post_stream("/v1/completions", body, [&](const std::string& all) {
    // Gone after 3 events of tokens.
    chunks = int(std::count(all.begin(), all.end(), '\n')) / 2;
    return chunks < 3;
  });
  EXPECT_GE(chunks, 3);
  // The server notices at its next writes and cancels the request: its pages go back.
  expect_one_cancelled_and_pages_back(s);
  EXPECT_LT(s.metric("clshard_generation_tokens_total"), 400) << "it did not run to the end";
}

TEST(Server, GracefulStopFinishesOrCancels) {
  const auto t0 = std::chrono::steady_clock::now();
  {
    // Enough time: the running request finishes normally, then the server stops.
    LiveServer s(tiny_config());
    json body = completion_body("finish me", 1, 40, false);
    json whole = json::parse(s.post("/v1/completions", body).body)["choices"][0];
    body["stream"] = true;
    auto f = std::async(std::launch::async,
                        [&] { return s.post_stream("/v1/completions", body); });
    while (s.metric("clshard_requests_running") < 1 &&
           std::chrono::steady_clock::now() - t0 < std::chrono::seconds(10))
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    EXPECT_EQ(s.server().shutdown(std::chrono::seconds(30)), 0u);
    Sse sse = parse_sse(f.get().body, false);
    EXPECT_TRUE(sse.done);
    EXPECT_EQ(sse.token_ids, whole["token_ids"].get<std::vector<int32_t>>());
    EXPECT_EQ(sse.finish_reason, whole["finish_reason"]);
    EXPECT_EQ(s.get("/health").status, 0) << "no longer listening";
  }
  {
    // No time: the request is cancelled and its client told so.
    LiveServer s(tiny_config());
    json body = completion_body("a long story", 5, 2000, true);
    body["ignore_eos"] = true;  // it runs 2000 tokens unless cancelled
    auto f = std::async(std::launch::async,
                        [&] { return s.post_stream("/v1/completions", body); });
    while (s.metric("clshard_generation_tokens_total") < 1 &&
           std::chrono::steady_clock::now() - t0 < std::chrono::seconds(10))
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    EXPECT_EQ(s.server().shutdown(std::chrono::milliseconds(100)), 1u);
    Sse sse = parse_sse(f.get().body, false);
    EXPECT_TRUE(sse.done);
    ASSERT_FALSE(sse.chunks.empty());
    EXPECT_EQ(sse.chunks.back()["error"]["code"], "shutting_down")
        << sse.token_ids.size() << " tokens, finish " << sse.finish_reason;
  }
}

TEST(Server, RequestDeadline) {
  LiveServer s(tiny_config(", request_deadline_s: 0.3"));
  json body = completion_body("slow", 1, 2000, false);
  body["ignore_eos"] = true;
  Reply r = s.post("/v1/completions", body);
  // 2000 tokens do not fit in 0.3 s on this model.
  ASSERT_EQ(r.status, 504) << r.body;
  EXPECT_EQ(json::parse(r.body)["error"]["code"], "request_deadline_exceeded");
  EXPECT_EQ(s.metric("clshard_requests_finished_total{outcome=\"deadline\"}"), 1);
  EXPECT_EQ(s.metric("clshard_kv_pages_used"), 0);
}

}  // namespace
}  // namespace clshard
