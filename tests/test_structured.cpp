// Structured output, the compiler's side (runtime/engine/structured/): token masks on hand-made
// vocabularies (tokens spanning several JSON tokens, UTF-8 split across tokens, a token that is a
// prefix of a keyword), regex masks against PCRE2's partial matching as an independent oracle,
// and the errors that name the JSON path.
#include <gtest/gtest.h>

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <cmath>
#include <random>
#include <set>

#include <nlohmann/json.hpp>

#include "models/registry.h"
#include "runtime/engine/sampling.h"
#include "runtime/engine/structured/format_cache.h"
#include "runtime/engine/structured/json_schema.h"
#include "runtime/engine/structured/regex_parser.h"
#include "runtime/engine/structured/response_format.h"
#include "runtime/engine/structured/token_automaton.h"
#include "runtime/text/tokenizer.h"
#include "tests/test_util.h"

namespace clshard {
namespace {

using namespace structured;
using ordered_json = nlohmann::ordered_json;

// A hand-made vocabulary: id = position.
const std::vector<std::string>& hand_vocab() {
  static const std::vector<std::string> v = {
      "{", "}", "[", "]", "\"", ":", ",", " ", "\n",                    // 0..8
      "\":", "},{", "\",\"", "\"}", "{\"", "\":\"",                     // 9..14 span JSON tokens
      "a", "b", "ab", "name", "na", "me",                               // 15..20
      "t", "tr", "true", "rue", "ue", "f", "false", "n", "nu", "null",  // 21..30
      "0", "1", "12", "01", "-", ".", "5", "e",                         // 31..38
      "\xC3", "\xA9", "\xC3\xA9", "caf\xC3", "\xA9\"",                  // 39..43 UTF-8 splits
      "\\", "u", "\\n", "x", "", "\xFF"};                               // 44..49
  return v;
}

std::shared_ptr<const TokenAutomaton> automaton(const Regex& re,
                                                const std::vector<std::string>& vocab) {
  return std::make_shared<const TokenAutomaton>(ByteDfa::build(re),
                                                std::make_shared<TokenVocabulary>(vocab));
}

std::set<std::string> allowed(const DfaConstraint& c) {
  const auto& v = hand_vocab();
  std::vector<uint32_t> bits(bitmask_words(uint32_t(v.size())));
  c.allowed_tokens(bits.data(), uint32_t(v.size()));
  std::set<std::string> out;
  for (size_t i = 0; i < v.size(); ++i) {
    const bool bit = (bits[i / 32] >> (i % 32)) & 1u;
    EXPECT_EQ(bit, c.allows(int32_t(i))) << "token " << i;
    if (bit) out.insert(v[i]);
  }
  return out;
}

int32_t id(const std::string& s) {
  const auto& v = hand_vocab();
  return int32_t(std::find(v.begin(), v.end(), s) - v.begin());
}

void feed(DfaConstraint& c, const std::vector<std::string>& toks) {
  for (const auto& t : toks) ASSERT_TRUE(c.advance(id(t))) << "token '" << t << "'";
}

// Every token of the hand-made vocabulary but these.
std::set<std::string> all_but(const std::set<std::string>& out) {
  std::set<std::string> s;
  for (const auto& t : hand_vocab())
    if (!t.empty() && !out.count(t)) s.insert(t);
  return s;
}

TEST(StructuredMasks, ObjectSchemaTokensSpanningSeveralJsonTokensAndUtf8Splits) {
  const auto schema = ordered_json::parse(
      R"({"type":"object","properties":{"name":{"type":"string"},"b":{"type":"boolean"}},
          "required":["name"]})");
  DfaConstraint c(automaton(json_schema_regex(schema, "s"), hand_vocab()));
  EXPECT_EQ(allowed(c), (std::set<std::string>{"{", "{\""}));
  EXPECT_FALSE(c.can_end());
  feed(c, {"{"});
  EXPECT_EQ(allowed(c), (std::set<std::string>{" ", "\n", "\""}));
  feed(c, {"\"", "na", "me"});
  // `":` and `":"` span the key's closing quote, the colon and the value's opening quote.
  EXPECT_EQ(allowed(c), (std::set<std::string>{"\"", "\":", "\":\""}));
  feed(c, {"\":\""});
  // Inside the string: `"}` and `","` close it and go on validly, `{"` is a brace in the text
  // and a closing quote; not `":` (a colon after the value), not a raw newline, a lone UTF-8
  // continuation byte or 0xFF.
  EXPECT_EQ(allowed(c), all_but({"\":", "\":\"", "\n", "\xA9", "\xA9\"", "\xFF"}));
  // UTF-8 split across tokens: after "caf\xC3" only a continuation byte may come.
  feed(c, {"caf\xC3"});
  EXPECT_EQ(allowed(c), (std::set<std::string>{"\xA9", "\xA9\""}));
  feed(c, {"\xA9", "\\"});
  // After a backslash: the escapes " \ b f n r t u, each possibly followed by more text.
  EXPECT_EQ(allowed(c), (std::set<std::string>{"\"", "\":", "\",\"", "\"}", "\":\"", "\\",
                                               "\\n", "u", "ue", "b", "f", "false", "n", "nu",
                                               "null", "name", "na", "t", "tr", "true", "rue"}));
  feed(c, {"\"", "\""});  // the escaped quote, then the closing one
  // The optional "b" may follow; `},{` may not (one object), nor `"}`.
  EXPECT_EQ(allowed(c), (std::set<std::string>{"}", ",", " ", "\n"}));
  EXPECT_FALSE(c.can_end());
  feed(c, {","});
  EXPECT_EQ(allowed(c), (std::set<std::string>{" ", "\n", "\""}));
  feed(c, {"\"", "b", "\":"});
  EXPECT_EQ(allowed(c), (std::set<std::string>{" ", "\n", "t", "tr", "true", "f", "false"}));
  // A token that is a prefix of a keyword, then the rest of it.
  feed(c, {"tr"});
  EXPECT_EQ(allowed(c), (std::set<std::string>{"u", "ue"}));
  feed(c, {"ue"});
  EXPECT_EQ(allowed(c), (std::set<std::string>{"}", " ", "\n"}));
  EXPECT_FALSE(c.advance(id("},{")));  // refused, and the state stays where it was
  feed(c, {"}"});
  EXPECT_TRUE(c.can_end());
  EXPECT_TRUE(c.is_complete());
  EXPECT_TRUE(allowed(c).empty());
}

TEST(StructuredMasks, ArrayOfObjectsWithMaxItems) {
  const auto schema = ordered_json::parse(
      R"({"type":"array","maxItems":3,"items":{"type":"object",
          "properties":{"a":{"type":"integer"}},"required":["a"]}})");
  DfaConstraint c(automaton(json_schema_regex(schema, "s"), hand_vocab()));
  EXPECT_EQ(allowed(c), (std::set<std::string>{"["}));
  feed(c, {"["});
  EXPECT_EQ(allowed(c), (std::set<std::string>{" ", "\n", "]", "{", "{\""}));
  feed(c, {"{\"", "a", "\":"});
  // An integer: no leading zero before a digit ("01").
  EXPECT_EQ(allowed(c), (std::set<std::string>{" ", "\n", "-", "0", "1", "12", "5"}));
  feed(c, {"1"});
  // `},{` closes this item, separates and opens the next; no fraction for an integer.
  EXPECT_EQ(allowed(c), (std::set<std::string>{"0", "1", "12", "01", "5", " ", "\n", "}",
                                               "},{"}));
  feed(c, {"},{"});
  EXPECT_EQ(allowed(c), (std::set<std::string>{" ", "\n", "\""}));
  feed(c, {"\"", "a", "\":", "0"});
  EXPECT_EQ(allowed(c), (std::set<std::string>{" ", "\n", "}", "},{"}));
  feed(c, {"},{", "\"", "a", "\":", "-"});
  EXPECT_EQ(allowed(c), (std::set<std::string>{"0", "1", "12", "5"}));
  feed(c, {"5"});
  // The third item: maxItems forbids `},{` now.
  EXPECT_EQ(allowed(c), (std::set<std::string>{"0", "1", "12", "01", "5", " ", "\n", "}"}));
  feed(c, {"}"});
  EXPECT_EQ(allowed(c), (std::set<std::string>{" ", "\n", "]"}));
  EXPECT_FALSE(c.can_end());
  feed(c, {"]"});
  EXPECT_TRUE(c.is_complete());
}

