// Penalties and log-probabilities through the engine, on the tiny Llama checkpoint (plain decoding)
// and the trained DeepSeek-V3 + MTP checkpoint (speculative decoding): the tokens and logprobs
// equal a host computation from the model's own all-position logits (`clshard logits`).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <set>

#include "models/registry.h"
#include "runtime/device.h"
#include "runtime/engine/engine.h"
#include "runtime/engine/generation.h"
#include "tests/test_util.h"

namespace clshard {
namespace {

// The engine's logprobs against log_softmax of the all-position logits (a separate ragged forward
// pass, so rounding differs a little).
constexpr double kLogprobTolerance = 1e-4;

std::unique_ptr<CausalLM> tiny_model() {
  return load_model(test::reference_dir() / "ckpt" / "llama3-tiny-f32",
                    LoadOptions{{&test::default_device()}, std::nullopt});
}

SchedulerLimits limits() {
  SchedulerLimits lim;
  lim.max_batch_size = 8;
  lim.max_batch_input_tokens = 64;
  lim.page_size = 16;
  lim.total_pages = 64;
  lim.max_length = 512;
  return lim;
}

std::vector<int32_t> prompt(int i) {
  std::vector<int32_t> t;
  for (int j = 0; j < 4 + 5 * i; ++j) t.push_back((i * 37 + j * 11) % 500 + 1);
  return t;
}

std::vector<GenerationResult> run_all(Engine& engine, const std::vector<GenerationRequest>& reqs,
                                      std::vector<TokenEvent>* events = nullptr) {
  std::map<uint64_t, std::vector<TokenLogprobs>> streamed;
  engine.on_token([&](const TokenEvent& e) {
    if (events) events->push_back(e);
    if (e.logprobs) streamed[e.handle].push_back(*e.logprobs);
  });
  std::vector<uint64_t> handles;
  for (const auto& r : reqs) handles.push_back(engine.submit(r));
  std::map<uint64_t, GenerationResult> by;
  while (engine.has_work())
    for (auto& r : engine.step()) by[r.handle] = r;
  std::vector<GenerationResult> out;
  for (uint64_t h : handles) {
    out.push_back(by.at(h));
    // What streamed is what the result holds.
    const auto& s = streamed[h];
    EXPECT_EQ(s.size(), out.back().logprobs.size());
    for (size_t k = 0; k < std::min(s.size(), out.back().logprobs.size()); ++k)
      EXPECT_EQ(s[k].logprob, out.back().logprobs[k].logprob);
  }
  return out;
}

std::vector<GenerationResult> run_tiny(CausalLM& model,
                                       const std::vector<GenerationRequest>& reqs) {
  const SchedulerLimits lim = limits();
  model.allocate_kv_cache(lim.total_pages, lim.page_size);
  Engine engine(model, nullptr, lim);
  return run_all(engine, reqs);
}

GenerationRequest greedy(const std::vector<int32_t>& p, uint32_t n) {
  GenerationRequest r;
  r.prompt = p;
  r.sampling.temperature = 0;
  r.max_tokens = n;
  return r;
}

std::vector<double> log_softmax(const float* row, uint32_t vocab) {
  double m = -INFINITY, z = 0;
  for (uint32_t i = 0; i < vocab; ++i) m = std::max(m, double(row[i]));
  for (uint32_t i = 0; i < vocab; ++i) z += std::exp(double(row[i]) - m);
  std::vector<double> out(vocab);
  for (uint32_t i = 0; i < vocab; ++i) out[i] = double(row[i]) - m - std::log(z);
  return out;
}

bool has_repeat(const std::vector<int32_t>& t) {
  return std::set<int32_t>(t.begin(), t.end()).size() != t.size();
}

TEST(EnginePenalties, GreedyWithPenaltiesEqualsTheHostRuleOnTheModelsLogits) {
  auto model = tiny_model();
  const uint32_t vocab = model->info().vocab_size;
  const uint32_t n_new = 24;
  // Without penalties the tiny model repeats itself within 24 tokens on these prompts...
  std::vector<GenerationRequest> plain = {greedy(prompt(1), n_new), greedy(prompt(4), n_new)};
  const auto free_run = run_tiny(*model, plain);
  for (const auto& r : free_run) ASSERT_TRUE(has_repeat(r.token_ids)) << "pick other prompts";
  // ...with the largest presence penalty it never does (and the two requests run together with
  // one that asks for none, which must stay unpenalised).
  std::vector<GenerationRequest> reqs = plain;
  for (auto& r : reqs) r.sampling.presence_penalty = 2.0f;
  GenerationRequest rep = greedy(prompt(2), 12);
  rep.sampling.repetition_penalty = 1.8f;
  rep.sampling.frequency_penalty = 0.3f;
  reqs.push_back(rep);
  reqs.push_back(plain[0]);
  const auto got = run_tiny(*model, reqs);
  EXPECT_FALSE(has_repeat(got[0].token_ids));
  EXPECT_FALSE(has_repeat(got[1].token_ids));
  EXPECT_EQ(got[3].token_ids, free_run[0].token_ids);
  // Every token is the argmax of the model's logits at its position, penalised on the host in
  // double by the rule of sampling.h from the prompt and the tokens before it.
  for (size_t q = 0; q < 3; ++q) {
    SCOPED_TRACE(q);
    std::vector<int32_t> seq = reqs[q].prompt;
    seq.insert(seq.end(), got[q].token_ids.begin(), got[q].token_ids.end());
    const auto logits = all_position_logits(*model, {seq})[0];
    const SamplingParams& p = reqs[q].sampling;
    for (size_t k = 0; k < got[q].token_ids.size(); ++k) {
      const size_t pos = reqs[q].prompt.size() - 1 + k;
      std::map<int32_t, int> generated;
      for (size_t j = 0; j < k; ++j) ++generated[got[q].token_ids[j]];
      const std::set<int32_t> in_prompt(reqs[q].prompt.begin(), reqs[q].prompt.end());
      int32_t best = -1;
      double best_l = -INFINITY;
      for (uint32_t t = 0; t < vocab; ++t) {
        double l = logits[pos * vocab + t];
        const int g = generated.count(int32_t(t)) ? generated[int32_t(t)] : 0;
        if (g > 0 || in_prompt.count(int32_t(t)))
          l = l > 0 ? l / p.repetition_penalty : l * p.repetition_penalty;
        l -= double(p.frequency_penalty) * g + (g > 0 ? double(p.presence_penalty) : 0.0);
        if (l > best_l) best_l = l, best = int32_t(t);
      }
      EXPECT_EQ(got[q].token_ids[k], best) << "token " << k;
    }
  }
}

TEST(EngineLogprobs, GreedyLogprobsAreTheRowMaximumAndEqualTheModelsLogSoftmax) {
  auto model = tiny_model();
  const uint32_t vocab = model->info().vocab_size;
  std::vector<GenerationRequest> reqs;
  for (int i = 0; i < 3; ++i) {
    GenerationRequest r = greedy(prompt(i), 10);
    r.sampling.logprobs = true;
    r.sampling.top_logprobs = i == 0 ? 0 : 5;
    reqs.push_back(r);
  }
  // Raw logprobs are before penalties and temperature: a penalised request reports the model's
  // own distribution at each position.
  reqs[2].sampling.presence_penalty = 1.5f;
  reqs.push_back(greedy(prompt(3), 6));  // asks for none
  const auto got = run_tiny(*model, reqs);
  EXPECT_TRUE(got[3].logprobs.empty());
  for (size_t q = 0; q < 3; ++q) {
    SCOPED_TRACE(q);
    ASSERT_EQ(got[q].logprobs.size(), got[q].token_ids.size());
    std::vector<int32_t> seq = reqs[q].prompt;
    seq.insert(seq.end(), got[q].token_ids.begin(), got[q].token_ids.end());
    const auto logits = all_position_logits(*model, {seq})[0];
    for (size_t k = 0; k < got[q].token_ids.size(); ++k) {
      const TokenLogprobs& lp = got[q].logprobs[k];
      const auto ref = log_softmax(&logits[(reqs[q].prompt.size() - 1 + k) * vocab], vocab);
      EXPECT_EQ(lp.token, got[q].token_ids[k]);
      EXPECT_NEAR(lp.logprob, ref[size_t(lp.token)], kLogprobTolerance) << "token " << k;
      ASSERT_EQ(lp.top.size(), size_t(reqs[q].sampling.top_logprobs));
      for (size_t j = 0; j < lp.top.size(); ++j)
        EXPECT_NEAR(lp.top[j].logprob, ref[size_t(lp.top[j].token)], kLogprobTolerance);
      if (q < 2 && !lp.top.empty()) {
        // Greedy without penalties: the sampled token is the row's best.
        EXPECT_EQ(lp.top[0].token, lp.token) << "token " << k;
        EXPECT_EQ(lp.top[0].logprob, lp.logprob);
        EXPECT_NEAR(lp.logprob, *std::max_element(ref.begin(), ref.end()), kLogprobTolerance);
      }
    }
  }
}

TEST(EngineLogprobs, ProcessedModeDescribesThePenalisedTemperedDistribution) {
  auto model = tiny_model();
  const uint32_t vocab = model->info().vocab_size;
  GenerationRequest r = greedy(prompt(2), 6);
  r.sampling.temperature = 0.5f;
  r.sampling.top_k = 1;  // greedy draws, tempered logprobs
  r.sampling.frequency_penalty = 1.0f;
  r.sampling.logprobs = true;
  r.sampling.top_logprobs = 3;
  const SchedulerLimits lim = limits();
  model->allocate_kv_cache(lim.total_pages, lim.page_size);
  Engine engine(*model, nullptr, lim);
  engine.set_logprobs_mode(LogprobsMode::Processed);
  const auto got = run_all(engine, {r})[0];
  std::vector<int32_t> seq = r.prompt;
  seq.insert(seq.end(), got.token_ids.begin(), got.token_ids.end());
  const auto logits = all_position_logits(*model, {seq})[0];
  for (size_t k = 0; k < got.token_ids.size(); ++k) {
    std::vector<float> row(&logits[(r.prompt.size() - 1 + k) * vocab],
                           &logits[(r.prompt.size() + k) * vocab]);
    std::map<int32_t, int> g;
    for (size_t j = 0; j < k; ++j) ++g[got.token_ids[j]];
    for (auto [t, c] : g) row[size_t(t)] -= 1.0f * float(c);
    for (float& l : row) l /= 0.5f;
    const auto ref = log_softmax(row.data(), vocab);
    EXPECT_NEAR(got.logprobs[k].logprob, ref[size_t(got.token_ids[k])], kLogprobTolerance);
    EXPECT_EQ(got.logprobs[k].top[0].token, got.token_ids[k]);
  }
}

TEST(EngineRequests, IgnoreEosKeepsGoingPastTheModelsEos) {
  auto model = tiny_model();
  const auto& eos = model->info().eos_token_ids;
  ASSERT_FALSE(eos.empty());
  // Sampled requests (the tiny model's distribution is broad): some draw an EOS and stop there.
  std::vector<GenerationRequest> reqs;
  for (int i = 0; i < 48; ++i) {
    GenerationRequest r = greedy(prompt(i % 6), 32);
    r.sampling.temperature = 1.0f;
    r.sampling.seed = 1000 + uint64_t(i);
    reqs.push_back(r);
  }
  const auto stopped = run_tiny(*model, reqs);
  std::vector<GenerationRequest> ignoring;
  std::vector<size_t> which;
  for (size_t i = 0; i < reqs.size(); ++i)
    if (stopped[i].reason == EndReason::Stop) {
      ignoring.push_back(reqs[i]);
      ignoring.back().ignore_eos = true;
      which.push_back(i);
    }
  ASSERT_FALSE(which.empty()) << "no request drew an EOS: pick other seeds";
  const auto got = run_tiny(*model, ignoring);
  for (size_t k = 0; k < which.size(); ++k) {
    const auto& before = stopped[which[k]].token_ids;
    // The same draws up to the EOS, which is now kept, and on to max_tokens.
    EXPECT_EQ(got[k].reason, EndReason::Length);
    ASSERT_EQ(got[k].token_ids.size(), 32u);
    EXPECT_EQ(std::vector<int32_t>(got[k].token_ids.begin(),
                                   got[k].token_ids.begin() + before.size()),
              before);
    EXPECT_TRUE(std::find(eos.begin(), eos.end(), got[k].token_ids[before.size()]) != eos.end());
  }
}

// Speculative decoding on the trained DeepSeek-V3 + MTP checkpoint: with penalties every verified
// position k sees the counts plus drafts 0..k-1, so seeded sampling commits exactly the tokens
// plain decoding commits, and the logprobs of the committed tokens agree.
std::map<size_t, GenerationResult> run_trained(uint32_t K) {
  const auto dir = test::shared_dir() / "models" / "dsv3-mtp-trained";
  LoadOptions o;
  o.devices = {&test::default_device()};
  auto target = load_model(dir, o);
  const uint32_t pages = 64;
  SchedulerLimits lim = limits();
  lim.total_pages = pages;
  lim.num_speculative_tokens = K;
  target->allocate_kv_cache(pages, 16);
  std::unique_ptr<DraftModel> draft;
  SpeculativeOptions spec;
  if (K > 0) {
    draft = load_draft("mtp", dir, std::nullopt, o);
    draft->allocate_kv_cache(pages, 16);
    spec.num_tokens = K;
  }
  Engine engine(*target, nullptr, lim, draft.get(), spec);
  std::vector<GenerationRequest> reqs;
  for (int i = 0; i < 4; ++i) {
    GenerationRequest r;
    for (int j = 0; j < 5 + 9 * i; ++j) r.prompt.push_back(int32_t((i * 131 + j * 37) % 2045 + 1));
    r.sampling.temperature = i == 3 ? 0.0f : 0.8f;
    r.sampling.seed = 1234 + uint64_t(i);
    r.sampling.frequency_penalty = 0.6f;
    r.sampling.presence_penalty = 0.4f;
    r.sampling.repetition_penalty = i == 0 ? 1.3f : 1.0f;
    r.sampling.logprobs = true;
    r.sampling.top_logprobs = 2;
    r.max_tokens = 16;
    reqs.push_back(r);
  }
  const auto res = run_all(engine, reqs);
  if (K > 0) {
    EXPECT_GT(engine.stats().speculative.accepted, 0u) << "no draft was accepted";
  }
  std::map<size_t, GenerationResult> out;
  for (size_t i = 0; i < res.size(); ++i) out[i] = res[i];
  return out;
}

TEST(SpeculativePenalties, SeededSamplingWithPenaltiesEqualsPlain) {
  const auto plain = run_trained(0);
  const auto spec = run_trained(3);
  for (const auto& [i, p] : plain) {
    SCOPED_TRACE(i);
    EXPECT_EQ(p.token_ids.size(), 16u);
    EXPECT_EQ(spec.at(i).token_ids, p.token_ids);
    ASSERT_EQ(spec.at(i).logprobs.size(), p.logprobs.size());
    for (size_t k = 0; k < p.logprobs.size(); ++k) {
      EXPECT_NEAR(spec.at(i).logprobs[k].logprob, p.logprobs[k].logprob, kLogprobTolerance);
      EXPECT_EQ(spec.at(i).logprobs[k].top[0].token, p.logprobs[k].top[0].token);
    }
  }
}

}  // namespace
}  // namespace clshard
