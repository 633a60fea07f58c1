// Structured output through the engine: the random-weight llama3-tiny samples 200 outputs at
// temperature 1.0 under 12 JSON schemas and 2 regexes, and every output must end on its own, parse
// and validate against its schema (checked here by a small validator of the supported subset,
// written apart from the compiler) or match its regex (checked by PCRE2). With speculative
// decoding (the trained DeepSeek-V3-style checkpoint and its MTP layer) the same holds, and greedy
// constrained speculative decoding gives exactly the tokens of greedy constrained plain decoding.
// The batch job's response_format and regex lines, and json_object mode, are checked too.
#include <gtest/gtest.h>

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <fstream>
#include <map>

#include <nlohmann/json.hpp>

#include "models/registry.h"
#include "runtime/device.h"
#include "runtime/engine/batch_io.h"
#include "runtime/engine/engine.h"
#include "runtime/engine/structured/response_format.h"
#include "runtime/text/tokenizer.h"
#include "tests/test_util.h"

namespace clshard {
namespace {

using json = nlohmann::json;
using ordered_json = nlohmann::ordered_json;

size_t codepoints(const std::string& s) {
  size_t n = 0;
  for (unsigned char c : s) n += (c & 0xC0) != 0x80;
  return n;
}

bool has_type(const json& v, const std::string& t) {
  if (t == "string") return v.is_string();
  if (t == "integer") return v.is_number_integer();
  if (t == "number") return v.is_number();
  if (t == "boolean") return v.is_boolean();
  if (t == "null") return v.is_null();
  if (t == "object") return v.is_object();
  if (t == "array") return v.is_array();
  return false;
}

// The JSON-schema subset the compiler supports, checked from the specification, not from the
// compiler's code. Returns "" when `v` is valid, else where and why not.
std::string invalid(const json& v, const json& s, const json& root, const std::string& at) {
  if (s.contains("$ref")) {
    const std::string ref = s["$ref"];
    return invalid(v, root["$defs"][ref.substr(std::string("#/$defs/").size())], root, at);
  }
  if (s.contains("anyOf")) {
    for (const auto& option : s["anyOf"])
      if (invalid(v, option, root, at).empty()) return "";
    return at + ": matches no anyOf option";
  }
  if (s.contains("const") && v != s["const"]) return at + ": not the const";
  if (s.contains("enum") && std::find(s["enum"].begin(), s["enum"].end(), v) == s["enum"].end())
    return at + ": not in the enum";
  if (s.contains("type")) {
    bool ok = false;
    if (s["type"].is_array()) {
      for (const auto& t : s["type"]) ok = ok || has_type(v, t);
    } else {
      ok = has_type(v, s["type"]);
    }
    if (!ok) return at + ": wrong type";
  }
  if (v.is_string()) {
    const size_t n = codepoints(v.get<std::string>());
    if (s.contains("minLength") && n < s["minLength"].get<size_t>()) return at + ": too short";
    if (s.contains("maxLength") && n > s["maxLength"].get<size_t>()) return at + ": too long";
  }
  if (v.is_array()) {
    if (s.contains("minItems") && v.size() < s["minItems"].get<size_t>()) return at + ": few";
    if (s.contains("maxItems") && v.size() > s["maxItems"].get<size_t>()) return at + ": many";
    if (s.contains("items"))
      for (size_t i = 0; i < v.size(); ++i) {
        std::string e = invalid(v[i], s["items"], root, at + "[" + std::to_string(i) + "]");
        if (!e.empty()) return e;
      }
  }
  if (v.is_object()) {
    if (s.contains("required"))
      for (const auto& r : s["required"])
        if (!v.contains(r.get<std::string>())) return at + ": lacks " + r.get<std::string>();
    for (const auto& [k, item] : v.items()) {
      if (s.contains("properties") && s["properties"].contains(k)) {
        std::string e = invalid(item, s["properties"][k], root, at + "." + k);
        if (!e.empty()) return e;
      } else if (s.value("additionalProperties", json(true)) == false) {
        return at + ": extra property " + k;
      }
    }
  }
  return "";
}

bool pcre2_full_match(const std::string& pattern, const std::string& text) {
  int err;
  PCRE2_SIZE off;
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.c_str()), pattern.size(),
                                   PCRE2_UTF | PCRE2_ANCHORED | PCRE2_ENDANCHORED, &err, &off,
                                   nullptr);
  if (!code) throw std::runtime_error("pcre2_compile: " + pattern);
  pcre2_match_data* data = pcre2_match_data_create_from_pattern(code, nullptr);
  const int rc = pcre2_match(code, reinterpret_cast<PCRE2_SPTR>(text.data()), text.size(), 0, 0,
                             data, nullptr);
  pcre2_match_data_free(data);
  pcre2_code_free(code);
  return rc >= 0;
}