TEST(StructuredMasks, EnumOfStringsAndKeywords) {
  const auto schema = ordered_json::parse(R"({"enum":["name","na",true,"\u00e9"]})");
  DfaConstraint c(automaton(json_schema_regex(schema, "s"), hand_vocab()));
  EXPECT_EQ(allowed(c), (std::set<std::string>{"\"", "t", "tr", "true"}));
  DfaConstraint k = c;
  feed(c, {"\""});
  EXPECT_EQ(allowed(c), (std::set<std::string>{"n", "na", "name", "\xC3", "\xC3\xA9"}));
  feed(c, {"na"});
  EXPECT_EQ(allowed(c), (std::set<std::string>{"\"", "me"}));
  EXPECT_FALSE(c.can_end());
  feed(c, {"\""});
  EXPECT_TRUE(c.is_complete());
  feed(k, {"t"});
  EXPECT_EQ(allowed(k), (std::set<std::string>{"rue"}));
  std::unique_ptr<TokenConstraint> copy = k.clone();
  ASSERT_TRUE(copy->advance(id("rue")));
  EXPECT_TRUE(copy->is_complete());
  EXPECT_FALSE(k.can_end());  // the clone moved on alone
}

// PCRE2 as an independent oracle: a token is allowed iff the text so far plus the token is a
// prefix of some match of the pattern (PCRE2's hard partial matching, anchored at both ends),
// and the output can end iff the text so far matches whole.
class Pcre2Oracle {
 public:
  explicit Pcre2Oracle(const std::string& pattern) {
    int err;
    PCRE2_SIZE off;
    // Anchored at the end by \z (PCRE2_ENDANCHORED does not combine with partial matching).
    const std::string whole = "(?:" + pattern + ")\\z";
    code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(whole.c_str()), whole.size(),
                          PCRE2_UTF | PCRE2_ANCHORED, &err, &off, nullptr);
    if (!code_) throw std::runtime_error("pcre2_compile failed for " + pattern);
    data_ = pcre2_match_data_create_from_pattern(code_, nullptr);
  }
  ~Pcre2Oracle() {
    pcre2_match_data_free(data_);
    pcre2_code_free(code_);
  }
  bool prefix(const std::string& s) const {
    const int rc = run(s, PCRE2_PARTIAL_HARD);
    if (rc < 0 && rc != PCRE2_ERROR_NOMATCH && rc != PCRE2_ERROR_PARTIAL)
      throw std::runtime_error("pcre2_match failed: " + std::to_string(rc));
    return rc != PCRE2_ERROR_NOMATCH;
  }
  bool full(const std::string& s) const { return run(s, 0) >= 0; }

 private:
  int run(const std::string& s, uint32_t opts) const {
    return pcre2_match(code_, reinterpret_cast<PCRE2_SPTR>(s.data()), s.size(), 0, opts, data_,
                       nullptr);
  }
  pcre2_code* code_;
  pcre2_match_data* data_;
};

