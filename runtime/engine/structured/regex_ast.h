// Regular expressions over bytes, as a tree: the common form the structured-output compilers build
// (a regex pattern, a JSON schema) before the DFA (byte_dfa.h). Characters are UTF-8 byte
// sequences; a Unicode class becomes an alternation of byte-range sequences (utf8_class).
#pragma once

#include <bitset>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace clshard::structured {

struct RegexNode;
using Regex = std::shared_ptr<const RegexNode>;

inline constexpr uint32_t kUnbounded = UINT32_MAX;

struct RegexNode {
  enum class Kind { Empty, Bytes, Concat, Alt, Repeat };
  Kind kind = Kind::Empty;
  std::bitset<256> bytes;       // Bytes: one byte out of this set
  std::vector<Regex> children;  // Concat, Alt; Repeat: {item} or {item, separator}
  // Repeat: item{min,max}; with a separator, item (separator item)* with min..max items. An
  // unbounded repeat keeps one copy of the item in the automaton (a loop), so a list of values
  // costs one value, not two.
  uint32_t min = 0, max = 0;
  // The NFA states ByteDfa::build makes of this tree (byte_dfa.cpp builds exactly this many),
  // with a subtree shared by several parents counted wherever it is used, saturating at
  // UINT64_MAX. Set once by the constructors below from the children's counts, so the expanded
  // size of any tree is known without walking it: a tree that shares subtrees (a $ref used
  // twice, a repeated group) can stand for an automaton exponentially larger than itself.
  uint64_t nfa_states = 1;
};

Regex empty();
Regex byte_set(const std::bitset<256>& bytes);
Regex byte_range(uint8_t lo, uint8_t hi);
Regex literal(std::string_view bytes);  // these bytes in order
// A part that is itself a sequence (concat) or an alternation (alt) is copied into the new node,
// which keeps trees shallow, but only up to kMaxFlattenedChildren children: a larger one stays
// one child, shared, so a subtree used in many places (a $ref) costs a pointer in each instead
// of a copy of its children (each level of a definition used twice by the next doubled the
// copying). The language is the same either way.
inline constexpr std::size_t kMaxFlattenedChildren = 64;
Regex concat(std::vector<Regex> parts);
Regex alt(std::vector<Regex> options);
Regex repeat(Regex item, uint32_t min, uint32_t max, Regex separator = nullptr);
inline Regex optional(Regex r) { return repeat(std::move(r), 0, 1); }
inline Regex star(Regex r) { return repeat(std::move(r), 0, kUnbounded); }

// Code point ranges [first, second], inclusive, any order or overlap; surrogates (U+D800..DFFF)
// are dropped. Returns the alternation of UTF-8 byte sequences of exactly those code points
// (nothing else: no overlong or surrogate encodings).
using CodepointRanges = std::vector<std::pair<uint32_t, uint32_t>>;
Regex utf8_class(CodepointRanges ranges);
// The complement of `ranges` within U+0000..U+10FFFF (surrogates excluded), sorted and merged.
CodepointRanges complement(CodepointRanges ranges);
// Appends the UTF-8 encoding of a code point.
void append_utf8(std::string& out, uint32_t cp);

}  // namespace clshard::structured
