#include "runtime/engine/warm_up.h"

#include <algorithm>
#include <chrono>
#include <functional>
#include <stdexcept>

namespace clshard {

namespace {

// Whether `rows` requests of `prompt` tokens, each keeping `new_tokens`, run as one prefill step
// and fit the replica's pages together to their last token (with the draft's lookahead).
bool fits(const SchedulerLimits& l, uint32_t prompt, uint32_t rows, uint32_t new_tokens) {
  const uint64_t positions = uint64_t(prompt) + new_tokens + l.num_speculative_tokens;
  const uint64_t pages = (positions + l.page_size - 1) / l.page_size;
  return rows <= l.max_batch_size && uint64_t(prompt) * rows <= l.max_batch_input_tokens &&
         prompt + new_tokens <= l.max_length && pages * rows <= l.total_pages;
}

// The sizes to take: 1, 2 and 3 (mla.cl's absorbed decode tiles min(T, 4) tokens, so each of
// them has a variant of its own), then the powers of two from 4 up to `most`.
std::vector<uint32_t> sizes_up_to(uint32_t first, uint32_t most,
                                  const std::function<bool(uint32_t)>& ok) {
  std::vector<uint32_t> v;
  for (uint32_t n = first; n <= most && ok(n); n = n < 4 ? n + 1 : n * 2) v.push_back(n);
  return v;
}

std::string span(const std::vector<uint32_t>& v) {
  if (v.size() == 1) return std::to_string(v.front());
  return std::to_string(v.front()) + "-" + std::to_string(v.back());
}

// Row r of a batch: greedy, the API's default sampling, or every sampling feature at once.
SamplingParams batch_row_sampling(uint32_t r) {
  SamplingParams p;
  p.seed = 1 + r;
  if (r % 3 == 0) {
    p.temperature = 0.0f;
  } else if (r % 3 == 2) {
    p.temperature = 0.8f;
    p.top_k = 40;
    p.top_p = 0.9f;
    p.min_p = 0.05f;
    p.frequency_penalty = 0.1f;
    p.presence_penalty = 0.1f;
    p.repetition_penalty = 1.1f;
    p.logprobs = true;
    p.top_logprobs = 2;
  }
  return p;
}

}  // namespace

std::string WarmUpPlan::describe() const {
  std::string s;
  if (!prompt_lengths.empty()) s = "prompts of " + span(prompt_lengths) + " tokens";
  if (!batch_sizes.empty())
    s += (s.empty() ? "" : ", ") + std::string("batches of ") + span(batch_sizes) + " requests";
  return s.empty() ? "nothing (the limits admit no request)" : s;
}

WarmUpPlan plan_warm_up(const SchedulerLimits& limits) {
  WarmUpPlan plan;
  // A plain step's first token ends the request; a speculative one's second comes from the
  // step that verifies the draft's tokens.
  plan.new_tokens = limits.num_speculative_tokens > 0 ? 2 : 1;
  plan.prompt_lengths = sizes_up_to(1, kWarmUpMaxPrompt, [&](uint32_t n) {
    return fits(limits, n, 1, plan.new_tokens);
  });
  plan.batch_sizes = sizes_up_to(2, limits.max_batch_size, [&](uint32_t b) {
    return fits(limits, 1, b, plan.new_tokens);
  });
  return plan;
}

WarmUpResult warm_up(Engine& engine, const WarmUpPlan& plan) {
  if (engine.has_work())
    throw std::logic_error("warm_up: the engine already has requests; it warms an idle one");
  const auto start = std::chrono::steady_clock::now();
  const uint32_t vocab = engine.vocab_size();
  const uint32_t replicas = uint32_t(engine.num_replicas());
  WarmUpResult result;
  // Distinct first tokens, so no request's pages match another's prefix.
  auto submit = [&](uint32_t prompt_len, SamplingParams sampling) {
    GenerationRequest req;
    for (uint32_t i = 0; i < prompt_len; ++i)
      req.prompt.push_back(int32_t((result.requests + 1 + uint64_t(i) * 17) % vocab));
    req.sampling = sampling;
    req.max_tokens = plan.new_tokens;
    req.ignore_eos = true;
    engine.submit(std::move(req));
    ++result.requests;
  };
  // Every request ends after plan.new_tokens tokens, within a step per prompt chunk and per token; the
  // bound only turns an engine bug into an error instead of a server that never gets ready.
  auto run = [&](const std::string& what, uint64_t max_steps) {
    for (uint64_t s = 0; engine.has_work(); ++s) {
      if (s == max_steps)
        throw std::runtime_error("warm-up: " + what + " still running after " +
                                 std::to_string(max_steps) + " steps");
      for (const GenerationResult& r : engine.step())
        if (r.reason == EndReason::Error)
          throw std::runtime_error("warm-up: " + what + " failed: " + r.error);
      ++result.steps;
    }
  };
  for (uint32_t n : plan.prompt_lengths) {
    SamplingParams greedy;
    greedy.temperature = 0.0f;
    for (uint32_t r = 0; r < replicas; ++r) submit(n, greedy);
    run("a prompt of " + std::to_string(n) + " tokens", 16 + 4 * plan.new_tokens);
  }
  for (uint32_t b : plan.batch_sizes) {
    for (uint32_t r = 0; r < replicas * b; ++r) submit(1, batch_row_sampling(r));
    run("a batch of " + std::to_string(b) + " requests", 16 + 4 * plan.new_tokens * b);
  }
  engine.reset_stats();
  result.seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return result;
}

}  // namespace clshard
