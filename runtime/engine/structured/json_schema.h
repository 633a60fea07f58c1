// JSON schemas (the OpenAI response_format subset) and "any JSON object" as Regex trees: the
// language of compact-ish JSON texts that validate against the schema.
//
// Layout: between tokens at most kMaxWhitespace whitespace characters (space, \n, \t, \r), so a
// model cannot loop forever on spaces. Objects list their properties in schema order (required
// ones always, optional ones may be left out; no others). Integers have at most 16 digits,
// fractions at most 16, exponents at most kMaxExponentDigits (an unbounded number is no use to anyone and would
// let a model loop forever on digits). Generic values (json_object mode, or a schema without a
// type) nest at most kMaxJsonDepth containers deep.
//
// Supported keywords: type (a name or a list), properties, required, additionalProperties (false
// or true: extra properties are never generated either way), items, minItems, maxItems, enum,
// const, minLength, maxLength, anyOf, $ref to #/$defs/NAME or #/definitions/NAME (not recursive),
// $defs/definitions (each definition compiled once however often it is referenced), and the annotations title, description, default, examples, $schema, $id,
// $comment, strict. Anything else throws std::invalid_argument naming the JSON path, e.g.
// "response_format.json_schema.schema.properties.age: unsupported keyword 'multipleOf'".
// So does a schema whose expanded tree (each $ref counted wherever it is used) would pass
// ByteDfa::kMaxBuildNfaStates (1,600,000 in Release), checked before its parts are joined:
// "...$defs.item: the schema is too large: expanded (each $ref wherever it is used), its
// automaton would exceed 1600000 NFA states".
#pragma once

#include <string>

#include <nlohmann/json.hpp>

#include "runtime/engine/structured/regex_ast.h"

namespace clshard::structured {

inline constexpr uint32_t kMaxWhitespace = 2;
inline constexpr uint32_t kMaxJsonDepth = 4;
// Exponent digits of a generated number: 2 keeps every number a finite double (json_schema.cpp).
inline constexpr uint32_t kMaxExponentDigits = 2;
// minItems/maxItems/minLength/maxLength above this are unrolled too far to be useful.
inline constexpr uint32_t kMaxBoundedCount = 256;
// Schemas nest at most this deep, counting each $ref followed as a level (the compiler recurses
// per level, and a chain of $defs is as deep as it is long).
inline constexpr uint32_t kMaxSchemaDepth = 64;

// The language of JSON texts valid under `schema`; `path` names the schema in error messages.
Regex json_schema_regex(const nlohmann::ordered_json& schema, const std::string& path);
// Any JSON object (response_format {"type": "json_object"}).
Regex json_object_regex();

}  // namespace clshard::structured
