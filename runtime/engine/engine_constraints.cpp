// The engine's side of structured output: the bitmask rows a step samples and verifies under
// (runtime/engine/constraint.h).
#include <algorithm>

#include "runtime/engine/engine.h"

namespace clshard {

void Engine::constraint_row(const TokenConstraint& c, uint32_t vocab, uint32_t* row) const {
  c.allowed_tokens(row, vocab);
  if (c.can_end())
    for (int32_t e : eos_ids_)
      if (e >= 0 && uint32_t(e) < vocab) row[uint32_t(e) >> 5] |= 1u << (uint32_t(e) & 31);
}

bool Engine::constraint_masks(const std::vector<const TokenConstraint*>& row_constraint,
                              uint32_t vocab, std::vector<uint32_t>& bits) const {
  if (std::none_of(row_constraint.begin(), row_constraint.end(),
                   [](const TokenConstraint* c) { return c != nullptr; }))
    return false;
  const uint32_t words = bitmask_words(vocab);
  bits.assign(row_constraint.size() * words, ~0u);
  for (size_t r = 0; r < row_constraint.size(); ++r)
    if (row_constraint[r]) constraint_row(*row_constraint[r], vocab, bits.data() + r * words);
  return true;
}

}  // namespace clshard

namespace clshard {

bool Engine::draft_masks(const std::vector<const TokenConstraint*>& constraints,
                         const std::vector<uint32_t>& logit_offsets,
                         const std::vector<int32_t>& drafts,
                         const std::vector<uint32_t>& draft_offsets, uint32_t rows,
                         uint32_t vocab, std::vector<uint32_t>& bits) const {
  if (std::none_of(constraints.begin(), constraints.end(),
                   [](const TokenConstraint* c) { return c != nullptr; }))
    return false;
  const uint32_t words = bitmask_words(vocab);
  bits.assign(size_t(rows) * words, ~0u);
  for (size_t s = 0; s < constraints.size(); ++s) {
    if (!constraints[s]) continue;
    std::unique_ptr<TokenConstraint> c = constraints[s]->clone();
    const uint32_t first = logit_offsets[s];
    const uint32_t count = draft_offsets[s + 1] - draft_offsets[s] + 1;
    bool walking = true;  // the drafts so far are all allowed (and none was an EOS)
    for (uint32_t i = 0; i < count; ++i) {
      uint32_t* row = bits.data() + size_t(first + i) * words;
      if (walking) {
        constraint_row(*c, vocab, row);
      } else {
        std::copy(row - words, row, row);
      }
      if (walking && i + 1 < count) {
        const int32_t d = drafts[draft_offsets[s] + i];
        walking = c->advance(d);  // an EOS or refused draft: later rows are repeats
      }
    }
  }
  return true;
}

}  // namespace clshard
