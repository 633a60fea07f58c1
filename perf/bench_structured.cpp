// Structured output's costs on a 128k vocabulary (the Llama 3 tokenizer, 128256 tokens): the
// vocabulary trie (once per tokenizer), compiling a format (JSON schema or regex -> byte DFA), and
// the per-step token mask, cold (the trie walked against the DFA state) and warm (the state's
// cached mask copied out), walking a valid output token by token.
//
// usage: bench_structured [tokenizer_dir]   (default $CLSHARD_SHARED_DIR/tokenizers/llama3)
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "perf/bench_util.h"
#include "runtime/engine/sampling.h"
#include "runtime/engine/structured/json_schema.h"
#include "runtime/engine/structured/regex_parser.h"
#include "runtime/engine/structured/response_format.h"
#include "runtime/engine/structured/token_automaton.h"
#include "runtime/text/tokenizer.h"

namespace {

using namespace clshard;
using namespace clshard::structured;
using Clock = std::chrono::steady_clock;
using ordered_json = nlohmann::ordered_json;

double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

std::filesystem::path default_tokenizer_dir() {
  if (const char* shared = std::getenv("CLSHARD_SHARED_DIR"))
    return std::filesystem::path(shared) / "tokenizers" / "llama3";
  return "../shared/tokenizers/llama3";
}

struct Case {
  const char* name;
  std::string schema;  // "" = regex / json_object
  std::string regex;
  bool json_object = false;
  std::string sample;  // a valid output, walked token by token
};

std::vector<Case> cases() {
  return {
      {"schema: 3 properties",
       R"({"type":"object","properties":{"name":{"type":"string"},"age":{"type":"integer"},
           "ok":{"type":"boolean"}},"required":["name","age"]})",
       "", false, R"({"name": "Ada Lovelace", "age": 36, "ok": true})"},
      {"schema: nested, 12 properties",
       R"({"type":"object","properties":{
           "id":{"type":"integer"},"title":{"type":"string","maxLength":80},
           "status":{"enum":["open","closed","pending"]},"score":{"type":"number"},
           "owner":{"type":"object","properties":{"name":{"type":"string"},
             "email":{"type":"string"},"admin":{"type":"boolean"}},"required":["name"]},
           "tags":{"type":"array","items":{"type":"string"},"maxItems":8},
           "created":{"type":"string"},"parent":{"type":["integer","null"]},
           "points":{"type":"array","items":{"type":"object","properties":{
             "x":{"type":"number"},"y":{"type":"number"}},"required":["x","y"]}},
           "done":{"type":"boolean"},"notes":{"type":"string"},"rank":{"type":"integer"}},
           "required":["id","title","status","owner","tags"]})",
       "", false,
       R"({"id": 7, "title": "Fix the parser", "status": "open", "score": 0.75, "owner": )"
       R"({"name": "Bob", "admin": false}, "tags": ["bug", "parser"], "points": [{"x": 1.5, )"
       R"("y": -2}], "done": false, "rank": 3})"},
      {"json_object", "", "", true,
       R"({"query": "weather in Paris", "days": [1, 2, 3], "units": {"temp": "C"}})"},
      {"regex: date + words", "", R"(\d{4}-\d{2}-\d{2}( [A-Za-z]+){1,5}\.)", false,
       "2024-06-01 The quick brown fox."},
  };
}

