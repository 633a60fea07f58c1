#include "runtime/text/chat_template.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstring>
#include <ctime>
#include <limits>
#include <map>
#include <optional>
#include <stdexcept>
#include <string_view>
#include <unordered_map>

#include "runtime/text/tokenizer.h"

namespace clshard {
namespace {

using json = nlohmann::json;

// ---------------------------------------------------------------------------------------------
// Errors carry the position in the template as line and column.

std::string position_of(const std::string& source, size_t pos) {
  size_t line = 1, column = 1;
  for (size_t i = 0; i < pos && i < source.size(); ++i) {
    if (source[i] == '\n') {
      ++line;
      column = 1;
    } else if ((static_cast<uint8_t>(source[i]) & 0xC0) != 0x80) {
      ++column;  // count characters, not UTF-8 continuation bytes
    }
  }
  return "line " + std::to_string(line) + " col " + std::to_string(column);
}

[[noreturn]] void fail_at(const std::string& source, size_t pos, const std::string& what) {
  throw std::runtime_error("chat template " + position_of(source, pos) + ": " + what);
}

// ---------------------------------------------------------------------------------------------
// UTF-8 helpers (template text is UTF-8; Python indexes strings by code point)

size_t utf8_length_at(std::string_view s, size_t i) {
  const auto b = static_cast<uint8_t>(s[i]);
  size_t n = b < 0x80 ? 1 : b >= 0xF0 ? 4 : b >= 0xE0 ? 3 : b >= 0xC0 ? 2 : 1;
  return std::min(n, s.size() - i);
}

uint32_t code_point_at(std::string_view s, size_t i) {
  const size_t n = utf8_length_at(s, i);
  const auto b = static_cast<uint8_t>(s[i]);
  if (n == 1) return b;
  uint32_t cp = b & (0x7F >> n);
  for (size_t k = 1; k < n; ++k) cp = (cp << 6) | (static_cast<uint8_t>(s[i + k]) & 0x3F);
  return cp;
}

// Byte offsets of each code point, plus the end.
std::vector<size_t> code_point_offsets(std::string_view s) {
  std::vector<size_t> offsets;
  for (size_t i = 0; i < s.size(); i += utf8_length_at(s, i)) offsets.push_back(i);
  offsets.push_back(s.size());
  return offsets;
}

// Python's str.isspace(), which strip()/split() use.
bool py_isspace(uint32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || (cp >= 0x1C && cp <= 0x20) || cp == 0x85 || cp == 0xA0 ||
         cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 ||
         cp == 0x202F || cp == 0x205F || cp == 0x3000;
}

// strip()/lstrip()/rstrip() with Python's whitespace, or with the given characters.
std::string py_strip(std::string_view s, bool left, bool right,
                     const std::optional<std::string>& chars = std::nullopt) {
  auto strippable = [&](uint32_t cp) {
    if (!chars) return py_isspace(cp);
    for (size_t i = 0; i < chars->size(); i += utf8_length_at(*chars, i))
      if (code_point_at(*chars, i) == cp) return true;
    return false;
  };
  const std::vector<size_t> offsets = code_point_offsets(s);
  size_t first = 0, last = offsets.size() - 1;  // code point range [first, last)
  if (left)
    while (first < last && strippable(code_point_at(s, offsets[first]))) ++first;
  if (right)
    while (last > first && strippable(code_point_at(s, offsets[last - 1]))) --last;
  return std::string(s.substr(offsets[first], offsets[last] - offsets[first]));
}

// Case mapping is ASCII-only: chat templates apply it to roles and keywords.
std::string ascii_lower(std::string s) {
  for (char& c : s) c = (c >= 'A' && c <= 'Z') ? static_cast<char>(c - 'A' + 'a') : c;
  return s;
}
std::string ascii_upper(std::string s) {
  for (char& c : s) c = (c >= 'a' && c <= 'z') ? static_cast<char>(c - 'a' + 'A') : c;
  return s;
}
bool ascii_alpha(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); }
std::string ascii_capitalize(std::string s) {
  s = ascii_lower(std::move(s));
  if (!s.empty() && s[0] >= 'a' && s[0] <= 'z') s[0] = static_cast<char>(s[0] - 'a' + 'A');
  return s;
}
std::string ascii_title(std::string s) {
  bool previous_is_letter = false;
  for (char& c : s) {
    if (ascii_alpha(c)) {
      const bool upper = c >= 'A' && c <= 'Z';
      if (!previous_is_letter && !upper) c = static_cast<char>(c - 'a' + 'A');
      if (previous_is_letter && upper) c = static_cast<char>(c - 'A' + 'a');
      previous_is_letter = true;
    } else {
      previous_is_letter = static_cast<uint8_t>(c) >= 0x80 && previous_is_letter;
    }
  }
  return s;
}

// ---------------------------------------------------------------------------------------------
// Python formatting of values: str(), repr() and json.dumps()

std::string py_float_repr(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d < 0 ? "-inf" : "inf";
  // Shortest round-trip digits, then Python's layout: positional for 1e-4 <= |d| < 1e16.
  char buffer[64];
  const auto result =
      std::to_chars(buffer, buffer + sizeof buffer, d, std::chars_format::scientific);
  const std::string sci(buffer, result.ptr);
  const size_t e = sci.find('e');
  std::string mantissa = sci.substr(0, e);
  const int exponent = std::stoi(sci.substr(e + 1));
  std::string sign;
  if (mantissa[0] == '-') {
    sign = "-";
    mantissa.erase(0, 1);
  }
  std::string digits;
  for (const char c : mantissa)
    if (c != '.') digits += c;
  if (exponent >= -4 && exponent < 16) {
    std::string out;
    if (exponent >= 0) {
      const auto int_digits = static_cast<size_t>(exponent) + 1;
      if (digits.size() <= int_digits) {
        out = digits + std::string(int_digits - digits.size(), '0') + ".0";
      } else {
        out = digits.substr(0, int_digits) + "." + digits.substr(int_digits);
      }
    } else {
      out = "0." + std::string(static_cast<size_t>(-exponent - 1), '0') + digits;
    }
    return sign + out;
  }
  std::string out = digits.substr(0, 1);
  if (digits.size() > 1) out += "." + digits.substr(1);
  const int magnitude = std::abs(exponent);
  out += exponent < 0 ? "e-" : "e+";
  if (magnitude < 10) out += '0';
  out += std::to_string(magnitude);
  return sign + out;
}

std::string py_repr_string(const std::string& s) {
  const bool use_double = s.find('\'') != std::string::npos && s.find('"') == std::string::npos;
  const char quote = use_double ? '"' : '\'';
  std::string out(1, quote);
  for (const char c : s) {
    const auto b = static_cast<uint8_t>(c);
    if (c == quote || c == '\\') {
      out += '\\';
      out += c;
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c == '\t') {
      out += "\\t";
    } else if (b < 0x20 || b == 0x7F) {
      static const char* hex = "0123456789abcdef";
      out += "\\x";
      out += hex[b >> 4];
      out += hex[b & 15];
    } else {
      out += c;
    }
  }
  out += quote;
  return out;
}

std::string py_str(const json& value);

std::string py_repr(const json& value) {
  if (value.is_string()) return py_repr_string(value.get_ref<const std::string&>());
  return py_str(value);
}

std::string py_str(const json& value) {
  switch (value.type()) {
    case json::value_t::null:
      return "None";
    case json::value_t::boolean:
      return value.get<bool>() ? "True" : "False";
    case json::value_t::number_integer:
      return std::to_string(value.get<int64_t>());
    case json::value_t::number_unsigned:
      return std::to_string(value.get<uint64_t>());
    case json::value_t::number_float:
      return py_float_repr(value.get<double>());
    case json::value_t::string:
      return value.get<std::string>();
    case json::value_t::array: {
      std::string out = "[";
      for (size_t i = 0; i < value.size(); ++i) out += (i ? ", " : "") + py_repr(value[i]);
      return out + "]";
    }
    case json::value_t::object: {
      std::string out = "{";
      bool first = true;
      for (const auto& [key, item] : value.items()) {
        out += (first ? "" : ", ") + py_repr_string(key) + ": " + py_repr(item);
        first = false;
      }
      return out + "}";
    }
    default:
      return "";
  }
}

void json_dump_string(const std::string& s, bool ensure_ascii, std::string& out) {
  static const char* hex = "0123456789abcdef";
  auto escape_unit = [&](uint32_t unit) {
    out += "\\u";
    for (int shift = 12; shift >= 0; shift -= 4) out += hex[(unit >> shift) & 15];
  };
  out += '"';
  for (size_t i = 0; i < s.size();) {
    const auto b = static_cast<uint8_t>(s[i]);
    if (b >= 0x80) {
      const size_t n = utf8_length_at(s, i);
      if (ensure_ascii) {
        const uint32_t cp = code_point_at(s, i);
        if (cp >= 0x10000) {
          escape_unit(0xD800 + ((cp - 0x10000) >> 10));
          escape_unit(0xDC00 + ((cp - 0x10000) & 0x3FF));
        } else {
          escape_unit(cp);
        }
      } else {
        out.append(s, i, n);
      }
      i += n;
      continue;
    }
    switch (b) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\b':
        out += "\\b";
        break;
      case '\f':
        out += "\\f";
        break;
      default:
        if (b < 0x20)
          escape_unit(b);
        else
          out += static_cast<char>(b);
    }
    ++i;
  }
  out += '"';
}

// Python's json.dumps: separators ", " / ": " without indent, "," / ": " with it.
void json_dump(const json& value, int indent, bool ensure_ascii, int level, std::string& out) {
  auto newline = [&](int depth) {
    out += '\n';
    out.append(static_cast<size_t>(indent * depth), ' ');
  };
  switch (value.type()) {
    case json::value_t::null:
      out += "null";
      return;
    case json::value_t::boolean:
      out += value.get<bool>() ? "true" : "false";
      return;
    case json::value_t::number_float: {
      const double d = value.get<double>();
      out += std::isnan(d)   ? "NaN"
             : std::isinf(d) ? (d < 0 ? "-Infinity" : "Infinity")
                             : py_float_repr(d);
      return;
    }
    case json::value_t::string:
      json_dump_string(value.get_ref<const std::string&>(), ensure_ascii, out);
      return;
    case json::value_t::array:
    case json::value_t::object: {
      const bool is_object = value.is_object();
      if (value.empty()) {
        out += is_object ? "{}" : "[]";
        return;
      }
      out += is_object ? '{' : '[';
      bool first = true;
      for (const auto& [key, item] : value.items()) {
        if (!first) out += indent >= 0 ? "," : ", ";
        first = false;
        if (indent >= 0) newline(level + 1);
        if (is_object) {
          json_dump_string(key, ensure_ascii, out);
          out += ": ";
        }
        json_dump(item, indent, ensure_ascii, level + 1, out);
      }
      if (indent >= 0) newline(level);
      out += is_object ? '}' : ']';
      return;
    }
    default:
      out += value.dump();
      return;  // integers
  }
}

