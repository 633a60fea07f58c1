// Writes a valid byte-level BPE tokenizer.json (+ tokenizer_config.json) of an exact vocabulary
// size, for the random checkpoints of `clshard make-model`.
#pragma once

#include <filesystem>
#include <string>
#include <vector>

namespace clshard {

struct SyntheticTokenizerSpec {
  uint32_t vocab_size = 0;                  // BPE tokens + special tokens
  std::vector<std::string> special_tokens;  // placed at the end of the vocabulary, in order
  std::string bos_token, eos_token;         // among special_tokens
  std::string pre_tokenizer_regex;          // the Split pattern (Llama 3's or DeepSeek's)
  std::string chat_template;
};

void write_synthetic_tokenizer(const std::filesystem::path& dir, const SyntheticTokenizerSpec& spec);

// Deterministic pseudo-random numbers (splitmix64 + Box-Muller), the same on every platform.
class SeededRandom {
 public:
  explicit SeededRandom(uint64_t seed) : state_(seed * 0x9E3779B97F4A7C15ull + 1) {}
  uint64_t next_u64();
  double uniform();  // [0, 1)
  float normal();    // N(0, 1)

 private:
  uint64_t state_;
  bool has_spare_ = false;
  double spare_ = 0;
};

}  // namespace clshard
