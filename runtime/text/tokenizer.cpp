#include "runtime/text/tokenizer.h"

#include "runtime/bounded_json.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <deque>
#include <fstream>
#include <mutex>
#include <queue>
#include <stdexcept>
#include <unordered_map>

#include <nlohmann/json.hpp>

namespace clshard {
namespace {

using nlohmann::json;

// ---------------------------------------------------------------------------------------------
// Errors and file reading

[[noreturn]] void fail(const std::string& source, const std::string& field,
                       const std::string& what) {
  throw std::runtime_error(source + ": " + field + ": " + what);
}

std::string read_whole_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot open " + path.string() + ": " + std::strerror(errno));
  std::string data;
  in.seekg(0, std::ios::end);
  data.resize(static_cast<size_t>(in.tellg()));
  in.seekg(0, std::ios::beg);
  in.read(data.data(), static_cast<std::streamsize>(data.size()));
  if (!in) throw std::runtime_error("cannot read " + path.string());
  return data;
}

json parse_json(std::string_view text, const std::string& source) {
  try {
    return parse_json_bounded(text);
  } catch (const std::exception& e) {
    throw std::runtime_error(source + ": malformed JSON: " + e.what());
  }
}

// Null counts as missing: Hugging Face writes null for unset options.
const json* member(const json& object, const char* key) {
  auto it = object.find(key);
  if (it == object.end() || it->is_null()) return nullptr;
  return &*it;
}

std::string type_name_of(const json& value, const std::string& source, const std::string& path) {
  if (!value.is_object()) fail(source, path, "expected an object");
  const json* type = member(value, "type");
  if (!type || !type->is_string()) fail(source, path + ".type", "missing or not a string");
  return type->get<std::string>();
}

bool bool_member(const json& object, const char* key, bool fallback, const std::string& source,
                 const std::string& path) {
  const json* value = member(object, key);
  if (!value) return fallback;
  if (!value->is_boolean()) fail(source, path + "." + key, "expected true or false");
  return value->get<bool>();
}

// ---------------------------------------------------------------------------------------------
// UTF-8

struct Utf8Scan {
  size_t length;  // bytes of the longest valid prefix of a character at the position (0: none)
  bool complete;  // whether those bytes are a whole character
};

// Well-formed sequences per the Unicode standard (table 3-7): no overlongs, no surrogates,
// nothing above U+10FFFF.
Utf8Scan scan_utf8(std::string_view s, size_t i) {
  const auto lead = static_cast<uint8_t>(s[i]);
  if (lead < 0x80) return {1, true};
  size_t need = 0;
  uint8_t lo = 0x80, hi = 0xBF;
  if (lead >= 0xC2 && lead <= 0xDF) {
    need = 2;
  } else if (lead >= 0xE0 && lead <= 0xEF) {
    need = 3;
    if (lead == 0xE0) lo = 0xA0;
    if (lead == 0xED) hi = 0x9F;
  } else if (lead >= 0xF0 && lead <= 0xF4) {
    need = 4;
    if (lead == 0xF0) lo = 0x90;
    if (lead == 0xF4) hi = 0x8F;
  } else {
    return {0, false};
  }
  size_t n = 1;
  while (n < need && i + n < s.size()) {
    const auto b = static_cast<uint8_t>(s[i + n]);
    if (b < lo || b > hi) break;
    lo = 0x80;
    hi = 0xBF;
    ++n;
  }
  return {n, n == need};
}

// Replaces each maximal ill-formed subsequence with U+FFFD, like Rust's String::from_utf8_lossy
// (which Hugging Face's decode uses), so our decode output matches theirs.
std::string utf8_lossy(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  size_t i = 0;
  while (i < s.size()) {
    const Utf8Scan scan = scan_utf8(s, i);
    if (scan.complete) {
      out.append(s.substr(i, scan.length));
      i += scan.length;
    } else {
      out += "\xEF\xBF\xBD";
      i += std::max<size_t>(scan.length, 1);
    }
  }
  return out;
}

void require_valid_utf8(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    if (static_cast<uint8_t>(s[i]) < 0x80) {
      ++i;
      continue;
    }
    const Utf8Scan scan = scan_utf8(s, i);
    if (!scan.complete)
      throw std::invalid_argument("Tokenizer::encode: text is not valid UTF-8 at byte " +
                                  std::to_string(i));
    i += scan.length;
  }
}

// Decodes the (valid) character at s[i]; sets length to its byte count.
uint32_t decode_code_point(std::string_view s, size_t i, size_t& length) {
  const auto lead = static_cast<uint8_t>(s[i]);
  if (lead < 0x80) {
    length = 1;
    return lead;
  }
  length = lead >= 0xF0 ? 4 : lead >= 0xE0 ? 3 : 2;
  uint32_t cp = lead & (0x7F >> length);
  for (size_t k = 1; k < length; ++k) cp = (cp << 6) | (static_cast<uint8_t>(s[i + k]) & 0x3F);
  return cp;
}

void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

// Unicode White_Space, the set Rust's char::is_whitespace uses (added tokens' lstrip/rstrip).
bool is_white_space(uint32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F ||
         cp == 0x205F || cp == 0x3000;
}

// ---------------------------------------------------------------------------------------------
// The GPT-2 byte-level alphabet: every byte stands for one printable character, so BPE works on
// text without spaces or control characters. Printable Latin-1 bytes map to themselves, the other
// 68 bytes to U+0100.. in byte order.

struct ByteAlphabet {
  std::array<std::string, 256> byte_to_char;
  std::array<int16_t, 512> code_point_to_byte;  // -1: not a byte-level character

  ByteAlphabet() {
    code_point_to_byte.fill(-1);
    uint32_t next_extra = 256;
    for (uint32_t b = 0; b < 256; ++b) {
      const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
      const uint32_t cp = printable ? b : next_extra++;
      append_utf8(byte_to_char[b], cp);
      code_point_to_byte[cp] = static_cast<int16_t>(b);
    }
  }
};

const ByteAlphabet& byte_alphabet() {
  static const ByteAlphabet alphabet;
  return alphabet;
}

// What the ByteLevel decoder makes of one token: the bytes its characters stand for, or, when
// some character is not in the byte alphabet (e.g. "<｜User｜>"), the token's own UTF-8.
std::string byte_level_decode(std::string_view token) {
  const ByteAlphabet& alphabet = byte_alphabet();
  std::string bytes;
  bytes.reserve(token.size());
  for (size_t i = 0; i < token.size();) {
    const Utf8Scan scan = scan_utf8(token, i);
    if (!scan.complete) return std::string(token);
    size_t length = 0;
    const uint32_t cp = decode_code_point(token, i, length);
    if (cp >= alphabet.code_point_to_byte.size() || alphabet.code_point_to_byte[cp] < 0)
      return std::string(token);
    bytes += static_cast<char>(alphabet.code_point_to_byte[cp]);
    i += length;
  }
  return bytes;
}

// ---------------------------------------------------------------------------------------------
// Regexes (PCRE2 with JIT)