std::string html_escape(const std::string& s) {
  std::string out;
  for (const char c : s) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&#34;";
        break;
      case '\'':
        out += "&#39;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// Lexer. Produces Jinja's token stream: text, {{ / }} and {% / %} delimiters with expression
// tokens between them; comments and whitespace control are resolved here.

enum class Tok {
  Text,
  VarBegin,
  VarEnd,
  BlockBegin,
  BlockEnd,
  Name,
  String,
  Integer,
  Float,
  Op,
  End
};

struct Token {
  Tok type;
  std::string value;  // text, name, string contents or operator
  size_t pos;
  int64_t integer = 0;
  double real = 0;
};

// transformers renders chat templates with trim_blocks and lstrip_blocks on.
constexpr bool kTrimBlocks = true;
constexpr bool kLstripBlocks = true;

class Lexer {
 public:
  explicit Lexer(const std::string& source) : s_(source) {}

  std::vector<Token> run() {
    bool line_starting = true;  // the previous tag's match ended a line (or we are at the start)
    while (true) {
      size_t open = pos_;
      while ((open = s_.find('{', open)) != std::string::npos) {
        if (open + 1 < s_.size() &&
            (s_[open + 1] == '{' || s_[open + 1] == '%' || s_[open + 1] == '#'))
          break;
        ++open;
      }
      std::string text = s_.substr(pos_, (open == std::string::npos ? s_.size() : open) - pos_);
      if (open == std::string::npos) {
        if (!text.empty()) tokens_.push_back({Tok::Text, text, pos_});
        break;
      }
      const char kind = s_[open + 1];
      const char modifier = open + 2 < s_.size() ? s_[open + 2] : '\0';
      if (modifier == '-') {
        text = py_strip(text, false, true);
      } else if (kLstripBlocks && kind != '{' && modifier != '+') {
        // lstrip_blocks: drop spaces and tabs between the line start and a block or comment tag.
        const size_t newline = text.rfind('\n');
        const size_t line_begin = newline == std::string::npos ? 0 : newline + 1;
        if ((newline != std::string::npos || line_starting) &&
            text.find_first_not_of(" \t", line_begin) == std::string::npos)
          text.resize(line_begin);
      }
      if (!text.empty()) tokens_.push_back({Tok::Text, text, pos_});
      pos_ = open + 2 + ((modifier == '-' || modifier == '+') ? 1 : 0);

      if (kind == '#') {
        const size_t close = s_.find("#}", pos_);
        if (close == std::string::npos) fail_at(s_, open, "unclosed comment");
        const bool strip = close > open + 2 && s_[close - 1] == '-';
        pos_ = close + 2;
        line_starting = end_tag(strip, true);
        continue;
      }
      tokens_.push_back({kind == '{' ? Tok::VarBegin : Tok::BlockBegin, "", open});
      line_starting = lex_tag(kind, open);
    }
    tokens_.push_back({Tok::End, "", s_.size()});
    return std::move(tokens_);
  }

 private:
  // Whitespace control after a tag: "-" eats all following whitespace, trim_blocks one newline
  // after a block or comment. Returns whether what was eaten ended a line.
  bool end_tag(bool strip, bool is_block) {
    if (strip) {
      bool ended_line = false;
      while (pos_ < s_.size() && py_isspace(code_point_at(s_, pos_))) {
        ended_line = s_[pos_] == '\n';
        pos_ += utf8_length_at(s_, pos_);
      }
      return ended_line;
    }
    if (is_block && kTrimBlocks && pos_ < s_.size() && s_[pos_] == '\n') {
      ++pos_;
      return true;
    }
    return false;
  }

  bool lex_tag(char kind, size_t open) {
    int depth = 0;  // open brackets: "}}" inside a dict literal does not end the tag
    while (true) {
      while (pos_ < s_.size() && std::strchr(" \t\r\n\f\v", s_[pos_]) && s_[pos_] != '\0') ++pos_;
      if (pos_ >= s_.size()) fail_at(s_, open, kind == '{' ? "unclosed '{{'" : "unclosed '{%'");
      if (depth == 0) {
        const bool minus = s_[pos_] == '-';
        const size_t at = pos_ + (minus ? 1 : 0);
        if (s_.compare(at, 2, kind == '{' ? "}}" : "%}") == 0) {
          tokens_.push_back({kind == '{' ? Tok::VarEnd : Tok::BlockEnd, "", pos_});
          pos_ = at + 2;
          return end_tag(minus, kind == '%');
        }
      }
      const size_t start = pos_;
      const char c = s_[pos_];
      if (ascii_alpha(c) || c == '_') {
        while (pos_ < s_.size() &&
               (ascii_alpha(s_[pos_]) || std::isdigit(static_cast<unsigned char>(s_[pos_])) ||
                s_[pos_] == '_'))
          ++pos_;
        tokens_.push_back({Tok::Name, s_.substr(start, pos_ - start), start});
      } else if (std::isdigit(static_cast<unsigned char>(c))) {
        lex_number();
      } else if (c == '\'' || c == '"') {
        lex_string();
      } else {
        static const char* two_char_ops[] = {"==", "!=", "<=", ">=", "//", "**"};
        std::string op;
        for (const char* candidate : two_char_ops)
          if (s_.compare(pos_, 2, candidate) == 0) op = candidate;
        if (op.empty() && std::strchr("+-*/%~<>=()[]{}.,:|", c) && c != '\0')
          op = std::string(1, c);
        if (op.empty()) fail_at(s_, pos_, std::string("unexpected character '") + c + "'");
        if (op == "(" || op == "[" || op == "{") ++depth;
        if ((op == ")" || op == "]" || op == "}") && depth > 0) --depth;
        pos_ += op.size();
        tokens_.push_back({Tok::Op, op, start});
      }
    }
  }

  void lex_number() {
    const size_t start = pos_;
    auto digits = [&] {
      while (pos_ < s_.size() &&
             (std::isdigit(static_cast<unsigned char>(s_[pos_])) || s_[pos_] == '_'))
        ++pos_;
    };
    digits();
    bool is_float = false;
    if (pos_ + 1 < s_.size() && s_[pos_] == '.' &&
        std::isdigit(static_cast<unsigned char>(s_[pos_ + 1]))) {
      is_float = true;
      ++pos_;
      digits();
    }
    if (pos_ < s_.size() && (s_[pos_] == 'e' || s_[pos_] == 'E')) {
      size_t after = pos_ + 1;
      if (after < s_.size() && (s_[after] == '+' || s_[after] == '-')) ++after;
      if (after < s_.size() && std::isdigit(static_cast<unsigned char>(s_[after]))) {
        is_float = true;
        pos_ = after;
        digits();
      }
    }
    std::string text;
    for (size_t i = start; i < pos_; ++i)
      if (s_[i] != '_') text += s_[i];
    Token token{is_float ? Tok::Float : Tok::Integer, text, start};
    if (is_float) {
      token.real = std::strtod(text.c_str(), nullptr);
    } else {
      const auto result = std::from_chars(text.data(), text.data() + text.size(), token.integer);
      if (result.ec != std::errc()) fail_at(s_, start, "integer literal out of range");
    }
    tokens_.push_back(std::move(token));
  }

  // Python string literal escapes (Jinja decodes them the same way).
  void lex_string() {
    const size_t start = pos_;
    const char quote = s_[pos_++];
    std::string value;
    while (true) {
      if (pos_ >= s_.size()) fail_at(s_, start, "unterminated string literal");
      const char c = s_[pos_++];
      if (c == quote) break;
      if (c != '\\') {
        value += c;
        continue;
      }
      if (pos_ >= s_.size()) fail_at(s_, start, "unterminated string literal");
      const char e = s_[pos_++];
      auto hex_escape = [&](size_t count) {
        if (pos_ + count > s_.size()) fail_at(s_, pos_, "truncated \\x/\\u escape");
        uint32_t cp = 0;
        for (size_t k = 0; k < count; ++k) {
          const char h = s_[pos_++];
          cp <<= 4;
          if (h >= '0' && h <= '9')
            cp |= static_cast<uint32_t>(h - '0');
          else if (h >= 'a' && h <= 'f')
            cp |= static_cast<uint32_t>(h - 'a' + 10);
          else if (h >= 'A' && h <= 'F')
            cp |= static_cast<uint32_t>(h - 'A' + 10);
          else
            fail_at(s_, pos_ - 1, "bad hex digit in escape");
        }
        if (cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF))
          fail_at(s_, pos_, "escape is not a character");
        // Encode as UTF-8.
        if (cp < 0x80) {
          value += static_cast<char>(cp);
        } else if (cp < 0x800) {
          value += static_cast<char>(0xC0 | (cp >> 6));
          value += static_cast<char>(0x80 | (cp & 0x3F));
        } else if (cp < 0x10000) {
          value += static_cast<char>(0xE0 | (cp >> 12));
          value += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
          value += static_cast<char>(0x80 | (cp & 0x3F));
        } else {
          value += static_cast<char>(0xF0 | (cp >> 18));
          value += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
          value += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
          value += static_cast<char>(0x80 | (cp & 0x3F));
        }
      };
      switch (e) {
        case 'n':
          value += '\n';
          break;
        case 't':
          value += '\t';
          break;
        case 'r':
          value += '\r';
          break;
        case '0':
          value += '\0';
          break;
        case 'a':
          value += '\a';
          break;
        case 'b':
          value += '\b';
          break;
        case 'f':
          value += '\f';
          break;
        case 'v':
          value += '\v';
          break;
        case '\\':
          value += '\\';
          break;
        case '\'':
          value += '\'';
          break;
        case '"':
          value += '"';
          break;
        case '\n':
          break;  // line continuation
        case 'x':
          hex_escape(2);
          break;
        case 'u':
          hex_escape(4);
          break;
        case 'U':
          hex_escape(8);
          break;
        default:  // Python keeps unknown escapes as written
          value += '\\';
          value += e;
      }
    }
    tokens_.push_back({Tok::String, value, start});
  }

  const std::string& s_;
  size_t pos_ = 0;
  std::vector<Token> tokens_;
};

// ---------------------------------------------------------------------------------------------
// Syntax tree

struct Node {
  enum class Kind {
    Literal,  // literal
    Name,     // name
    List,     // args: items (tuples are lists too)
    Dict,     // args: key, value, key, value, ...
    Attr,     // args[0].name
    Item,     // args[0][args[1]]
    Slice,    // args[0][args[1]:args[2]:args[3]], missing parts null
    Call,     // args[0](args[1..], kwargs)
    Filter,   // args[0] | name(args[1..], kwargs)
    Test,     // args[0] is [not] name(args[1..])
    Not,
    Negate,
    Plus,
    Binary,  // args[0] name args[1]: + - * / // % ** ~
    And,
    Or,
    Compare,   // args[0] ops[0] args[1] ops[1] args[2] ...
    Condition  // args[0] if args[1] else args[2] (args[2] may be null)
  };
  Kind kind;
  size_t pos = 0;
  std::string name;
  json literal;
  std::vector<std::unique_ptr<Node>> args;
  std::vector<std::pair<std::string, std::unique_ptr<Node>>> kwargs;
  std::vector<std::string> ops;
  bool negated = false;
  int depth = 1;  // height of this subtree, bounded so evaluation cannot exhaust the stack
};
using NodePtr = std::unique_ptr<Node>;

struct Stmt;
using StmtPtr = std::unique_ptr<Stmt>;
using Body = std::vector<StmtPtr>;

struct Stmt {
  enum class Kind { Text, Output, If, For, Set, SetAttr, SetBlock, Break, Continue, Block };
  Kind kind;
  size_t pos = 0;
  std::string text;                                // Text
  NodePtr expr;                                    // Output, Set/SetAttr value, For iterable
  std::vector<std::pair<NodePtr, Body>> branches;  // If: (condition, body) for if and each elif
  Body body, else_body;                            // For / SetBlock / Block body; If / For else
  std::vector<std::string> targets;  // For / Set names; SetAttr: {variable, attribute}
  NodePtr filter;                    // For: the "if" condition
};

// ---------------------------------------------------------------------------------------------
// Parser: recursive descent with Jinja's precedence (filters and tests bind tighter than any
// operator, so a + b | trim is a + (b | trim)).

class Parser {
 public:
  Parser(const std::string& source, std::vector<Token> tokens)
      : src_(source), tokens_(std::move(tokens)) {}

  Body parse_template() {
    std::string ended_by;
    return parse_body({}, ended_by);
  }

 private:
  const Token& peek(size_t ahead = 0) const {
    return tokens_[std::min(index_ + ahead, tokens_.size() - 1)];
  }
  const Token& advance() { return tokens_[std::min(index_++, tokens_.size() - 1)]; }
  bool at_op(std::string_view op) const { return peek().type == Tok::Op && peek().value == op; }
  bool at_name(std::string_view name) const {
    return peek().type == Tok::Name && peek().value == name;
  }
  bool skip_op(std::string_view op) {
    if (!at_op(op)) return false;
    ++index_;
    return true;
  }
  bool skip_name(std::string_view name) {
    if (!at_name(name)) return false;
    ++index_;
    return true;
  }

  static std::string describe(const Token& token) {
    switch (token.type) {
      case Tok::Text:
        return "template text";
      case Tok::VarBegin:
        return "'{{'";
      case Tok::VarEnd:
        return "'}}'";
      case Tok::BlockBegin:
        return "'{%'";
      case Tok::BlockEnd:
        return "'%}'";
      case Tok::Name:
        return "'" + token.value + "'";
      case Tok::String:
        return "a string";
      case Tok::Integer:
      case Tok::Float:
        return "a number";
      case Tok::Op:
        return "'" + token.value + "'";
      case Tok::End:
        return "the end of the template";
    }
    return "?";
  }