// A response format of the test: a JSON schema or a regex. Every one bounds the length of its
// outputs (maxLength, maxItems, enums; numbers are bounded by the grammar), so a request given
// enough tokens always ends with a complete output. json_object mode is not among them: a random
// model wanders in its unbounded strings and objects, and a request that reaches max_tokens ends
// with finish_reason "length" and an unfinished text, as in any server.
struct Format {
  std::string schema;  // "" for a regex
  std::string regex;
};

const std::vector<Format>& formats() {
  static const std::vector<Format> f = {
      {R"({"type":"object","properties":{"name":{"type":"string","maxLength":8},
           "age":{"type":"integer"}},"required":["name","age"],"additionalProperties":false})"},
      {R"({"type":"array","items":{"type":"integer"},"minItems":1,"maxItems":4})"},
      {R"({"type":"object","properties":{"ok":{"type":"boolean"},"note":{"type":"null"}},
           "required":["ok"],"additionalProperties":false})"},
      {R"({"enum":["red","green","blue",1,null]})"},
      {R"({"type":"object","properties":{"color":{"type":"string","enum":["red","green"]},
           "hex":{"const":"#fff"}},"required":["color","hex"]})"},
      {R"({"type":"number"})"},
      {R"({"type":"object","properties":{"user":{"type":"object","properties":{
           "id":{"type":"integer"},"tags":{"type":"array","items":{"type":"string",
           "maxLength":4},"maxItems":2}},"required":["id","tags"]}},"required":["user"]})"},
      {R"({"type":["string","null"],"maxLength":5})"},
      {R"({"anyOf":[{"type":"integer"},{"type":"boolean"}]})"},
      {R"({"type":"object","properties":{"a":{"type":"number"},"b":{"type":"string",
           "minLength":2,"maxLength":3},"c":{"type":"array","items":{"type":"boolean"},
           "maxItems":3}},"required":["b"],"additionalProperties":false})"},
      {R"({"$defs":{"pt":{"type":"object","properties":{"x":{"type":"integer"},
           "y":{"type":"integer"}},"required":["x","y"]}},"type":"array",
           "items":{"$ref":"#/$defs/pt"},"maxItems":2})"},
      {R"({"type":"object","properties":{"id":{"type":"integer"},"score":{"type":"number"},
           "label":{"enum":["a","b"]}},"required":["id","score","label"]})"},
      {"", "\\d{3}-[a-z]{2,4}"},
      {"", "(yes|no|maybe)( [A-Z][a-z]{0,5}){0,3}\\."},
  };
  return f;
}

std::shared_ptr<TokenConstraint> compile(const Format& f, const Tokenizer& tok) {
  if (!f.regex.empty()) return compile_response_format(nullptr, &f.regex, tok);
  const ordered_json rf = {
      {"type", "json_schema"},
      {"json_schema", {{"name", "t"}, {"schema", ordered_json::parse(f.schema)}}}};
  return compile_response_format(&rf, nullptr, tok);
}