// Hugging Face runs these patterns with Oniguruma, whose Unicode \s is the White_Space property
// (it includes U+0085, excludes U+180E and U+FEFF). PCRE2's \s under UCP is a different set, so
// \s and \S are rewritten to the property explicitly; that works inside classes too.
std::string translate_pattern(std::string_view pattern) {
  std::string out;
  out.reserve(pattern.size() + 32);
  for (size_t i = 0; i < pattern.size(); ++i) {
    if (pattern[i] == '\\' && i + 1 < pattern.size()) {
      const char next = pattern[i + 1];
      if (next == 's') {
        out += "\\p{White_Space}";
      } else if (next == 'S') {
        out += "\\P{White_Space}";
      } else {
        out += '\\';
        out += next;
      }
      ++i;
    } else {
      out += pattern[i];
    }
  }
  return out;
}

// Per-thread match state: match data and a JIT stack are not safe to share between threads.
struct MatchScratch {
  pcre2_match_data* data = nullptr;
  pcre2_match_context* context = nullptr;
  pcre2_jit_stack* jit_stack = nullptr;

  MatchScratch() {
    data = pcre2_match_data_create(16, nullptr);
    context = pcre2_match_context_create(nullptr);
    // Long runs of whitespace backtrack through (?!\S); the default 32 KiB JIT stack is small.
    jit_stack = pcre2_jit_stack_create(32 * 1024, 4 * 1024 * 1024, nullptr);
    if (!data || !context || !jit_stack) throw std::bad_alloc();
    pcre2_jit_stack_assign(context, nullptr, jit_stack);
  }
  ~MatchScratch() {
    pcre2_jit_stack_free(jit_stack);
    pcre2_match_context_free(context);
    pcre2_match_data_free(data);
  }
  MatchScratch(const MatchScratch&) = delete;
  MatchScratch& operator=(const MatchScratch&) = delete;
};

MatchScratch& match_scratch() {
  thread_local MatchScratch scratch;
  return scratch;
}

class Regex {
 public:
  Regex(std::string_view pattern, const std::string& source, const std::string& field) {
    const std::string translated = translate_pattern(pattern);
    int error_code = 0;
    PCRE2_SIZE error_offset = 0;
    code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(translated.data()), translated.size(),
                          PCRE2_UTF | PCRE2_UCP, &error_code, &error_offset, nullptr);
    if (!code_) {
      PCRE2_UCHAR message[256];
      pcre2_get_error_message(error_code, message, sizeof message);
      fail(source, field,
           "regex does not compile (" + std::string(reinterpret_cast<char*>(message)) +
               " at offset " + std::to_string(error_offset) + " of '" + translated + "')");
    }
    // Without JIT support PCRE2's interpreter still gives the same matches, only slower.
    pcre2_jit_compile(code_, PCRE2_JIT_COMPLETE);
  }
  ~Regex() { pcre2_code_free(code_); }
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // First match at or after `start`; false when there is none. The subject must be valid UTF-8
  // (checked once per encode, not per call: PCRE2's own check rescans the whole subject).
  bool find(std::string_view subject, size_t start, size_t& match_begin, size_t& match_end) const {
    if (subject.empty()) return false;
    MatchScratch& scratch = match_scratch();
    const int rc = pcre2_match(code_, reinterpret_cast<PCRE2_SPTR>(subject.data()), subject.size(),
                               start, PCRE2_NO_UTF_CHECK, scratch.data, scratch.context);
    if (rc == PCRE2_ERROR_NOMATCH) return false;
    if (rc < 0) {
      PCRE2_UCHAR message[256];
      pcre2_get_error_message(rc, message, sizeof message);
      throw std::runtime_error("Tokenizer: regex match failed: " +
                               std::string(reinterpret_cast<char*>(message)));
    }
    const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(scratch.data);
    match_begin = ovector[0];
    match_end = ovector[1];
    return true;
  }

 private:
  pcre2_code* code_ = nullptr;
};

// The pattern ByteLevel uses when use_regex is true (GPT-2's).
// Ids index dense tables (id -> text, flags), so one hostile id would make loading allocate as
// many entries as its value (fuzzing found ids of 3.4M and 13.8M in a file of a few tokens, taking
// seconds and gigabytes). Real vocabularies are dense and far below both bounds (Llama 3: 128,256
// ids for 128,256 tokens; DeepSeek-V3: 129,280): an id is at most kMaxTokenId, and at most twice
// the number of tokens in the file plus kIdSlack.
constexpr int64_t kMaxTokenId = (int64_t{1} << 22) - 1;
constexpr int64_t kIdSlack = 1024;

int64_t largest_dense_id(size_t tokens) {
  return std::min<int64_t>(kMaxTokenId, 2 * int64_t(tokens) + kIdSlack);
}

constexpr std::string_view kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// ---------------------------------------------------------------------------------------------
// Added tokens: a byte trie giving the longest token starting at a position.

class TokenTrie {
 public:
  void insert(std::string_view text, int32_t value) {
    int32_t node = 0;
    for (const char c : text) {
      const auto byte = static_cast<uint8_t>(c);
      int32_t child = find_child(node, byte);
      if (child < 0) {
        child = static_cast<int32_t>(nodes_.size());
        nodes_[node].children.emplace_back(byte, child);
        nodes_.emplace_back();
      }
      node = child;
    }
    nodes_[node].value = value;
    starts_[static_cast<uint8_t>(text[0])] = true;
  }

  bool empty() const { return nodes_.size() == 1; }
  bool may_start_with(char c) const { return starts_[static_cast<uint8_t>(c)]; }

  // Value of the longest entry that text[pos..] starts with, -1 if none; sets its length.
  int32_t longest_at(std::string_view text, size_t pos, size_t& length) const {
    int32_t node = 0, best = -1;
    for (size_t i = pos; i < text.size(); ++i) {
      node = find_child(node, static_cast<uint8_t>(text[i]));
      if (node < 0) break;
      if (nodes_[node].value >= 0) {
        best = nodes_[node].value;
        length = i + 1 - pos;
      }
    }
    return best;
  }

 private:
  struct Node {
    std::vector<std::pair<uint8_t, int32_t>> children;
    int32_t value = -1;
  };

  int32_t find_child(int32_t node, uint8_t byte) const {
    for (const auto& [b, child] : nodes_[node].children)
      if (b == byte) return child;
    return -1;
  }

  std::vector<Node> nodes_{1};
  std::array<bool, 256> starts_{};
};

struct AddedToken {
  std::string content;
  int32_t id = -1;
  bool special = false;
  bool lstrip = false;  // also swallow whitespace before the token
  bool rstrip = false;  // also swallow whitespace after it
};

// A piece of the input: plain text to pre-tokenize, or an added token already matched.
struct Segment {
  std::string_view text;
  int32_t added_id = -1;
};