  [[noreturn]] void unexpected(const std::string& wanted) const {
    fail_at(src_, peek().pos, "expected " + wanted + ", found " + describe(peek()));
  }
  void expect_op(std::string_view op) {
    if (!skip_op(op)) unexpected("'" + std::string(op) + "'");
  }
  void expect(Tok type, const char* what) {
    if (peek().type != type) unexpected(what);
    ++index_;
  }
  std::string expect_name() {
    if (peek().type != Tok::Name) unexpected("a name");
    return advance().value;
  }

  // Templates come with model files; bound nesting so a hostile one cannot overflow the stack
  // while parsing (recursion) or evaluating (tree height).
  static constexpr int kMaxDepth = 200;

  class NestingGuard {
   public:
    explicit NestingGuard(Parser& parser) : parser_(parser) {
      if (++parser_.nesting_ > kMaxDepth)
        fail_at(parser_.src_, parser_.peek().pos, "template nested too deeply");
    }
    ~NestingGuard() { --parser_.nesting_; }
    NestingGuard(const NestingGuard&) = delete;
    NestingGuard& operator=(const NestingGuard&) = delete;

   private:
    Parser& parser_;
  };

  void check_depth(Node& parent, const Node& child) {
    parent.depth = std::max(parent.depth, child.depth + 1);
    if (parent.depth > kMaxDepth) fail_at(src_, parent.pos, "expression nested too deeply");
  }

  // Every child is attached through here, so no tree grows past kMaxDepth.
  void add_child(Node& parent, NodePtr child) {
    if (child) check_depth(parent, *child);
    parent.args.push_back(std::move(child));
  }

  static NodePtr node(Node::Kind kind, size_t pos) {
    auto n = std::make_unique<Node>();
    n->kind = kind;
    n->pos = pos;
    return n;
  }

  // Statements until one of end_tags opens a block tag; the tag name is consumed and returned in
  // ended_by, the rest of that tag is left to the caller.
  Body parse_body(std::initializer_list<std::string_view> end_tags, std::string& ended_by) {
    const NestingGuard guard(*this);
    Body body;
    while (true) {
      const Token& token = peek();
      if (token.type == Tok::End) {
        if (end_tags.size() != 0)  // the last end tag is the one that closes the block
          fail_at(src_, token.pos, "missing {% " + std::string(*(end_tags.end() - 1)) + " %}");
        return body;
      }
      if (token.type == Tok::Text) {
        auto stmt = std::make_unique<Stmt>();
        stmt->kind = Stmt::Kind::Text;
        stmt->pos = token.pos;
        stmt->text = token.value;
        body.push_back(std::move(stmt));
        ++index_;
        continue;
      }
      if (token.type == Tok::VarBegin) {
        ++index_;
        auto stmt = std::make_unique<Stmt>();
        stmt->kind = Stmt::Kind::Output;
        stmt->pos = token.pos;
        stmt->expr = parse_tuple(true);
        expect(Tok::VarEnd, "'}}'");
        body.push_back(std::move(stmt));
        continue;
      }
      if (token.type != Tok::BlockBegin) unexpected("text, '{{' or '{%'");
      const size_t tag_pos = token.pos;
      ++index_;
      if (peek().type != Tok::Name) unexpected("a tag name");
      const std::string tag = peek().value;
      for (std::string_view end : end_tags) {
        if (tag == end) {
          ++index_;
          ended_by = tag;
          return body;
        }
      }
      ++index_;
      if (tag == "if") {
        body.push_back(parse_if(tag_pos));
      } else if (tag == "for") {
        body.push_back(parse_for(tag_pos));
      } else if (tag == "set") {
        body.push_back(parse_set(tag_pos));
      } else if (tag == "break" || tag == "continue") {
        if (loop_depth_ == 0) fail_at(src_, tag_pos, "'" + tag + "' outside a for loop");
        expect(Tok::BlockEnd, "'%}'");
        auto stmt = std::make_unique<Stmt>();
        stmt->kind = tag == "break" ? Stmt::Kind::Break : Stmt::Kind::Continue;
        stmt->pos = tag_pos;
        body.push_back(std::move(stmt));
      } else if (tag == "generation") {
        // transformers' marker for assistant-token masks; renders its body unchanged.
        expect(Tok::BlockEnd, "'%}'");
        auto stmt = std::make_unique<Stmt>();
        stmt->kind = Stmt::Kind::Block;
        stmt->pos = tag_pos;
        std::string ended;
        stmt->body = parse_body({"endgeneration"}, ended);
        expect(Tok::BlockEnd, "'%}'");
        body.push_back(std::move(stmt));
      } else if (tag == "elif" || tag == "else" || tag.rfind("end", 0) == 0) {
        fail_at(src_, tag_pos, "unexpected {% " + tag + " %}");
      } else {
        fail_at(src_, tag_pos, "unsupported tag '" + tag + "'");
      }
    }
  }

  StmtPtr parse_if(size_t pos) {
    auto stmt = std::make_unique<Stmt>();
    stmt->kind = Stmt::Kind::If;
    stmt->pos = pos;
    std::string ended_by = "elif";
    while (ended_by == "elif") {
      NodePtr condition = parse_tuple(false);
      expect(Tok::BlockEnd, "'%}'");
      Body branch = parse_body({"elif", "else", "endif"}, ended_by);
      stmt->branches.emplace_back(std::move(condition), std::move(branch));
    }
    expect(Tok::BlockEnd, "'%}'");
    if (ended_by == "else") {
      stmt->else_body = parse_body({"endif"}, ended_by);
      expect(Tok::BlockEnd, "'%}'");
    }
    return stmt;
  }

  StmtPtr parse_for(size_t pos) {
    auto stmt = std::make_unique<Stmt>();
    stmt->kind = Stmt::Kind::For;
    stmt->pos = pos;
    do {
      stmt->targets.push_back(expect_name());
    } while (skip_op(","));
    if (!skip_name("in")) unexpected("'in'");
    stmt->expr = parse_tuple(false);
    if (skip_name("if")) stmt->filter = parse_expression(true);
    if (at_name("recursive")) fail_at(src_, peek().pos, "recursive loops are not supported");
    expect(Tok::BlockEnd, "'%}'");
    ++loop_depth_;
    std::string ended_by;
    stmt->body = parse_body({"else", "endfor"}, ended_by);
    --loop_depth_;
    expect(Tok::BlockEnd, "'%}'");
    if (ended_by == "else") {
      stmt->else_body = parse_body({"endfor"}, ended_by);
      expect(Tok::BlockEnd, "'%}'");
    }
    return stmt;
  }

  StmtPtr parse_set(size_t pos) {
    auto stmt = std::make_unique<Stmt>();
    stmt->pos = pos;
    stmt->targets.push_back(expect_name());
    if (skip_op(".")) {
      stmt->kind = Stmt::Kind::SetAttr;
      stmt->targets.push_back(expect_name());
    } else {
      stmt->kind = Stmt::Kind::Set;
      while (skip_op(",")) stmt->targets.push_back(expect_name());
    }
    if (skip_op("=")) {
      stmt->expr = parse_tuple(true);
      expect(Tok::BlockEnd, "'%}'");
      return stmt;
    }
    if (stmt->kind != Stmt::Kind::Set || stmt->targets.size() != 1) unexpected("'='");
    // {% set name %}...{% endset %} captures the rendered body.
    expect(Tok::BlockEnd, "'%}'");
    stmt->kind = Stmt::Kind::SetBlock;
    std::string ended_by;
    stmt->body = parse_body({"endset"}, ended_by);
    expect(Tok::BlockEnd, "'%}'");
    return stmt;
  }

  // Expressions ---------------------------------------------------------------------------------

  // a, b, c (a tuple, evaluated as a list) or a single expression.
  NodePtr parse_tuple(bool with_condition) {
    const size_t pos = peek().pos;
    NodePtr first = parse_expression(with_condition);
    if (!at_op(",")) return first;
    NodePtr tuple = node(Node::Kind::List, pos);
    add_child(*tuple, std::move(first));
    while (skip_op(",")) {
      if (peek().type == Tok::VarEnd || peek().type == Tok::BlockEnd || at_op(")")) break;
      add_child(*tuple, parse_expression(with_condition));
    }
    return tuple;
  }

  NodePtr parse_expression(bool with_condition) {
    const NestingGuard guard(*this);
    NodePtr expr = parse_or();
    if (!with_condition) return expr;
    while (at_name("if")) {
      const size_t pos = advance().pos;
      NodePtr condition = parse_or();
      NodePtr otherwise = skip_name("else") ? parse_expression(true) : nullptr;
      NodePtr cond = node(Node::Kind::Condition, pos);
      add_child(*cond, std::move(expr));
      add_child(*cond, std::move(condition));
      add_child(*cond, std::move(otherwise));
      expr = std::move(cond);
    }
    return expr;
  }

  NodePtr parse_or() {
    NodePtr left = parse_and();
    while (at_name("or")) {
      NodePtr n = node(Node::Kind::Or, advance().pos);
      add_child(*n, std::move(left));
      add_child(*n, parse_and());
      left = std::move(n);
    }
    return left;
  }

  NodePtr parse_and() {
    NodePtr left = parse_not();
    while (at_name("and")) {
      NodePtr n = node(Node::Kind::And, advance().pos);
      add_child(*n, std::move(left));
      add_child(*n, parse_not());
      left = std::move(n);
    }
    return left;
  }

  NodePtr parse_not() {
    const NestingGuard guard(*this);
    if (at_name("not")) {
      NodePtr n = node(Node::Kind::Not, advance().pos);
      add_child(*n, parse_not());
      return n;
    }
    return parse_compare();
  }

  NodePtr parse_compare() {
    const size_t pos = peek().pos;
    NodePtr first = parse_math1();
    NodePtr compare;
    while (true) {
      std::string op;
      if (peek().type == Tok::Op &&
          (peek().value == "==" || peek().value == "!=" || peek().value == "<" ||
           peek().value == "<=" || peek().value == ">" || peek().value == ">=")) {
        op = advance().value;
      } else if (at_name("in")) {
        ++index_;
        op = "in";
      } else if (at_name("not") && peek(1).type == Tok::Name && peek(1).value == "in") {
        index_ += 2;
        op = "not in";
      } else {
        break;
      }
      if (!compare) {
        compare = node(Node::Kind::Compare, pos);
        add_child(*compare, std::move(first));
      }
      compare->ops.push_back(op);
      add_child(*compare, parse_math1());
    }
    return compare ? std::move(compare) : std::move(first);
  }

  NodePtr binary(std::string op, size_t pos, NodePtr left, NodePtr right) {
    NodePtr n = node(Node::Kind::Binary, pos);
    n->name = std::move(op);
    add_child(*n, std::move(left));
    add_child(*n, std::move(right));
    return n;
  }

  NodePtr parse_math1() {
    NodePtr left = parse_concat();
    while (at_op("+") || at_op("-")) {
      const Token& op = advance();
      left = binary(op.value, op.pos, std::move(left), parse_concat());
    }
    return left;
  }

  NodePtr parse_concat() {
    NodePtr left = parse_math2();
    while (at_op("~")) {
      const Token& op = advance();
      left = binary("~", op.pos, std::move(left), parse_math2());
    }
    return left;
  }

  NodePtr parse_math2() {
    NodePtr left = parse_pow();
    while (at_op("*") || at_op("/") || at_op("//") || at_op("%")) {
      const Token& op = advance();
      left = binary(op.value, op.pos, std::move(left), parse_pow());
    }
    return left;
  }

  NodePtr parse_pow() {
    NodePtr left = parse_unary(true);
    while (at_op("**")) {
      const Token& op = advance();
      left = binary("**", op.pos, std::move(left), parse_unary(true));
    }
    return left;
  }

