// Tests of the Hugging Face tokenizer: the shared Llama 3 / DeepSeek-V3 expected encodings,
// streaming decode, a minimal byte-level tokenizer like the one make-model writes, and the errors
// for files we cannot tokenize faithfully.
#include "runtime/text/tokenizer.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "tests/test_util.h"

namespace clshard {
namespace {

using nlohmann::json;

std::filesystem::path tokenizers_dir() { return test::tokenizers_dir(); }
const Tokenizer& llama3() { return test::llama3_tokenizer(); }
const Tokenizer& deepseek_v3() { return test::deepseek_v3_tokenizer(); }

struct ExpectedCase {
  std::string name, text;
  std::vector<int32_t> ids;
};

std::vector<ExpectedCase> read_expected(const std::string& file) {
  std::ifstream in(tokenizers_dir() / file);
  if (!in) throw std::runtime_error("cannot open " + (tokenizers_dir() / file).string());
  std::vector<ExpectedCase> cases;
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    const json j = json::parse(line);
    cases.push_back({j.at("name").get<std::string>(), j.at("text").get<std::string>(),
                     j.at("ids").get<std::vector<int32_t>>()});
  }
  return cases;
}

bool is_valid_utf8(const std::string& s) {
  for (size_t i = 0; i < s.size();) {
    const auto b = static_cast<uint8_t>(s[i]);
    const size_t n = b < 0x80 ? 1 : (b >> 5) == 6 ? 2 : (b >> 4) == 14 ? 3 : (b >> 3) == 30 ? 4 : 0;
    if (n == 0 || i + n > s.size()) return false;
    for (size_t k = 1; k < n; ++k)
      if ((static_cast<uint8_t>(s[i + k]) & 0xC0) != 0x80) return false;
    i += n;
  }
  return true;
}

// A fresh directory under the system temp dir, removed afterwards.
class TempDir {
 public:
  explicit TempDir(const std::string& name) {
    static std::atomic<int> counter{0};
    path_ = std::filesystem::temp_directory_path() /
            ("clshard_test_" + name + "_" + std::to_string(::getpid()) + "_" +
             std::to_string(counter++));
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~TempDir() { std::filesystem::remove_all(path_); }
  const std::filesystem::path& path() const { return path_; }
  void write(const std::string& file, const std::string& text) const {
    std::ofstream(path_ / file) << text;
  }

 private:
  std::filesystem::path path_;
};

void check_expected(const Tokenizer& tokenizer, const std::string& file, size_t* passed) {
  const std::vector<ExpectedCase> cases = read_expected(file);
  ASSERT_GE(cases.size(), 80u);
  for (const ExpectedCase& c : cases) {
    SCOPED_TRACE(file + ": " + c.name);
    const std::vector<int32_t> ids = tokenizer.encode(c.text);
    EXPECT_EQ(ids, c.ids);
    EXPECT_EQ(tokenizer.decode(c.ids), c.text);
    if (ids == c.ids && tokenizer.decode(c.ids) == c.text) ++*passed;
  }
  EXPECT_EQ(*passed, cases.size());
}

TEST(Tokenizer, Llama3MatchesEveryExpectedEncoding) {
  size_t passed = 0;
  check_expected(llama3(), "expected_llama3.jsonl", &passed);
}

TEST(Tokenizer, DeepSeekV3MatchesEveryExpectedEncoding) {
  size_t passed = 0;
  check_expected(deepseek_v3(), "expected_deepseek_v3.jsonl", &passed);
}

// Llama 3 sets ignore_merges: every vocabulary token that is valid UTF-8 (and so one pre-token)
// encodes to itself, even where the merges alone would split it (e.g. " việc").
TEST(Tokenizer, Llama3VocabularyTokensEncodeToThemselves) {
  const Tokenizer& t = llama3();
  EXPECT_EQ(t.encode(" việc"), (std::vector<int32_t>{100769}));
  EXPECT_EQ(t.encode("ektedir"), (std::vector<int32_t>{101673}));
  size_t checked = 0, mismatched = 0;
  for (int32_t id = 0; id < 128000; ++id) {
    const std::string& bytes = t.token_bytes(id);
    if (!is_valid_utf8(bytes)) continue;
    ++checked;
    if (t.encode(bytes) != std::vector<int32_t>{id}) ++mismatched;
  }
  EXPECT_GT(checked, 120000u);
  EXPECT_EQ(mismatched, 0u);
}

TEST(Tokenizer, VocabularyAndSpecialTokens) {
  const Tokenizer& l = llama3();
  EXPECT_EQ(l.vocab_size(), 128256u);
  EXPECT_EQ(l.bos_token(), "<|begin_of_text|>");
  EXPECT_EQ(l.eos_token(), "<|end_of_text|>");
  EXPECT_EQ(l.bos_id(), 128000);
  EXPECT_EQ(l.eos_id(), 128001);
  EXPECT_EQ(l.token_id("<|eot_id|>"), 128009);
  EXPECT_EQ(l.token_id("Ġworld"), 1917);
  EXPECT_EQ(l.token_id("no such token"), std::nullopt);
  EXPECT_EQ(l.token_text(1917), "Ġworld");
  EXPECT_EQ(l.token_bytes(1917), " world");
  EXPECT_TRUE(l.is_special(128009));
  EXPECT_FALSE(l.is_special(1917));
  EXPECT_TRUE(l.chat_template().has_value());

  const Tokenizer& d = deepseek_v3();
  EXPECT_EQ(d.vocab_size(), 128815u);
  EXPECT_EQ(d.bos_id(), 0);
  EXPECT_EQ(d.eos_id(), 1);
  EXPECT_EQ(d.token_id("<｜User｜>"), 128803);
  // Added but not special: decoding with skip_special_tokens keeps it.
  EXPECT_FALSE(d.is_special(128803));
  EXPECT_TRUE(d.is_special(1));
  // Not a byte-level string: the ByteLevel decoder passes it through as UTF-8.
  EXPECT_EQ(d.token_bytes(128803), "<｜User｜>");
}

// Llama 3's tokenizer.json post-processor is ByteLevel (adds nothing); DeepSeek-V3's
// tokenizer_config.json says add_bos_token, which transformers applies.
TEST(Tokenizer, AddSpecialTokensFollowsPostProcessorAndConfig) {
  EXPECT_EQ(llama3().encode("Hello world", true), (std::vector<int32_t>{9906, 1917}));
  std::vector<int32_t> with_bos = deepseek_v3().encode("Hello world");
  with_bos.insert(with_bos.begin(), 0);
  EXPECT_EQ(deepseek_v3().encode("Hello world", true), with_bos);
}

TEST(Tokenizer, DecodeSkipsOnlySpecialTokens) {
  const std::vector<int32_t> ids = llama3().encode("<|begin_of_text|>Hello<|eot_id|>");
  EXPECT_EQ(ids, (std::vector<int32_t>{128000, 9906, 128009}));
  EXPECT_EQ(llama3().decode(ids, true), "Hello");
  const std::vector<int32_t> ds_ids = deepseek_v3().encode("<｜begin▁of▁sentence｜><｜User｜>Hi");
  EXPECT_EQ(deepseek_v3().decode(ds_ids, true), "<｜User｜>Hi");
}

// Finds the token standing for one raw byte (every byte-level vocabulary has all 256).
int32_t byte_token(const Tokenizer& tokenizer, uint8_t byte) {
  for (size_t id = 0; id < tokenizer.vocab_size(); ++id) {
    const std::string& bytes = tokenizer.token_bytes(static_cast<int32_t>(id));
    if (bytes.size() == 1 && static_cast<uint8_t>(bytes[0]) == byte &&
        !tokenizer.is_special(static_cast<int32_t>(id)))
      return static_cast<int32_t>(id);
  }
  throw std::runtime_error("no token for byte " + std::to_string(byte));
}

TEST(Tokenizer, DecodeReplacesInvalidUtf8) {
  const Tokenizer& t = llama3();
  const int32_t lead = byte_token(t, 0xF0);
  const int32_t continuation = byte_token(t, 0x9F);
  EXPECT_EQ(t.decode({lead}), "\xEF\xBF\xBD");
  EXPECT_EQ(t.decode({continuation, lead, continuation}), "\xEF\xBF\xBD\xEF\xBF\xBD");
  EXPECT_EQ(t.decode({lead, continuation, byte_token(t, 0x98), byte_token(t, 0x80)}), "😀");
}

TEST(StreamDecoder, HoldsBackSplitCharacters) {
  const Tokenizer& t = llama3();
  StreamDecoder stream(t);
  // "😀" is F0 9F 98 80: nothing comes out until its last byte.
  EXPECT_EQ(stream.push(byte_token(t, 0xF0)), "");
  EXPECT_EQ(stream.push(byte_token(t, 0x9F)), "");
  EXPECT_EQ(stream.push(byte_token(t, 0x98)), "");
  EXPECT_EQ(stream.push(byte_token(t, 0x80)), "😀");
  // "你" is E4 BD A0, with ASCII before it.
  EXPECT_EQ(stream.push(t.encode("a")[0]), "a");
  EXPECT_EQ(stream.push(byte_token(t, 0xE4)), "");
  EXPECT_EQ(stream.push(byte_token(t, 0xBD)), "");
  EXPECT_EQ(stream.push(byte_token(t, 0xA0)), "你");
  EXPECT_EQ(stream.flush(), "");
}

TEST(StreamDecoder, InvalidBytesAreNotHeldAndFlushReplacesTheRest) {
  const Tokenizer& t = llama3();
  StreamDecoder stream(t);
  EXPECT_EQ(stream.push(byte_token(t, 0x9F)), "\xEF\xBF\xBD");  // a continuation byte alone
  EXPECT_EQ(stream.push(byte_token(t, 0xE4)), "");
  EXPECT_EQ(stream.push(t.encode("b")[0]),
            "\xEF\xBF\xBD"
            "b");  // the lead byte was cut short
  EXPECT_EQ(stream.push(byte_token(t, 0xF0)), "");
  EXPECT_EQ(stream.flush(), "\xEF\xBF\xBD");
  EXPECT_EQ(stream.flush(), "");
}

// Token by token, every expected text (CJK, emoji, ZWJ sequences, ...) streams back exactly,
// and no chunk ever ends inside a character.
TEST(StreamDecoder, StreamsEveryExpectedTextExactly) {
  size_t split_characters = 0;
  for (const auto& [tokenizer, file] : {std::pair{&llama3(), "expected_llama3.jsonl"},
                                        std::pair{&deepseek_v3(), "expected_deepseek_v3.jsonl"}}) {
    for (const ExpectedCase& c : read_expected(file)) {
      SCOPED_TRACE(std::string(file) + ": " + c.name);
      StreamDecoder stream(*tokenizer);
      std::string text;
      for (const int32_t id : c.ids) {
        const std::string chunk = stream.push(id);
        EXPECT_TRUE(is_valid_utf8(chunk));
        if (chunk.size() != tokenizer->token_bytes(id).size()) ++split_characters;
        text += chunk;
      }
      text += stream.flush();
      EXPECT_EQ(text, c.text);
    }
  }
  EXPECT_GT(split_characters, 20u);  // the cases do split characters across tokens
}

TEST(StreamDecoder, SkipsSpecialTokensWhenAsked) {
  const Tokenizer& t = llama3();
  StreamDecoder stream(t, true);
  std::string text;
  for (const int32_t id : t.encode("<|begin_of_text|>Hi 你好<|eot_id|>")) text += stream.push(id);
  EXPECT_EQ(text + stream.flush(), "Hi 你好");
}

TEST(Tokenizer, RejectsInvalidInputAndIds) {
  EXPECT_THROW(llama3().encode("bad \xC3("), std::invalid_argument);
  EXPECT_THROW(llama3().decode({-1}), std::out_of_range);
  EXPECT_THROW(llama3().decode({128256}), std::out_of_range);
  EXPECT_THROW(llama3().token_text(1 << 30), std::out_of_range);
}

// Long inputs: a 100k-character word goes through the heap-based BPE quickly and exactly.
TEST(Tokenizer, LongWordsRoundTrip) {
  const std::string word(100000, 'a');
  const std::vector<int32_t> ids = llama3().encode(word);
  EXPECT_LT(ids.size(), word.size() / 4);
  EXPECT_EQ(llama3().decode(ids), word);
  const std::string spaces = std::string(50000, ' ') + "x" + std::string(50000, '\n');
  EXPECT_EQ(llama3().decode(llama3().encode(spaces)), spaces);
}

TEST(Tokenizer, ConcurrentEncodesAgree) {
  const std::vector<ExpectedCase> cases = read_expected("expected_llama3.jsonl");
  std::atomic<int> mismatches{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int round = 0; round < 5; ++round)
        for (const ExpectedCase& c : cases)
          if (llama3().encode(c.text) != c.ids) ++mismatches;
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(mismatches.load(), 0);
}

// ---------------------------------------------------------------------------------------------
// A minimal byte-level BPE tokenizer.json as make-model writes one: the 256 byte tokens, a few
// merges and special tokens, and the ByteLevel pre-tokenizer with GPT-2's regex.

// The GPT-2 byte-to-character table, written out independently of the tokenizer's.
std::string byte_char(int b) {
  const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
  int cp = b;
  if (!printable) {
    cp = 256;
    for (int k = 0; k < b; ++k)
      if (!((k >= 0x21 && k <= 0x7E) || (k >= 0xA1 && k <= 0xAC) || k >= 0xAE)) ++cp;
  }
  std::string out;
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
  return out;
}

struct MiniOptions {
  bool pair_merges = false;  // merges as [a, b] instead of "a b"
  bool add_prefix_space = false;
  bool template_bos = true;  // TemplateProcessing adds <|bos|>
  bool ignore_merges = false;
  json extra_added_tokens = json::array();
  // Appended after the standard merges; their results get ids from 266 on.
  std::vector<std::pair<std::string, std::string>> extra_merges;
  std::vector<std::string> extra_vocab;  // tokens no merge produces, ids after extra_merges'
  json pre_tokenizer = nullptr;          // replaces the ByteLevel pre-tokenizer when set
};

// Vocabulary: bytes 0..255, then he(256) ll(257) hell(258) hello(259) Ġw(260) Ġwo(261)
// n'(262); specials <|bos|>(263) <|eos|>(264) <|pad|>(265).
std::string mini_tokenizer_json(const MiniOptions& options = {}) {
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[byte_char(b)] = b;
  const std::vector<std::pair<std::string, std::string>> merges = {
      {"h", "e"}, {"l", "l"}, {"he", "ll"}, {"hell", "o"}, {"Ġ", "w"}, {"Ġw", "o"}, {"n", "'"}};
  json merge_list = json::array();
  int next_id = 256;
  for (const auto& [a, b] : merges) {
    vocab[a + b] = next_id++;
    merge_list.push_back(options.pair_merges ? json::array({a, b}) : json(a + " " + b));
  }
  json added = json::array();
  for (const char* special : {"<|bos|>", "<|eos|>", "<|pad|>"}) {
    added.push_back({{"id", next_id++},
                     {"content", special},
                     {"single_word", false},
                     {"lstrip", false},
                     {"rstrip", false},
                     {"normalized", false},
                     {"special", true}});
  }
  for (const json& extra : options.extra_added_tokens) added.push_back(extra);
  for (const auto& [a, b] : options.extra_merges) {
    vocab[a + b] = next_id++;
    merge_list.push_back(a + " " + b);
  }
  for (const std::string& token : options.extra_vocab) vocab[token] = next_id++;
  json post = nullptr;
  if (options.template_bos) {
    post = {{"type", "TemplateProcessing"},
            {"single", json::array({{{"SpecialToken", {{"id", "<|bos|>"}, {"type_id", 0}}}},
                                    {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}})},
            {"pair", json::array()},
            {"special_tokens",
             {{"<|bos|>", {{"id", "<|bos|>"}, {"ids", {263}}, {"tokens", {"<|bos|>"}}}}}}};
  }
  const json tokenizer = {
      {"version", "1.0"},
      {"added_tokens", added},
      {"normalizer", nullptr},
      {"pre_tokenizer", options.pre_tokenizer.is_null()
                            ? json{{"type", "ByteLevel"},
                                   {"add_prefix_space", options.add_prefix_space},
                                   {"trim_offsets", true},
                                   {"use_regex", true}}
                            : options.pre_tokenizer},
      {"post_processor", post},
      {"decoder",
       {{"type", "ByteLevel"},
        {"add_prefix_space", true},
        {"trim_offsets", true},
        {"use_regex", true}}},
      {"model",
       {{"type", "BPE"},
        {"dropout", nullptr},
        {"unk_token", nullptr},
        {"fuse_unk", false},
        {"byte_fallback", false},
        {"ignore_merges", options.ignore_merges},
        {"vocab", vocab},
        {"merges", merge_list}}}};
  return tokenizer.dump();
}

std::vector<int32_t> bytes_of(const std::string& s) {
  std::vector<int32_t> ids;
  for (const char c : s) ids.push_back(static_cast<uint8_t>(c));
  return ids;
}

TEST(MiniTokenizer, EncodesWithMergesAndRoundTrips) {
  TempDir dir("mini");
  dir.write("tokenizer.json", mini_tokenizer_json());
  dir.write("tokenizer_config.json",
            R"({"bos_token": "<|bos|>", "eos_token": {"content": "<|eos|>"}})");
  const Tokenizer t = Tokenizer::from_dir(dir.path());
  EXPECT_EQ(t.vocab_size(), 266u);
  EXPECT_EQ(t.bos_id(), 263);
  EXPECT_EQ(t.eos_id(), 264);
  EXPECT_EQ(t.chat_template(), std::nullopt);

  // "hello" merges all the way; " world" only to "Ġwo" then raw bytes.
  EXPECT_EQ(t.encode("hello world"), (std::vector<int32_t>{259, 261, 'r', 'l', 'd'}));
  EXPECT_EQ(t.encode("hello world", true), (std::vector<int32_t>{263, 259, 261, 'r', 'l', 'd'}));
  // GPT-2's regex splits "don't" into "don" + "'t", so the merge "n '" never applies.
  EXPECT_EQ(t.encode("don't"), bytes_of("don't"));
  EXPECT_EQ(t.encode("n'"),
            (std::vector<int32_t>{'n', '\''}));  // "n" + "'" are separate pieces too
  EXPECT_EQ(t.encode("<|bos|>hello<|eos|>"), (std::vector<int32_t>{263, 259, 264}));

  for (const std::string text :
       {"", "hello world", "  multiple   spaces\n\ttabs\r\n",
        "ünïcödé 你好 😀👨‍👩‍👧", "<|bos|>x<|pad|><|eos|>",
        "numbers 12345 and symbols !@#$%^&*()"}) {
    SCOPED_TRACE(text);
    EXPECT_EQ(t.decode(t.encode(text)), text);
  }
  EXPECT_EQ(t.decode(t.encode("<|bos|>hi<|eos|>"), true), "hi");
}

TEST(MiniTokenizer, PairMergeFormatGivesTheSameIds) {
  MiniOptions options;
  options.pair_merges = true;
  const Tokenizer pairs = Tokenizer::from_json(mini_tokenizer_json(options));
  const Tokenizer strings = Tokenizer::from_json(mini_tokenizer_json());
  for (const std::string text : {"hello world", "hellohello wow", "shell hello"})
    EXPECT_EQ(pairs.encode(text), strings.encode(text)) << text;
  EXPECT_EQ(pairs.encode("hello world"), (std::vector<int32_t>{259, 261, 'r', 'l', 'd'}));
}

TEST(MiniTokenizer, AddPrefixSpace) {
  MiniOptions options;
  options.add_prefix_space = true;
  options.template_bos = false;
  const Tokenizer t = Tokenizer::from_json(mini_tokenizer_json(options));
  EXPECT_EQ(t.encode("world"), (std::vector<int32_t>{261, 'r', 'l', 'd'}));   // as " world"
  EXPECT_EQ(t.encode(" world"), (std::vector<int32_t>{261, 'r', 'l', 'd'}));  // already has one
  EXPECT_EQ(t.encode("world", true), t.encode("world"));  // no post-processor: nothing added
  EXPECT_EQ(t.decode(t.encode("world")), " world");
}

TEST(MiniTokenizer, AddedTokensWithLstripAndRstrip) {
  MiniOptions options;
  options.extra_added_tokens = json::array({{{"id", 266},
                                             {"content", "<mask>"},
                                             {"lstrip", true},
                                             {"rstrip", false},
                                             {"normalized", false},
                                             {"special", true}},
                                            {{"id", 267},
                                             {"content", "<sep>"},
                                             {"lstrip", false},
                                             {"rstrip", true},
                                             {"normalized", true},
                                             {"special", false}}});
  const Tokenizer t = Tokenizer::from_json(mini_tokenizer_json(options));
  EXPECT_EQ(t.encode("a \t<mask> b"), (std::vector<int32_t>{'a', 266, 0x20, 'b'}));
  EXPECT_EQ(t.encode("a <sep>  b"), (std::vector<int32_t>{'a', 0x20, 267, 'b'}));
  // Longest match wins among added tokens starting at the same place.
  EXPECT_EQ(t.encode("<mask><sep>"), (std::vector<int32_t>{266, 267}));
}

// ignore_merges: a pre-token that is itself in the vocabulary is that token, whatever the merges.
TEST(MiniTokenizer, IgnoreMergesTakesWholeWords) {
  MiniOptions options;
  options.extra_vocab = {"abc"};  // id 266, unreachable by merges
  const Tokenizer merging = Tokenizer::from_json(mini_tokenizer_json(options));
  EXPECT_EQ(merging.encode("abc"), bytes_of("abc"));
  options.ignore_merges = true;
  const Tokenizer ignoring = Tokenizer::from_json(mini_tokenizer_json(options));
  EXPECT_EQ(ignoring.encode("abc"), (std::vector<int32_t>{266}));
  EXPECT_EQ(ignoring.encode("abcd"), bytes_of("abcd"));
}

// Split patterns see \s as Unicode White_Space, as the reference (Oniguruma) does: U+0085 is
// whitespace, U+180E and U+FEFF are not (PCRE2's own \s disagrees on U+180E). Each merge below
// joins the last byte of one character with the first of the next, so it applies only when the
// two characters end up in the same pre-token.
TEST(MiniTokenizer, SplitWhitespaceIsUnicodeWhiteSpace) {
  MiniOptions options;
  options.template_bos = false;
  options.pre_tokenizer = {
      {"type", "Sequence"},
      {"pretokenizers",
       {{{"type", "Split"},
         {"pattern", {{"Regex", "\\s+"}}},
         {"behavior", "Isolated"},
         {"invert", false}},
        {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}}}}};
  options.extra_merges = {{byte_char(0x8E), byte_char(0x20)},  // 266: U+180E's last byte + space
                          {byte_char(0x85), byte_char('x')},   // 267: U+0085's last byte + 'x'
                          {byte_char(0x20), byte_char(0xEF)},  // 268: space + U+FEFF's first byte
                          {byte_char('a'), byte_char(0xE1)}};  // 269: 'a' + U+180E's first byte
  const Tokenizer t = Tokenizer::from_json(mini_tokenizer_json(options));
  // U+180E (E1 A0 8E) is not whitespace: "\u180E" and " " are separate pieces, but "a\u180E" is
  // one.
  EXPECT_EQ(t.encode("\u180E "), (std::vector<int32_t>{0xE1, 0xA0, 0x8E, 0x20}));
  EXPECT_EQ(t.encode("a\u180E"), (std::vector<int32_t>{269, 0xA0, 0x8E}));
  // U+0085 (C2 85) is whitespace: a piece of its own, apart from the 'x'.
  EXPECT_EQ(t.encode("\u0085x"), (std::vector<int32_t>{0xC2, 0x85, 'x'}));
  // U+FEFF (EF BB BF) is not whitespace: the space is a piece of its own.
  EXPECT_EQ(t.encode(" \uFEFF"), (std::vector<int32_t>{0x20, 0xEF, 0xBB, 0xBF}));
  EXPECT_EQ(t.encode("\u180E"), (std::vector<int32_t>{0xE1, 0xA0, 0x8E}));
}

TEST(MiniTokenizer, ChatTemplateJinjaFileOverridesConfig) {
  TempDir dir("jinja");
  dir.write("tokenizer.json", mini_tokenizer_json());
  dir.write("tokenizer_config.json", R"({"chat_template": "from config"})");
  EXPECT_EQ(Tokenizer::from_dir(dir.path()).chat_template(), "from config");
  dir.write("chat_template.jinja", "from file");
  EXPECT_EQ(Tokenizer::from_dir(dir.path()).chat_template(), "from file");
}

// ---------------------------------------------------------------------------------------------
// Errors name the file and the field.

std::string load_error(const std::string& tokenizer_json) {
  try {
    Tokenizer::from_json(tokenizer_json, {}, "test/tokenizer.json");
  } catch (const std::runtime_error& e) {
    return e.what();
  }
  return "(loaded)";
}

// mini_tokenizer_json() with one field replaced.
std::string mini_with(const std::string& pointer, const json& value) {
  json j = json::parse(mini_tokenizer_json());
  j[json::json_pointer(pointer)] = value;
  return j.dump();
}

TEST(TokenizerErrors, MissingFileNamesThePath) {
  try {
    Tokenizer::from_dir("/nonexistent/clshard/tokenizer");
    FAIL() << "loaded a missing directory";
  } catch (const std::runtime_error& e) {
    EXPECT_EQ(std::string(e.what()),
              "tokenizer directory /nonexistent/clshard/tokenizer does not exist");
  }
  TempDir dir("empty");
  try {
    Tokenizer::from_dir(dir.path());
    FAIL() << "loaded a directory without tokenizer.json";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("cannot open " + (dir.path() / "tokenizer.json").string()),
              std::string::npos)
        << e.what();
  }
}