// Splits `text` around the added tokens of `trie` (leftmost, then longest match, like the
// Aho-Corasick LeftmostLongest automaton Hugging Face uses).
void split_on_added_tokens(std::string_view text, const TokenTrie& trie,
                           const std::vector<AddedToken>& tokens, std::vector<Segment>& out) {
  if (trie.empty()) {
    out.push_back({text, -1});
    return;
  }
  size_t plain_begin = 0;
  size_t pos = 0;
  while (pos < text.size()) {
    size_t length = 0;
    const int32_t index = trie.may_start_with(text[pos]) ? trie.longest_at(text, pos, length) : -1;
    if (index < 0) {
      ++pos;
      continue;
    }
    const AddedToken& token = tokens[static_cast<size_t>(index)];
    size_t begin = pos, end = pos + length;
    if (token.lstrip) {
      while (begin > plain_begin) {
        size_t prev = begin - 1;
        while (prev > plain_begin && (static_cast<uint8_t>(text[prev]) & 0xC0) == 0x80) --prev;
        size_t cp_length = 0;
        if (!is_white_space(decode_code_point(text, prev, cp_length))) break;
        begin = prev;
      }
    }
    if (token.rstrip) {
      while (end < text.size()) {
        size_t cp_length = 0;
        if (!is_white_space(decode_code_point(text, end, cp_length))) break;
        end += cp_length;
      }
    }
    if (begin > plain_begin) out.push_back({text.substr(plain_begin, begin - plain_begin), -1});
    out.push_back({text.substr(begin, end - begin), token.id});
    plain_begin = pos = end;
  }
  if (plain_begin < text.size()) out.push_back({text.substr(plain_begin), -1});
}

// ---------------------------------------------------------------------------------------------
// Lookup tables

struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
template <typename V>
using StringMap = std::unordered_map<std::string, V, StringHash, std::equal_to<>>;

uint64_t hash_bytes(std::string_view s) {
  uint64_t h = 0xcbf29ce484222325ULL;  // FNV-1a: tokens are short, so a bytewise hash is cheap
  for (const char c : s) h = (h ^ static_cast<uint8_t>(c)) * 0x100000001b3ULL;
  return h ^ (h >> 29);
}

uint64_t mix64(uint64_t x) {  // splitmix64's finalizer
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

size_t table_capacity_for(size_t entries) {
  size_t capacity = 16;
  while (capacity < entries + entries / 2) capacity *= 2;  // load factor at most 2/3
  return capacity;
}

// Open-addressing map from token text to id. The vocabulary is built once and read on every
// word, so a flat table with the texts in one arena beats std::unordered_map's node per entry,
// both to build (load time) and to probe.
class TokenIndex {
 public:
  void reserve(size_t entries, size_t text_bytes) {
    slots_.assign(table_capacity_for(entries), Slot{});
    arena_.reserve(text_bytes);
  }

  // Returns false (and changes nothing) when the text is already present.
  bool insert(std::string_view text, int32_t id) {
    if ((size_ + 1) * 3 > slots_.size() * 2) grow();
    const uint64_t hash = hash_bytes(text);
    size_t i = hash & (slots_.size() - 1);
    for (;; i = (i + 1) & (slots_.size() - 1)) {
      Slot& slot = slots_[i];
      if (slot.id < 0) break;
      if (matches(slot, hash, text)) return false;
    }
    slots_[i] = {static_cast<uint32_t>(hash), static_cast<uint32_t>(arena_.size()),
                 static_cast<uint32_t>(text.size()), id};
    arena_.append(text);
    ++size_;
    return true;
  }

  std::optional<int32_t> find(std::string_view text) const {
    if (slots_.empty()) return std::nullopt;
    const uint64_t hash = hash_bytes(text);
    for (size_t i = hash & (slots_.size() - 1);; i = (i + 1) & (slots_.size() - 1)) {
      const Slot& slot = slots_[i];
      if (slot.id < 0) return std::nullopt;
      if (matches(slot, hash, text)) return slot.id;
    }
  }

 private:
  struct Slot {
    uint32_t hash = 0;  // low bits of the text's hash, to skip most string compares
    uint32_t offset = 0, length = 0;
    int32_t id = -1;  // -1: empty
  };

  bool matches(const Slot& slot, uint64_t hash, std::string_view text) const {
    return slot.hash == static_cast<uint32_t>(hash) && slot.length == text.size() &&
           std::memcmp(arena_.data() + slot.offset, text.data(), text.size()) == 0;
  }

  void grow() {
    std::vector<Slot> old = std::move(slots_);
    slots_.assign(std::max<size_t>(16, old.size() * 2), Slot{});
    for (const Slot& slot : old) {
      if (slot.id < 0) continue;
      const uint64_t hash = hash_bytes(std::string_view(arena_).substr(slot.offset, slot.length));
      size_t i = hash & (slots_.size() - 1);
      while (slots_[i].id >= 0) i = (i + 1) & (slots_.size() - 1);
      slots_[i] = slot;
    }
  }

  std::vector<Slot> slots_;
  std::string arena_;
  size_t size_ = 0;
};

struct Merge {
  int32_t rank = -1;    // position in the merges list: lower merges first
  int32_t result = -1;  // id of the merged token
};

// Open-addressing map from a pair of token ids to their merge; probed for every adjacent pair
// during BPE, so it is kept flat.
class MergeTable {
 public:
  void reserve(size_t entries) { slots_.assign(table_capacity_for(entries), Slot{}); }

  // Call reserve() with the final count first: the table does not grow. A repeated pair keeps
  // its last rank, as Hugging Face's (collected into a HashMap) does.
  void insert(int32_t left, int32_t right, Merge merge) {
    const uint64_t key = pair_key(left, right);
    size_t i = mix64(key) & (slots_.size() - 1);
    while (slots_[i].key != kEmpty && slots_[i].key != key) i = (i + 1) & (slots_.size() - 1);
    slots_[i] = {key, merge};
  }

  const Merge* find(int32_t left, int32_t right) const {
    const uint64_t key = pair_key(left, right);
    for (size_t i = mix64(key) & (slots_.size() - 1);; i = (i + 1) & (slots_.size() - 1)) {
      if (slots_[i].key == key) return &slots_[i].merge;
      if (slots_[i].key == kEmpty) return nullptr;
    }
  }

 private:
  static constexpr uint64_t kEmpty = ~0ULL;  // ids are non-negative int32, so never a real key
  static uint64_t pair_key(int32_t left, int32_t right) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) |
           static_cast<uint32_t>(right);
  }
  struct Slot {
    uint64_t key = kEmpty;
    Merge merge;
  };
  std::vector<Slot> slots_{16};
};

// ---------------------------------------------------------------------------------------------
// Reading tokenizer.json. model.vocab and model.merges hold hundreds of thousands of entries;
// building a JSON DOM for them (a std::map node per token) took most of the load time, so a SAX
// reader streams them into plain vectors and builds the DOM only for everything else.

struct StreamedModel {
  bool has_vocab = false, has_merges = false;
  std::vector<std::pair<std::string, int32_t>> vocab;
  std::vector<std::pair<std::string, std::string>> merges;
};

class TokenizerJsonReader {
 public:
  using string_t = json::string_t;

  json root;
  StreamedModel model;
  std::string error;  // set when the reader itself rejects the input

