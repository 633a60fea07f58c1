// A byte DFA (byte_dfa.h) lifted to tokens over one vocabulary (token_vocabulary.h): the mask of
// tokens allowed in a DFA state is the set of tokens whose bytes all walk the DFA from it without
// leaving the language, found by walking the vocabulary's trie against the DFA; masks are cached
// per DFA state, so a state is walked once however many requests and steps pass through it.
// Shared by every request of one compiled format (thread-safe); DfaConstraint is the per-request
// cursor.
#pragma once

#include <memory>
#include <mutex>
#include <vector>

#include "runtime/engine/constraint.h"
#include "runtime/engine/structured/byte_dfa.h"
#include "runtime/engine/structured/token_vocabulary.h"

namespace clshard::structured {

class TokenAutomaton {
 public:
  // Masks beyond max_cache_bytes are computed every time instead of being kept.
  TokenAutomaton(ByteDfa dfa, std::shared_ptr<const TokenVocabulary> vocab,
                 size_t max_cache_bytes = size_t(64) << 20);

  const ByteDfa& dfa() const { return dfa_; }
  const TokenVocabulary& vocab() const { return *vocab_; }
  uint32_t mask_words() const { return words_; }
  // Writes mask_words() words: the tokens allowed in `state`. Returns whether any is.
  bool mask(int32_t state, uint32_t* out) const;
  // The DFA state after the token's bytes, or ByteDfa::kDead.
  int32_t after(int32_t state, int32_t token) const;
  // The most memory it can come to hold, in bytes: the DFA's tables, the per-state mask slots,
  // and every mask it may cache (one per state, within max_cache_bytes). The vocabulary is shared
  // between automata and not counted. Fixed at construction, so a cache that admits automata by
  // this size stays within its budget however far the masks fill in later.
  size_t max_bytes() const;
  // Masks computed by walking the trie (cache misses), for the benchmarks and tests.
  uint64_t walks() const;

 private:
  struct Entry {
    std::vector<uint32_t> bits;
    bool any = false;
  };
  bool compute(int32_t state, uint32_t* out) const;

  ByteDfa dfa_;
  std::shared_ptr<const TokenVocabulary> vocab_;
  uint32_t words_;
  size_t max_cached_;
  mutable std::mutex mu_;
  mutable std::vector<std::unique_ptr<Entry>> cache_;  // per DFA state
  mutable size_t cached_ = 0;
  mutable uint64_t walks_ = 0;
};

// One request's position in a TokenAutomaton.
class DfaConstraint final : public TokenConstraint {
 public:
  explicit DfaConstraint(std::shared_ptr<const TokenAutomaton> automaton);
  void allowed_tokens(uint32_t* bits, uint32_t vocab) const override;
  bool allows(int32_t token) const override;
  bool advance(int32_t token) override;
  bool can_end() const override { return automaton_->dfa().accepting(state_); }
  bool is_complete() const override;
  std::unique_ptr<TokenConstraint> clone() const override {
    return std::make_unique<DfaConstraint>(*this);
  }
  int32_t state() const { return state_; }

 private:
  std::shared_ptr<const TokenAutomaton> automaton_;
  int32_t state_;
};

}  // namespace clshard::structured
