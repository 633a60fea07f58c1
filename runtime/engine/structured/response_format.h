// Structured output for requests: OpenAI's response_format and the `regex` extension, compiled
// into a TokenConstraint (runtime/engine/constraint.h) that GenerationRequest::constraint takes.
//
//   response_format: {"type": "text"}                       no constraint
//                    {"type": "json_object"}                any JSON object
//                    {"type": "json_schema", "json_schema": {"name", "schema", "strict",
//                                                             "description"}}
//   regex: a pattern the whole output must match (regex_parser.h lists the syntax)
//
// The schema subset and the JSON layout allowed are in json_schema.h. Properties come out in the
// schema's order: parse request bodies with nlohmann::ordered_json to keep it (the nlohmann::json
// overload sees its keys sorted). A compiled format is cached per vocabulary and format text, so
// a server that sees the same schema again pays only a lookup, and the token masks computed for
// one request serve the next; the cache keeps within a byte budget (format_cache.h).
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "runtime/engine/constraint.h"

namespace clshard {

class Tokenizer;

// Returns null when neither is given (or response_format is {"type": "text"}). Throws
// std::invalid_argument naming the field and the JSON path inside it, e.g.
//   "response_format.json_schema.schema.properties.age: unsupported keyword 'multipleOf'"
//   "regex: at offset 3: unsupported escape '\b'"
//   "regex: cannot be combined with a response_format of type json_schema"
// `field` is the name response_format has in the request ("body.response_format" in an OpenAI
// batch line), `regex_field` the same for regex. Thread-safe.
std::shared_ptr<TokenConstraint> compile_response_format(
    const nlohmann::ordered_json* response_format, const std::string* regex,
    const Tokenizer& tok, const std::string& field = "response_format",
    const std::string& regex_field = "regex");
std::shared_ptr<TokenConstraint> compile_response_format(
    const nlohmann::json* response_format, const std::string* regex, const Tokenizer& tok,
    const std::string& field = "response_format", const std::string& regex_field = "regex");
// A regex alone (the `regex` extension without a response_format): a plain nullptr would fit
// both overloads above.
inline std::shared_ptr<TokenConstraint> compile_response_format(
    std::nullptr_t, const std::string* regex, const Tokenizer& tok,
    const std::string& field = "response_format", const std::string& regex_field = "regex") {
  return compile_response_format(static_cast<const nlohmann::ordered_json*>(nullptr), regex, tok,
                                 field, regex_field);
}

}  // namespace clshard