  bool null() { return value(json()); }
  bool boolean(bool v) { return value(json(v)); }
  bool number_integer(json::number_integer_t v) {
    if (mode_ == Mode::Vocab) return vocab_id(v);
    return value(json(v));
  }
  bool number_unsigned(json::number_unsigned_t v) {
    if (mode_ == Mode::Vocab)
      return vocab_id(
          v > static_cast<json::number_unsigned_t>(INT64_MAX) ? -1 : static_cast<int64_t>(v));
    return value(json(v));
  }
  bool number_float(json::number_float_t v, const string_t&) { return value(json(v)); }
  bool binary(json::binary_t&) { return value(json()); }

  bool string(string_t& v) {
    if (mode_ == Mode::Merges) {
      // "left right": both halves are non-empty and neither contains a space.
      const size_t space = v.find(' ');
      if (space == 0 || space == std::string::npos || space + 1 == v.size() ||
          v.find(' ', space + 1) != std::string::npos)
        return reject(merge_path(), "'" + v + "' is not two tokens separated by one space");
      model.merges.emplace_back(v.substr(0, space), v.substr(space + 1));
      return true;
    }
    if (mode_ == Mode::MergePair) {
      pair_.push_back(std::move(v));
      return true;
    }
    return value(json(std::move(v)));
  }

  bool key(string_t& k) {
    if (mode_ == Mode::Vocab)
      vocab_key_ = std::move(k);
    else
      key_ = std::move(k);
    return true;
  }

  bool start_object(std::size_t) {
    if (mode_ == Mode::Dom && stack_.size() == 2 && stack_.back() == model_object_ &&
        key_ == "vocab") {
      mode_ = Mode::Vocab;
      model.has_vocab = true;
      return true;
    }
    if (mode_ != Mode::Dom)
      return reject(mode_ == Mode::Vocab ? "model.vocab" : merge_path(), "unexpected object");
    json* object = add(json::object());
    if (stack_.size() == 1 && key_ == "model") model_object_ = object;
    stack_.push_back(object);
    return true;
  }

  bool end_object() {
    if (mode_ == Mode::Vocab) {
      mode_ = Mode::Dom;
      return true;
    }
    stack_.pop_back();
    return true;
  }

  bool start_array(std::size_t) {
    if (mode_ == Mode::Dom && stack_.size() == 2 && stack_.back() == model_object_ &&
        key_ == "merges") {
      mode_ = Mode::Merges;
      model.has_merges = true;
      return true;
    }
    if (mode_ == Mode::Merges) {
      mode_ = Mode::MergePair;
      pair_.clear();
      return true;
    }
    if (mode_ != Mode::Dom)
      return reject(mode_ == Mode::Vocab ? "model.vocab" : merge_path(), "unexpected array");
    stack_.push_back(add(json::array()));
    return true;
  }

  bool end_array() {
    if (mode_ == Mode::MergePair) {
      if (pair_.size() != 2) return reject(merge_path(), "expected [\"left\", \"right\"]");
      model.merges.emplace_back(std::move(pair_[0]), std::move(pair_[1]));
      mode_ = Mode::Merges;
      return true;
    }
    if (mode_ == Mode::Merges) {
      mode_ = Mode::Dom;
      return true;
    }
    stack_.pop_back();
    return true;
  }

  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& e) {
    if (error.empty()) error = std::string("malformed JSON: ") + e.what();
    return false;
  }

 private:
  enum class Mode { Dom, Vocab, Merges, MergePair };

  bool value(json&& v) {
    if (mode_ == Mode::Vocab)
      return reject("model.vocab[\"" + vocab_key_ + "\"]", "id is not an integer");
    if (mode_ != Mode::Dom) return reject(merge_path(), "expected a string");
    add(std::move(v));
    return true;
  }

  bool vocab_id(int64_t id) {
    if (id < 0 || id > kMaxTokenId)
      return reject("model.vocab[\"" + vocab_key_ + "\"]",
                    "id " + std::to_string(id) + " is not in 0.." + std::to_string(kMaxTokenId));
    model.vocab.emplace_back(std::move(vocab_key_), static_cast<int32_t>(id));
    return true;
  }

  json* add(json&& v) {
    if (stack_.empty()) {
      root = std::move(v);
      return &root;
    }
    json& parent = *stack_.back();
    if (parent.is_array()) {
      parent.push_back(std::move(v));
      return &parent.back();
    }
    json& slot = parent[key_];
    slot = std::move(v);
    return &slot;
  }

  std::string merge_path() const {
    return "model.merges[" + std::to_string(model.merges.size()) + "]";
  }

  bool reject(const std::string& field, const std::string& what) {
    error = field + ": " + what;
    return false;
  }

  Mode mode_ = Mode::Dom;
  std::vector<json*> stack_;  // open DOM containers, innermost last
  json* model_object_ = nullptr;
  std::string key_, vocab_key_;
  std::vector<std::string> pair_;
};

struct PreTokenizerStep {
  enum class Kind { Split, ByteLevel } kind;
  std::shared_ptr<const Regex> regex;  // Split's pattern, or GPT-2's for ByteLevel with use_regex
  bool add_prefix_space = false;       // ByteLevel only
};

// Words longer than this are not cached: they are rare and would crowd out the common ones.
constexpr size_t kMaxCachedWordBytes = 256;
constexpr size_t kWordCacheCapacity = 1 << 17;

}  // namespace

// ---------------------------------------------------------------------------------------------

struct Tokenizer::Impl {
  std::string source;

  TokenIndex model_vocab;
  // Entry counts of model.vocab and added_tokens, for the density bound on ids.
  size_t model_vocab_size = 0, added_token_count = 0;
  StringMap<int32_t> added_by_content;
  MergeTable merges;
  std::array<int32_t, 256> byte_token{};  // id of each single-byte token, -1 if missing
  std::optional<int32_t> unk_id;
  bool ignore_merges = false;  // a word that is itself a token skips the merges

  std::vector<std::string> id_to_text;
  std::vector<std::string> id_to_bytes;
  std::vector<uint8_t> id_flags;
  static constexpr uint8_t kPresent = 1, kSpecial = 2;

  std::vector<AddedToken> added_tokens;
  TokenTrie raw_added_trie;         // tokens matched before normalization ("normalized": false)
  TokenTrie normalized_added_trie;  // tokens matched after it ("normalized": true)

  std::vector<PreTokenizerStep> pre_tokenizer;
  std::vector<int32_t> prefix_ids, suffix_ids;  // what add_special_tokens adds around the text

  std::optional<std::string> bos_token, eos_token, chat_template;
  std::optional<int32_t> bos_id, eos_id;

  mutable std::mutex cache_mutex;
  mutable StringMap<std::vector<int32_t>> word_cache;

  static std::shared_ptr<Impl> load(std::string_view tokenizer_json,
                                    std::string_view tokenizer_config_json,
                                    const std::string& source_name);
  static std::shared_ptr<Impl> load_file(const std::filesystem::path& tokenizer_json);