  NodePtr parse_unary(bool with_filter) {
    const NestingGuard guard(*this);
    NodePtr result;
    if (at_op("-") || at_op("+")) {
      const Token& op = advance();
      result = node(op.value == "-" ? Node::Kind::Negate : Node::Kind::Plus, op.pos);
      add_child(*result, parse_unary(false));
    } else {
      result = parse_postfix(parse_primary());
    }
    return with_filter ? parse_filters(std::move(result)) : std::move(result);
  }

  NodePtr parse_primary() {
    const Token& token = peek();
    const size_t pos = token.pos;
    switch (token.type) {
      case Tok::Name: {
        ++index_;
        const std::string& name = token.value;
        NodePtr n = node(Node::Kind::Literal, pos);
        if (name == "true" || name == "True")
          n->literal = true;
        else if (name == "false" || name == "False")
          n->literal = false;
        else if (name == "none" || name == "None")
          n->literal = nullptr;
        else {
          n->kind = Node::Kind::Name;
          n->name = name;
        }
        return n;
      }
      case Tok::String: {
        // Adjacent string literals concatenate, as in Python.
        std::string value;
        while (peek().type == Tok::String) value += advance().value;
        NodePtr n = node(Node::Kind::Literal, pos);
        n->literal = std::move(value);
        return n;
      }
      case Tok::Integer:
      case Tok::Float: {
        ++index_;
        NodePtr n = node(Node::Kind::Literal, pos);
        if (token.type == Tok::Integer)
          n->literal = token.integer;
        else
          n->literal = token.real;
        return n;
      }
      case Tok::Op:
        if (token.value == "(") {
          ++index_;
          if (skip_op(")")) return node(Node::Kind::List, pos);  // ()
          NodePtr inner = parse_expression(true);
          if (at_op(",")) {
            NodePtr tuple = node(Node::Kind::List, pos);
            add_child(*tuple, std::move(inner));
            while (skip_op(",") && !at_op(")")) add_child(*tuple, parse_expression(true));
            inner = std::move(tuple);
          }
          expect_op(")");
          return inner;
        }
        if (token.value == "[") {
          ++index_;
          NodePtr list = node(Node::Kind::List, pos);
          while (!at_op("]")) {
            add_child(*list, parse_expression(true));
            if (!skip_op(",")) break;
          }
          expect_op("]");
          return list;
        }
        if (token.value == "{") {
          ++index_;
          NodePtr dict = node(Node::Kind::Dict, pos);
          while (!at_op("}")) {
            add_child(*dict, parse_expression(true));
            expect_op(":");
            add_child(*dict, parse_expression(true));
            if (!skip_op(",")) break;
          }
          expect_op("}");
          return dict;
        }
        break;
      default:
        break;
    }
    unexpected("an expression");
  }

  void parse_call_args(Node& call) {
    // After "(": positional arguments, then name=value ones.
    while (!at_op(")")) {
      if (peek().type == Tok::Name && peek(1).type == Tok::Op && peek(1).value == "=") {
        std::string name = advance().value;
        ++index_;
        NodePtr value = parse_expression(true);
        check_depth(call, *value);
        call.kwargs.emplace_back(std::move(name), std::move(value));
      } else {
        if (!call.kwargs.empty())
          fail_at(src_, peek().pos, "positional argument after keyword argument");
        add_child(call, parse_expression(true));
      }
      if (!skip_op(",")) break;
    }
    expect_op(")");
  }

  // Postfix nodes take their base's position, so errors point at the start of "a.b[c](d)".
  NodePtr parse_postfix(NodePtr expr) {
    while (true) {
      const size_t pos = expr->pos;
      if (at_op(".")) {
        ++index_;
        NodePtr n;
        if (peek().type == Tok::Integer) {  // x.0 is x[0]
          n = node(Node::Kind::Item, pos);
          NodePtr index = node(Node::Kind::Literal, peek().pos);
          index->literal = advance().integer;
          add_child(*n, std::move(expr));
          add_child(*n, std::move(index));
        } else {
          n = node(Node::Kind::Attr, pos);
          n->name = expect_name();
          add_child(*n, std::move(expr));
        }
        expr = std::move(n);
      } else if (at_op("[")) {
        ++index_;
        NodePtr parts[3];
        bool is_slice = false;
        for (int part = 0; part < 3; ++part) {
          if (!at_op(":") && !at_op("]")) parts[part] = parse_expression(true);
          if (part < 2 && skip_op(":")) {
            is_slice = true;
            continue;
          }
          break;
        }
        expect_op("]");
        NodePtr n = node(is_slice ? Node::Kind::Slice : Node::Kind::Item, pos);
        add_child(*n, std::move(expr));
        if (!is_slice && !parts[0]) fail_at(src_, pos, "empty subscript");
        for (int part = 0; part < (is_slice ? 3 : 1); ++part) add_child(*n, std::move(parts[part]));
        expr = std::move(n);
      } else if (at_op("(")) {
        ++index_;
        NodePtr n = node(Node::Kind::Call, pos);
        add_child(*n, std::move(expr));
        parse_call_args(*n);
        expr = std::move(n);
      } else {
        return expr;
      }
    }
  }

  NodePtr parse_filters(NodePtr expr) {
    while (true) {
      if (at_op("|")) {
        const size_t pos = advance().pos;
        NodePtr n = node(Node::Kind::Filter, pos);
        n->name = expect_name();
        add_child(*n, std::move(expr));
        if (skip_op("(")) parse_call_args(*n);
        expr = std::move(n);
      } else if (at_name("is")) {
        const size_t pos = advance().pos;
        NodePtr n = node(Node::Kind::Test, pos);
        n->negated = skip_name("not");
        n->name = expect_name();
        add_child(*n, std::move(expr));
        const Token& next = peek();
        if (skip_op("(")) {
          parse_call_args(*n);
        } else if ((next.type == Tok::Name || next.type == Tok::String ||
                    next.type == Tok::Integer || next.type == Tok::Float ||
                    (next.type == Tok::Op && (next.value == "[" || next.value == "{"))) &&
                   !(next.type == Tok::Name &&
                     (next.value == "else" || next.value == "or" || next.value == "and" ||
                      next.value == "if" || next.value == "is"))) {
          // "x is divisibleby 3": one argument without parentheses.
          add_child(*n, parse_postfix(parse_primary()));
        }
        expr = std::move(n);
      } else if (at_op("(")) {
        NodePtr n = node(Node::Kind::Call, advance().pos);
        add_child(*n, std::move(expr));
        parse_call_args(*n);
        expr = std::move(n);
      } else {
        return expr;
      }
    }
  }

  const std::string& src_;
  std::vector<Token> tokens_;
  size_t index_ = 0;
  int loop_depth_ = 0;
  int nesting_ = 0;
};

// ---------------------------------------------------------------------------------------------
// Values

struct Namespace;

// A template value: Jinja's Undefined, JSON data, or a namespace() object. Data is shared and
// immutable, so reading messages[3].content points into the context instead of copying it.
struct Value {
  enum class Kind { Undefined, Data, Namespace };
  Kind kind = Kind::Undefined;
  std::shared_ptr<const json> data;
  std::shared_ptr<Namespace> ns;
  std::string what;  // Undefined: the expression that had no value, for error messages

  static Value make(json j) {
    Value v;
    v.kind = Kind::Data;
    v.data = std::make_shared<const json>(std::move(j));
    return v;
  }
  // Part of a larger document, kept alive by it.
  static Value view(const std::shared_ptr<const json>& owner, const json& part) {
    Value v;
    v.kind = Kind::Data;
    v.data = std::shared_ptr<const json>(owner, &part);
    return v;
  }
  static Value undefined(std::string what) {
    Value v;
    v.what = std::move(what);
    return v;
  }
  bool is_undefined() const { return kind == Kind::Undefined; }
  bool is_data() const { return kind == Kind::Data; }
  const json& j() const { return *data; }
};

// Attributes hold Values (not JSON) so that an undefined value or a nested namespace survives
// being stored, and so that reading an attribute never aliases a later assignment.
struct Namespace {
  std::map<std::string, Value> attributes;
};

const char* type_name(const Value& v) {
  if (v.kind == Value::Kind::Undefined) return "undefined";
  if (v.kind == Value::Kind::Namespace) return "namespace";
  switch (v.j().type()) {
    case json::value_t::null:
      return "NoneType";
    case json::value_t::boolean:
      return "bool";
    case json::value_t::number_integer:
    case json::value_t::number_unsigned:
      return "int";
    case json::value_t::number_float:
      return "float";
    case json::value_t::string:
      return "str";
    case json::value_t::array:
      return "list";
    case json::value_t::object:
      return "dict";
    default:
      return "value";
  }
}

bool truthy(const Value& v) {
  if (v.kind == Value::Kind::Undefined) return false;
  if (v.kind == Value::Kind::Namespace) return true;
  const json& j = v.j();
  switch (j.type()) {
    case json::value_t::null:
      return false;
    case json::value_t::boolean:
      return j.get<bool>();
    case json::value_t::number_integer:
    case json::value_t::number_unsigned:
      return j.get<int64_t>() != 0;
    case json::value_t::number_float:
      return j.get<double>() != 0.0;
    case json::value_t::string:
      return !j.get_ref<const std::string&>().empty();
    case json::value_t::array:
    case json::value_t::object:
      return !j.empty();
    default:
      return true;
  }
}

json to_json(const Value& v);

std::string to_str(const Value& v) {
  if (v.kind == Value::Kind::Undefined) return "";
  if (v.kind == Value::Kind::Namespace) return "<Namespace " + py_str(to_json(v)) + ">";
  return py_str(v.j());
}

bool is_int(const json& j) { return j.is_number_integer(); }
bool is_number(const json& j) { return j.is_number(); }
bool is_string(const Value& v) { return v.is_data() && v.j().is_string(); }

// ---------------------------------------------------------------------------------------------
// Renderer

class Renderer {
 public:
  Renderer(const std::string& source, const json& context) : src_(source) {
    // The caller keeps the context alive for the whole render, so it is viewed, not copied.
    context_ = std::shared_ptr<const json>(std::shared_ptr<const json>(), &context);
    scopes_.emplace_back();
  }

  void render(const Body& body, std::string& out) {
    if (exec_body(body, out) != Flow::Normal) fail_at(src_, 0, "break or continue outside a loop");
  }

 private:
  enum class Flow { Normal, Break, Continue };
  using Scope = std::unordered_map<std::string, Value>;

  struct Args {
    std::vector<Value> positional;
    std::vector<std::pair<std::string, Value>> named;

    // The argument at `index` or named `name`, if given.
    std::optional<Value> get(size_t index, std::string_view name) const {
      if (std::optional<Value> value = keyword(name)) return value;
      if (index < positional.size()) return positional[index];
      return std::nullopt;
    }
    // A keyword-only argument.
    std::optional<Value> keyword(std::string_view name) const {
      for (const auto& [key, value] : named)
        if (key == name) return value;
      return std::nullopt;
    }
  };

  [[noreturn]] void fail(size_t pos, const std::string& what) const { fail_at(src_, pos, what); }

  // A template is code from a checkpoint: its work and its output are bounded, so a hostile one
  // ends with an error instead of running for hours or filling the memory. Real chat templates
  // take a few thousand steps (100k is ~3000 messages) and write a few KB; a step costs about
  // 1 us, 20 under ASan.
  static constexpr uint64_t kMaxSteps = 100'000;  // statements, loop turns, built items
  static constexpr size_t kMaxValueBytes = 16u << 20;    // any string or list, and the output
  void charge(uint64_t steps, size_t pos) const {
    steps_ += steps;
    if (steps_ > kMaxSteps)
      fail(pos, "the template ran more than " + std::to_string(kMaxSteps) +
                    " steps (a loop that does not end?)");
  }
  void check_size(size_t bytes, size_t pos) const {
    if (bytes > kMaxValueBytes)
      fail(pos, "the template built a value or output over " +
                    std::to_string(kMaxValueBytes >> 20) + " MiB");
  }
  // Python's ints are unbounded; ours are 64-bit, and a result that does not fit is an error.
  int64_t checked(char op, int64_t a, int64_t b, size_t pos) const {
    int64_t result = 0;
    const bool overflowed = op == '+'   ? __builtin_add_overflow(a, b, &result)
                            : op == '-' ? __builtin_sub_overflow(a, b, &result)
                                        : __builtin_mul_overflow(a, b, &result);
    if (overflowed) fail(pos, std::string("integer overflow in ") + op);
    return result;
  }

