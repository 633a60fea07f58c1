#include "runtime/engine/structured/regex_parser.h"

#include <cctype>
#include <stdexcept>
#include <string>

namespace clshard::structured {

namespace {

CodepointRanges digit_ranges() { return {{'0', '9'}}; }
CodepointRanges word_ranges() { return {{'0', '9'}, {'A', 'Z'}, {'a', 'z'}, {'_', '_'}}; }
CodepointRanges space_ranges() { return {{'\t', '\r'}, {' ', ' '}}; }

class Parser {
 public:
  explicit Parser(std::string_view p) : p_(p) {}

  Regex parse() {
    if (at('^')) ++i_;
    Regex r = alternation();
    if (i_ < p_.size()) {
      if (p_[i_] == ')') fail("unmatched ')'");
      fail("unexpected '" + std::string(1, p_[i_]) + "'");
    }
    return r;
  }

 private:
  std::string_view p_;
  size_t i_ = 0;
  int depth_ = 0;

  [[noreturn]] void fail(const std::string& what) const {
    throw std::invalid_argument("at offset " + std::to_string(i_) + ": " + what);
  }
  bool at(char c) const { return i_ < p_.size() && p_[i_] == c; }

  Regex alternation() {
    std::vector<Regex> options = {sequence()};
    while (at('|')) {
      ++i_;
      options.push_back(sequence());
    }
    return options.size() == 1 ? options[0] : alt(std::move(options));
  }

  Regex sequence() {
    std::vector<Regex> parts;
    while (i_ < p_.size() && !at('|') && !at(')')) {
      if (at('$')) {
        ++i_;
        // Only as the last character of the pattern (the output must end there anyway).
        if (i_ != p_.size() || depth_ > 0) fail("'$' is supported only at the end of the pattern");
        break;
      }
      if (at('^')) fail("'^' is supported only at the start of the pattern");
      Regex atom_r = atom();
      parts.push_back(quantified(std::move(atom_r)));
    }
    return concat(std::move(parts));
  }

  uint32_t number() {
    size_t start = i_;
    uint64_t v = 0;
    while (i_ < p_.size() && p_[i_] >= '0' && p_[i_] <= '9') {
      v = v * 10 + uint64_t(p_[i_] - '0');
      if (v > kMaxRepeatCount) fail("repetition count above " + std::to_string(kMaxRepeatCount));
      ++i_;
    }
    if (i_ == start) fail("expected a number");
    return uint32_t(v);
  }

  Regex quantified(Regex r) {
    while (i_ < p_.size()) {
      uint32_t lo, hi;
      const char c = p_[i_];
      if (c == '*') {
        lo = 0, hi = kUnbounded;
        ++i_;
      } else if (c == '+') {
        lo = 1, hi = kUnbounded;
        ++i_;
      } else if (c == '?') {
        lo = 0, hi = 1;
        ++i_;
      } else if (c == '{' && i_ + 1 < p_.size() && p_[i_ + 1] >= '0' && p_[i_ + 1] <= '9') {
        ++i_;
        lo = number();
        hi = lo;
        if (at(',')) {
          ++i_;
          hi = at('}') ? kUnbounded : number();
        }
        if (!at('}')) fail("expected '}' to close the repetition");
        ++i_;
        if (hi < lo) fail("repetition {" + std::to_string(lo) + "," + std::to_string(hi) + "}");
      } else {
        break;
      }
      // Lazy (?) and possessive (+) suffixes match the same strings.
      if (at('?') || at('+')) ++i_;
      r = repeat(std::move(r), lo, hi);
    }
    return r;
  }

  uint32_t hex(size_t digits) {
    uint32_t v = 0;
    for (size_t k = 0; k < digits; ++k) {
      if (i_ >= p_.size() || !std::isxdigit(static_cast<unsigned char>(p_[i_])))
        fail("expected " + std::to_string(digits) + " hex digits");
      const char c = p_[i_++];
      v = v * 16 + uint32_t(c <= '9' ? c - '0' : (c | 0x20) - 'a' + 10);
    }
    return v;
  }

  // The next UTF-8 code point of the pattern.
  uint32_t codepoint() {
    const unsigned char c = static_cast<unsigned char>(p_[i_]);
    size_t n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
    if (n == 0 || i_ + n > p_.size()) fail("invalid UTF-8 in the pattern");
    uint32_t cp = n == 1 ? c : c & (0x7F >> n);
    for (size_t k = 1; k < n; ++k) {
      const unsigned char d = static_cast<unsigned char>(p_[i_ + k]);
      if ((d & 0xC0) != 0x80) fail("invalid UTF-8 in the pattern");
      cp = (cp << 6) | (d & 0x3F);
    }
    i_ += n;
    return cp;
  }