  void load_model(const json& model, StreamedModel& streamed);
  void load_added_tokens(const json& added);
  void check_normalizer(const json& normalizer, const std::string& path) const;
  void load_pre_tokenizer(const json& pre, const std::string& path);
  void load_post_processor(const json& post, const std::string& path);
  void check_decoder(const json& decoder) const;
  void load_config(const json& config, const std::string& config_source);

  std::optional<int32_t> lookup(std::string_view token) const {
    if (auto it = added_by_content.find(token); it != added_by_content.end()) return it->second;
    return model_vocab.find(token);
  }

  void encode_plain(std::string_view text, std::vector<int32_t>& out) const;
  void encode_word(std::string_view word, std::vector<int32_t>& out) const;
  void bpe(std::string_view word, std::vector<int32_t>& out) const;

  bool has_id(int32_t id) const {
    return id >= 0 && static_cast<size_t>(id) < id_flags.size() && (id_flags[id] & kPresent);
  }
  void check_id(int32_t id) const {
    if (!has_id(id))
      throw std::out_of_range("Tokenizer: token id " + std::to_string(id) +
                              " is not in the vocabulary");
  }
};

void Tokenizer::Impl::load_model(const json& model, StreamedModel& streamed) {
  if (!model.is_object()) fail(source, "model", "missing or not an object");
  if (const json* type = member(model, "type"); type && *type != "BPE")
    fail(source, "model.type",
         "'" + (type->is_string() ? type->get<std::string>() : type->dump()) +
             "' is not supported (only BPE, byte-level)");
  if (const json* dropout = member(model, "dropout");
      dropout && !(dropout->is_number() && dropout->get<double>() == 0.0))
    fail(source, "model.dropout", "BPE dropout is not supported");
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"})
    if (const json* value = member(model, key); value && *value != "")
      fail(source, std::string("model.") + key, "is not supported by byte-level BPE");
  if (bool_member(model, "byte_fallback", false, source, "model"))
    fail(source, "model.byte_fallback", "is not supported (byte-level BPE needs no fallback)");
  ignore_merges = bool_member(model, "ignore_merges", false, source, "model");

  if (!streamed.has_vocab) fail(source, "model.vocab", "missing or not an object");
  int32_t max_id = -1;
  size_t text_bytes = 0;
  for (const auto& [text, id] : streamed.vocab) {
    max_id = std::max(max_id, id);
    text_bytes += text.size();
  }
  if (max_id > largest_dense_id(streamed.vocab.size() + added_token_count))
    for (const auto& [text, id] : streamed.vocab)
      if (id == max_id)
        fail(source, "model.vocab[\"" + text + "\"]",
             "id " + std::to_string(id) + " is beyond " +
                 std::to_string(largest_dense_id(streamed.vocab.size() + added_token_count)) +
                 " (ids must be dense: at most twice the " +
                 std::to_string(streamed.vocab.size() + added_token_count) +
                 " tokens of the file plus " + std::to_string(kIdSlack) + ")");
  model_vocab.reserve(streamed.vocab.size(), text_bytes);
  id_to_text.resize(static_cast<size_t>(max_id + 1));
  id_flags.assign(static_cast<size_t>(max_id + 1), 0);
  for (auto& [text, id] : streamed.vocab) {
    if (id_flags[id] & kPresent)
      fail(source, "model.vocab[\"" + text + "\"]",
           "id " + std::to_string(id) + " is also used by '" + id_to_text[id] + "'");
    if (!model_vocab.insert(text, id))
      fail(source, "model.vocab[\"" + text + "\"]", "token appears twice");
    id_to_text[id] = std::move(text);
    id_flags[id] = kPresent;
  }
  model_vocab_size = streamed.vocab.size();
  streamed.vocab = {};

  const ByteAlphabet& alphabet = byte_alphabet();
  for (int b = 0; b < 256; ++b)
    byte_token[b] = model_vocab.find(alphabet.byte_to_char[b]).value_or(-1);

  if (const json* unk = member(model, "unk_token")) {
    if (!unk->is_string()) fail(source, "model.unk_token", "expected a string");
    unk_id = model_vocab.find(unk->get_ref<const std::string&>());
    if (!unk_id) fail(source, "model.unk_token", "is not in model.vocab");
  }

  if (!streamed.has_merges) fail(source, "model.merges", "missing or not an array");
  merges.reserve(streamed.merges.size());
  std::string merged;
  for (size_t rank = 0; rank < streamed.merges.size(); ++rank) {
    const auto& [left, right] = streamed.merges[rank];
    merged.assign(left);
    merged.append(right);
    const auto left_id = model_vocab.find(left), right_id = model_vocab.find(right),
               merged_id = model_vocab.find(merged);
    if (!left_id || !right_id || !merged_id)
      fail(source, "model.merges[" + std::to_string(rank) + "]",
           "'" + left + "' + '" + right + "' uses or makes a token missing from model.vocab");
    merges.insert(*left_id, *right_id, Merge{static_cast<int32_t>(rank), *merged_id});
  }
  streamed.merges = {};
}

void Tokenizer::Impl::load_added_tokens(const json& added) {
  if (!added.is_array()) fail(source, "added_tokens", "expected an array");
  for (size_t i = 0; i < added.size(); ++i) {
    const json& entry = added[i];
    const std::string path = "added_tokens[" + std::to_string(i) + "]";
    if (!entry.is_object()) fail(source, path, "expected an object");
    const json* id = member(entry, "id");
    const json* content = member(entry, "content");
    if (!id || !id->is_number_integer())
      fail(source, path + ".id", "missing or not an integer");
    if (id->get<int64_t>() < 0 || id->get<int64_t>() > kMaxTokenId)
      fail(source, path + ".id",
           std::to_string(id->get<int64_t>()) + " is not in 0.." + std::to_string(kMaxTokenId));
    if (!content || !content->is_string() || content->get_ref<const std::string&>().empty())
      fail(source, path + ".content", "missing or not a non-empty string");
    if (bool_member(entry, "single_word", false, source, path))
      fail(source, path + ".single_word", "true is not supported");

    const int64_t dense = largest_dense_id(model_vocab_size + added.size());
    if (id->get<int64_t>() > dense)
      fail(source, path + ".id",
           std::to_string(id->get<int64_t>()) + " is beyond " + std::to_string(dense) +
               " (ids must be dense: at most twice the " +
               std::to_string(model_vocab_size + added.size()) + " tokens of the file plus " +
               std::to_string(kIdSlack) + ")");
    AddedToken token;
    token.id = id->get<int32_t>();
    token.content = content->get<std::string>();
    token.special = bool_member(entry, "special", false, source, path);
    token.lstrip = bool_member(entry, "lstrip", false, source, path);
    token.rstrip = bool_member(entry, "rstrip", false, source, path);
    const bool normalized = bool_member(entry, "normalized", !token.special, source, path);

    if (static_cast<size_t>(token.id) >= id_to_text.size()) {
      id_to_text.resize(static_cast<size_t>(token.id) + 1);
      id_flags.resize(static_cast<size_t>(token.id) + 1, 0);
    }
    id_to_text[token.id] = token.content;
    id_flags[token.id] = kPresent | (token.special ? kSpecial : 0);
    added_by_content[token.content] = token.id;
    const auto index = static_cast<int32_t>(added_tokens.size());
    (normalized ? normalized_added_trie : raw_added_trie).insert(token.content, index);
    added_tokens.push_back(std::move(token));
  }
}