TEST(TokenizerErrors, MalformedJson) {
  EXPECT_EQ(load_error(R"({"model": {"vocab": {"a": 0}, )")
                .rfind("test/tokenizer.json: malformed JSON: ", 0),
            0u);
  TempDir dir("malformed");
  dir.write("tokenizer.json", mini_tokenizer_json());
  dir.write("tokenizer_config.json", "{ nope");
  try {
    Tokenizer::from_dir(dir.path());
    FAIL() << "loaded a malformed tokenizer_config.json";
  } catch (const std::runtime_error& e) {
    EXPECT_EQ(std::string(e.what()).rfind(
                  (dir.path() / "tokenizer_config.json").string() + ": malformed JSON", 0),
              0u)
        << e.what();
  }
}

TEST(TokenizerErrors, UnsupportedTypesNameTheField) {
  EXPECT_EQ(load_error(mini_with("/model/type", "WordPiece")),
            "test/tokenizer.json: model.type: 'WordPiece' is not supported (only BPE, byte-level)");
  EXPECT_EQ(load_error(mini_with("/pre_tokenizer", {{"type", "Whitespace"}})),
            "test/tokenizer.json: pre_tokenizer.type: 'Whitespace' is not supported (Sequence, "
            "Split, ByteLevel)");
  EXPECT_EQ(load_error(mini_with(
                "/pre_tokenizer",
                {{"type", "Sequence"},
                 {"pretokenizers",
                  {{{"type", "Split"}, {"pattern", {{"Regex", "\\d"}}}, {"behavior", "Removed"}},
                   {{"type", "ByteLevel"}}}}})),
            "test/tokenizer.json: pre_tokenizer.pretokenizers[0].behavior: \"Removed\" is not "
            "supported (only \"Isolated\")");
  EXPECT_EQ(load_error(mini_with("/pre_tokenizer",
                                 {{"type", "Sequence"}, {"pretokenizers", json::array()}})),
            "test/tokenizer.json: pre_tokenizer: has no ByteLevel step (only byte-level BPE is "
            "supported)");
  EXPECT_EQ(load_error(mini_with("/normalizer", {{"type", "NFC"}})),
            "test/tokenizer.json: normalizer.type: 'NFC' is not supported");
  EXPECT_EQ(load_error(mini_with("/decoder", {{"type", "WordPiece"}})),
            "test/tokenizer.json: decoder.type: 'WordPiece' is not supported (only ByteLevel)");
  EXPECT_EQ(
      load_error(mini_with("/post_processor", {{"type", "BertProcessing"}})),
      "test/tokenizer.json: post_processor.type: 'BertProcessing' is not supported (ByteLevel, "
      "TemplateProcessing, Sequence)");
  EXPECT_EQ(load_error(mini_with("/model/byte_fallback", true)),
            "test/tokenizer.json: model.byte_fallback: is not supported (byte-level BPE needs no "
            "fallback)");
}

