#include "runtime/engine/structured/regex_ast.h"

#include <algorithm>
#include <stdexcept>

namespace clshard::structured {

namespace {

uint64_t add_states(uint64_t a, uint64_t b) { return a > UINT64_MAX - b ? UINT64_MAX : a + b; }
uint64_t mul_states(uint64_t a, uint64_t n) {
  return n != 0 && a > UINT64_MAX / n ? UINT64_MAX : a * n;
}

// Mirrors Nfa::build and Nfa::build_repeat (byte_dfa.cpp) state for state.
uint64_t count_nfa_states(const RegexNode& n) {
  uint64_t total = 0;
  switch (n.kind) {
    case RegexNode::Kind::Empty: return 1;
    case RegexNode::Kind::Bytes: return 2;
    case RegexNode::Kind::Concat:
      for (const Regex& c : n.children) total = add_states(total, c->nfa_states);
      return total;
    case RegexNode::Kind::Alt:
      total = 2;
      for (const Regex& c : n.children) total = add_states(total, c->nfa_states);
      return total;
    case RegexNode::Kind::Repeat: {
      const uint64_t item = n.children[0]->nfa_states;
      const uint64_t sep = n.children.size() > 1 ? n.children[1]->nfa_states : 0;
      if (n.max == kUnbounded) {  // the fixed copies, then one looping copy and its separator
        const uint64_t fixed = n.min > 0 ? n.min - 1 : 0;
        return add_states(add_states(mul_states(item, fixed + 1),
                                     mul_states(sep, fixed > 0 ? fixed : 1)),
                          3);
      }
      return add_states(add_states(mul_states(item, n.max), mul_states(sep, n.max - 1)), 2);
    }
  }
  throw std::logic_error("unknown regex node");
}

Regex make(RegexNode n) {
  n.nfa_states = count_nfa_states(n);
  return std::make_shared<const RegexNode>(std::move(n));
}

}  // namespace

Regex empty() { return make(RegexNode{}); }

Regex byte_set(const std::bitset<256>& bytes) {
  RegexNode n;
  n.kind = RegexNode::Kind::Bytes;
  n.bytes = bytes;
  return make(std::move(n));
}

Regex byte_range(uint8_t lo, uint8_t hi) {
  std::bitset<256> b;
  for (unsigned c = lo; c <= hi; ++c) b.set(c);
  return byte_set(b);
}

Regex literal(std::string_view bytes) {
  std::vector<Regex> parts;
  for (unsigned char c : bytes) parts.push_back(byte_range(c, c));
  return concat(std::move(parts));
}

Regex concat(std::vector<Regex> parts) {
  std::vector<Regex> flat;
  for (auto& p : parts) {
    if (p->kind == RegexNode::Kind::Empty) continue;
    if (p->kind == RegexNode::Kind::Concat && p->children.size() <= kMaxFlattenedChildren)
      flat.insert(flat.end(), p->children.begin(), p->children.end());
    else
      flat.push_back(std::move(p));
  }
  if (flat.empty()) return empty();
  if (flat.size() == 1) return flat[0];
  RegexNode n;
  n.kind = RegexNode::Kind::Concat;
  n.children = std::move(flat);
  return make(std::move(n));
}

Regex alt(std::vector<Regex> options) {
  if (options.empty()) throw std::logic_error("alt() of no options");
  // Single bytes merge into one set: fewer automaton states.
  std::bitset<256> merged;
  std::vector<Regex> rest;
  bool any_bytes = false;
  for (auto& o : options) {
    if (o->kind == RegexNode::Kind::Bytes) {
      merged |= o->bytes;
      any_bytes = true;
    } else if (o->kind == RegexNode::Kind::Alt && o->children.size() <= kMaxFlattenedChildren) {
      rest.insert(rest.end(), o->children.begin(), o->children.end());
    } else {
      rest.push_back(std::move(o));
    }
  }
  if (any_bytes) rest.insert(rest.begin(), byte_set(merged));
  if (rest.size() == 1) return rest[0];
  RegexNode n;
  n.kind = RegexNode::Kind::Alt;
  n.children = std::move(rest);
  return make(std::move(n));
}

Regex repeat(Regex item, uint32_t min, uint32_t max, Regex separator) {
  if (max < min) throw std::logic_error("repeat() with max < min");
  if (max == 0) return empty();
  if (min == 1 && max == 1) return item;
  RegexNode n;
  n.kind = RegexNode::Kind::Repeat;
  n.children = {std::move(item)};
  if (separator && separator->kind != RegexNode::Kind::Empty)
    n.children.push_back(std::move(separator));
  n.min = min;
  n.max = max;
  return make(std::move(n));
}

void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += char(cp);
  } else if (cp < 0x800) {
    out += char(0xC0 | (cp >> 6));
    out += char(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += char(0xE0 | (cp >> 12));
    out += char(0x80 | ((cp >> 6) & 0x3F));
    out += char(0x80 | (cp & 0x3F));
  } else {
    out += char(0xF0 | (cp >> 18));
    out += char(0x80 | ((cp >> 12) & 0x3F));
    out += char(0x80 | ((cp >> 6) & 0x3F));
    out += char(0x80 | (cp & 0x3F));
  }
}

