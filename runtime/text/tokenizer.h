// Hugging Face byte-level BPE tokenizer (tokenizer.json + tokenizer_config.json).
//
// Covers what byte-level BPE models ship: a BPE model over the GPT-2 byte alphabet, an optional
// Sequence of regex Split pre-tokenizers followed by ByteLevel, added/special tokens matched in the
// raw text before pre-tokenization, the ByteLevel / TemplateProcessing post-processors and the
// ByteLevel decoder. Anything else in the file is rejected at load time with an error naming the
// field, rather than silently tokenizing differently from the reference implementation.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace clshard {

class Tokenizer {
 public:
  // Loads dir/tokenizer.json plus, when present, dir/tokenizer_config.json (special token names,
  // chat template) and dir/chat_template.jinja (a chat template that overrides the config's).
  // Throws std::runtime_error naming the file and the offending field.
  static Tokenizer from_dir(const std::filesystem::path& dir);
  // Loads one tokenizer.json; a tokenizer_config.json in the same directory is read too.
  static Tokenizer from_file(const std::filesystem::path& tokenizer_json);
  // Parses tokenizer.json text (and optional tokenizer_config.json text) already in memory;
  // source_name is used in error messages.
  static Tokenizer from_json(std::string_view tokenizer_json,
                             std::string_view tokenizer_config_json = {},
                             const std::string& source_name = "tokenizer.json");

  // Text must be valid UTF-8 (std::invalid_argument otherwise). Added tokens written in the text
  // are always matched; add_special_tokens only controls the post-processor's BOS/EOS.
  // Thread-safe: the word cache is guarded internally.
  std::vector<int32_t> encode(std::string_view text, bool add_special_tokens = false) const;
  // Invalid UTF-8 produced by the ids (e.g. a lone half of a character) becomes U+FFFD, as in
  // Hugging Face's decode. Throws std::out_of_range for an id with no token.
  std::string decode(const std::vector<int32_t>& ids, bool skip_special_tokens = false) const;

  // Highest token id + 1, added tokens included (the embedding table's row count).
  size_t vocab_size() const;
  // Looks up a token by its text as written in tokenizer.json (byte-level form, e.g. "Ġthe").
  std::optional<int32_t> token_id(std::string_view token) const;
  // Token text as written in tokenizer.json. Throws std::out_of_range for an id with no token.
  const std::string& token_text(int32_t id) const;
  // The bytes the token decodes to; may be an incomplete UTF-8 sequence.
  const std::string& token_bytes(int32_t id) const;
  // True for added tokens marked "special" (those skip_special_tokens removes).
  bool is_special(int32_t id) const;

  // From tokenizer_config.json's bos_token / eos_token (a string or {"content": ...}).
  std::optional<std::string> bos_token() const;
  std::optional<std::string> eos_token() const;
  std::optional<int32_t> bos_id() const;
  std::optional<int32_t> eos_id() const;
  std::optional<std::string> chat_template() const;

 private:
  struct Impl;
  explicit Tokenizer(std::shared_ptr<const Impl> impl);
  // Shared and immutable (apart from the internally locked word cache), so copies are cheap.
  std::shared_ptr<const Impl> impl_;

  friend class StreamDecoder;
};

// Decodes generated tokens one at a time. Output never ends in the middle of a UTF-8 character:
// an incomplete trailing sequence is held back until the token completing it arrives (or flush()).
// The concatenation of all push() results and flush() equals Tokenizer::decode of all the ids.
class StreamDecoder {
 public:
  explicit StreamDecoder(const Tokenizer& tokenizer, bool skip_special_tokens = false);
  std::string push(int32_t id);
  // Emits whatever is held back (an incomplete sequence becomes U+FFFD) and resets.
  std::string flush();

 private:
  Tokenizer tokenizer_;
  bool skip_special_tokens_;
  std::string pending_;
};

}  // namespace clshard