  // After a backslash: a class escape (\d ...) fills `cls` and returns true; otherwise `cp` is
  // the escaped code point.
  bool escape(CodepointRanges& cls, uint32_t& cp, bool in_class) {
    if (i_ >= p_.size()) fail("a pattern cannot end with '\\'");
    const char c = p_[i_++];
    switch (c) {
      case 'd': cls = digit_ranges(); return true;
      case 'D': cls = complement(digit_ranges()); return true;
      case 'w': cls = word_ranges(); return true;
      case 'W': cls = complement(word_ranges()); return true;
      case 's': cls = space_ranges(); return true;
      case 'S': cls = complement(space_ranges()); return true;
      case 'n': cp = '\n'; return false;
      case 'r': cp = '\r'; return false;
      case 't': cp = '\t'; return false;
      case 'f': cp = '\f'; return false;
      case 'v': cp = '\v'; return false;
      case '0': cp = 0; return false;
      case 'x':
        if (at('{')) {
          ++i_;
          cp = 0;
          size_t n = 0;
          while (i_ < p_.size() && std::isxdigit(static_cast<unsigned char>(p_[i_])) && n < 7) {
            cp = cp * 16 + hex(1);
            ++n;
          }
          if (!at('}') || n == 0) fail("expected \\x{HEX}");
          ++i_;
          if (cp > 0x10FFFF) fail("code point above U+10FFFF");
        } else {
          cp = hex(2);
        }
        return false;
      case 'u': cp = hex(4); return false;
      case 'b':
        if (in_class) {
          cp = '\b';
          return false;
        }
        break;
      default:
        if (!std::isalnum(static_cast<unsigned char>(c))) {
          --i_;
          cp = codepoint();
          return false;
        }
    }
    --i_;
    fail("unsupported escape '\\" + std::string(1, c) + "'");
  }

  Regex atom() {
    const char c = p_[i_];
    if (c == '(') {
      ++i_;
      if (at('?')) {
        if (i_ + 1 < p_.size() && p_[i_ + 1] == ':') {
          i_ += 2;
        } else {
          fail("unsupported group syntax '(?' (only (?:...) is supported)");
        }
      }
      if (depth_ >= kMaxGroupDepth)
        fail("groups nested deeper than " + std::to_string(kMaxGroupDepth) + " levels");
      ++depth_;
      Regex r = alternation();
      --depth_;
      if (!at(')')) fail("missing ')'");
      ++i_;
      return r;
    }
    if (c == '[') return char_class();
    if (c == '.') {
      ++i_;
      return utf8_class(complement({{'\n', '\n'}}));
    }
    if (c == '*' || c == '+' || c == '?') fail("nothing to repeat");
    if (c == '{' && i_ + 1 < p_.size() && p_[i_ + 1] >= '0' && p_[i_ + 1] <= '9')
      fail("nothing to repeat");
    if (c == '\\') {
      ++i_;
      CodepointRanges cls;
      uint32_t cp = 0;
      if (escape(cls, cp, false)) return utf8_class(std::move(cls));
      std::string s;
      append_utf8(s, cp);
      return literal(s);
    }
    const uint32_t cp = codepoint();
    std::string s;
    append_utf8(s, cp);
    return literal(s);
  }

  Regex char_class() {
    const size_t open = i_;
    ++i_;
    bool negate = false;
    if (at('^')) {
      negate = true;
      ++i_;
    }
    CodepointRanges ranges;
    bool first = true;
    while (true) {
      if (i_ >= p_.size()) {
        i_ = open;
        fail("unterminated character class");
      }
      if (at(']') && !first) {
        ++i_;
        break;
      }
      first = false;
      if (at('[') && i_ + 1 < p_.size() && (p_[i_ + 1] == ':' || p_[i_ + 1] == '=' ||
                                            p_[i_ + 1] == '.'))
        fail("POSIX classes like [:alpha:] are not supported");
      uint32_t lo;
      if (at('\\')) {
        ++i_;
        CodepointRanges cls;
        if (escape(cls, lo, true)) {
          ranges.insert(ranges.end(), cls.begin(), cls.end());
          continue;
        }
      } else {
        lo = codepoint();
      }
      uint32_t hi = lo;
      if (at('-') && i_ + 1 < p_.size() && p_[i_ + 1] != ']') {
        ++i_;
        if (at('\\')) {
          ++i_;
          CodepointRanges cls;
          if (escape(cls, hi, true)) fail("a class escape cannot end a range");
        } else {
          hi = codepoint();
        }
        if (hi < lo) fail("range out of order in a character class");
      }
      ranges.push_back({lo, hi});
    }
    if (negate) ranges = complement(std::move(ranges));
    if (ranges.empty()) fail("a character class that matches nothing");
    return utf8_class(std::move(ranges));
  }
};

}  // namespace

Regex parse_regex(std::string_view pattern) { return Parser(pattern).parse(); }

}  // namespace clshard::structured