TEST(StructuredMasks, RegexMasksAgreeWithPcre2PartialMatching) {
  // Whole UTF-8 characters only: PCRE2 does not match inside one.
  const std::vector<std::string> vocab = {
      "a", "b", "c", ",", "ab", "bc", "abc", "ab,", "b,c", "1", "12", "123", "-", "f", "o",
      "fo", "foo", "fob", "x", "\xC3\xA9", "\xC3\xA9\xC3\xA9", "e", "d", "cd", "@", ".", "com",
      ".com", "_", "Z", "  ", " ", "\n", "7-", "-1", "z\xE2\x82\xAC", "\xE2\x82\xAC"};
  const std::vector<std::string> patterns = {
      "[a-c]+(,[a-c]+)*",   "\\d{2,4}-\\d{2}",     "(foo|fob|fa)+x?",       "\xC3\xA9+[^\xC3\xA9]?",
      "a{3}|b{2,}",         "\\w+@\\w+\\.com",     "(?:ab|cd)*e",           "[^,\\n]{1,5}\\n?",
      "-?(0|[1-9]\\d*)",    ".{0,3}z\xE2\x82\xAC", "\\s*(abc|ab)\\s*$",     "^[\\w.]+(?:,\\s?[\\w.]+)*"};
  auto vocab_ptr = std::make_shared<TokenVocabulary>(vocab);
  std::mt19937 rng(11);
  for (const auto& pattern : patterns) {
    SCOPED_TRACE(pattern);
    Pcre2Oracle oracle(pattern);
    auto a = std::make_shared<const TokenAutomaton>(ByteDfa::build(parse_regex(pattern)),
                                                    vocab_ptr);
    for (int walk = 0; walk < 20; ++walk) {
      DfaConstraint c(a);
      std::string text;
      for (int step = 0; step < 12; ++step) {
        std::vector<uint32_t> bits(bitmask_words(uint32_t(vocab.size())));
        c.allowed_tokens(bits.data(), uint32_t(vocab.size()));
        std::vector<int32_t> ok;
        for (size_t t = 0; t < vocab.size(); ++t) {
          const bool bit = (bits[t / 32] >> (t % 32)) & 1u;
          ASSERT_EQ(bit, oracle.prefix(text + vocab[t]))
              << "after '" << text << "', token '" << vocab[t] << "'";
          if (bit) ok.push_back(int32_t(t));
        }
        ASSERT_EQ(c.can_end(), oracle.full(text)) << "after '" << text << "'";
        if (ok.empty()) break;
        const int32_t t = ok[rng() % ok.size()];
        ASSERT_TRUE(c.advance(t));
        text += vocab[size_t(t)];
      }
    }
  }
}

TEST(StructuredMasks, MatchesTheRegexThemselves) {
  const ByteDfa d = ByteDfa::build(parse_regex("(a|b)*abb"));
  EXPECT_TRUE(d.matches("abb"));
  EXPECT_TRUE(d.matches("babaabb"));
  EXPECT_FALSE(d.matches("ab"));
  EXPECT_FALSE(d.matches("abba"));
  const ByteDfa n = ByteDfa::build(parse_regex("x{2,3}(,y)+"));
  EXPECT_TRUE(n.matches("xx,y,y"));
  EXPECT_TRUE(n.matches("xxx,y"));
  EXPECT_FALSE(n.matches("x,y"));
  EXPECT_FALSE(n.matches("xxxx,y"));
  EXPECT_FALSE(n.matches("xx"));
}