// Only normalizers that change nothing are accepted: the shipped byte-level files have none or an
// empty Sequence, and a real one (NFC, Lowercase, ...) would change the ids.
void Tokenizer::Impl::check_normalizer(const json& normalizer, const std::string& path) const {
  const std::string type = type_name_of(normalizer, source, path);
  if (type != "Sequence") fail(source, path + ".type", "'" + type + "' is not supported");
  const json* inner = member(normalizer, "normalizers");
  if (!inner || !inner->is_array()) fail(source, path + ".normalizers", "missing or not an array");
  for (size_t i = 0; i < inner->size(); ++i)
    check_normalizer((*inner)[i], path + ".normalizers[" + std::to_string(i) + "]");
}

void Tokenizer::Impl::load_pre_tokenizer(const json& pre, const std::string& path) {
  const std::string type = type_name_of(pre, source, path);
  if (type == "Sequence") {
    const json* steps = member(pre, "pretokenizers");
    if (!steps || !steps->is_array())
      fail(source, path + ".pretokenizers", "missing or not an array");
    for (size_t i = 0; i < steps->size(); ++i)
      load_pre_tokenizer((*steps)[i], path + ".pretokenizers[" + std::to_string(i) + "]");
    return;
  }
  // Steps after ByteLevel would see byte-level characters, which we only produce inside BPE.
  if (!pre_tokenizer.empty() && pre_tokenizer.back().kind == PreTokenizerStep::Kind::ByteLevel)
    fail(source, path, "a pre-tokenizer after ByteLevel is not supported");
  if (type == "Split") {
    const json* pattern = member(pre, "pattern");
    if (!pattern || !pattern->is_object())
      fail(source, path + ".pattern", "missing or not an object");
    const json* regex = member(*pattern, "Regex");
    if (!regex || !regex->is_string())
      fail(source, path + ".pattern", "only {\"Regex\": ...} patterns are supported");
    const json* behavior = member(pre, "behavior");
    if (!behavior || *behavior != "Isolated")
      fail(source, path + ".behavior",
           (behavior ? behavior->dump() : std::string("missing")) +
               " is not supported (only \"Isolated\")");
    if (bool_member(pre, "invert", false, source, path))
      fail(source, path + ".invert", "true is not supported");
    pre_tokenizer.push_back(
        {PreTokenizerStep::Kind::Split,
         std::make_shared<Regex>(regex->get<std::string>(), source, path + ".pattern.Regex"),
         false});
  } else if (type == "ByteLevel") {
    PreTokenizerStep step{PreTokenizerStep::Kind::ByteLevel, nullptr,
                          bool_member(pre, "add_prefix_space", true, source, path)};
    if (bool_member(pre, "use_regex", true, source, path))
      step.regex = std::make_shared<Regex>(kGpt2Pattern, source, path + " (GPT-2 pattern)");
    pre_tokenizer.push_back(std::move(step));
  } else {
    fail(source, path + ".type", "'" + type + "' is not supported (Sequence, Split, ByteLevel)");
  }
}

void Tokenizer::Impl::load_post_processor(const json& post, const std::string& path) {
  const std::string type = type_name_of(post, source, path);
  if (type == "ByteLevel") return;  // only adjusts offsets, which we do not report
  if (type == "Sequence") {
    const json* steps = member(post, "processors");
    if (!steps || !steps->is_array()) fail(source, path + ".processors", "missing or not an array");
    for (size_t i = 0; i < steps->size(); ++i)
      load_post_processor((*steps)[i], path + ".processors[" + std::to_string(i) + "]");
    return;
  }
  if (type != "TemplateProcessing")
    fail(source, path + ".type",
         "'" + type + "' is not supported (ByteLevel, TemplateProcessing, Sequence)");
  if (!prefix_ids.empty() || !suffix_ids.empty())
    fail(source, path, "more than one TemplateProcessing is not supported");
  const json* single = member(post, "single");
  const json* specials = member(post, "special_tokens");
  if (!single || !single->is_array()) fail(source, path + ".single", "missing or not an array");
  bool seen_sequence = false;
  for (size_t i = 0; i < single->size(); ++i) {
    const json& piece = (*single)[i];
    const std::string piece_path = path + ".single[" + std::to_string(i) + "]";
    if (piece.contains("Sequence")) {
      seen_sequence = true;
      continue;
    }
    const json* special = piece.is_object() ? member(piece, "SpecialToken") : nullptr;
    const json* name = special ? member(*special, "id") : nullptr;
    if (!name || !name->is_string())
      fail(source, piece_path, "expected {\"Sequence\": ...} or {\"SpecialToken\": {\"id\": ...}}");
    const json* entry =
        specials ? member(*specials, name->get_ref<const std::string&>().c_str()) : nullptr;
    const json* ids = entry ? member(*entry, "ids") : nullptr;
    if (!ids || !ids->is_array())
      fail(source, path + ".special_tokens", "no ids for " + name->dump());
    for (const json& id : *ids) {
      if (!id.is_number_integer()) fail(source, path + ".special_tokens", "non-integer id");
      (seen_sequence ? suffix_ids : prefix_ids).push_back(id.get<int32_t>());
    }
  }
  if (!seen_sequence) fail(source, path + ".single", "has no {\"Sequence\": ...} entry");
}

void Tokenizer::Impl::check_decoder(const json& decoder) const {
  const std::string type = type_name_of(decoder, source, "decoder");
  if (type != "ByteLevel")
    fail(source, "decoder.type", "'" + type + "' is not supported (only ByteLevel)");
}

