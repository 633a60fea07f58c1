// A per-request constraint on the tokens a request may generate (structured output): an automaton
// over token ids that the engine asks, before each sampled position, which tokens may come next,
// and tells which token was kept. The engine turns the answer into the packed bitmask the sampler
// and the speculative acceptance take (runtime/engine/sampling.h, acceptance.h).
//
// End of generation: the constraint says nothing about EOS ids (they belong to the model). The
// engine allows its EOS ids exactly when can_end() holds, and ends a request by itself (reason
// Stop, no EOS token) as soon as is_complete() holds: the output is finished and no token may
// follow it.
//
// A constraint never leads to a dead end: after any allowed token, either some token is allowed
// or can_end() holds (the implementations prune states that cannot reach an accepting one).
#pragma once

#include <cstdint>
#include <memory>

namespace clshard {

class TokenConstraint {
 public:
  virtual ~TokenConstraint() = default;

  // Writes bitmask_words(vocab) words (runtime/engine/sampling.h's packing: bit i % 32 of word
  // i / 32 set = token i allowed next). Token ids at or beyond the constraint's own vocabulary
  // (a model may pad its embedding table past the tokenizer's) are never allowed; EOS ids are not
  // set (the engine adds them when can_end()).
  virtual void allowed_tokens(uint32_t* bits, uint32_t vocab) const = 0;
  // Whether `token` may come next (the same answer as its bit in allowed_tokens).
  virtual bool allows(int32_t token) const = 0;
  // Moves past `token`. Returns false, and leaves the state unchanged, when the token is not
  // allowed.
  virtual bool advance(int32_t token) = 0;
  // The output so far is complete (an EOS may come now).
  virtual bool can_end() const = 0;
  // The output is complete and nothing may follow it.
  virtual bool is_complete() const = 0;
  // An independent copy in the same state (speculative decoding walks copies through drafts).
  virtual std::unique_ptr<TokenConstraint> clone() const = 0;
};

}  // namespace clshard
