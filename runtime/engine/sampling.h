// Token sampling on the device that holds the logits, for a whole batch in one kernel launch, with
// MAX's semantics (shared/design/max-reference.md §7): temperature, top-k, top-p within the
// top-k, min-p, a per-row per-step seed, and an optional structured-output bitmask.
//
// What a row samples from, in this order:
//   * allowed tokens: bitmask bit set (when a bitmask is given) and a logit that is not NaN or
//     -inf (+inf counts as the largest float);
//   * temperature 0 or top_k 1: the argmax (ties to the lowest id); no randomness;
//   * otherwise w_i = exp((l_i - l_max) / max(T, 1e-6)), so the best token has w = 1;
//   * min_p: drop tokens with w < min_p (p_i < min_p * p_max);
//   * top_k (> 0 and below the allowed count): keep the k best;
//   * top_p (< 1): keep the smallest prefix of the remaining tokens, best first, whose mass is
//     >= top_p of their total (min_p before top_p, as vLLM; MAX has no combined min-p path);
//   * draw from the kept tokens in proportion to w.
// "Best first" is by logit descending with ties to the lower id, everywhere (top-k and top-p cut
// through ties deterministically).
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include "runtime/cl.h"

namespace clshard {

class Device;

struct SamplingParams {
  float temperature = 1.0f;  // >= 0; 0 = greedy
  int32_t top_k = -1;        // -1 or 0 = whole vocabulary
  float top_p = 1.0f;        // (0, 1]
  float min_p = 0.0f;        // [0, 1]
  uint64_t seed = 0;         // per request; each step samples with step_seed(...)
  // (max_tokens, stop ids/strings live in the request, not here)
};

// Throws std::invalid_argument naming the first bad field (negative or NaN temperature, top_k
// below -1, top_p outside (0, 1], min_p outside [0, 1]).
void validate_sampling_params(const SamplingParams& p);

// The seed a request samples its next token with (MAX: request seed + tokens in the context), so
// its output does not depend on what else is in the batch.
inline uint64_t step_seed(const SamplingParams& p, uint64_t tokens_in_context) {
  return p.seed + tokens_in_context;
}

// 32-bit words per row of a packed bitmask: bit (i % 32) of word i / 32 set = token i allowed.
inline uint32_t bitmask_words(uint32_t vocab) { return (vocab + 31) / 32; }

// Samples one token per row of `logits` (f32 [rows, vocab] on `dev`) in one kernel launch and
// returns the ids. Row r draws with step_seeds[r] only (params[r].seed is not read: the caller
// folds it into the step seed). `bitmask`, when given, is packed int32 [rows, bitmask_words(V)].
// The logits and the bitmask are not modified; unless every row is greedy, a pooled scratch of
// rows x (vocab + vocab/16) floats holds the kept masses (35 MB at 64 x 128256). Throws
// std::invalid_argument for bad parameters or sizes, and std::runtime_error naming the row when a
// row allows no token at all. One call at a time per device: the cached kernel's arguments are
// shared.
std::vector<int32_t> sample_tokens(Device& dev, const cl::Mem& logits, uint32_t rows,
                                   uint32_t vocab, const std::vector<SamplingParams>& params,
                                   const std::vector<uint64_t>& step_seeds,
                                   const cl::Mem* bitmask = nullptr);

// ---- host references (tests, and a CPU fallback) ------------------------------------------------

// The filtered, renormalised distribution a row is drawn from ([vocab], zeros outside the kept
// set), computed by sorting. `allowed_bits` is the row's packed bitmask or null. Throws
// std::invalid_argument when no token is allowed.
std::vector<float> sampling_distribution(const float* logits, uint32_t vocab,
                                         const SamplingParams& p,
                                         const uint32_t* allowed_bits = nullptr);

// The token the device kernel draws for this row, by the kernel's own algorithm and float
// arithmetic order on the host; the results agree except where the device's exp() differs from
// the host's by an ulp right at a decision boundary. -1 when no token is allowed.
int32_t sample_reference(const float* logits, uint32_t vocab, const SamplingParams& p,
                         uint64_t step_seed, const uint32_t* allowed_bits = nullptr);

// The order every filter and tie follows, as the kernels compute it: a larger rank is a better
// token (logit descending, +inf as the largest float, -0 below +0, ties to the lower id).
uint64_t token_rank(const float* logits, uint32_t i);

// Whether token i may be drawn at all: its bit set in `allowed_bits` (when given) and a logit that
// is neither NaN nor -inf.
bool token_allowed(const float* logits, const uint32_t* allowed_bits, uint32_t i);

// Philox4x32-10 (Random123), the generator behind every draw: draw number n of a row uses
// counter {n, 0, 0, 0} and key {seed low, seed high}, and the top 24 bits of word 0.
std::array<uint32_t, 4> philox4x32_10(std::array<uint32_t, 4> counter,
                                      std::array<uint32_t, 2> key);

}  // namespace clshard
