// A tokenizer's vocabulary as byte strings, arranged for computing token masks: a trie in preorder
// (flat arrays), so the tokens a byte automaton allows are found in one pass that skips every
// subtree the automaton rejects at its first byte. Built once per tokenizer (of() caches it by the
// vocabulary's content).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace clshard {
class Tokenizer;
}

namespace clshard::structured {

class TokenVocabulary {
 public:
  // token_bytes[id] = what token id decodes to; an empty string marks a token that constrained
  // output never uses (special tokens, ids with no token).
  explicit TokenVocabulary(const std::vector<std::string>& token_bytes);
  // The tokenizer's vocabulary, special tokens left out (EOS is the engine's business). Cached:
  // tokenizers with the same byte strings share one.
  static std::shared_ptr<const TokenVocabulary> of(const Tokenizer& tok);

  uint32_t size() const { return uint32_t(offsets_.size() - 1); }
  std::string_view bytes(int32_t id) const {
    return {bytes_.data() + offsets_[size_t(id)], offsets_[size_t(id) + 1] - offsets_[size_t(id)]};
  }
  uint64_t fingerprint() const { return fingerprint_; }
  uint32_t trie_nodes() const { return uint32_t(node_byte_.size()); }

  // Calls visit(token id) for every token whose bytes `step` accepts from `start`: step(state,
  // byte) returns the next state or a negative value to reject. States are int32_t.
  template <class Step, class Visit>
  void walk(int32_t start, Step&& step, Visit&& visit) const {
    std::vector<int32_t>& st = stack_scratch();
    st.resize(max_depth_ + 1);
    st[0] = start;
    const size_t n = node_byte_.size();
    for (size_t i = 0; i < n;) {
      const uint32_t d = node_depth_[i];
      const int32_t s = step(st[d - 1], node_byte_[i]);
      if (s < 0) {
        i = node_skip_[i];
        continue;
      }
      st[d] = s;
      for (uint32_t k = node_tokens_[i]; k < node_tokens_[i + 1]; ++k) visit(tokens_[k]);
      ++i;
    }
  }

 private:
  static std::vector<int32_t>& stack_scratch();
  std::string bytes_;
  std::vector<uint32_t> offsets_;  // [size + 1]
  uint64_t fingerprint_ = 0;
  // The trie, nodes in preorder; node i reads node_byte_[i] at depth node_depth_[i] (>= 1), its
  // subtree ends before node_skip_[i], its tokens are tokens_[node_tokens_[i] ..
  // node_tokens_[i + 1]).
  std::vector<uint8_t> node_byte_;
  std::vector<uint16_t> node_depth_;
  std::vector<uint32_t> node_skip_;
  std::vector<uint32_t> node_tokens_;
  std::vector<int32_t> tokens_;
  uint32_t max_depth_ = 0;
};

}  // namespace clshard::structured