  const json& need_data(const Value& v, size_t pos, const std::string& context) const {
    if (v.kind == Value::Kind::Undefined) fail(pos, context + ": '" + v.what + "' is undefined");
    if (v.kind == Value::Kind::Namespace) fail(pos, context + ": a namespace is not allowed here");
    return v.j();
  }

  const std::string& need_string(const Value& v, size_t pos, const std::string& context) const {
    const json& j = need_data(v, pos, context);
    if (!j.is_string()) fail(pos, context + ": expected a string, got " + type_name(v));
    return j.get_ref<const std::string&>();
  }

  int64_t need_int(const Value& v, size_t pos, const std::string& context) const {
    const json& j = need_data(v, pos, context);
    if (j.is_boolean()) return j.get<bool>() ? 1 : 0;
    if (!is_int(j)) fail(pos, context + ": expected an integer, got " + type_name(v));
    return j.get<int64_t>();
  }

  // Statements ------------------------------------------------------------------------------

  Flow exec_body(const Body& body, std::string& out) {
    for (const StmtPtr& stmt : body) {
      const Flow flow = exec(*stmt, out);
      if (flow != Flow::Normal) return flow;
    }
    return Flow::Normal;
  }

  Flow exec(const Stmt& stmt, std::string& out) {
    switch (stmt.kind) {
      case Stmt::Kind::Text:
        charge(1, stmt.pos);
        out += stmt.text;
        check_size(out.size(), stmt.pos);
        return Flow::Normal;
      case Stmt::Kind::Output:
        charge(1, stmt.pos);
        out += to_str(eval(*stmt.expr));
        check_size(out.size(), stmt.pos);
        return Flow::Normal;
      case Stmt::Kind::If:
        for (const auto& [condition, branch] : stmt.branches)
          if (truthy(eval(*condition))) return exec_body(branch, out);
        return exec_body(stmt.else_body, out);
      case Stmt::Kind::For:
        return exec_for(stmt, out);
      case Stmt::Kind::Set: {
        Value value = eval(*stmt.expr);
        assign(stmt.targets, std::move(value), stmt.pos);
        return Flow::Normal;
      }
      case Stmt::Kind::SetAttr: {
        Value target = lookup(stmt.targets[0]);
        if (target.kind != Value::Kind::Namespace)
          fail(stmt.pos, "cannot set attribute '" + stmt.targets[1] + "' on '" + stmt.targets[0] +
                             "' (a " + type_name(target) +
                             "): only namespace() objects can be changed");
        target.ns->attributes[stmt.targets[1]] = eval(*stmt.expr);
        return Flow::Normal;
      }
      case Stmt::Kind::SetBlock: {
        std::string captured;
        if (exec_body(stmt.body, captured) != Flow::Normal)
          fail(stmt.pos, "break or continue in a set block");
        scopes_.back()[stmt.targets[0]] = Value::make(std::move(captured));
        return Flow::Normal;
      }
      case Stmt::Kind::Break:
        return Flow::Break;
      case Stmt::Kind::Continue:
        return Flow::Continue;
      case Stmt::Kind::Block:
        return exec_body(stmt.body, out);
    }
    return Flow::Normal;
  }

  // Unpacks value into the targets (one name, or several from a list).
  void assign(const std::vector<std::string>& targets, Value value, size_t pos) {
    Scope& scope = scopes_.back();
    if (targets.size() == 1) {
      scope[targets[0]] = std::move(value);
      return;
    }
    const json& list = need_data(value, pos, "unpacking");
    if (!list.is_array() || list.size() != targets.size())
      fail(pos, "cannot unpack " + std::string(type_name(value)) + " into " +
                    std::to_string(targets.size()) + " names");
    for (size_t i = 0; i < targets.size(); ++i)
      scope[targets[i]] = Value::view(value.data, list[i]);
  }

  // The items a for loop or filter iterates: list items, dict keys, string characters.
  std::vector<Value> iterate(const Value& v, size_t pos) const {
    std::vector<Value> items;
    if (v.kind == Value::Kind::Undefined) return items;  // Jinja's Undefined iterates as empty
    if (v.kind == Value::Kind::Namespace) fail(pos, "a namespace is not iterable");
    const json& j = v.j();
    if (j.is_array()) {
      for (const json& item : j) items.push_back(Value::view(v.data, item));
    } else if (j.is_object()) {
      for (const auto& [key, item] : j.items()) items.push_back(Value::make(key));
    } else if (j.is_string()) {
      const std::string& s = j.get_ref<const std::string&>();
      for (size_t i = 0; i < s.size(); i += utf8_length_at(s, i))
        items.push_back(Value::make(s.substr(i, utf8_length_at(s, i))));
    } else {
      fail(pos, std::string("'") + type_name(v) + "' object is not iterable");
    }
    return items;
  }

  Flow exec_for(const Stmt& stmt, std::string& out) {
    std::vector<Value> items = iterate(eval(*stmt.expr), stmt.expr->pos);
    if (stmt.filter) {
      // The "if" filter sees each item but not loop (loop.* counts only the kept items).
      std::vector<Value> kept;
      for (Value& item : items) {
        scopes_.emplace_back();
        assign(stmt.targets, item, stmt.pos);
        const bool keep = truthy(eval(*stmt.filter));
        scopes_.pop_back();
        if (keep) kept.push_back(std::move(item));
      }
      items = std::move(kept);
    }
    if (items.empty()) return exec_body(stmt.else_body, out);
    const auto length = static_cast<int64_t>(items.size());
    for (int64_t i = 0; i < length; ++i) {
      charge(1, stmt.pos);
      // Each iteration gets a fresh scope: variables set inside do not outlive it.
      scopes_.emplace_back();
      json loop = {{"index", i + 1},         {"index0", i},
                   {"revindex", length - i}, {"revindex0", length - i - 1},
                   {"first", i == 0},        {"last", i == length - 1},
                   {"length", length}};
      if (i > 0 && items[i - 1].is_data()) loop["previtem"] = items[i - 1].j();
      if (i + 1 < length && items[i + 1].is_data()) loop["nextitem"] = items[i + 1].j();
      scopes_.back()["loop"] = Value::make(std::move(loop));
      assign(stmt.targets, items[static_cast<size_t>(i)], stmt.pos);
      const Flow flow = exec_body(stmt.body, out);
      scopes_.pop_back();
      if (flow == Flow::Break) break;
    }
    return Flow::Normal;
  }

  // Expressions -----------------------------------------------------------------------------

  Value lookup(const std::string& name) const {
    for (auto scope = scopes_.rbegin(); scope != scopes_.rend(); ++scope)
      if (auto it = scope->find(name); it != scope->end()) return it->second;
    if (context_->is_object())
      if (auto it = context_->find(name); it != context_->end()) return Value::view(context_, *it);
    return Value::undefined(name);
  }

  Value eval(const Node& n) {
    switch (n.kind) {
      case Node::Kind::Literal:
        return Value::make(n.literal);
      case Node::Kind::Name:
        return lookup(n.name);
      case Node::Kind::List: {
        json list = json::array();
        for (const NodePtr& item : n.args) list.push_back(to_json_at(eval(*item), item->pos));
        return Value::make(std::move(list));
      }
      case Node::Kind::Dict: {
        json dict = json::object();
        for (size_t i = 0; i + 1 < n.args.size(); i += 2) {
          const Value key = eval(*n.args[i]);
          dict[need_string(key, n.args[i]->pos, "dict key")] =
              to_json_at(eval(*n.args[i + 1]), n.args[i + 1]->pos);
        }
        return Value::make(std::move(dict));
      }
      case Node::Kind::Attr:
        return get_attr(eval(*n.args[0]), n.name, n.pos, describe(*n.args[0]));
      case Node::Kind::Item:
        return get_item(eval(*n.args[0]), eval(*n.args[1]), n.pos, describe(*n.args[0]));
      case Node::Kind::Slice:
        return slice(n);
      case Node::Kind::Call:
        return call(n);
      case Node::Kind::Filter: {
        Value input = eval(*n.args[0]);
        return apply_filter(n.name, std::move(input), eval_args(n), n.pos);
      }
      case Node::Kind::Test: {
        Value input = eval(*n.args[0]);
        const bool result = apply_test(n.name, input, eval_args(n).positional, n.pos);
        return Value::make(result != n.negated);
      }
      case Node::Kind::Not:
        return Value::make(!truthy(eval(*n.args[0])));
      case Node::Kind::Negate:
      case Node::Kind::Plus: {
        const Value v = eval(*n.args[0]);
        const json& j = need_data(v, n.pos, "unary operator");
        if (!is_number(j))
          fail(n.pos, std::string("bad operand type for unary operator: '") + type_name(v) + "'");
        if (n.kind == Node::Kind::Plus) return v;
        if (is_int(j)) {
          int64_t negated;  // the most negative integer has no positive twin
          if (__builtin_sub_overflow(int64_t{0}, j.get<int64_t>(), &negated))
            fail(n.pos, "integer overflow in unary -");
          return Value::make(negated);
        }
        return Value::make(-j.get<double>());
      }
      case Node::Kind::And: {
        Value left = eval(*n.args[0]);
        return truthy(left) ? eval(*n.args[1]) : left;
      }
      case Node::Kind::Or: {
        Value left = eval(*n.args[0]);
        return truthy(left) ? left : eval(*n.args[1]);
      }
      case Node::Kind::Binary:
        return binary(n.name, eval(*n.args[0]), eval(*n.args[1]), n.pos);
      case Node::Kind::Compare: {
        Value left = eval(*n.args[0]);
        for (size_t i = 0; i < n.ops.size(); ++i) {
          Value right = eval(*n.args[i + 1]);
          if (!compare(n.ops[i], left, right, n.args[i + 1]->pos)) return Value::make(false);
          left = std::move(right);
        }
        return Value::make(true);
      }
      case Node::Kind::Condition:
        if (truthy(eval(*n.args[1]))) return eval(*n.args[0]);
        return n.args[2] ? eval(*n.args[2])
                         : Value::undefined("conditional expression without else");
    }
    fail(n.pos, "unknown expression");
  }

  // A short source form of an expression, for "'x.y' is undefined" messages.
  static std::string describe(const Node& n) {
    switch (n.kind) {
      case Node::Kind::Name:
        return n.name;
      case Node::Kind::Attr:
        return describe(*n.args[0]) + "." + n.name;
      case Node::Kind::Item:
        if (n.args[1]->kind == Node::Kind::Literal)
          return describe(*n.args[0]) + "[" + py_repr(n.args[1]->literal) + "]";
        return describe(*n.args[0]) + "[...]";
      case Node::Kind::Literal:
        return py_repr(n.literal);
      default:
        return "expression";
    }
  }

  json to_json_at(const Value& v, size_t pos) const {
    if (v.kind == Value::Kind::Undefined) fail(pos, "'" + v.what + "' is undefined");
    return to_json(v);
  }

  Args eval_args(const Node& n) {
    Args args;
    for (size_t i = 1; i < n.args.size(); ++i) args.positional.push_back(eval(*n.args[i]));
    for (const auto& [name, value] : n.kwargs) args.named.emplace_back(name, eval(*value));
    return args;
  }

  Value get_attr(const Value& object, const std::string& name, size_t pos,
                 const std::string& what) const {
    if (object.kind == Value::Kind::Undefined)
      fail(pos, "'" + object.what + "' is undefined (reading its attribute '" + name + "')");
    if (object.kind == Value::Kind::Namespace) {
      auto it = object.ns->attributes.find(name);
      return it == object.ns->attributes.end() ? Value::undefined(what + "." + name) : it->second;
    }
    const json& j = object.j();
    if (j.is_object())
      if (auto it = j.find(name); it != j.end()) return Value::view(object.data, *it);
    return Value::undefined(what + "." + name);
  }