// Numbers: at most 16 integer digits and 2 exponent digits, so every number the grammar allows is
// a finite double (nlohmann refuses 471e658, which the former 3 exponent digits allowed).
TEST(StructuredMasks, NumbersStayFiniteDoubles) {
  const ByteDfa d = ByteDfa::build(json_schema_regex(ordered_json{{"type", "number"}}, "s"));
  for (const char* ok : {"0", "-12.5", "1e99", "9999999999999999.9999999999999999E+99", "3e-7"}) {
    EXPECT_TRUE(d.matches(ok)) << ok;
    EXPECT_TRUE(std::isfinite(nlohmann::json::parse(ok).get<double>())) << ok;
  }
  for (const char* bad : {"1e100", "471e658", "1e", "01", "1.", "--1", "12345678901234567"})
    EXPECT_FALSE(d.matches(bad)) << bad;
}

// The tokenizer of `make-model --preset llama3-tiny` (512 tokens), made once per process.
const Tokenizer& tiny_tokenizer() {
  static const Tokenizer tok = [] {
    const auto dir = test::temp_dir("structured_tokenizer");
    make_model("llama3-tiny", dir, MakeModelOptions{});
    return Tokenizer::from_dir(dir);
  }();
  return tok;
}

std::string compile_error(const std::string& response_format_json, const std::string* regex) {
  const ordered_json rf = response_format_json.empty() ? ordered_json()
                                                       : ordered_json::parse(response_format_json);
  try {
    compile_response_format(response_format_json.empty() ? nullptr : &rf, regex,
                            tiny_tokenizer());
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "(no error)";
}

std::string schema_error(const std::string& schema) {
  return compile_error(R"({"type":"json_schema","json_schema":{"name":"x","schema":)" + schema +
                           "}}",
                       nullptr);
}

TEST(StructuredErrors, NameTheFieldAndTheJsonPath) {
  EXPECT_EQ(schema_error(R"({"type":"object","properties":{"age":{"type":"integer",
                            "multipleOf":5}}})"),
            "response_format.json_schema.schema.properties.age: unsupported keyword 'multipleOf'");
  EXPECT_EQ(schema_error(R"({"type":"object","properties":{"x":{"anyOf":[{"type":"null"},
                            {"type":"string","pattern":"a+"}]}}})"),
            "response_format.json_schema.schema.properties.x.anyOf[1]: unsupported keyword "
            "'pattern'");
  EXPECT_EQ(schema_error(R"({"type":"array","items":{"type":"strin"}})"),
            "response_format.json_schema.schema.items.type: expected one of string, number, "
            "integer, boolean, null, object, array; got \"strin\"");
  EXPECT_EQ(schema_error(R"({"type":"object","properties":{"a":{}},"required":["b"]})"),
            "response_format.json_schema.schema.required[0]: 'b' is not among the properties");
  EXPECT_EQ(schema_error(R"({"$defs":{"n":{"type":"array","items":{"$ref":"#/$defs/n"}}},
                            "$ref":"#/$defs/n"})"),
            "response_format.json_schema.schema.$defs.n.items.$ref: recursive reference "
            "'#/$defs/n' is not supported");
  EXPECT_EQ(schema_error(R"({"type":"string","maxLength":2,"minLength":3})"),
            "response_format.json_schema.schema: maxLength is below minLength");
  EXPECT_EQ(compile_error(R"({"type":"xml"})", nullptr),
            "response_format.type: expected \"text\", \"json_object\" or \"json_schema\", got "
            "\"xml\"");
  EXPECT_EQ(compile_error(R"({"type":"json_schema"})", nullptr),
            "response_format.json_schema: expected an object with a \"schema\"");
  const std::string bad_regex = "ab\\bc", unbalanced = "(ab", rx = "a+";
  EXPECT_EQ(compile_error("", &bad_regex), "regex: at offset 3: unsupported escape '\\b'");
  EXPECT_EQ(compile_error("", &unbalanced), "regex: at offset 3: missing ')'");
  EXPECT_EQ(compile_error(R"({"type":"json_object"})", &rx),
            "regex: cannot be combined with a response_format of type json_object");
  // No format, or plain text: no constraint.
  const ordered_json text = {{"type", "text"}};
  EXPECT_EQ(compile_response_format(&text, nullptr, tiny_tokenizer()), nullptr);
  EXPECT_EQ(compile_response_format(static_cast<const ordered_json*>(nullptr), nullptr,
                                    tiny_tokenizer()),
            nullptr);
}

