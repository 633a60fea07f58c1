// Speculative-decoding acceptance on the device that holds the target's verification logits, for
// a whole batch in one kernel launch (issue 14; shared/design/max-reference.md §5.3 and §7).
//
// Request b brings num_drafts[b] = K draft tokens d_0..d_{K-1} and K + 1 rows of target logits:
// row i < K is the target's prediction at the position of d_i, row K the one after the last draft
// (the bonus position). Position i draws with step seed step_seeds[b] + i, the seed plain decoding
// would use there, and the request's bitmask row for that position when a bitmask is given. The
// drafts are verified in order; the first rejection ends the request's step:
//   num_accepted[b] = the accepted prefix length (0..K),
//   next_token[b]   = the token at the first rejected position, or the bonus when all K passed.
// The caller commits d_0..d_{num_accepted-1} and then next_token.
//
// Strict rows (the default). Position i computes t_i, the token sample_tokens draws from row i with
// the same parameters, seed and bitmask row: the same kernel code (kernels_cl/sampling.cl), so
// bitwise the same token. d_i is accepted iff d_i == t_i; otherwise t_i is the next token.
//   * greedy (temperature 0 or top_k 1): t_i = argmax (ties to the lowest id), so a draft is
//     accepted while it is the argmax and the next token is the argmax of the first rejected row
//     (or of the bonus row);
//   * stochastic: let p be the filtered, tempered distribution plain sampling draws from
//     (temperature, min-p, top-k, top-p, bitmask; sampling.h). This is exact rejection sampling for
//     a point-mass draft: P(accept d) = P(t = d) = p(d), and given a rejection t is distributed as
//     p(y) / (1 - p(d)) for y != d, i.e. p with d removed and renormalised; when all drafts are
//     accepted the bonus is t_K, sample_tokens' draw at that row with that seed. Coupling the
//     accept test to the sampler's own draw, instead of flipping a separate coin u < p(d) and then
//     drawing from the residual, gives the same acceptance rate and the same output distribution,
//     needs no p(d) (under top-p that needs the nucleus mass the sampler never computes), makes a
//     seeded speculative run commit exactly the tokens plain sampling with the same seeds commits
//     (up to the rounding of the logits themselves), and stays exact even when the draft came from
//     the same random stream. The committed token at every position is distributed as p there, so
//     K positions commit tokens distributed as the product of the target's conditionals.
//   * a token the bitmask disallows (or with a NaN/-inf logit) has p = 0: it is never accepted and
//     never drawn.
//   MAX's stochastic sampler (rejection_sampler.py) accepts with u < p(d) where p is only the
//   tempered softmax (no top-k/top-p/min-p), and draws the recovered token from that full p, d
//   included; the committed token then has P(d) = p(d) + (1 - p(d)) p(d), which over-weights the
//   draft, and the unfiltered verification changes the distribution against plain sampling too.
//   clshard does not copy either.
//
// Relaxed rows (thinking[b] set, for requests inside a thinking block; MAX's relaxed acceptance):
// with P = softmax of the untempered logits over the allowed tokens, d_i is accepted iff it is
// allowed, fewer than relaxed.top_k allowed tokens rank above it (logit descending, ties to the
// lower id) and P(d_i) >= P(top-1) - relaxed.delta; at the first rejection the next token is the
// argmax. The bonus (all drafts accepted) is drawn by the strict rule, as sample_tokens would.
#pragma once

#include <cstdint>
#include <vector>

#include "runtime/cl.h"
#include "runtime/engine/sampling.h"

namespace clshard {

class Device;

struct RelaxedAcceptance {  // MAX's relaxed acceptance for rows in a thinking block
  uint32_t top_k = 10;      // the draft must be among the top_k tokens of the untempered softmax
  float delta = 0.6f;       // and have probability >= p(top-1) - delta
};

struct AcceptanceResult {
  std::vector<uint32_t> num_accepted;  // [B] drafts accepted (prefix length), 0..num_drafts[b]
  std::vector<int32_t> next_token;     // [B] recovered token at the first rejection, or the bonus
                                       // token when all were accepted
};

// logits: f32 [sum_b (num_drafts[b] + 1), vocab] on dev; request b's verification rows are
// logit_offsets[b] .. logit_offsets[b+1]-1 (= num_drafts[b] + 1 rows): row i (< num_drafts[b])
// verifies drafts[draft_offsets[b] + i]; the last row is the bonus position. B = params.size();
// both offset vectors have B + 1 entries, nondecreasing, draft_offsets[B] == drafts.size().
// params/step_seeds as sample_tokens (step_seeds[b] = the seed plain sampling would use at the
// first verified position; position i uses step_seeds[b] + i).
// thinking[b]: use relaxed acceptance for this request (empty vector = none).
// bitmask: optional packed int32 [logit rows, bitmask_words(vocab)], applied at every verified
// position (its rows are indexed like the logits rows).
// One kernel launch, one work-item per request; rows after a request's first rejection are not
// read. Scratch: B x (vocab + vocab/16) floats unless every request is greedy. Throws
// std::invalid_argument naming the bad size or field (a draft outside the vocabulary included),
// and std::runtime_error naming the request when a row it reaches allows no token at all. One call
// at a time per device (the cached kernel's arguments are shared).
AcceptanceResult accept_drafts(
    Device& dev, const cl::Mem& logits, uint32_t vocab, const std::vector<uint32_t>& logit_offsets,
    const std::vector<int32_t>& drafts, const std::vector<uint32_t>& draft_offsets,
    const std::vector<SamplingParams>& params, const std::vector<uint64_t>& step_seeds,
    const std::vector<uint8_t>& thinking = {}, const RelaxedAcceptance& relaxed = {},
    const cl::Mem* bitmask = nullptr);

// Host reference of the same rule (tests, docs), on host logits [rows, vocab] and an optional host
// bitmask [rows, bitmask_words(vocab)] (empty = none). Strict positions draw with
// sample_reference, so the results agree with the kernel except where exp() differs by an ulp at a
// decision boundary; relaxed probabilities are summed in double. Same errors as accept_drafts.
AcceptanceResult accept_drafts_reference(
    const std::vector<float>& logits, uint32_t vocab, const std::vector<uint32_t>& logit_offsets,
    const std::vector<int32_t>& drafts, const std::vector<uint32_t>& draft_offsets,
    const std::vector<SamplingParams>& params, const std::vector<uint64_t>& step_seeds,
    const std::vector<uint8_t>& thinking = {}, const RelaxedAcceptance& relaxed = {},
    const std::vector<uint32_t>& bitmask = {});

}  // namespace clshard
