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
  // Penalties (apply_penalties), applied before temperature and the filters:
  float frequency_penalty = 0.0f;   // [-2, 2], OpenAI: per time a token was generated
  float presence_penalty = 0.0f;    // [-2, 2], OpenAI: once for a token generated at all
  float repetition_penalty = 1.0f;  // > 0, HF: tokens in the prompt or generated; 1 = off
  // Log-probabilities of each kept token (compute_logprobs): the sampled one, and the top n.
  bool logprobs = false;
  int32_t top_logprobs = 0;  // [0, kMaxTopLogprobs]; > 0 needs logprobs
  // (max_tokens, stop ids/strings live in the request, not here)

  bool has_penalties() const {
    return frequency_penalty != 0.0f || presence_penalty != 0.0f || repetition_penalty != 1.0f;
  }
};

// The most top_logprobs a request may ask for (OpenAI's limit).
inline constexpr int32_t kMaxTopLogprobs = 20;

// Throws std::invalid_argument naming the first bad field (negative or NaN temperature, top_k
// below -1, top_p outside (0, 1], min_p outside [0, 1], a penalty outside [-2, 2] or a
// repetition_penalty <= 0, top_logprobs outside [0, 20] or without logprobs).
void validate_sampling_params(const SamplingParams& p);

// The seed a request samples its next token with (MAX: request seed + tokens in the context), so
// its output does not depend on what else is in the batch.
inline uint64_t step_seed(const SamplingParams& p, uint64_t tokens_in_context) {
  return p.seed + tokens_in_context;
}

// The seed of choice i of a request asking for n > 1 completions: choice 0 is the request's own
// seed, so n = 1 and a single request agree. Not seed + i: step_seed adds the context length, so
// choice 1 would replay choice 0's draws one token later; the choices' step seeds stay apart for
// contexts below 2^32 tokens.
inline uint64_t choice_seed(uint64_t seed, uint32_t choice) {
  return seed + (uint64_t(choice) << 32);
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

// ---- penalties ----------------------------------------------------------------------------------
//
// With g = the times the request generated token t so far and seen = (t in the prompt or g > 0),
// as vLLM applies them (repetition first):
//   l = seen ? (l > 0 ? l / repetition : l * repetition) : l
//   l = l - frequency * g - (g > 0 ? presence : 0)
// The counts live on the device, one uint32 per vocabulary entry in a slot per request (low 31
// bits: g; top bit: in the prompt). A dense slot rather than a sparse (token, count) list: the
// update is one atomic increment per committed token with no search, the apply pass is a streaming
// pass of 16-wide loads that costs about what reading the logits costs, and the memory (vocab x 4
// bytes per running request that asks for penalties: 0.5 MB at 128k) is small next to its KV pages.

// The device-side token counts of the requests that use penalties, one slot each.
class PenaltyCounts {
 public:
  PenaltyCounts(Device& dev, uint32_t vocab);
  // A zeroed slot with the prompt's tokens marked (one small upload); grows the buffer when full.
  uint32_t acquire(const std::vector<int32_t>& prompt);
  void release(uint32_t slot);
  // Counts the tokens committed in a step: (slot, token) pairs, one launch.
  void add(const std::vector<std::pair<uint32_t, int32_t>>& slot_tokens);
  const cl::Mem& counts() const { return counts_; }
  Device& device() const { return *dev_; }
  uint32_t vocab() const { return vocab_; }
  uint32_t slots_in_use() const;

 private:
  Device* dev_;
  uint32_t vocab_;
  cl::Mem counts_;
  std::vector<bool> used_;
};

// A logits row to penalise: the request's params, its counts slot, and tokens to count on top
// of the slot (a verified draft run: the drafts before this position).
struct PenaltyRow {
  uint32_t row = 0;
  uint32_t slot = 0;
  SamplingParams params;
  std::vector<int32_t> extra_tokens;
};

// Writes the penalised rows of `src` (f32 [rows, vocab]) into `dst` (the same buffer: in place).
// Out of place (dst != src), the rows not listed are copied unchanged. One launch.
void apply_penalties(const PenaltyCounts& counts, const cl::Mem& src, const cl::Mem& dst,
                     uint32_t rows, const std::vector<PenaltyRow>& penalised);

// ---- log-probabilities --------------------------------------------------------------------------

struct TokenLogprob {
  int32_t token = -1;
  float logprob = 0.0f;
};
// The log-probability of a kept token and the top_logprobs best tokens of its row (best first:
// logit descending, ties to the lower id).
struct TokenLogprobs {
  int32_t token = -1;
  float logprob = 0.0f;
  std::vector<TokenLogprob> top;
};

// Which distribution logprobs describe: the model's own (log_softmax of the raw logits; vLLM's
// default raw_logprobs), or the processed one: log_softmax((penalised logits) / T) (T = 0 reads
// as 1) over the bitmask's allowed tokens; top-k/top-p/min-p do not enter either.
enum class LogprobsMode { Raw, Processed };

struct LogprobRow {
  uint32_t row = 0;        // logits row
  int32_t token = -1;      // the token kept there
  uint32_t top_n = 0;      // [0, kMaxTopLogprobs]
  float inv_temperature = 1.0f;
  bool use_bitmask = false;
};

// Log-probabilities for the listed rows of `logits` (f32 [rows, vocab] on dev), one work-item per
// listed row: a max pass that keeps the top n, a log-sum-exp pass. A token with a -inf or NaN logit
// (or outside the bitmask) gets -inf. `bitmask` as sample_tokens, read only for use_bitmask rows.
std::vector<TokenLogprobs> compute_logprobs(Device& dev, const cl::Mem& logits, uint32_t vocab,
                                            const std::vector<LogprobRow>& rows,
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