TEST(TokenizerErrors, BadModelContentsNameTheEntry) {
  EXPECT_EQ(
      load_error(mini_with("/model/merges/0", "h e x")),
      "test/tokenizer.json: model.merges[0]: 'h e x' is not two tokens separated by one space");
  EXPECT_EQ(load_error(mini_with("/model/merges/1", "q zz")),
            "test/tokenizer.json: model.merges[1]: 'q' + 'zz' uses or makes a token missing from "
            "model.vocab");
  EXPECT_EQ(load_error(mini_with("/model/vocab/a", "x")),
            "test/tokenizer.json: model.vocab[\"a\"]: id is not an integer");
  EXPECT_EQ(load_error(mini_with("/model/vocab", json::array())),
            "test/tokenizer.json: model.vocab: missing or not an object");
  EXPECT_EQ(load_error(mini_with("/pre_tokenizer", {{"type", "Sequence"},
                                                    {"pretokenizers",
                                                     {{{"type", "Split"},
                                                       {"pattern", {{"Regex", "(ab"}}},
                                                       {"behavior", "Isolated"}},
                                                      {{"type", "ByteLevel"}}}}}))
                .rfind("test/tokenizer.json: pre_tokenizer.pretokenizers[0].pattern.Regex: regex "
                       "does not compile (",
                       0),
            0u);
  EXPECT_EQ(load_error(mini_with("/added_tokens/0/single_word", true)),
            "test/tokenizer.json: added_tokens[0].single_word: true is not supported");
  // Ids index dense tables: one near INT32_MAX would make loading allocate tens of gigabytes (the
  // fuzzer's input took 6.5 s and 2 GB); the largest accepted id is 2^22 - 1.
  EXPECT_EQ(load_error(mini_with("/model/vocab/a", 2000000000)),
            "test/tokenizer.json: model.vocab[\"a\"]: id 2000000000 is not in 0..4194303");
  EXPECT_EQ(load_error(mini_with("/model/vocab/a", -1)),
            "test/tokenizer.json: model.vocab[\"a\"]: id -1 is not in 0..4194303");
  EXPECT_EQ(load_error(mini_with("/added_tokens/0/id", 4194304)),
            "test/tokenizer.json: added_tokens[0].id: 4194304 is not in 0..4194303");
  // ... and ids must be dense: at most twice the file's token count plus 1024 (the mini tokenizer
  // has 266 tokens, so 1556; fuzzing found an id of 3.4M in a file of a few tokens).
  EXPECT_EQ(load_error(mini_with("/model/vocab/a", 5000)),
            "test/tokenizer.json: model.vocab[\"a\"]: id 5000 is beyond 1556 (ids must be dense: at "
            "most twice the 266 tokens of the file plus 1024)");
  EXPECT_EQ(load_error(mini_with("/added_tokens/0/id", 5000)),
            "test/tokenizer.json: added_tokens[0].id: 5000 is beyond 1556 (ids must be dense: at "
            "most twice the 266 tokens of the file plus 1024)");
  EXPECT_EQ(load_error(mini_with("/added_tokens/0/id", "7")),
            "test/tokenizer.json: added_tokens[0].id: missing or not an integer");
}

}  // namespace
}  // namespace clshard