// "" when the output is valid for its format.
std::string check_output(const Format& f, const std::string& text) {
  if (!f.regex.empty())
    return pcre2_full_match(f.regex, text) ? "" : "does not match the regex";
  json v;
  try {
    v = json::parse(text);
  } catch (const json::exception& e) {
    return std::string("does not parse: ") + e.what();
  }
  const json schema = json::parse(f.schema);
  return invalid(v, schema, schema, "$");
}

struct Outcome {
  std::vector<GenerationResult> results;
  std::vector<size_t> format_of;
};

// `count` requests over the formats in turn, all submitted at once.
Outcome generate(Engine& engine, const Tokenizer& tok, size_t count, float temperature,
                 uint32_t max_tokens) {
  std::vector<std::shared_ptr<TokenConstraint>> compiled;
  for (const auto& f : formats()) compiled.push_back(compile(f, tok));
  Outcome o;
  std::map<uint64_t, size_t> index;
  for (size_t i = 0; i < count; ++i) {
    GenerationRequest r;
    r.prompt = tok.encode("Answer " + std::to_string(i) + " in the format: ");
    r.sampling.temperature = temperature;
    r.sampling.seed = 1000 + i;
    r.max_tokens = max_tokens;
    r.constraint = compiled[i % compiled.size()];
    index[engine.submit(std::move(r))] = i;
    o.format_of.push_back(i % compiled.size());
  }
  o.results.resize(count);
  while (engine.has_work())
    for (auto& res : engine.step()) o.results[index.at(res.handle)] = std::move(res);
  return o;
}

void expect_all_valid(const Outcome& o, const Tokenizer& tok) {
  size_t checked = 0;
  for (size_t i = 0; i < o.results.size(); ++i) {
    const GenerationResult& r = o.results[i];
    const Format& f = formats()[o.format_of[i]];
    SCOPED_TRACE("request " + std::to_string(i) + ", format " + std::to_string(o.format_of[i]) +
                 ": " + r.text);
    ASSERT_EQ(r.reason, EndReason::Stop) << r.error;
    EXPECT_EQ(tok.decode(r.token_ids, true), r.text);
    EXPECT_EQ(check_output(f, r.text), "");
    ++checked;
  }
  EXPECT_EQ(checked, o.results.size());
}

struct TinyLlama {
  std::filesystem::path dir;
  std::unique_ptr<CausalLM> model;
  std::optional<Tokenizer> tok;
  TinyLlama() {
    dir = test::temp_dir("structured_llama3_tiny");
    make_model("llama3-tiny", dir, MakeModelOptions{});
    model = load_model(dir, LoadOptions{{&test::default_device()}, std::nullopt});
    tok = Tokenizer::from_dir(dir);
  }
};

TEST(StructuredGeneration, TwoHundredRandomModelOutputsAllValidate) {
  TinyLlama m;
  SchedulerLimits lim;
  lim.max_batch_size = 40;
  lim.max_batch_input_tokens = 512;
  lim.page_size = 16;
  lim.total_pages = 40 * 24;
  lim.max_length = 512;
  m.model->allocate_kv_cache(lim.total_pages, lim.page_size);
  Engine engine(*m.model, &*m.tok, lim);
  // max_tokens generous enough for any output of the bounded formats: every request must end
  // because its output is complete (reason Stop), never at max_tokens.
  const Outcome o = generate(engine, *m.tok, 200, 1.0f, 360);
  expect_all_valid(o, *m.tok);
}