namespace {

CodepointRanges normalise(CodepointRanges r) {
  std::vector<std::pair<uint32_t, uint32_t>> in;
  for (auto [a, b] : r) {
    if (a > b) std::swap(a, b);
    b = std::min<uint32_t>(b, 0x10FFFF);
    if (a > b) continue;
    // Cut the surrogates out.
    if (a < 0xD800 && b >= 0xD800) {
      in.push_back({a, 0xD7FF});
      if (b > 0xDFFF) in.push_back({0xE000, b});
    } else if (a >= 0xD800 && a <= 0xDFFF) {
      if (b > 0xDFFF) in.push_back({0xE000, b});
    } else {
      in.push_back({a, b});
    }
  }
  std::sort(in.begin(), in.end());
  CodepointRanges out;
  for (auto [a, b] : in) {
    if (!out.empty() && a <= out.back().second + 1)
      out.back().second = std::max(out.back().second, b);
    else
      out.push_back({a, b});
  }
  return out;
}

// Byte-range sequences of one code point range whose ends have the same UTF-8 length, split
// until every position is an independent byte range (the utf8-ranges construction).
void encode_range(uint32_t lo, uint32_t hi, std::vector<Regex>& out) {
  static const uint32_t limits[] = {0x7F, 0x7FF, 0xFFFF};
  for (uint32_t m : limits)
    if (lo <= m && hi > m) {
      encode_range(lo, m, out);
      encode_range(m + 1, hi, out);
      return;
    }
  if (hi < 0x80) {
    out.push_back(byte_range(uint8_t(lo), uint8_t(hi)));
    return;
  }
  for (uint32_t i = 1; i < 4; ++i) {
    const uint32_t m = (1u << (6 * i)) - 1;
    if ((lo & ~m) != (hi & ~m)) {
      if ((lo & m) != 0) {
        encode_range(lo, lo | m, out);
        encode_range((lo | m) + 1, hi, out);
        return;
      }
      if ((hi & m) != m) {
        encode_range(lo, (hi & ~m) - 1, out);
        encode_range(hi & ~m, hi, out);
        return;
      }
    }
  }
  std::string a, b;
  append_utf8(a, lo);
  append_utf8(b, hi);
  std::vector<Regex> seq;
  for (size_t k = 0; k < a.size(); ++k) seq.push_back(byte_range(uint8_t(a[k]), uint8_t(b[k])));
  out.push_back(concat(std::move(seq)));
}

}  // namespace

CodepointRanges complement(CodepointRanges ranges) {
  CodepointRanges r = normalise(std::move(ranges)), out;
  uint32_t next = 0;
  for (auto [a, b] : r) {
    if (a > next) out.push_back({next, a - 1});
    next = b + 1;
  }
  if (next <= 0x10FFFF) out.push_back({next, 0x10FFFF});
  return normalise(std::move(out));
}

Regex utf8_class(CodepointRanges ranges) {
  std::vector<Regex> options;
  for (auto [a, b] : normalise(std::move(ranges))) encode_range(a, b, options);
  if (options.empty()) throw std::invalid_argument("a character class that matches nothing");
  return alt(std::move(options));
}

}  // namespace clshard::structured