void Tokenizer::Impl::load_config(const json& config, const std::string& config_source) {
  if (!config.is_object()) fail(config_source, "(root)", "expected an object");
  // Special tokens are written as a plain string or as an AddedToken object.
  auto special_token = [&](const char* key) -> std::optional<std::string> {
    const json* value = member(config, key);
    if (!value) return std::nullopt;
    if (value->is_string()) return value->get<std::string>();
    if (value->is_object()) {
      const json* content = member(*value, "content");
      if (content && content->is_string()) return content->get<std::string>();
    }
    fail(config_source, key, "expected a string or an object with \"content\"");
  };
  bos_token = special_token("bos_token");
  eos_token = special_token("eos_token");
  if (bos_token) bos_id = lookup(*bos_token);
  if (eos_token) eos_id = lookup(*eos_token);

  if (const json* tmpl = member(config, "chat_template")) {
    if (tmpl->is_string()) {
      chat_template = tmpl->get<std::string>();
    } else if (tmpl->is_array()) {
      // Several named templates: use "default" (the one transformers picks).
      for (const json& named : *tmpl)
        if (named.is_object() && named.value("name", "") == "default" &&
            named.contains("template") && named["template"].is_string())
          chat_template = named["template"].get<std::string>();
      if (!chat_template) fail(config_source, "chat_template", "no template named \"default\"");
    } else {
      fail(config_source, "chat_template", "expected a string or a list of named templates");
    }
  }

  // transformers' Llama-style fast tokenizers rebuild the post-processor from these flags, so
  // when the config states them they decide what add_special_tokens adds.
  auto flag = [&](const char* key) -> std::optional<bool> {
    const json* value = member(config, key);
    if (!value) return std::nullopt;
    if (!value->is_boolean()) fail(config_source, key, "expected true or false");
    return value->get<bool>();
  };
  if (auto add_bos = flag("add_bos_token")) {
    prefix_ids.clear();
    if (*add_bos) {
      if (!bos_id) fail(config_source, "add_bos_token", "true but bos_token is not a known token");
      prefix_ids.push_back(*bos_id);
    }
  }
  if (auto add_eos = flag("add_eos_token")) {
    suffix_ids.clear();
    if (*add_eos) {
      if (!eos_id) fail(config_source, "add_eos_token", "true but eos_token is not a known token");
      suffix_ids.push_back(*eos_id);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Encoding

void Tokenizer::Impl::encode_plain(std::string_view text, std::vector<int32_t>& out) const {
  std::vector<std::string_view> pieces{text};
  std::vector<std::string_view> next;
  std::deque<std::string> prefixed;  // storage for pieces that got a prefix space
  for (const PreTokenizerStep& step : pre_tokenizer) {
    if (step.kind == PreTokenizerStep::Kind::ByteLevel && step.add_prefix_space) {
      for (std::string_view& piece : pieces) {
        if (!piece.empty() && piece.front() != ' ')
          piece = prefixed.emplace_back(" " + std::string(piece));
      }
    }
    if (!step.regex) continue;
    // "Isolated" splitting: every match is a piece, and so is the text between matches.
    next.clear();
    for (std::string_view piece : pieces) {
      size_t pos = 0, last = 0, begin = 0, end = 0;
      while (pos < piece.size() && step.regex->find(piece, pos, begin, end)) {
        if (end == begin) {  // an empty match: step over one character
          pos = begin + std::max<size_t>(scan_utf8(piece, begin).length, 1);
          continue;
        }
        if (begin > last) next.push_back(piece.substr(last, begin - last));
        next.push_back(piece.substr(begin, end - begin));
        last = pos = end;
      }
      if (last < piece.size()) next.push_back(piece.substr(last));
    }
    pieces.swap(next);
  }
  for (std::string_view piece : pieces)
    if (!piece.empty()) encode_word(piece, out);
}

void Tokenizer::Impl::encode_word(std::string_view word, std::vector<int32_t>& out) const {
  const bool cacheable = word.size() <= kMaxCachedWordBytes;
  if (cacheable) {
    std::lock_guard lock(cache_mutex);
    if (auto it = word_cache.find(word); it != word_cache.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  const size_t first = out.size();
  bpe(word, out);
  if (cacheable) {
    std::vector<int32_t> ids(out.begin() + static_cast<std::ptrdiff_t>(first), out.end());
    std::lock_guard lock(cache_mutex);
    // Dropping everything is crude but keeps memory bounded without LRU bookkeeping per hit.
    if (word_cache.size() >= kWordCacheCapacity) word_cache.clear();
    word_cache.emplace(word, std::move(ids));
  }
}

// Byte-level BPE of one pre-token (raw bytes). Merges are applied lowest rank first, leftmost
// first among equal ranks, as Hugging Face does; a heap of candidate pairs over a linked list of
// symbols keeps long words near O(n log n).
void Tokenizer::Impl::bpe(std::string_view word, std::vector<int32_t>& out) const {
  if (ignore_merges) {
    std::string mapped;
    mapped.reserve(word.size() * 2);
    for (const char c : word) mapped += byte_alphabet().byte_to_char[static_cast<uint8_t>(c)];
    if (const auto id = model_vocab.find(mapped)) {
      out.push_back(*id);
      return;
    }
  }

  struct Symbol {
    int32_t id;
    int32_t prev, next;  // neighbours in the list, -1 at the ends
    bool alive;
  };
  std::vector<Symbol> symbols;
  symbols.reserve(word.size());
  for (const char c : word) {
    int32_t id = byte_token[static_cast<uint8_t>(c)];
    if (id < 0) {
      // A byte missing from the vocabulary: the unknown token if there is one, else dropped
      // (what Hugging Face's BPE does without unk_token).
      if (!unk_id) continue;
      id = *unk_id;
    }
    const auto index = static_cast<int32_t>(symbols.size());
    symbols.push_back({id, index - 1, index + 1, true});
  }
  if (symbols.empty()) return;
  symbols.back().next = -1;

  struct Candidate {
    int32_t rank, left;  // merge priority and position of the left symbol
    int32_t left_id, right_id, result;
    bool operator>(const Candidate& o) const {
      return rank != o.rank ? rank > o.rank : left > o.left;
    }
  };
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> queue;
  auto consider = [&](int32_t left) {
    const int32_t right = symbols[left].next;
    if (right < 0) return;
    if (const Merge* merge = merges.find(symbols[left].id, symbols[right].id))
      queue.push({merge->rank, left, symbols[left].id, symbols[right].id, merge->result});
  };
  for (int32_t i = 0; i + 1 < static_cast<int32_t>(symbols.size()); ++i) consider(i);

  while (!queue.empty()) {
    const Candidate c = queue.top();
    queue.pop();
    Symbol& left = symbols[c.left];
    // Skip candidates made stale by earlier merges: the pair at this position changed.
    if (!left.alive || left.id != c.left_id || left.next < 0) continue;
    Symbol& right = symbols[left.next];
    if (right.id != c.right_id) continue;
    left.id = c.result;
    right.alive = false;
    left.next = right.next;
    if (right.next >= 0) symbols[right.next].prev = c.left;
    if (left.prev >= 0) consider(left.prev);
    consider(c.left);
  }
  for (int32_t i = 0; i >= 0; i = symbols[i].next) out.push_back(symbols[i].id);
}

// ---------------------------------------------------------------------------------------------

Tokenizer::Tokenizer(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}

std::shared_ptr<Tokenizer::Impl> Tokenizer::Impl::load(std::string_view tokenizer_json,
                                                       std::string_view tokenizer_config_json,
                                                       const std::string& source_name) {
  auto impl = std::make_shared<Impl>();
  impl->source = source_name;
  TokenizerJsonReader reader;
  const bool parsed = json::sax_parse(tokenizer_json.begin(), tokenizer_json.end(), &reader);
  if (!parsed || !reader.error.empty())
    throw std::runtime_error(source_name + ": " +
                             (reader.error.empty() ? "malformed JSON" : reader.error));
  const json& root = reader.root;
  if (!root.is_object()) fail(source_name, "(root)", "expected an object");

  const json* model = member(root, "model");
  if (!model) fail(source_name, "model", "missing");
  if (const json* added = member(root, "added_tokens"); added && added->is_array())
    impl->added_token_count = added->size();
  impl->load_model(*model, reader.model);
  if (const json* added = member(root, "added_tokens")) impl->load_added_tokens(*added);
  if (const json* normalizer = member(root, "normalizer"))
    impl->check_normalizer(*normalizer, "normalizer");
  const json* pre = member(root, "pre_tokenizer");
  if (!pre) fail(source_name, "pre_tokenizer", "missing (byte-level BPE needs ByteLevel)");
  impl->load_pre_tokenizer(*pre, "pre_tokenizer");
  if (impl->pre_tokenizer.empty() ||
      impl->pre_tokenizer.back().kind != PreTokenizerStep::Kind::ByteLevel)
    fail(source_name, "pre_tokenizer", "has no ByteLevel step (only byte-level BPE is supported)");
  if (const json* post = member(root, "post_processor"))
    impl->load_post_processor(*post, "post_processor");
  // A missing decoder is taken as ByteLevel: nothing else can decode a byte-level vocabulary.
  if (const json* decoder = member(root, "decoder")) impl->check_decoder(*decoder);

  impl->id_to_bytes.resize(impl->id_to_text.size());
  for (size_t id = 0; id < impl->id_to_text.size(); ++id)
    if (impl->id_flags[id] & Impl::kPresent)
      impl->id_to_bytes[id] = byte_level_decode(impl->id_to_text[id]);

  if (!tokenizer_config_json.empty()) {
    std::filesystem::path config_source =
        std::filesystem::path(source_name).parent_path() / "tokenizer_config.json";
    impl->load_config(parse_json(tokenizer_config_json, config_source.string()),
                      config_source.string());
  }
  return impl;
}

Tokenizer Tokenizer::from_json(std::string_view tokenizer_json,
                               std::string_view tokenizer_config_json,
                               const std::string& source_name) {
  return Tokenizer(Impl::load(tokenizer_json, tokenizer_config_json, source_name));
}

std::shared_ptr<Tokenizer::Impl> Tokenizer::Impl::load_file(
    const std::filesystem::path& tokenizer_json) {
  const std::string text = read_whole_file(tokenizer_json);
  const std::filesystem::path config_path = tokenizer_json.parent_path() / "tokenizer_config.json";
  const std::string config =
      std::filesystem::exists(config_path) ? read_whole_file(config_path) : "";
  return load(text, config, tokenizer_json.string());
}

Tokenizer Tokenizer::from_file(const std::filesystem::path& tokenizer_json) {
  return Tokenizer(Impl::load_file(tokenizer_json));
}

Tokenizer Tokenizer::from_dir(const std::filesystem::path& dir) {
  if (!std::filesystem::is_directory(dir))
    throw std::runtime_error("tokenizer directory " + dir.string() + " does not exist");
  std::shared_ptr<Impl> impl = Impl::load_file(dir / "tokenizer.json");
  // Newer transformers save the chat template as its own file, which wins over the config's.
  const std::filesystem::path jinja = dir / "chat_template.jinja";
  if (std::filesystem::exists(jinja)) impl->chat_template = read_whole_file(jinja);
  return Tokenizer(std::move(impl));
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool add_special_tokens) const {
  require_valid_utf8(text);
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 4);
  if (add_special_tokens) ids.insert(ids.end(), impl_->prefix_ids.begin(), impl_->prefix_ids.end());

  std::vector<Segment> raw_segments, segments;
  split_on_added_tokens(text, impl_->raw_added_trie, impl_->added_tokens, raw_segments);
  // The normalizer is the identity, so normalized-text tokens are matched in the same text.
  for (const Segment& segment : raw_segments) {
    if (segment.added_id >= 0)
      segments.push_back(segment);
    else
      split_on_added_tokens(segment.text, impl_->normalized_added_trie, impl_->added_tokens,
                            segments);
  }
  for (const Segment& segment : segments) {
    if (segment.added_id >= 0)
      ids.push_back(segment.added_id);
    else
      impl_->encode_plain(segment.text, ids);
  }

  if (add_special_tokens) ids.insert(ids.end(), impl_->suffix_ids.begin(), impl_->suffix_ids.end());
  return ids;
}

std::string Tokenizer::decode(const std::vector<int32_t>& ids, bool skip_special_tokens) const {
  std::string bytes;
  for (const int32_t id : ids) {
    impl_->check_id(id);
    if (skip_special_tokens && (impl_->id_flags[id] & Impl::kSpecial)) continue;
    bytes += impl_->id_to_bytes[id];
  }
  return utf8_lossy(bytes);
}

size_t Tokenizer::vocab_size() const { return impl_->id_to_text.size(); }

std::optional<int32_t> Tokenizer::token_id(std::string_view token) const {
  return impl_->lookup(token);
}

const std::string& Tokenizer::token_text(int32_t id) const {
  impl_->check_id(id);
  return impl_->id_to_text[id];
}

const std::string& Tokenizer::token_bytes(int32_t id) const {
  impl_->check_id(id);
  return impl_->id_to_bytes[id];
}

bool Tokenizer::is_special(int32_t id) const {
  return impl_->has_id(id) && (impl_->id_flags[id] & Impl::kSpecial);
}

std::optional<std::string> Tokenizer::bos_token() const { return impl_->bos_token; }
std::optional<std::string> Tokenizer::eos_token() const { return impl_->eos_token; }
std::optional<int32_t> Tokenizer::bos_id() const { return impl_->bos_id; }
std::optional<int32_t> Tokenizer::eos_id() const { return impl_->eos_id; }
std::optional<std::string> Tokenizer::chat_template() const { return impl_->chat_template; }

// ---------------------------------------------------------------------------------------------

StreamDecoder::StreamDecoder(const Tokenizer& tokenizer, bool skip_special_tokens)
    : tokenizer_(tokenizer), skip_special_tokens_(skip_special_tokens) {}

std::string StreamDecoder::push(int32_t id) {
  if (skip_special_tokens_ && tokenizer_.is_special(id)) {
    tokenizer_.impl_->check_id(id);
    return {};
  }
  pending_ += tokenizer_.token_bytes(id);
  // Hold back a trailing sequence that is a valid start of a character still missing bytes.
  // A lead byte can never continue an earlier sequence, so splitting there decodes exactly as
  // decoding everything at once would.
  size_t keep_from = pending_.size();
  for (size_t back = 1; back <= 3 && back <= pending_.size(); ++back) {
    const size_t pos = pending_.size() - back;
    const auto byte = static_cast<uint8_t>(pending_[pos]);
    if (byte < 0x80) break;     // ASCII: nothing after it can be an unfinished character
    if (byte < 0xC0) continue;  // a continuation byte: look further back for its lead
    const Utf8Scan scan = scan_utf8(pending_, pos);
    if (!scan.complete && scan.length == back) keep_from = pos;
    break;
  }
  std::string out = utf8_lossy(std::string_view(pending_).substr(0, keep_from));
  pending_.erase(0, keep_from);
  return out;
}

std::string StreamDecoder::flush() {
  std::string out = utf8_lossy(pending_);
  pending_.clear();
  return out;
}

}  // namespace clshard