Regex regex_of(const Case& c) {
  if (!c.regex.empty()) return parse_regex(c.regex);
  if (c.json_object) return json_object_regex();
  return json_schema_regex(ordered_json::parse(c.schema), "schema");
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Structured output's costs on a 128k vocabulary: the vocabulary trie, compiling a "
               "format, and the per-step token mask cold and warm",
               "bench_structured"};
  std::string dir_arg = default_tokenizer_dir().string();
  app.add_option("TOKENIZER_DIR", dir_arg, "directory with the Llama 3 tokenizer.json")
      ->capture_default_str();
  bench::parse_args(app, argc, argv);
  const std::filesystem::path dir = dir_arg;
  const Tokenizer tok = Tokenizer::from_dir(dir);
  auto t0 = Clock::now();
  auto vocab = TokenVocabulary::of(tok);
  const double vocab_ms = ms_since(t0);
  t0 = Clock::now();
  auto again = TokenVocabulary::of(tok);
  const double vocab_hit_ms = ms_since(t0);
  std::printf("vocabulary: %u tokens, %u trie nodes; built in %.1f ms, found again in %.2f ms "
              "(fingerprint of the byte strings)\n\n",
              vocab->size(), vocab->trie_nodes(), vocab_ms, vocab_hit_ms);
  std::printf("%-30s %8s %8s %6s %10s %9s %7s %11s %11s %11s\n", "format", "NFA", "DFA",
              "class", "compile ms", "api ms", "steps", "cold ms/st", "warm us/st",
              "walk ms/st");
  for (const Case& c : cases()) {
    // Compile: expression tree and DFA (what a new format costs).
    t0 = Clock::now();
    ByteDfa dfa = ByteDfa::build(regex_of(c));
    const double compile_ms = ms_since(t0);
    const uint32_t nfa = dfa.nfa_states(), states = dfa.num_states(), classes = dfa.num_classes();
    // Through the public API (cold: includes the vocabulary fingerprint and the first mask).
    const std::string unique_regex = c.regex.empty() ? "" : c.regex + "|z{3}";
    ordered_json rf;
    if (!c.regex.empty()) {
    } else if (c.json_object) {
      rf = {{"type", "json_object"}};
    } else {
      // A fresh schema (a title nobody used) so the format cache misses.
      ordered_json s = ordered_json::parse(c.schema);
      s["title"] = "bench " + std::to_string(std::rand());
      rf = {{"type", "json_schema"}, {"json_schema", {{"name", "b"}, {"schema", s}}}};
    }
    t0 = Clock::now();
    auto api = c.regex.empty() ? compile_response_format(&rf, nullptr, tok)
                               : compile_response_format(nullptr, &unique_regex, tok);
    const double api_ms = ms_since(t0);

    const std::vector<int32_t> ids = tok.encode(c.sample);
    std::vector<uint32_t> bits(bitmask_words(uint32_t(tok.vocab_size())));
    auto shared = std::make_shared<const TokenAutomaton>(std::move(dfa), vocab);
    auto uncached = std::make_shared<const TokenAutomaton>(ByteDfa::build(regex_of(c)), vocab,
                                                           /*max_cache_bytes=*/0);
    // Cold pass: every new DFA state walks the trie once; warm pass: all cached.
    double pass_ms[2];
    for (int pass = 0; pass < 2; ++pass) {
      DfaConstraint k(shared);
      t0 = Clock::now();
      for (int32_t t : ids) {
        k.allowed_tokens(bits.data(), uint32_t(tok.vocab_size()));
        if (!k.advance(t)) {
          std::fprintf(stderr, "%s: the sample's token %d is refused\n", c.name, t);
          return 1;
        }
      }
      pass_ms[pass] = ms_since(t0);
    }
    DfaConstraint u(uncached);
    t0 = Clock::now();
    for (int32_t t : ids) {
      u.allowed_tokens(bits.data(), uint32_t(tok.vocab_size()));
      u.advance(t);
    }
    const double walk_ms = ms_since(t0);
    const double n = double(ids.size());
    std::printf("%-30s %8u %8u %6u %10.2f %9.2f %7zu %11.3f %11.2f %11.3f\n", c.name, nfa, states,
                classes, compile_ms, api_ms, ids.size(), pass_ms[0] / n, pass_ms[1] / n * 1e3,
                walk_ms / n);
  }
  std::printf("\ncompile ms: expression tree + NFA + DFA; api ms: compile_response_format on a new "
              "format (also the vocabulary lookup and the first mask);\ncold: the first walk "
              "through the sample (masks computed as states are met), warm: the second (cached "
              "masks copied),\nwalk: every step walks the trie (no cache), the cost of a state "
              "seen for the first time.\n");
  return 0;
}