  Value get_item(const Value& object, const Value& key, size_t pos, const std::string& what) const {
    if (object.kind == Value::Kind::Undefined)
      fail(pos, "'" + object.what + "' is undefined (reading an item of it)");
    if (key.kind == Value::Kind::Undefined)
      fail(pos, "'" + key.what + "' is undefined (used as a subscript)");
    if (object.kind == Value::Kind::Namespace) {
      if (!is_string(key)) return Value::undefined(what + "[...]");
      return get_attr(object, key.j().get<std::string>(), pos, what);
    }
    const json& j = object.j();
    const std::string key_text = key.is_data() ? py_repr(key.j()) : "...";
    if (j.is_object() && is_string(key)) {
      if (auto it = j.find(key.j().get_ref<const std::string&>()); it != j.end())
        return Value::view(object.data, *it);
    } else if ((j.is_array() || j.is_string()) && key.is_data() &&
               (is_int(key.j()) || key.j().is_boolean())) {
      int64_t index = need_int(key, pos, "subscript");
      if (j.is_array()) {
        const auto size = static_cast<int64_t>(j.size());
        if (index < 0) index += size;
        if (index >= 0 && index < size)
          return Value::view(object.data, j[static_cast<size_t>(index)]);
      } else {
        const std::string& s = j.get_ref<const std::string&>();
        const std::vector<size_t> offsets = code_point_offsets(s);
        const auto size = static_cast<int64_t>(offsets.size() - 1);
        if (index < 0) index += size;
        if (index >= 0 && index < size)
          return Value::make(s.substr(offsets[index], offsets[index + 1] - offsets[index]));
      }
    }
    return Value::undefined(what + "[" + key_text + "]");
  }

