#include "runtime/engine/structured/response_format.h"

#include <stdexcept>

#include "runtime/engine/structured/format_cache.h"
#include "runtime/engine/structured/json_schema.h"
#include "runtime/engine/structured/regex_parser.h"
#include "runtime/engine/structured/token_automaton.h"

namespace clshard {

using nlohmann::ordered_json;
using namespace structured;

namespace {

[[noreturn]] void fail(const std::string& where, const std::string& what) {
  throw std::invalid_argument(where + ": " + what);
}

}  // namespace

std::shared_ptr<TokenConstraint> compile_response_format(const ordered_json* response_format,
                                                         const std::string* regex,
                                                         const Tokenizer& tok,
                                                         const std::string& field,
                                                         const std::string& regex_field) {
  std::string kind, key_text;
  const ordered_json* schema = nullptr;
  std::string schema_path;
  if (response_format && !response_format->is_null()) {
    const ordered_json& rf = *response_format;
    if (!rf.is_object()) fail(field, "expected an object like {\"type\": \"json_object\"}");
    if (!rf.contains("type") || !rf["type"].is_string())
      fail(field + ".type", "expected \"text\", \"json_object\" or \"json_schema\"");
    kind = rf["type"].get<std::string>();
    for (const auto& [k, v] : rf.items())
      if (k != "type" && !(k == "json_schema" && kind == "json_schema"))
        fail(field, "unknown field \"" + k + "\" for type " + kind);
    if (kind == "json_schema") {
      if (!rf.contains("json_schema") || !rf["json_schema"].is_object())
        fail(field + ".json_schema", "expected an object with a \"schema\"");
      const ordered_json& js = rf["json_schema"];
      for (const auto& [k, v] : js.items())
        if (k != "name" && k != "schema" && k != "strict" && k != "description")
          fail(field + ".json_schema", "unknown field \"" + k +
                                           "\" (expected: name, schema, strict, description)");
      if (!js.contains("schema"))
        fail(field + ".json_schema.schema", "missing (the JSON schema to follow)");
      schema = &js["schema"];
      schema_path = field + ".json_schema.schema";
      key_text = "json_schema:" + schema->dump();
    } else if (kind == "json_object") {
      key_text = "json_object";
    } else if (kind == "text") {
      kind.clear();
    } else {
      fail(field + ".type", "expected \"text\", \"json_object\" or \"json_schema\", got \"" +
                                kind + "\"");
    }
  }
  if (regex) {
    if (!kind.empty())
      fail(regex_field, "cannot be combined with a " + field + " of type " + kind);
    if (regex->empty()) fail(regex_field, "is empty");
    kind = "regex";
    key_text = "regex:" + *regex;
  }
  if (kind.empty()) return nullptr;

  // The expression first: a bad format fails before any work on the vocabulary.
  Regex re;
  std::string where = kind == "regex" ? regex_field : schema ? schema_path : field;
  try {
    if (kind == "regex") {
      re = parse_regex(*regex);
    } else if (kind == "json_object") {
      re = json_object_regex();
    } else {
      where.clear();  // the schema compiler's messages carry the path already
      re = json_schema_regex(*schema, schema_path);
    }
  } catch (const std::invalid_argument& e) {
    if (where.empty()) throw;
    fail(where, e.what());
  }
  auto vocab = TokenVocabulary::of(tok);
  const std::string key = std::to_string(vocab->fingerprint()) + "/" + key_text;
  std::shared_ptr<const TokenAutomaton> automaton = format_cache().find(key);
  if (!automaton) {
    ByteDfa dfa;
    try {
      dfa = ByteDfa::build(re);
    } catch (const std::invalid_argument& e) {
      fail(kind == "regex" ? regex_field : schema ? schema_path : field, e.what());
    }
    automaton = std::make_shared<const TokenAutomaton>(std::move(dfa), std::move(vocab));
    // Not kept when bigger than the cache's whole budget: this request uses it all the same.
    format_cache().put(key, automaton);
  }
  auto c = std::make_shared<DfaConstraint>(automaton);
  // The first mask is computed here, on the caller's thread, rather than in the engine's step.
  std::vector<uint32_t> first(automaton->mask_words());
  if (!automaton->mask(c->state(), first.data()) && !c->can_end())
    fail(kind == "regex" ? regex_field : field,
         "no token of the vocabulary can start an output of this format");
  return c;
}

std::shared_ptr<TokenConstraint> compile_response_format(const nlohmann::json* response_format,
                                                         const std::string* regex,
                                                         const Tokenizer& tok,
                                                         const std::string& field,
                                                         const std::string& regex_field) {
  if (!response_format)
    return compile_response_format(static_cast<const ordered_json*>(nullptr), regex, tok, field, regex_field);
  const ordered_json ordered = ordered_json::parse(response_format->dump());
  return compile_response_format(&ordered, regex, tok, field, regex_field);
}

}  // namespace clshard