// The limits a hostile format cannot pass (found by tests/fuzz's json_schema target): each is a
// clear error, found before the work it would cost (deep recursion, an exponential tree, a huge
// automaton built state by state).
TEST(StructuredErrors, HostileFormatsHitLimitsWithClearErrors) {
  // Groups nest at most kMaxGroupDepth (100) deep: the 101st '(' is refused, 100 compile.
  const std::string deep_groups = std::string(101, '(') + "a" + std::string(101, ')');
  EXPECT_EQ(compile_error("", &deep_groups),
            "regex: at offset 101: groups nested deeper than 100 levels");
  const std::string groups_100 = std::string(100, '(') + "a" + std::string(100, ')');
  EXPECT_EQ(compile_error("", &groups_100), "(no error)");
  // Repetitions of repetitions: refused from the tree's size, before any NFA state is made.
  const std::string nested_repeats = "((a{1000}){1000}){1000}";
  EXPECT_EQ(compile_error("", &nested_repeats),
            "regex: the expression is too large: its automaton would exceed 1600000 NFA states");
  // A chain of 500 x 1000 letters: 1,002,002 NFA states, within those 1,600,000. It took 0.54 s
  // in Release and 3.8-5.5 s in the fuzz build to build them and reach the DFA's 200,000-state
  // limit. Each NFA state is charged kStepsPerNfaState (10) before any is made: within the fuzz
  // build's 1,500,000 steps that refuses it at once (tests/fuzz/regressions/json_schema/
  // regex_chain_of_1m_nfa_states); Release's 20,000,000 pay for the NFA (0.07 s now that its
  // table is reserved) and the DFA stops at its state limit.
  const std::string letters = "((a{0500}){1000})";
  const Regex letter_chain = parse_regex(letters);
  EXPECT_EQ(letter_chain->nfa_states, 1'002'002u);
  try {
    ByteDfa::build(letter_chain, ByteDfa::kMaxStates, 1'500'000);
    ADD_FAILURE() << "the chain built within 1,500,000 steps";
  } catch (const std::invalid_argument& e) {
    EXPECT_STREQ(e.what(), "the expression is too large: its automaton's 1002002 NFA states would "
                           "take more than 1500000 steps to build");
  }
  EXPECT_EQ(compile_error("", &letters),
            "regex: the expression is too large: its automaton would exceed 200000 states");
  // The charge is exact: a{1000} (2,002 NFA states) needs 20,020 steps before its NFA is built.
  const Regex a1000 = parse_regex("a{1000}");
  ASSERT_EQ(a1000->nfa_states, 2002u);
  try {
    ByteDfa::build(a1000, ByteDfa::kMaxStates, 2002 * ByteDfa::kStepsPerNfaState - 1);
    ADD_FAILURE() << "a{1000} built within 20,019 steps";
  } catch (const std::invalid_argument& e) {
    EXPECT_STREQ(e.what(), "the expression is too large: its automaton's 2002 NFA states would "
                           "take more than 20019 steps to build");
  }
  const ByteDfa a1000_dfa = ByteDfa::build(a1000);
  EXPECT_EQ(a1000_dfa.num_states(), 1001u);
  EXPECT_TRUE(a1000_dfa.matches(std::string(1000, 'a')));
  EXPECT_FALSE(a1000_dfa.matches(std::string(999, 'a')));
  EXPECT_GT(ByteDfa::last_build_steps(), 2002 * ByteDfa::kStepsPerNfaState);
  // The schema compiler refuses past the same limit (ByteDfa::kMaxBuildNfaStates), which the
  // Release budget leaves at kMaxNfaStates.
  EXPECT_EQ(ByteDfa::kMaxBuildNfaStates, 1'600'000u);

  // Few states, each holding hundreds of NFA states: an exploding branch beside a run of 500
  // optional letters took 8 s and 0.8 GB before reaching the 200,000-state limit; the step budget
  // ends it after 20,000,000 NFA states visited.
  const std::string heavy_states = "(?:(a|b)*a(a|b){16}|(?:[ab]?){500})";
  EXPECT_EQ(compile_error("", &heavy_states),
            "regex: the expression is too large: building its automaton would take more than "
            "20000000 steps");
  // Many states of few NFA states each: ".{1000}" ten times (190,000 states, 13 byte classes)
  // took 2.3 s when only the NFA states visited were counted; each transition counts too now.
  std::string wildcards;
  for (int i = 0; i < 10; ++i) wildcards += ".{1000}";
  EXPECT_EQ(compile_error("", &wildcards),
            "regex: the expression is too large: building its automaton would take more than "
            "20000000 steps");
  // Any JSON object (4,944 NFA states, 1,725 states, 44 byte classes): its NFA states charged,
  // 349,984 NFA states visited and 75,900 transitions, inside the budget and inside the fuzz
  // build's 1,500,000.
  EXPECT_EQ(json_object_regex()->nfa_states, 4944u);
  EXPECT_EQ(ByteDfa::build(json_object_regex()).num_states(), 1725u);
  EXPECT_EQ(ByteDfa::last_build_steps(), 4'944u * ByteDfa::kStepsPerNfaState + 349'984u +
                                             75'900u * ByteDfa::kStepsPerTransition);
  EXPECT_LT(ByteDfa::last_build_steps(), 1'500'000u);

  // Schemas nest at most kMaxSchemaDepth (64) levels: 65 nested "items" are refused at the 65th.
  std::string items_65, path = "response_format.json_schema.schema";
  for (int i = 0; i < 65; ++i) items_65 += R"({"type":"array","items":)";
  items_65 += "{}" + std::string(65, '}');
  for (int i = 0; i < 64; ++i) path += ".items";
  EXPECT_EQ(schema_error(items_65),
            path + ": nested deeper than 64 levels (counting each $ref followed)");
  // A chain of 100 definitions, each referring to the next: the $refs count as levels.
  ordered_json chain = {{"$defs", ordered_json::object()}, {"$ref", "#/$defs/d99"}};
  chain["$defs"]["d0"] = {{"type", "string"}};
  for (int i = 1; i < 100; ++i)
    chain["$defs"]["d" + std::to_string(i)] = {{"$ref", "#/$defs/d" + std::to_string(i - 1)}};
  EXPECT_EQ(schema_error(chain.dump()),
            "response_format.json_schema.schema.$defs.d36: nested deeper than 64 levels "
            "(counting each $ref followed)");
  // Each definition used twice by the next: 2^25 strings if expanded (and 2^25 compiles of d0
  // before). Compiled once each, the tree stays small, and its expanded size is refused where it
  // passes the automaton's 1,600,000 NFA states (d11: 2 x d10 plus the brackets and separator).
  ordered_json doubling = {{"$defs", ordered_json::object()}, {"$ref", "#/$defs/d25"}};
  doubling["$defs"]["d0"] = {{"type", "string"}, {"maxLength", 8}};
  for (int i = 1; i <= 25; ++i)
    doubling["$defs"]["d" + std::to_string(i)] = {
        {"type", "array"}, {"items", {{"$ref", "#/$defs/d" + std::to_string(i - 1)}}},
        {"minItems", 2}, {"maxItems", 2}};
  EXPECT_EQ(schema_error(doubling.dump()),
            "response_format.json_schema.schema.$defs.d11: the schema is too large: expanded "
            "(each $ref wherever it is used), its automaton would exceed 1600000 NFA states");
  // Shared definitions still compile: d3 = [[[s, s], [s, s]], [[s, s], [s, s]]].
  doubling["$ref"] = "#/$defs/d3";
  EXPECT_EQ(schema_error(doubling.dump()), "(no error)");
}

// Nested anyOf of distinct definitions (tests/fuzz/regressions/json_schema/
// anyof_refs_doubling_distinct, 25 s and 0.9 GB in the fuzz build before): a_k = anyOf[a_(k-1),
// b_(k-1)] and b_k = anyOf[b_(k-1), a_(k-1)], a_0 = "a", b_0 = "b". Each is compiled once, but
// alt() copied its options' alternatives into one list, so a_30 would have held 2^30 (16 GiB of
// pointers). It copies at most kMaxFlattenedChildren (64) now, and the options' expanded sizes
// are summed before they are joined and refused past ByteDfa::kMaxNfaStates (1,600,000).
TEST(StructuredErrors, NestedAnyOfOfDistinctRefsIsRefusedByItsExpandedSize) {
  auto schema = [](int top) {
    ordered_json s = {{"$defs", ordered_json::object()}, {"$ref", "#/$defs/a" + std::to_string(top)}};
    s["$defs"]["a0"] = {{"const", "a"}};
    s["$defs"]["b0"] = {{"const", "b"}};
    for (int k = 1; k <= 30; ++k) {
      const std::string a = "#/$defs/a" + std::to_string(k - 1),
                        b = "#/$defs/b" + std::to_string(k - 1);
      s["$defs"]["a" + std::to_string(k)] = {{"anyOf", {{{"$ref", a}}, {{"$ref", b}}}}};
      s["$defs"]["b" + std::to_string(k)] = {{"anyOf", {{{"$ref", b}}, {{"$ref", a}}}}};
    }
    return s;
  };
  // a_7: 128 literals of 3 bytes (6 NFA states each) in one alternation (2 more): 770 states.
  // a_8 is the alternation of a_7 and b_7, a_9 of a_7, b_7, b_7, a_7 (a_8's and b_8's two
  // options copied) and so on to 64 options, then again: a_14 has 128 x 64 literals (98,562
  // states), a_17 788,498 and a_18 1,576,994. a_19's options together count 3,153,988: refused
  // there, a_18's pass.
  EXPECT_EQ(schema_error(schema(30).dump()),
            "response_format.json_schema.schema.$defs.a19: the schema is too large: expanded "
            "(each $ref wherever it is used), its automaton would exceed 1600000 NFA states");
  EXPECT_EQ(schema_error(schema(19).dump()), schema_error(schema(30).dump()));
  // Below the limit the language is unchanged. a_6's and b_6's 64 alternatives are copied into
  // a_7's 128; a_7 and b_7 (128 each) stay shared options of a_8 and up, not copied.
  const Regex a7 = json_schema_regex(schema(7), "s"), a10 = json_schema_regex(schema(10), "s");
  ASSERT_EQ(a7->kind, RegexNode::Kind::Alt);
  EXPECT_EQ(a7->children.size(), 128u);
  EXPECT_EQ(a7->nfa_states, 2u + 6u * 128u);
  ASSERT_EQ(a10->kind, RegexNode::Kind::Alt);
  ASSERT_EQ(a10->children.size(), 8u);
  for (const Regex& option : a10->children) EXPECT_EQ(option->children.size(), 128u);
  EXPECT_EQ(a10->nfa_states, 2u + 8u * 770u);
  // The same doubling through two required properties of each object (the regression
  // properties_refs_doubling_30: 0.8 to 1.8 s in the fuzz build when each object's children
  // were copied into the next, under the 1,600,000 states; 75 ms now): refused where it passes
  // the limit.
  ordered_json objects = {{"$defs", ordered_json::object()}, {"$ref", "#/$defs/d30"}};
  objects["$defs"]["d0"] = {{"type", "string"}};
  for (int k = 1; k <= 30; ++k) {
    const ordered_json ref = {{"$ref", "#/$defs/d" + std::to_string(k - 1)}};
    objects["$defs"]["d" + std::to_string(k)] = {
        {"type", "object"}, {"properties", {{"a", ref}, {"b", ref}}}, {"required", {"a", "b"}}};
  }
  EXPECT_EQ(schema_error(objects.dump()),
            "response_format.json_schema.schema.$defs.d14: the schema is too large: expanded "
            "(each $ref wherever it is used), its automaton would exceed 1600000 NFA states");
  // As many NFA states as the tree counts (RegexNode::nfa_states mirrors the construction).
  const ByteDfa dfa = ByteDfa::build(a10);
  EXPECT_EQ(dfa.nfa_states(), a10->nfa_states);
  EXPECT_TRUE(dfa.matches(R"("a")"));
  EXPECT_TRUE(dfa.matches(R"("b")"));
  EXPECT_FALSE(dfa.matches(R"("c")"));
  EXPECT_FALSE(dfa.matches(R"("ab")"));
}

// Properties come in schema order, required ones always, optional ones when chosen: every subset
// of a, b, c, d, e (b and d required) is checked compact, matching exactly when it holds b and d.
// Then 3,000 required properties, whose sequence (one item per member) is built once: building
// each suffix of it copied n^2/2 items, 9.8 s and 2.4 GB in Release (the regression
// tests/fuzz/regressions/json_schema/object_1000_required_properties: 4.9 s in the fuzz build).
TEST(StructuredSchema, ObjectPropertiesRequiredAndOptionalInOrder) {
  const auto schema = ordered_json::parse(
      R"({"type":"object","properties":{"a":{"const":1},"b":{"const":2},"c":{"const":3},
          "d":{"const":4},"e":{"const":5}},"required":["b","d"]})");
  const ByteDfa dfa = ByteDfa::build(json_schema_regex(schema, "s"));
  const std::string names = "abcde";
  int matched = 0;
  for (int subset = 0; subset < 32; ++subset) {
    std::string text = "{";
    for (int k = 0; k < 5; ++k)
      if (subset & (1 << k))
        text += (text.size() > 1 ? "," : "") + std::string("\"") + names[size_t(k)] + "\":" +
                std::to_string(k + 1);
    text += "}";
    const bool valid = (subset & 0b01010) == 0b01010;
    EXPECT_EQ(dfa.matches(text), valid) << text;
    matched += dfa.matches(text);
  }
  EXPECT_EQ(matched, 8);
  EXPECT_FALSE(dfa.matches(R"({"d":4,"b":2})"));  // out of order

  ordered_json many = {{"type", "object"}, {"properties", ordered_json::object()},
                       {"required", ordered_json::array()}};
  std::string all = "{";
  for (int i = 0; i < 3000; ++i) {
    const std::string name = "p" + std::to_string(i);
    many["properties"][name] = {{"type", "null"}};
    many["required"].push_back(name);
    all += (i ? "," : "") + ordered_json(name).dump() + ":null";
  }
  all += "}";
  const Regex re = json_schema_regex(many, "s");
  const ByteDfa many_dfa = ByteDfa::build(re);
  EXPECT_EQ(many_dfa.nfa_states(), re->nfa_states);  // the tree counts what the NFA makes
  EXPECT_TRUE(many_dfa.matches(all));
  EXPECT_FALSE(many_dfa.matches(all.substr(0, all.rfind(',')) + "}"));  // the last one left out
}

