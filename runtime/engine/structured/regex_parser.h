// The `regex` extension's patterns (and JSON schema `pattern`-free parts) parsed into a Regex tree.
//
// Supported (PCRE/ECMAScript syntax, matched against the WHOLE output, as if anchored at both
// ends): literals (UTF-8), `.` (any code point but \n), classes [...] with ranges, negation and
// the escapes below, groups (...) and (?:...), alternation |, quantifiers * + ? {n} {n,} {n,m}
// (lazy and possessive suffixes are accepted and mean the same set of strings), escapes \d \D \w
// \W \s \S \n \r \t \f \v \0 \xHH \x{H...} \uHHHH and escaped punctuation, ^ at the very start
// and $ at the very end. Anything else (backreferences, lookaround, \b, inline flags, named
// classes [:alpha:], ^/$ elsewhere) throws std::invalid_argument naming the offset.
#pragma once

#include <string_view>

#include "runtime/engine/structured/regex_ast.h"

namespace clshard::structured {

// Bounded repetitions are unrolled into copies of their item; counts above this are rejected.
inline constexpr uint32_t kMaxRepeatCount = 1000;
// Groups nest at most this deep (the parser recurses per group; real patterns nest a few levels).
inline constexpr int kMaxGroupDepth = 100;

Regex parse_regex(std::string_view pattern);

}  // namespace clshard::structured
