// Serving's warm-up: before `clshard serve` says it is ready, a few synthetic requests take a step
// of every shape class a client's requests fall into, so the kernels those shapes pick are built
// (or read from the kernel cache) and launched once before any client waits on them.
//
// Why: kernels are specialised by a step's rows and query length (tiles of 1 / 4 / 8 rows; GEMV,
// batch and packed GEMMs; the MoE tiers; decode or prefill attention; MLA's absorbed decode tiles
// of min(T, 4) tokens: every boundary is 2, 3 or a power of two up to 128), and each variant is
// built on first use. On a machine with an empty kernel cache (a new container, a new driver)
// the first requests after "ready" waited for those builds: llama3-1b bf16 on the 2-core EPYC,
// 10.6 s for a first 5-token prompt (0.63 s warm), 6.1 s for the first 300-token one, 2.6 s for
// the first with penalties and logprobs.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "runtime/engine/engine.h"
#include "runtime/engine/scheduler.h"

namespace clshard {

// The longest warm-up prompt: the last step-row boundary of any kernel choice (the packed GEMMs'
// default gemm_bf16_packed_rows).
inline constexpr uint32_t kWarmUpMaxPrompt = 128;

struct WarmUpPlan {
  // For each, one request per replica alone: a prefill step of that many rows.
  std::vector<uint32_t> prompt_lengths;
  // For each, that many one-token requests per replica together, greedy and sampled rows (the
  // API's defaults, and every sampling feature at once: top-k, top-p, min-p, penalties,
  // logprobs): a step of that many rows that each sample, as a decode step of that batch.
  std::vector<uint32_t> batch_sizes;
  // Tokens each request keeps: 1, or 2 with a draft (the second from a verifying step).
  uint32_t new_tokens = 1;
  // "prompts of 1-128 tokens, batches of 2-32 requests"
  std::string describe() const;
};

// 1, 2, 3, then powers of two: prompts up to kWarmUpMaxPrompt tokens, batches from 2 up to
// max_batch_size rows, within what the limits admit as one step (max_batch_input_tokens,
// max_length, the replica's KV pages).
WarmUpPlan plan_warm_up(const SchedulerLimits& limits);

struct WarmUpResult {
  uint32_t requests = 0;
  uint64_t steps = 0;
  double seconds = 0;
};

// Runs the plan on an idle engine (nothing submitted), then zeroes its stats so that what it
// reports counts clients' requests only. The requests are seeded, so nothing a client gets
// depends on whether the warm-up ran; with prefix caching, their pages stay published like any
// finished request's (their prompts are synthetic token runs). Throws std::runtime_error naming
// the request when one of them fails.
WarmUpResult warm_up(Engine& engine, const WarmUpPlan& plan);

}  // namespace clshard