  // Python slicing of lists and strings.
  Value slice(const Node& n) {
    const Value object = eval(*n.args[0]);
    const json& j = need_data(object, n.pos, "slice");
    std::optional<int64_t> bounds[3];
    for (int part = 0; part < 3; ++part) {
      if (!n.args[part + 1]) continue;
      const Value v = eval(*n.args[part + 1]);
      if (v.is_data() && v.j().is_null()) continue;
      bounds[part] = need_int(v, n.args[part + 1]->pos, "slice bound");
    }
    const int64_t step = bounds[2].value_or(1);
    if (step == 0) fail(n.pos, "slice step cannot be zero");

    std::vector<size_t> offsets;
    int64_t size = 0;
    if (j.is_array()) {
      size = static_cast<int64_t>(j.size());
    } else if (j.is_string()) {
      offsets = code_point_offsets(j.get_ref<const std::string&>());
      size = static_cast<int64_t>(offsets.size() - 1);
    } else {
      fail(n.pos, std::string("'") + type_name(object) + "' object is not subscriptable");
    }
    auto clamp = [&](std::optional<int64_t> bound, int64_t fallback) {
      if (!bound) return fallback;
      int64_t b = *bound < 0 ? *bound + size : *bound;
      if (step > 0) return std::clamp<int64_t>(b, 0, size);
      return std::clamp<int64_t>(b, -1, size - 1);
    };
    const int64_t start = clamp(bounds[0], step > 0 ? 0 : size - 1);
    const int64_t stop = clamp(bounds[1], step > 0 ? size : -1);
    std::vector<int64_t> picked;
    for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) picked.push_back(i);
    if (j.is_array()) {
      json out = json::array();
      for (const int64_t i : picked) out.push_back(j[static_cast<size_t>(i)]);
      return Value::make(std::move(out));
    }
    const std::string& s = j.get_ref<const std::string&>();
    std::string out;
    for (const int64_t i : picked) out.append(s, offsets[i], offsets[i + 1] - offsets[i]);
    return Value::make(std::move(out));
  }

  // Operators ---------------------------------------------------------------------------------

  Value binary(const std::string& op, const Value& left, const Value& right, size_t pos) const {
    if (op == "~") {
      std::string joined = to_str(left) + to_str(right);
      check_size(joined.size(), pos);
      return Value::make(std::move(joined));
    }
    const json& a = need_data(left, pos, "operator " + op);
    const json& b = need_data(right, pos, "operator " + op);
    auto type_error = [&]() -> Value {
      fail(pos, "unsupported operand types for " + op + ": '" + type_name(left) + "' and '" +
                    type_name(right) + "'");
    };
    const bool numbers = is_number(a) && is_number(b) && !a.is_boolean() && !b.is_boolean();
    const bool ints = numbers && is_int(a) && is_int(b);
    if (op == "+") {
      if (ints) return Value::make(checked('+', a.get<int64_t>(), b.get<int64_t>(), pos));
      if (numbers) return Value::make(a.get<double>() + b.get<double>());
      if (a.is_string() && b.is_string()) {
        check_size(a.get_ref<const std::string&>().size() + b.get_ref<const std::string&>().size(),
                   pos);
        return Value::make(a.get<std::string>() + b.get<std::string>());
      }
      if (a.is_array() && b.is_array()) {
        check_size(a.size() + b.size(), pos);
        charge(a.size() + b.size(), pos);
        json out = a;
        out.insert(out.end(), b.begin(), b.end());
        return Value::make(std::move(out));
      }
      return type_error();
    }
    if (op == "-") {
      if (ints) return Value::make(checked('-', a.get<int64_t>(), b.get<int64_t>(), pos));
      if (numbers) return Value::make(a.get<double>() - b.get<double>());
      return type_error();
    }
    if (op == "*") {
      if (ints) return Value::make(checked('*', a.get<int64_t>(), b.get<int64_t>(), pos));
      if (numbers) return Value::make(a.get<double>() * b.get<double>());
      // Repetition: "ab" * 3, [x] * 3.
      const json* sequence = (a.is_string() || a.is_array()) && is_int(b)   ? &a
                             : (b.is_string() || b.is_array()) && is_int(a) ? &b
                                                                            : nullptr;
      if (!sequence) return type_error();
      const int64_t count = std::max<int64_t>(0, (sequence == &a ? b : a).get<int64_t>());
      const size_t unit = sequence->is_string() ? sequence->get_ref<const std::string&>().size()
                                                : sequence->size();
      if (unit != 0 && uint64_t(count) > kMaxValueBytes / unit)
        check_size(kMaxValueBytes + 1, pos);
      charge(uint64_t(count), pos);
      json out = sequence->is_string() ? json("") : json::array();
      for (int64_t i = 0; i < count; ++i) {
        if (out.is_string())
          out.get_ref<std::string&>() += sequence->get_ref<const std::string&>();
        else
          out.insert(out.end(), sequence->begin(), sequence->end());
      }
      return Value::make(std::move(out));
    }
    if (!numbers) return type_error();
    if (op == "/") {
      if (b.get<double>() == 0.0) fail(pos, "division by zero");
      return Value::make(a.get<double>() / b.get<double>());
    }
    if (op == "//" || op == "%") {
      if (b.get<double>() == 0.0) fail(pos, op == "%" ? "modulo by zero" : "division by zero");
      if (ints) {
        const int64_t x = a.get<int64_t>(), y = b.get<int64_t>();
        if (x == std::numeric_limits<int64_t>::min() && y == -1)
          fail(pos, "integer overflow in " + op);
        int64_t quotient = x / y, remainder = x % y;
        if (remainder != 0 && ((remainder < 0) != (y < 0))) {  // Python floors toward -infinity
          --quotient;
          remainder += y;
        }
        return Value::make(op == "//" ? quotient : remainder);
      }
      const double x = a.get<double>(), y = b.get<double>();
      const double quotient = std::floor(x / y);
      return Value::make(op == "//" ? quotient : x - quotient * y);
    }
    if (op == "**") {
      if (ints && b.get<int64_t>() >= 0) {
        // By squaring: the exponent may be large, and every product is checked.
        int64_t result = 1, base = a.get<int64_t>();
        for (int64_t e = b.get<int64_t>(); e > 0; e >>= 1) {
          if ((e & 1) && __builtin_mul_overflow(result, base, &result))
            fail(pos, "integer overflow in **");
          if (e > 1 && __builtin_mul_overflow(base, base, &base))
            fail(pos, "integer overflow in **");
        }
        return Value::make(result);
      }
      return Value::make(std::pow(a.get<double>(), b.get<double>()));
    }
    return type_error();
  }

  bool equal(const Value& a, const Value& b) const {
    if (a.kind != b.kind) return false;
    if (a.kind == Value::Kind::Undefined) return true;
    if (a.kind == Value::Kind::Namespace) return a.ns == b.ns;
    return a.j() == b.j();
  }

  bool contains(const Value& container, const Value& item, size_t pos) const {
    if (container.kind == Value::Kind::Undefined) return false;
    if (container.kind == Value::Kind::Namespace)
      return is_string(item) && container.ns->attributes.count(item.j().get<std::string>()) > 0;
    const json& c = container.j();
    if (c.is_string()) {
      return c.get_ref<const std::string&>().find(need_string(item, pos, "'in <string>'")) !=
             std::string::npos;
    }
    if (c.is_array()) {
      for (const json& element : c)
        if (item.is_data() && element == item.j()) return true;
      return false;
    }
    if (c.is_object()) return is_string(item) && c.contains(item.j().get_ref<const std::string&>());
    fail(pos, std::string("argument of type '") + type_name(container) + "' is not iterable");
  }

  bool compare(const std::string& op, const Value& a, const Value& b, size_t pos) const {
    if (op == "==") return equal(a, b);
    if (op == "!=") return !equal(a, b);
    if (op == "in") return contains(b, a, pos);
    if (op == "not in") return !contains(b, a, pos);
    const json& x = need_data(a, pos, "comparison");
    const json& y = need_data(b, pos, "comparison");
    int order;
    if (is_number(x) && is_number(y)) {
      const double dx = x.get<double>(), dy = y.get<double>();
      order = dx < dy ? -1 : dx > dy ? 1 : 0;
    } else if (x.is_string() && y.is_string()) {
      order = x.get_ref<const std::string&>().compare(y.get_ref<const std::string&>());
    } else if (x.is_array() && y.is_array()) {
      order = x < y ? -1 : y < x ? 1 : 0;
    } else {
      fail(pos,
           "'" + op + "' not supported between '" + type_name(a) + "' and '" + type_name(b) + "'");
    }
    if (op == "<") return order < 0;
    if (op == "<=") return order <= 0;
    if (op == ">") return order > 0;
    return order >= 0;
  }

  // Calls: global functions and methods of str and dict --------------------------------------

  Value call(const Node& n) {
    const Node& callee = *n.args[0];
    if (callee.kind == Node::Kind::Attr) {
      const Value object = eval(*callee.args[0]);
      return call_method(object, callee.name, eval_args(n), n.pos, describe(*callee.args[0]));
    }
    if (callee.kind != Node::Kind::Name) fail(n.pos, "this expression cannot be called");
    const Value existing = lookup(callee.name);
    if (!existing.is_undefined())
      fail(n.pos, "'" + callee.name + "' is a " + type_name(existing) + ", not a function");
    return call_global(callee.name, eval_args(n), n.pos);
  }

  Value call_global(const std::string& name, const Args& args, size_t pos) {
    if (name == "raise_exception") {
      const std::optional<Value> message = args.get(0, "message");
      fail(pos, "raise_exception: " + (message ? to_str(*message) : std::string()));
    }
    if (name == "namespace" || name == "dict") {
      Value result;
      std::map<std::string, Value> attributes;
      for (const Value& positional : args.positional) {  // namespace({...}) / dict({...})
        const json& j = need_data(positional, pos, name + "()");
        if (!j.is_object()) fail(pos, name + "() takes a dict or keyword arguments");
        for (const auto& [key, item] : j.items())
          attributes[key] = Value::view(positional.data, item);
      }
      for (const auto& [key, value] : args.named) attributes[key] = value;
      if (name == "dict") {
        json out = json::object();
        for (const auto& [key, value] : attributes) out[key] = to_json_at(value, pos);
        return Value::make(std::move(out));
      }
      result.kind = Value::Kind::Namespace;
      result.ns = std::make_shared<Namespace>();
      result.ns->attributes = std::move(attributes);
      return result;
    }
    if (name == "range") {
      std::vector<int64_t> bounds;
      for (const Value& v : args.positional) bounds.push_back(need_int(v, pos, "range()"));
      if (bounds.empty() || bounds.size() > 3) fail(pos, "range() takes 1 to 3 arguments");
      const int64_t start = bounds.size() == 1 ? 0 : bounds[0];
      const int64_t stop = bounds.size() == 1 ? bounds[0] : bounds[1];
      const int64_t step = bounds.size() == 3 ? bounds[2] : 1;
      if (step == 0) fail(pos, "range() step must not be zero");
      // The length first, in 128 bits (stop - start can overflow 64), then the items.
      const __int128 span = step > 0 ? __int128(stop) - start : __int128(start) - stop;
      const __int128 magnitude = step > 0 ? __int128(step) : -__int128(step);
      const __int128 count = span <= 0 ? 0 : (span + magnitude - 1) / magnitude;
      if (count > __int128(kMaxSteps)) charge(kMaxSteps + 1, pos);
      charge(uint64_t(count), pos);
      json out = json::array();
      for (int64_t k = 0; k < int64_t(count); ++k)
        out.push_back(int64_t(start + __int128(k) * step));
      return Value::make(std::move(out));
    }
    if (name == "strftime_now") {
      const std::optional<Value> format = args.get(0, "format");
      if (!format) fail(pos, "strftime_now() needs a format");
      const std::time_t now = std::time(nullptr);
      std::tm local{};
      localtime_r(&now, &local);
      char buffer[256];
      const size_t length = std::strftime(
          buffer, sizeof buffer, need_string(*format, pos, "strftime_now()").c_str(), &local);
      return Value::make(std::string(buffer, length));
    }
    fail(pos, "'" + name + "' is undefined (not a variable or a known function)");
  }

  Value call_method(const Value& object, const std::string& name, const Args& args, size_t pos,
                    const std::string& what) {
    if (object.kind == Value::Kind::Undefined)
      fail(pos, "'" + object.what + "' is undefined (calling its method '" + name + "')");
    const std::string context = what + "." + name + "()";
    if (object.kind == Value::Kind::Namespace) fail(pos, context + ": namespaces have no methods");
    const json& j = object.j();
    auto arg_string = [&](size_t index, std::string_view arg_name) -> std::optional<std::string> {
      const std::optional<Value> v = args.get(index, arg_name);
      if (!v || (v->is_data() && v->j().is_null())) return std::nullopt;
      return need_string(*v, pos, context);
    };
    if (j.is_string()) {
      const std::string& s = j.get_ref<const std::string&>();
      if (name == "startswith" || name == "endswith") {
        const std::optional<Value> arg = args.get(0, "prefix");
        if (!arg) fail(pos, context + " needs an argument");
        std::vector<std::string> candidates;  // a string or a tuple of strings
        const json& a = need_data(*arg, pos, context);
        if (a.is_array()) {
          for (const json& c : a) candidates.push_back(c.is_string() ? c.get<std::string>() : "");
        } else {
          candidates.push_back(need_string(*arg, pos, context));
        }
        for (const std::string& c : candidates) {
          if (name == "startswith"
                  ? s.compare(0, c.size(), c) == 0
                  : s.size() >= c.size() && s.compare(s.size() - c.size(), c.size(), c) == 0)
            return Value::make(true);
        }
        return Value::make(false);
      }
      if (name == "strip") return Value::make(py_strip(s, true, true, arg_string(0, "chars")));
      if (name == "lstrip") return Value::make(py_strip(s, true, false, arg_string(0, "chars")));
      if (name == "rstrip") return Value::make(py_strip(s, false, true, arg_string(0, "chars")));
      if (name == "upper") return Value::make(ascii_upper(s));
      if (name == "lower") return Value::make(ascii_lower(s));
      if (name == "title") return Value::make(ascii_title(s));
      if (name == "capitalize") return Value::make(ascii_capitalize(s));
      if (name == "split") {
        const std::optional<std::string> separator = arg_string(0, "sep");
        const std::optional<Value> max_value = args.get(1, "maxsplit");
        return Value::make(
            py_split(s, separator, max_value ? need_int(*max_value, pos, context) : -1, pos));
      }
      if (name == "splitlines") {
        json out = json::array();
        size_t begin = 0;
        for (size_t i = 0; i < s.size(); ++i) {
          if (s[i] == '\n' || s[i] == '\r') {
            out.push_back(s.substr(begin, i - begin));
            if (s[i] == '\r' && i + 1 < s.size() && s[i + 1] == '\n') ++i;
            begin = i + 1;
          }
        }
        if (begin < s.size()) out.push_back(s.substr(begin));
        return Value::make(std::move(out));
      }
      if (name == "replace") {
        const std::optional<std::string> old_text = arg_string(0, "old");
        const std::optional<std::string> new_text = arg_string(1, "new");
        if (!old_text || !new_text) fail(pos, context + " needs two strings");
        const std::optional<Value> count = args.get(2, "count");
        std::string replaced =
            py_replace(s, *old_text, *new_text, count ? need_int(*count, pos, context) : -1);
        check_size(replaced.size(), pos);
        return Value::make(std::move(replaced));
      }
      if (name == "find") {
        const std::optional<std::string> needle = arg_string(0, "sub");
        if (!needle) fail(pos, context + " needs a string");
        const size_t at = s.find(*needle);
        if (at == std::string::npos) return Value::make(-1);
        return Value::make(static_cast<int64_t>(code_point_offsets(s.substr(0, at)).size() - 1));
      }
      if (name == "count") {
        const std::optional<std::string> needle = arg_string(0, "sub");
        if (!needle) fail(pos, context + " needs a string");
        int64_t count = 0;
        if (needle->empty()) return Value::make(static_cast<int64_t>(code_point_offsets(s).size()));
        for (size_t at = s.find(*needle); at != std::string::npos;
             at = s.find(*needle, at + needle->size()))
          ++count;
        return Value::make(count);
      }
      if (name == "join") {
        const std::optional<Value> items = args.get(0, "iterable");
        if (!items) fail(pos, context + " needs a list");
        std::string out;
        bool first = true;
        for (const Value& item : iterate(*items, pos)) {
          if (!first) out += s;
          out += need_string(item, pos, context);
          check_size(out.size(), pos);
          first = false;
        }
        return Value::make(std::move(out));
      }
    } else if (j.is_object()) {
      if (name == "items" || name == "keys" || name == "values") {
        json out = json::array();
        for (const auto& [key, item] : j.items()) {
          if (name == "items")
            out.push_back(json::array({key, item}));
          else if (name == "keys")
            out.push_back(key);
          else
            out.push_back(item);
        }
        return Value::make(std::move(out));
      }
      if (name == "get") {
        const std::optional<Value> key = args.get(0, "key");
        if (!key) fail(pos, context + " needs a key");
        if (is_string(*key))
          if (auto it = j.find(key->j().get_ref<const std::string&>()); it != j.end())
            return Value::view(object.data, *it);
        const std::optional<Value> fallback = args.get(1, "default");
        return fallback ? *fallback : Value::make(nullptr);
      }
    }
    fail(pos, context + ": '" + type_name(object) + "' has no method '" + name + "'");
  }

  json py_split(const std::string& s, const std::optional<std::string>& separator,
                int64_t max_split, size_t pos) const {
    json out = json::array();
    if (separator) {
      if (separator->empty()) fail(pos, "split(): empty separator");
      size_t begin = 0;
      for (size_t at = s.find(*separator); at != std::string::npos && max_split != 0;
           at = s.find(*separator, begin)) {
        out.push_back(s.substr(begin, at - begin));
        begin = at + separator->size();
        if (max_split > 0) --max_split;
      }
      out.push_back(s.substr(begin));
      return out;
    }
    // No separator: split on runs of whitespace, ignoring it at both ends.
    size_t i = 0;
    auto skip_space = [&] {
      while (i < s.size() && py_isspace(code_point_at(s, i))) i += utf8_length_at(s, i);
    };
    skip_space();
    while (i < s.size()) {
      if (max_split == 0) {
        out.push_back(py_strip(s.substr(i), false, true));
        break;
      }
      const size_t begin = i;
      while (i < s.size() && !py_isspace(code_point_at(s, i))) i += utf8_length_at(s, i);
      out.push_back(s.substr(begin, i - begin));
      if (max_split > 0) --max_split;
      skip_space();
    }
    return out;
  }

  static std::string py_replace(const std::string& s, const std::string& old_text,
                                const std::string& new_text, int64_t count) {
    if (old_text.empty()) {  // Python inserts the replacement between characters
      std::string out;
      int64_t done = 0;
      for (size_t i = 0; i <= s.size(); i += i < s.size() ? utf8_length_at(s, i) : 1) {
        if (count < 0 || done < count) {
          out += new_text;
          ++done;
        }
        if (i < s.size()) out.append(s, i, utf8_length_at(s, i));
      }
      return out;
    }
    std::string out;
    size_t begin = 0;
    int64_t done = 0;
    for (size_t at = s.find(old_text); at != std::string::npos && (count < 0 || done < count);
         at = s.find(old_text, begin)) {
      out.append(s, begin, at - begin);
      out += new_text;
      begin = at + old_text.size();
      ++done;
    }
    out.append(s, begin);
    return out;
  }

  // Filters -----------------------------------------------------------------------------------

  Value apply_filter(const std::string& name, const Value& input, const Args& args, size_t pos) {
    const std::string context = "filter '" + name + "'";
    if (name == "default" || name == "d") {
      const std::optional<Value> fallback = args.get(0, "default_value");
      const std::optional<Value> boolean = args.get(1, "boolean");
      const bool use_fallback =
          input.is_undefined() || (boolean && truthy(*boolean) && !truthy(input));
      if (!use_fallback) return input;
      return fallback ? *fallback : Value::make("");
    }
    if (name == "safe") return input;
    if (name == "string") return Value::make(to_str(input));
    if (name == "tojson") {
      const std::optional<Value> indent = args.get(0, "indent");
      const std::optional<Value> ensure_ascii = args.get(1, "ensure_ascii");
      std::string out;
      const bool has_indent = indent && !(indent->is_data() && indent->j().is_null());
      json_dump(to_json_at(input, pos),
                has_indent ? static_cast<int>(need_int(*indent, pos, context)) : -1,
                ensure_ascii && truthy(*ensure_ascii), 0, out);
      return Value::make(std::move(out));
    }
    if (name == "length" || name == "count") {
      if (input.kind == Value::Kind::Namespace)
        return Value::make(static_cast<int64_t>(input.ns->attributes.size()));
      if (input.is_undefined()) return Value::make(0);
      const json& j = need_data(input, pos, context);
      if (j.is_string())
        return Value::make(
            static_cast<int64_t>(code_point_offsets(j.get_ref<const std::string&>()).size() - 1));
      if (j.is_array() || j.is_object()) return Value::make(static_cast<int64_t>(j.size()));
      fail(pos, context + ": object of type '" + type_name(input) + "' has no len()");
    }
    if (name == "list") {
      json out = json::array();
      for (const Value& item : iterate(input, pos)) out.push_back(to_json_at(item, pos));
      return Value::make(std::move(out));
    }
    if (name == "first" || name == "last") {
      const std::vector<Value> items = iterate(input, pos);
      if (items.empty()) return Value::undefined(context + " of an empty sequence");
      return name == "first" ? items.front() : items.back();
    }
    if (name == "reverse") {
      const json& j = need_data(input, pos, context);
      if (j.is_string()) {
        std::string out;
        const std::string& s = j.get_ref<const std::string&>();
        const std::vector<size_t> offsets = code_point_offsets(s);
        for (size_t k = offsets.size() - 1; k > 0; --k)
          out.append(s, offsets[k - 1], offsets[k] - offsets[k - 1]);
        return Value::make(std::move(out));
      }
      json out = json::array();
      std::vector<Value> items = iterate(input, pos);
      for (auto it = items.rbegin(); it != items.rend(); ++it) out.push_back(to_json_at(*it, pos));
      return Value::make(std::move(out));
    }
    if (name == "join") {
      const std::optional<Value> separator = args.get(0, "d");
      const std::optional<Value> attribute = args.get(1, "attribute");
      const std::string glue = separator ? to_str(*separator) : "";
      std::string out;
      bool first = true;
      for (Value item : iterate(input, pos)) {
        if (attribute) item = get_attr(item, to_str(*attribute), pos, "item");
        if (!first) out += glue;
        out += to_str(item);
        check_size(out.size(), pos);
        first = false;
      }
      return Value::make(std::move(out));
    }
    if (name == "items") {
      if (input.is_undefined()) return Value::make(json::array());
      return call_method(input, "items", {}, pos, "value");
    }
    if (name == "map") {
      // map(attribute="x", default=...) or map("filter", args...)
      const std::optional<Value> attribute = args.keyword("attribute");
      json out = json::array();
      for (const Value& item : iterate(input, pos)) {
        Value mapped;
        if (attribute) {
          mapped = get_attr(item, to_str(*attribute), pos, "item");
          if (mapped.is_undefined())
            if (const std::optional<Value> fallback = args.keyword("default")) mapped = *fallback;
        } else {
          if (args.positional.empty()) fail(pos, context + " needs a filter name or attribute=");
          Args rest;
          rest.positional.assign(args.positional.begin() + 1, args.positional.end());
          rest.named = args.named;
          mapped = apply_filter(need_string(args.positional[0], pos, context), item, rest, pos);
        }
        out.push_back(to_json_at(mapped, pos));
      }
      return Value::make(std::move(out));
    }
    if (name == "select" || name == "reject" || name == "selectattr" || name == "rejectattr") {
      const bool by_attribute = name == "selectattr" || name == "rejectattr";
      const bool keep_when = name == "select" || name == "selectattr";
      size_t next = 0;
      std::string attribute;
      if (by_attribute) {
        if (args.positional.empty()) fail(pos, context + " needs an attribute name");
        attribute = need_string(args.positional[next++], pos, context);
      }
      std::optional<std::string> test;
      if (next < args.positional.size()) test = need_string(args.positional[next++], pos, context);
      const std::vector<Value> test_args(
          args.positional.begin() + static_cast<std::ptrdiff_t>(next), args.positional.end());
      json out = json::array();
      for (const Value& item : iterate(input, pos)) {
        const Value subject = by_attribute ? get_attr(item, attribute, pos, "item") : item;
        const bool passed = test ? apply_test(*test, subject, test_args, pos) : truthy(subject);
        if (passed == keep_when) out.push_back(to_json_at(item, pos));
      }
      return Value::make(std::move(out));
    }
    if (name == "indent") {
      // indent(width=4, first=False, blank=False): indents every line after the first.
      const std::optional<Value> width_value = args.get(0, "width");
      const std::optional<Value> first_value = args.get(1, "first");
      const std::optional<Value> blank_value = args.get(2, "blank");
      const std::string pad =
          width_value && is_string(*width_value)
              ? width_value->j().get<std::string>()
              : std::string(
                    static_cast<size_t>(width_value ? need_int(*width_value, pos, context) : 4),
                    ' ');
      const bool indent_first = first_value && truthy(*first_value);
      const bool indent_blank = blank_value && truthy(*blank_value);
      const std::string s = to_str(input);
      std::string out;
      size_t begin = 0;
      bool first_line = true;
      while (true) {
        const size_t end = s.find('\n', begin);
        const std::string line =
            s.substr(begin, end == std::string::npos ? std::string::npos : end - begin);
        if ((first_line ? indent_first : true) && (indent_blank || !line.empty())) out += pad;
        out += line;
        if (end == std::string::npos) break;
        out += '\n';
        begin = end + 1;
        first_line = false;
      }
      return Value::make(std::move(out));
    }
    if (name == "int") {
      if (input.is_data() && is_int(input.j())) return input;  // exact, not through a double
      if (input.is_data() && input.j().is_number()) {
        // Python's int(): NaN is not a number to convert (the default, as Jinja's filter falls
        // back), and past 64 bits the value has no int here.
        const double d = input.j().get<double>();
        if (std::isnan(d)) {
          const std::optional<Value> fallback = args.get(0, "default");
          return fallback ? *fallback : Value::make(0);
        }
        if (!(d >= -0x1p63 && d < 0x1p63)) fail(pos, context + ": integer overflow");
        return Value::make(static_cast<int64_t>(d));
      }
      if (is_string(input)) {
        const std::string text = py_strip(input.j().get<std::string>(), true, true);
        int64_t value = 0;
        const auto result = std::from_chars(text.data(), text.data() + text.size(), value);
        if (result.ec == std::errc() && result.ptr == text.data() + text.size())
          return Value::make(value);
      }
      const std::optional<Value> fallback = args.get(0, "default");
      return fallback ? *fallback : Value::make(0);
    }
    if (name == "float") {
      if (input.is_data() && input.j().is_number()) return Value::make(input.j().get<double>());
      if (is_string(input)) {
        const std::string text = py_strip(input.j().get<std::string>(), true, true);
        char* end = nullptr;
        const double value = std::strtod(text.c_str(), &end);
        if (!text.empty() && end == text.c_str() + text.size()) return Value::make(value);
      }
      const std::optional<Value> fallback = args.get(0, "default");
      return fallback ? *fallback : Value::make(0.0);
    }
    if (name == "abs") {
      const json& j = need_data(input, pos, context);
      if (is_int(j)) {
        const int64_t x = j.get<int64_t>();
        if (x == std::numeric_limits<int64_t>::min()) fail(pos, context + ": integer overflow");
        return Value::make(x < 0 ? -x : x);
      }
      if (j.is_number()) return Value::make(std::fabs(j.get<double>()));
      fail(pos, context + ": bad operand type '" + type_name(input) + "'");
    }
    // The remaining filters take and return strings.
    if (name == "trim") {
      const std::optional<Value> chars = args.get(0, "chars");
      return Value::make(
          py_strip(to_str(input), true, true,
                   chars ? std::optional<std::string>(to_str(*chars)) : std::nullopt));
    }
    if (name == "upper") return Value::make(ascii_upper(to_str(input)));
    if (name == "lower") return Value::make(ascii_lower(to_str(input)));
    if (name == "capitalize") return Value::make(ascii_capitalize(to_str(input)));
    if (name == "title") return Value::make(ascii_title(to_str(input)));
    if (name == "escape" || name == "e") return Value::make(html_escape(to_str(input)));
    if (name == "replace") {
      const std::optional<Value> old_text = args.get(0, "old");
      const std::optional<Value> new_text = args.get(1, "new");
      if (!old_text || !new_text) fail(pos, context + " needs two strings");
      const std::optional<Value> count = args.get(2, "count");
      return Value::make(py_replace(to_str(input), to_str(*old_text), to_str(*new_text),
                                    count ? need_int(*count, pos, context) : -1));
    }
    fail(pos, "unknown filter '" + name + "'");
  }

  // Tests ---------------------------------------------------------------------------------------

  bool apply_test(const std::string& name, const Value& v, const std::vector<Value>& args,
                  size_t pos) const {
    auto arg = [&](size_t index) -> const Value& {
      if (index >= args.size()) fail(pos, "test '" + name + "' needs an argument");
      return args[index];
    };
    if (name == "defined") return !v.is_undefined();
    if (name == "undefined") return v.is_undefined();
    if (name == "none") return v.is_data() && v.j().is_null();
    if (name == "boolean") return v.is_data() && v.j().is_boolean();
    if (name == "true") return v.is_data() && v.j().is_boolean() && v.j().get<bool>();
    if (name == "false") return v.is_data() && v.j().is_boolean() && !v.j().get<bool>();
    if (name == "string") return is_string(v);
    if (name == "number") return v.is_data() && v.j().is_number();
    if (name == "integer") return v.is_data() && is_int(v.j());
    if (name == "float") return v.is_data() && v.j().is_number_float();
    if (name == "mapping") return v.is_data() && v.j().is_object();
    if (name == "sequence")
      return v.is_data() && (v.j().is_array() || v.j().is_string() || v.j().is_object());
    if (name == "iterable")
      return v.is_undefined() ||
             (v.is_data() && (v.j().is_array() || v.j().is_string() || v.j().is_object()));
    if (name == "odd" || name == "even") {
      const int64_t n = need_int(v, pos, "test '" + name + "'");
      return (n % 2 != 0) == (name == "odd");
    }
    if (name == "divisibleby") {
      const int64_t divisor = need_int(arg(0), pos, "test 'divisibleby'");
      if (divisor == 0) fail(pos, "test 'divisibleby': division by zero");
      return need_int(v, pos, "test 'divisibleby'") % divisor == 0;
    }
    if (name == "eq" || name == "equalto" || name == "==") return equal(v, arg(0));
    if (name == "ne" || name == "!=") return !equal(v, arg(0));
    if (name == "lt" || name == "lessthan" || name == "<") return compare("<", v, arg(0), pos);
    if (name == "le" || name == "<=") return compare("<=", v, arg(0), pos);
    if (name == "gt" || name == "greaterthan" || name == ">") return compare(">", v, arg(0), pos);
    if (name == "ge" || name == ">=") return compare(">=", v, arg(0), pos);
    if (name == "in") return contains(arg(0), v, pos);
    fail(pos, "unknown test '" + name + "'");
  }

  const std::string& src_;
  std::shared_ptr<const json> context_;
  std::vector<Scope> scopes_;
  mutable uint64_t steps_ = 0;  // charge()
};

