#include "runtime/engine/structured/token_automaton.h"

#include <algorithm>
#include <cstring>

#include "runtime/engine/sampling.h"

namespace clshard::structured {

TokenAutomaton::TokenAutomaton(ByteDfa dfa, std::shared_ptr<const TokenVocabulary> vocab,
                               size_t max_cache_bytes)
    : dfa_(std::move(dfa)),
      vocab_(std::move(vocab)),
      words_(bitmask_words(vocab_->size())),
      max_cached_(max_cache_bytes),
      cache_(dfa_.num_states()) {}

bool TokenAutomaton::compute(int32_t state, uint32_t* out) const {
  std::fill(out, out + words_, 0u);
  bool any = false;
  const ByteDfa& d = dfa_;
  vocab_->walk(
      state, [&d](int32_t s, uint8_t b) { return d.next(s, b); },
      [&](int32_t t) {
        out[uint32_t(t) >> 5] |= 1u << (uint32_t(t) & 31);
        any = true;
      });
  return any;
}

bool TokenAutomaton::mask(int32_t state, uint32_t* out) const {
  {
    std::lock_guard<std::mutex> lock(mu_);
    const Entry* e = cache_[size_t(state)].get();
    if (e) {
      std::memcpy(out, e->bits.data(), size_t(words_) * 4);
      return e->any;
    }
    ++walks_;
  }
  const bool any = compute(state, out);
  std::lock_guard<std::mutex> lock(mu_);
  if (!cache_[size_t(state)] && cached_ + size_t(words_) * 4 <= max_cached_) {
    auto e = std::make_unique<Entry>();
    e->bits.assign(out, out + words_);
    e->any = any;
    cache_[size_t(state)] = std::move(e);
    cached_ += size_t(words_) * 4;
  }
  return any;
}

size_t TokenAutomaton::max_bytes() const {
  const size_t mask_bytes = size_t(words_) * 4;
  const size_t masks =
      mask_bytes == 0 ? 0 : std::min<size_t>(dfa_.num_states(), max_cached_ / mask_bytes);
  return dfa_.table_bytes() + cache_.capacity() * sizeof(cache_[0]) +
         masks * (mask_bytes + sizeof(Entry));
}

uint64_t TokenAutomaton::walks() const {
  std::lock_guard<std::mutex> lock(mu_);
  return walks_;
}

int32_t TokenAutomaton::after(int32_t state, int32_t token) const {
  if (token < 0 || uint32_t(token) >= vocab_->size()) return ByteDfa::kDead;
  const std::string_view b = vocab_->bytes(token);
  if (b.empty()) return ByteDfa::kDead;
  return dfa_.walk(state, b);
}

DfaConstraint::DfaConstraint(std::shared_ptr<const TokenAutomaton> automaton)
    : automaton_(std::move(automaton)), state_(automaton_->dfa().start()) {}

void DfaConstraint::allowed_tokens(uint32_t* bits, uint32_t vocab) const {
  const uint32_t words = bitmask_words(vocab), own = automaton_->mask_words();
  if (words >= own) {
    automaton_->mask(state_, bits);
    std::fill(bits + own, bits + words, 0u);
  } else {
    std::vector<uint32_t> full(own);
    automaton_->mask(state_, full.data());
    std::copy(full.begin(), full.begin() + words, bits);
  }
  if (vocab % 32 != 0 && words > 0) bits[words - 1] &= (1u << (vocab % 32)) - 1;
}

bool DfaConstraint::allows(int32_t token) const {
  return automaton_->after(state_, token) != ByteDfa::kDead;
}

bool DfaConstraint::advance(int32_t token) {
  const int32_t s = automaton_->after(state_, token);
  if (s == ByteDfa::kDead) return false;
  state_ = s;
  return true;
}

bool DfaConstraint::is_complete() const {
  if (!can_end()) return false;
  if (!automaton_->dfa().has_next(state_)) return true;
  std::vector<uint32_t> bits(automaton_->mask_words());
  return !automaton_->mask(state_, bits.data());
}

}  // namespace clshard::structured