// json_object mode: its strings, arrays and objects are unbounded, so a model may still be inside
// one at max_tokens and end with finish_reason "length" and an unfinished text. (The earlier
// version of these tests had json_object among the formats: the trained checkpoint wrote prose
// into a JSON string and the batch job's random model wandered in one until max_tokens 360, which
// read as an unterminated string; the automaton was right.) Every output that ends on its own
// (Stop) is a complete JSON object; every other one has run exactly max_tokens tokens.
TEST(StructuredGeneration, JsonObjectOutputsThatEndAreObjects) {
  TinyLlama m;
  SchedulerLimits lim;
  lim.max_batch_size = 32;
  lim.max_batch_input_tokens = 512;
  lim.page_size = 16;
  lim.total_pages = 32 * 16;
  lim.max_length = 256;
  m.model->allocate_kv_cache(lim.total_pages, lim.page_size);
  Engine engine(*m.model, &*m.tok, lim);
  const ordered_json rf = {{"type", "json_object"}};
  const auto constraint = compile_response_format(&rf, nullptr, *m.tok);
  const uint32_t max_tokens = 160;
  std::map<uint64_t, size_t> index;
  for (size_t i = 0; i < 32; ++i) {
    GenerationRequest r;
    r.prompt = m.tok->encode("Object " + std::to_string(i) + ": ");
    r.sampling.temperature = 1.0f;
    r.sampling.seed = 500 + i;
    r.max_tokens = max_tokens;
    r.constraint = constraint;
    index[engine.submit(std::move(r))] = i;
  }
  size_t ended = 0, cut = 0;
  while (engine.has_work())
    for (const GenerationResult& r : engine.step()) {
      SCOPED_TRACE("request " + std::to_string(index.at(r.handle)) + ": " + r.text);
      if (r.reason == EndReason::Stop) {
        ++ended;
        json v;
        EXPECT_NO_THROW(v = json::parse(r.text));
        EXPECT_TRUE(v.is_object());
      } else {
        ++cut;
        EXPECT_EQ(r.reason, EndReason::Length) << r.error;
        EXPECT_EQ(r.token_ids.size(), max_tokens);
      }
    }
  EXPECT_EQ(ended + cut, 32u);
  EXPECT_GT(ended, 0u) << "some random walks close their object within " << max_tokens;
}

// The trained DeepSeek-V3-style checkpoint with its MTP layer (drafts really get accepted) and
// its tokenizer; K = 2 drafts per step, or plain decoding with K = 0.
struct TrainedMtp {
  std::unique_ptr<CausalLM> target;
  std::unique_ptr<DraftModel> draft;
  std::optional<Tokenizer> tok;
  std::unique_ptr<Engine> engine;
  explicit TrainedMtp(uint32_t K) {
    const auto dir = test::shared_dir() / "models" / "dsv3-mtp-trained";
    LoadOptions o;
    o.devices = {&test::default_device()};
    target = load_model(dir, o);
    tok = Tokenizer::from_dir(dir);
    SchedulerLimits lim;
    lim.max_batch_size = 16;
    lim.max_batch_input_tokens = 256;
    lim.page_size = 16;
    lim.total_pages = 16 * 28;
    lim.max_length = 448;
    lim.num_speculative_tokens = K;
    target->allocate_kv_cache(lim.total_pages, lim.page_size);
    SpeculativeOptions spec;
    if (K > 0) {
      draft = load_draft("mtp", dir, std::nullopt, o);
      draft->allocate_kv_cache(lim.total_pages, lim.page_size);
      spec.num_tokens = K;
    }
    engine = std::make_unique<Engine>(*target, &*tok, lim, draft.get(), spec);
  }
};

TEST(StructuredGeneration, SpeculativeOutputsValidateAndGreedyEqualsPlain) {
  {
    TrainedMtp spec(2);
    const Outcome o = generate(*spec.engine, *spec.tok, 28, 1.0f, 360);
    expect_all_valid(o, *spec.tok);
    EXPECT_GT(spec.engine->stats().speculative.drafted, 0u);
  }
  // Greedy: the masks of every verified position must be those plain decoding uses there.
  std::vector<std::vector<int32_t>> plain_tokens, spec_tokens;
  uint64_t accepted = 0;
  {
    TrainedMtp plain(0);
    const Outcome o = generate(*plain.engine, *plain.tok, 14, 0.0f, 360);
    expect_all_valid(o, *plain.tok);
    for (const auto& r : o.results) plain_tokens.push_back(r.token_ids);
  }
  {
    TrainedMtp spec(2);
    const Outcome o = generate(*spec.engine, *spec.tok, 14, 0.0f, 360);
    expect_all_valid(o, *spec.tok);
    for (const auto& r : o.results) spec_tokens.push_back(r.token_ids);
    accepted = spec.engine->stats().speculative.accepted;
  }
  EXPECT_EQ(spec_tokens, plain_tokens);
  EXPECT_GT(accepted, 0u) << "no draft was accepted under the constraints";
}