TEST(StructuredErrors, SchemaOrderIsKeptWithOrderedJson) {
  const auto rf = ordered_json::parse(R"({"type":"json_schema","json_schema":{"schema":
      {"type":"object","properties":{"zeta":{"const":1},"alpha":{"const":2}},
       "required":["zeta","alpha"]}}})");
  auto c = compile_response_format(&rf, nullptr, tiny_tokenizer());
  ASSERT_NE(c, nullptr);
  const Tokenizer& tok = tiny_tokenizer();
  for (int32_t t : tok.encode(R"({"zeta":1,"alpha":2})")) ASSERT_TRUE(c->advance(t)) << t;
  EXPECT_TRUE(c->is_complete());
  auto other = compile_response_format(&rf, nullptr, tiny_tokenizer());
  bool ok = true;
  for (int32_t t : tok.encode(R"({"alpha":2,"zeta":1})")) ok = ok && other->advance(t);
  EXPECT_FALSE(ok) << "properties must come in schema order";
}

// The cache of compiled formats keeps within a byte budget: least recently used entries go first,
// and an automaton bigger than the whole budget serves its request without being kept.
TEST(StructuredCache, ByteBudgetEvictsLeastRecentlyUsed) {
  // What an automaton counts: its DFA's tables and one pointer per state, plus at most one mask
  // per state within max_cache_bytes (here 50 tokens: 2 words = 8 bytes a mask).
  const auto vocab = std::make_shared<TokenVocabulary>(hand_vocab());
  const ByteDfa abc = ByteDfa::build(parse_regex("abc"));
  EXPECT_EQ(TokenAutomaton(abc, vocab, 0).max_bytes(),
            abc.table_bytes() + abc.num_states() * sizeof(void*));
  EXPECT_GT(TokenAutomaton(abc, vocab).max_bytes(),
            abc.table_bytes() + abc.num_states() * (sizeof(void*) + 8));
  // A mask cache of 16 bytes holds two masks: only those two count.
  EXPECT_LT(TokenAutomaton(abc, vocab, 16).max_bytes(), TokenAutomaton(abc, vocab).max_bytes());

  auto make = [&](const std::string& re) {
    return std::make_shared<const TokenAutomaton>(ByteDfa::build(parse_regex(re)), vocab);
  };
  const auto a = make("a"), b = make("b|bb"), c = make("c{1,3}"), big = make("[a-z]{1,200}");
  const size_t ea = FormatCache::entry_bytes("A", *a), eb = FormatCache::entry_bytes("B", *b),
               ec = FormatCache::entry_bytes("C", *c);
  ASSERT_LT(ea, eb);
  ASSERT_LT(eb, ec);
  // Room for any two of the three, not for all three.
  const size_t budget = eb + ec;
  ASSERT_GT(FormatCache::entry_bytes("BIG", *big), budget);
  FormatCache cache(budget);
  EXPECT_TRUE(cache.put("A", a));
  EXPECT_TRUE(cache.put("B", b));
  EXPECT_EQ(cache.keys(), (std::vector<std::string>{"B", "A"}));
  EXPECT_EQ(cache.bytes(), ea + eb);
  EXPECT_EQ(cache.find("A"), a);  // A becomes the most recently used: B goes next
  EXPECT_TRUE(cache.put("C", c));
  EXPECT_EQ(cache.keys(), (std::vector<std::string>{"C", "A"}));
  EXPECT_EQ(cache.bytes(), ec + ea);
  EXPECT_EQ(cache.find("B"), nullptr);
  // B again: A is now the least recently used; B and C fill the budget exactly.
  EXPECT_TRUE(cache.put("B", b));
  EXPECT_EQ(cache.keys(), (std::vector<std::string>{"B", "C"}));
  EXPECT_EQ(cache.bytes(), budget);
  // Bigger than the whole budget: not kept, and nothing is evicted for it.
  EXPECT_FALSE(cache.put("BIG", big));
  EXPECT_EQ(cache.keys(), (std::vector<std::string>{"B", "C"}));
  EXPECT_EQ(cache.find("BIG"), nullptr);
  EXPECT_EQ(cache.bytes(), budget);
  // A smaller budget evicts down to it, least recently used (C) first.
  cache.set_budget(ec);
  EXPECT_EQ(cache.keys(), (std::vector<std::string>{"B"}));
  EXPECT_EQ(cache.bytes(), eb);

  // Through compile_response_format: with the process-wide cache's budget below the automaton's
  // size, the request is constrained all the same and nothing is kept; with the default budget
  // it is kept.
  struct RestoreBudget {
    ~RestoreBudget() { format_cache().set_budget(kFormatCacheBytes); }
  } restore;
  format_cache().clear();
  format_cache().set_budget(4096);
  const ordered_json rf = {{"type", "json_object"}};
  const Tokenizer& tok = tiny_tokenizer();
  for (int round = 0; round < 2; ++round) {
    auto constraint = compile_response_format(&rf, nullptr, tok);
    ASSERT_NE(constraint, nullptr);
    for (int32_t t : tok.encode(R"({"a": [1, "x"]})")) ASSERT_TRUE(constraint->advance(t)) << t;
    EXPECT_TRUE(constraint->can_end());
    auto rejecting = compile_response_format(&rf, nullptr, tok);
    EXPECT_FALSE(rejecting->advance(tok.encode("[")[0]));
    EXPECT_EQ(format_cache().keys().size(), 0u) << "round " << round;
    EXPECT_EQ(format_cache().bytes(), 0u);
  }
  format_cache().set_budget(kFormatCacheBytes);
  compile_response_format(&rf, nullptr, tok);
  ASSERT_EQ(format_cache().keys().size(), 1u);
  EXPECT_GT(format_cache().bytes(), size_t(4096));
  EXPECT_LE(format_cache().bytes(), kFormatCacheBytes);
}

}  // namespace
}  // namespace clshard
