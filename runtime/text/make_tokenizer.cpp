#include "runtime/text/make_tokenizer.h"

#include <cmath>
#include <fstream>
#include <set>
#include <stdexcept>

#include <nlohmann/json.hpp>

namespace clshard {

namespace {

// GPT-2's byte-to-unicode table: printable bytes map to themselves, the rest to U+0100 onwards, so
// every byte has a visible single-character token.
std::vector<std::string> byte_level_alphabet() {
  std::vector<int> cps(256, -1);
  auto keep = [](int b) { return (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || b >= 174; };
  int extra = 0;
  for (int b = 0; b < 256; ++b) cps[b] = keep(b) ? b : 256 + extra++;
  std::vector<std::string> out;
  for (int b = 0; b < 256; ++b) {
    int cp = cps[b];
    std::string s;
    if (cp < 0x80) s.push_back(char(cp));
    else {
      s.push_back(char(0xC0 | (cp >> 6)));
      s.push_back(char(0x80 | (cp & 0x3F)));
    }
    out.push_back(s);
  }
  return out;
}

}  // namespace

uint64_t SeededRandom::next_u64() {
  uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

double SeededRandom::uniform() { return double(next_u64() >> 11) * 0x1.0p-53; }

float SeededRandom::normal() {
  if (has_spare_) {
    has_spare_ = false;
    return float(spare_);
  }
  double u = uniform(), v = uniform();
  if (u < 1e-300) u = 1e-300;
  const double r = std::sqrt(-2.0 * std::log(u)), a = 2.0 * M_PI * v;
  spare_ = r * std::sin(a);
  has_spare_ = true;
  return float(r * std::cos(a));
}

void write_synthetic_tokenizer(const std::filesystem::path& dir,
                               const SyntheticTokenizerSpec& spec) {
  const uint32_t n_special = uint32_t(spec.special_tokens.size());
  if (spec.vocab_size < 256 + n_special)
    throw std::invalid_argument("synthetic tokenizer: vocab_size " +
                                std::to_string(spec.vocab_size) + " is below 256 bytes + " +
                                std::to_string(n_special) + " special tokens");
  const uint32_t n_bpe = spec.vocab_size - n_special;
  const auto alphabet = byte_level_alphabet();
  std::vector<std::string> tokens = alphabet;
  std::set<std::string> seen(tokens.begin(), tokens.end());
  nlohmann::ordered_json merges = nlohmann::ordered_json::array();
  // Merges in a fixed order: common ASCII bytes first (letters, space-marker 'Ġ'), each existing
  // token extended by one byte, so every merge's parts exist before it.
  std::vector<int> order;
  for (int b : {' ', 'e', 't', 'a', 'o', 'i', 'n', 's', 'r', 'h', 'l', 'd', 'c', 'u', 'm'})
    order.push_back(b);
  for (int b = 'a'; b <= 'z'; ++b) order.push_back(b);
  for (int b = 'A'; b <= 'Z'; ++b) order.push_back(b);
  for (int b = 0; b < 256; ++b) order.push_back(b);
  std::vector<int> unique_order;
  std::set<int> used;
  for (int b : order)
    if (used.insert(b).second) unique_order.push_back(b);
  for (size_t left = 0; tokens.size() < n_bpe && left < tokens.size(); ++left) {
    for (int b : unique_order) {
      if (tokens.size() >= n_bpe) break;
      std::string merged = tokens[left] + alphabet[b];
      if (!seen.insert(merged).second) continue;
      merges.push_back(tokens[left] + " " + alphabet[b]);
      tokens.push_back(merged);
    }
  }
  nlohmann::ordered_json vocab = nlohmann::ordered_json::object();
  for (size_t i = 0; i < tokens.size(); ++i) vocab[tokens[i]] = i;

  nlohmann::ordered_json added = nlohmann::ordered_json::array();
  for (uint32_t i = 0; i < n_special; ++i)
    added.push_back({{"id", n_bpe + i}, {"content", spec.special_tokens[i]},
                     {"single_word", false}, {"lstrip", false}, {"rstrip", false},
                     {"normalized", false}, {"special", true}});

  nlohmann::ordered_json tok;
  tok["version"] = "1.0";
  tok["truncation"] = nullptr;
  tok["padding"] = nullptr;
  tok["added_tokens"] = added;
  tok["normalizer"] = nullptr;
  tok["pre_tokenizer"] = {
      {"type", "Sequence"},
      {"pretokenizers",
       {{{"type", "Split"},
         {"pattern", {{"Regex", spec.pre_tokenizer_regex}}},
         {"behavior", "Isolated"},
         {"invert", false}},
        {{"type", "ByteLevel"},
         {"add_prefix_space", false},
         {"trim_offsets", true},
         {"use_regex", false}}}}};
  tok["post_processor"] = {{"type", "ByteLevel"}, {"add_prefix_space", true},
                           {"trim_offsets", false}, {"use_regex", true}};
  tok["decoder"] = {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", true},
                    {"use_regex", true}};
  tok["model"] = {{"type", "BPE"},          {"dropout", nullptr},
                  {"unk_token", nullptr},   {"continuing_subword_prefix", nullptr},
                  {"end_of_word_suffix", nullptr}, {"fuse_unk", false},
                  {"byte_fallback", false}, {"ignore_merges", false},
                  {"vocab", vocab},         {"merges", merges}};
  std::ofstream(dir / "tokenizer.json") << tok.dump(1) << "\n";

  nlohmann::ordered_json cfg;
  cfg["bos_token"] = spec.bos_token;
  cfg["eos_token"] = spec.eos_token;
  cfg["chat_template"] = spec.chat_template;
  cfg["model_max_length"] = 131072;
  cfg["tokenizer_class"] = "PreTrainedTokenizerFast";
  std::ofstream(dir / "tokenizer_config.json") << cfg.dump(1) << "\n";
}

}  // namespace clshard