// The batch job: response_format and regex lines give valid outputs; bad ones become the line's
// error record naming the field, and the job goes on.
TEST(StructuredGeneration, BatchJobLinesWithFormats) {
  const auto model_dir = test::temp_dir("structured_batch_model");
  make_model("llama3-tiny", model_dir, MakeModelOptions{});
  const auto dir = test::temp_dir("structured_batch_job");
  const std::string schema = formats()[0].schema;
  std::ofstream(dir / "prompts.jsonl")
      << R"({"id": "s", "prompt": "Hi", "temperature": 1.0, "response_format": {"type": )"
      << R"("json_schema", "json_schema": {"name": "p", "schema": )" << ordered_json::parse(schema)
      << "}}}\n"
      << R"({"id": "r", "prompt": "Hi", "temperature": 1.0, "regex": "\\d{3}-[a-z]{2,4}"})"
      << "\n"
      << R"({"custom_id": "o", "body": {"prompt": "Hi", "temperature": 1.0, "response_format": )"
      << R"({"type": "json_schema", "json_schema": {"name": "q", "schema": )"
      << ordered_json::parse(formats()[2].schema) << "}}}}\n"
      << R"({"id": "bad1", "prompt": "Hi", "response_format": {"type": "json_schema", )"
      << R"("json_schema": {"schema": {"type": "integer", "minimum": 3}}}})" << "\n"
      << R"({"id": "bad2", "prompt": "Hi", "regex": 5})" << "\n"
      << R"({"custom_id": "bad3", "body": {"prompt": "Hi", "regex": "a(b"}})" << "\n";
  std::ofstream(dir / "deploy.yaml")
      << "model:\n  path: " << model_dir.string() << "\ndevices:\n  type: cpu\n"
      << "kv_cache:\n  page_size: 16\nbatch:\n  max_batch_size: 4\n"
      << "  max_batch_input_tokens: 64\nsampling:\n  max_tokens: 360\n"
      << "job:\n  input: prompts.jsonl\n  output: out/completions.jsonl\n";
  std::string out, err;
  ASSERT_EQ(test::run_clshard({"run", (dir / "deploy.yaml").string()}, &out, &err), 0) << err;
  std::ifstream in(dir / "out" / "completions.jsonl");
  std::map<std::string, json> recs;
  for (std::string line; std::getline(in, line);) {
    const json r = json::parse(line);
    recs[r.contains("custom_id") ? r["custom_id"].get<std::string>() : r["id"].get<std::string>()] =
        r;
  }
  ASSERT_EQ(recs.size(), 6u) << err;
  EXPECT_EQ(check_output(formats()[0], recs["s"]["text"]), "") << recs["s"];
  EXPECT_EQ(recs["s"]["finish_reason"], "stop");
  EXPECT_EQ(check_output(formats()[12], recs["r"]["text"]), "") << recs["r"];
  const json body = recs["o"]["response"]["body"];
  EXPECT_EQ(check_output(formats()[2], body["choices"][0]["text"]), "") << body;
  EXPECT_EQ(body["choices"][0]["finish_reason"], "stop") << body;
  EXPECT_EQ(recs["bad1"]["error"],
            "response_format.json_schema.schema: unsupported keyword 'minimum'");
  EXPECT_EQ(recs["bad2"]["error"],
            "regex: expected a string (a pattern the whole output must match), got 5");
  EXPECT_EQ(recs["bad3"]["error"], "body.regex: at offset 3: missing ')'") << recs["bad3"];
}

}  // namespace
}  // namespace clshard