json to_json(const Value& v) {
  if (v.kind == Value::Kind::Data) return v.j();
  if (v.kind == Value::Kind::Namespace) {
    json out = json::object();
    for (const auto& [key, value] : v.ns->attributes)
      if (!value.is_undefined()) out[key] = to_json(value);
    return out;
  }
  return nullptr;
}

// Jinja turns \r\n and \r into \n and drops one trailing newline (keep_trailing_newline=False).
std::string normalize_source(std::string source) {
  std::string out;
  out.reserve(source.size());
  for (size_t i = 0; i < source.size(); ++i) {
    if (source[i] == '\r') {
      out += '\n';
      if (i + 1 < source.size() && source[i + 1] == '\n') ++i;
    } else {
      out += source[i];
    }
  }
  if (!out.empty() && out.back() == '\n') out.pop_back();
  return out;
}

}  // namespace

struct ChatTemplate::Program {
  std::string source;  // normalized; error positions refer to it
  Body body;
};

ChatTemplate::ChatTemplate(std::string source) : program_(std::make_unique<Program>()) {
  program_->source = normalize_source(std::move(source));
  Lexer lexer(program_->source);
  Parser parser(program_->source, lexer.run());
  program_->body = parser.parse_template();
}

ChatTemplate::~ChatTemplate() = default;
ChatTemplate::ChatTemplate(ChatTemplate&&) noexcept = default;
ChatTemplate& ChatTemplate::operator=(ChatTemplate&&) noexcept = default;

std::string ChatTemplate::render(const nlohmann::json& context) const {
  if (!context.is_object() && !context.is_null())
    throw std::invalid_argument("chat template context must be a JSON object");
  std::string out;
  Renderer renderer(program_->source, context);
  renderer.render(program_->body, out);
  return out;
}

std::string render_chat_template(const std::string& tmpl, const nlohmann::json& context) {
  return ChatTemplate(tmpl).render(context);
}

std::string apply_chat_template_json(const Tokenizer& tokenizer, const nlohmann::json& messages,
                                     bool add_generation_prompt,
                                     const nlohmann::json& extra_context) {
  const std::optional<std::string> tmpl = tokenizer.chat_template();
  if (!tmpl) throw std::runtime_error("apply_chat_template: the tokenizer has no chat template");
  if (!messages.is_array())
    throw std::invalid_argument("apply_chat_template: messages must be a JSON array");
  if (!extra_context.is_object())
    throw std::invalid_argument("apply_chat_template: extra_context must be a JSON object");
  nlohmann::json context = {{"messages", messages},
                            {"add_generation_prompt", add_generation_prompt}};
  if (const auto bos = tokenizer.bos_token()) context["bos_token"] = *bos;
  if (const auto eos = tokenizer.eos_token()) context["eos_token"] = *eos;
  for (const auto& [key, value] : extra_context.items()) context[key] = value;
  return render_chat_template(*tmpl, context);
}

std::string apply_chat_template(const Tokenizer& tokenizer,
                                const std::vector<ChatMessage>& messages,
                                bool add_generation_prompt, const nlohmann::json& extra_context) {
  nlohmann::json list = nlohmann::json::array();
  for (const ChatMessage& message : messages)
    list.push_back({{"role", message.role}, {"content", message.content}});
  return apply_chat_template_json(tokenizer, list, add_generation_prompt, extra_context);
}

}  // namespace clshard
