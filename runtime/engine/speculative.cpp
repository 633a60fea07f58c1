// The engine's speculative step (MAX's unified MTP / Eagle3 step, host-driven):
//   1. the target runs the scheduled rows; a decode row carries its last token followed by the
//      drafts the previous step proposed, and asks logits for all of them (logits_per_row) and
//      the hidden states the draft reads (DraftInfo::target_hidden);
//   2. acceptance on the device (runtime/engine/acceptance.h) keeps a prefix of the drafts and
//      adds one token of the target's own; stop tokens, stop strings and max_tokens cut the run;
//   3. the scheduler commits a variable number of tokens per row (the cache length advances by
//      the accepted positions only; rejected positions are overwritten later);
//   4. draft step 0 runs over every position the target just computed up to the last accepted
//      one, each reading the token at the next position and the target's hidden row there, and
//      proposes the first draft from the last position; steps 1..K-1 feed one draft token each,
//      with the draft's own output row, and propose the rest (drafts are greedy).
// The draft's cache shares the target's page table: the scheduler gives a verifying row pages for
// K - 1 positions beyond the row, where steps 1..K-1 write.
#include <algorithm>
#include <chrono>
#include <stdexcept>

#include "runtime/device.h"
#include "runtime/engine/draft_step.h"
#include "runtime/engine/engine.h"

namespace clshard {

namespace {

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Greedy tokens of every logits row (drafts are always greedy).
std::vector<int32_t> argmax_rows(const StepOutputs& out) {
  SamplingParams greedy;
  greedy.temperature = 0;
  return sample_tokens(*out.device, out.logits, out.rows, out.vocab,
                       std::vector<SamplingParams>(out.rows, greedy),
                       std::vector<uint64_t>(out.rows, 0));
}

}  // namespace

void Engine::step_speculative(Batch& b) {
  auto t1 = Clock::now();
  const DraftInfo& di = draft_->info();
  b.merged.return_hidden = di.target_hidden;
  b.merged.hidden_layers = di.target_layers;
  StepOutputs out = model_.forward(b.merged);

  // The rows that sample verify their drafts (none at a prefill) and get one token of the target.
  std::vector<size_t> verifying;
  std::vector<uint32_t> logit_offsets, draft_offsets = {0};
  std::vector<int32_t> drafts;
  std::vector<SamplingParams> params;
  std::vector<uint64_t> seeds;
  std::vector<uint8_t> thinking;
  std::vector<const TokenConstraint*> constraints;
  // Penalties at every verified position: position k counts the drafts before it on top of the
  // request's committed tokens, so acceptance sees what plain decoding would have sampled from.
  std::vector<PenaltyRow> penalised;
  bool keep_raw = false;
  for (size_t i = 0; i < b.row_info.size(); ++i) {
    const ScheduledRow& row = *b.row_info[i];
    if (!row.needs_sample) continue;
    Live& live = live_.at(b.row_handle[i]);
    verifying.push_back(i);
    logit_offsets.push_back(out.logit_offsets[i]);
    const uint32_t end = b.merged.input_row_offsets[i + 1];
    drafts.insert(drafts.end(), b.merged.tokens.begin() + (end - row.num_drafts),
                  b.merged.tokens.begin() + end);
    draft_offsets.push_back(uint32_t(drafts.size()));
    params.push_back(live.req.sampling);
    seeds.push_back(step_seed(live.req.sampling, live.req.prompt.size() + row.num_generated));
    thinking.push_back(spec_.relaxed_thinking && live.thinking);
    constraints.push_back(live.constraint.get());
    const SamplingParams& sp = live.req.sampling;
    if (sp.has_penalties()) {
      const uint32_t slot = penalty_slot(*out.device, out.vocab, live);
      const auto first = drafts.end() - row.num_drafts;
      for (uint32_t k = 0; k <= row.num_drafts; ++k)
        penalised.push_back({logit_offsets.back() + k, slot, sp,
                             std::vector<int32_t>(first, first + k)});
      keep_raw = keep_raw || (sp.logprobs && logprobs_mode_ == LogprobsMode::Raw);
    }
  }
  AcceptanceResult acc;
  Scratch copy;
  const cl::Mem& verify_from = penalised_logits(out, penalised, keep_raw, copy);
  if (!verifying.empty()) {
    logit_offsets.push_back(out.logit_offsets[verifying.back() + 1]);
    std::vector<uint32_t> bits;
    if (draft_masks(constraints, logit_offsets, drafts, draft_offsets, out.rows, out.vocab,
                    bits)) {
      Scratch mask(*out.device, bits.size() * sizeof(uint32_t));
      out.device->write(mask.mem(), bits.data(), bits.size() * sizeof(uint32_t));
      acc = accept_drafts(*out.device, verify_from, out.vocab, logit_offsets, drafts,
                          draft_offsets, params, seeds, thinking, spec_.relaxed, &mask.mem());
    } else {
      acc = accept_drafts(*out.device, verify_from, out.vocab, logit_offsets, drafts,
                          draft_offsets, params, seeds, thinking, spec_.relaxed);
    }
  }
  // Log-probabilities of every token a verifying row may commit: the accepted drafts and the
  // target's token, each at its own position.
  std::vector<LogprobRow> lp_rows;
  std::vector<const SamplingParams*> lp_params;
  std::vector<size_t> lp_first(verifying.size() + 1, 0);
  for (size_t s = 0; s < verifying.size(); ++s) {
    lp_first[s] = lp_rows.size();
    const SamplingParams& sp = live_.at(b.row_handle[verifying[s]]).req.sampling;
    if (sp.logprobs)
      for (uint32_t k = 0; k <= acc.num_accepted[s]; ++k) {
        const int32_t t =
            k < acc.num_accepted[s] ? drafts[draft_offsets[s] + k] : acc.next_token[s];
        lp_rows.push_back({logit_offsets[s] + k, t, 0, 1.0f, false});
        lp_params.push_back(&sp);
      }
  }
  lp_first[verifying.size()] = lp_rows.size();
  const std::vector<TokenLogprobs> lps = step_logprobs(out, verify_from, lp_rows, lp_params);
  stats_.device_s += since(t1);

  // What each verifying row keeps: the accepted drafts and the target's token, cut where the
  // request ends (max_tokens, a stop token, a stop string).
  auto t2 = Clock::now();
  std::vector<std::vector<int32_t>> committed(verifying.size());
  SpeculativeStats& ss = stats_.speculative;
  for (size_t s = 0; s < verifying.size(); ++s) {
    const size_t i = verifying[s];
    const ScheduledRow& row = *b.row_info[i];
    const uint32_t n = acc.num_accepted[s];
    if (row.num_drafts > 0) {
      ++ss.verify_rows;
      ss.drafted += row.num_drafts;
      ss.accepted += n;
      for (uint32_t k = 0; k < row.num_drafts && k < ss.drafted_at.size(); ++k) {
        ++ss.drafted_at[k];
        ss.accepted_at[k] += k < n;
      }
    }
    const auto first = drafts.begin() + draft_offsets[s];
    std::vector<int32_t> run(first, first + n);
    run.push_back(acc.next_token[s]);
    Live& live = live_.at(b.row_handle[i]);
    const uint32_t room = schedulers_[live.replica].remaining_tokens(live.local);
    if (run.size() > room) run.resize(std::max<uint32_t>(room, 1));
    const bool has_lp = lp_first[s + 1] > lp_first[s];
    for (size_t t = 0; t < run.size(); ++t)
      if (observe(b.row_handle[i], live, run[t], has_lp ? &lps[lp_first[s] + t] : nullptr)) {
        run.resize(t + 1);
        break;
      }
    stats_.output_tokens += run.size();
    committed[s] = std::move(run);
  }
  std::vector<std::pair<uint64_t, std::vector<int32_t>>> counted;
  for (size_t s = 0; s < verifying.size(); ++s)
    counted.push_back({b.row_handle[verifying[s]], committed[s]});
  count_committed(counted);
  for (size_t r = 0, s = 0; r < b.plans.size(); ++r) {
    if (!b.plans[r]) continue;
    std::vector<std::vector<int32_t>> mine;
    for (const auto& row : b.plans[r]->rows)
      if (row.needs_sample) mine.push_back(committed[s++]);
    schedulers_[r].commit(*b.plans[r], mine);
  }
  stats_.host_s += since(t2);

  auto t3 = Clock::now();
  propose_drafts(b, out, committed);
  stats_.device_s += since(t3);
  ss.draft_s += since(t3);
}

void Engine::propose_drafts(const Batch& b, const StepOutputs& target,
                            const std::vector<std::vector<int32_t>>& committed) {
  const size_t R = schedulers_.size();
  const uint32_t K = spec_.num_tokens;
  const StepInputs& m = b.merged;
  const uint32_t P = m.pages_per_row;

  // Step 0: every position the target computed, up to the last accepted one.
  DraftStep step0(R, P);
  std::vector<size_t> drafting;        // merged rows whose requests get new drafts
  std::vector<uint32_t> next_position;  // per drafting row: where step 1 writes
  for (size_t i = 0, s = 0; i < b.row_info.size(); ++i) {
    const ScheduledRow& row = *b.row_info[i];
    const size_t r = b.row_replica[i];
    const uint32_t begin = m.input_row_offsets[i], len = m.row_length(i);
    const uint32_t replica_base =
        m.data_parallel_splits.empty() ? 0 : m.input_row_offsets[m.data_parallel_splits[r]];
    const uint32_t* pages = m.lookup_table.data() + size_t(i) * P;
    std::vector<int32_t> tokens;
    if (row.needs_sample) {
      const auto& kept = committed[s++];
      const Live& live = live_.at(b.row_handle[i]);
      if (schedulers_[r].state(live.local) != RequestState::Running) continue;
      // The row's tokens up to the last accepted one, each reading the token after it.
      const uint32_t count = (len - row.num_drafts) + uint32_t(kept.size()) - 1;
      tokens.assign(m.tokens.begin() + begin + 1, m.tokens.begin() + begin + count);
      tokens.push_back(kept.back());
      step0.add_row(r, tokens, row.cache_length, pages, 1, begin - replica_base);
      drafting.push_back(i);
      next_position.push_back(row.cache_length + count);
    } else {
      // An intermediate prefill chunk: the draft's cache must hold these positions too.
      tokens.assign(m.tokens.begin() + begin + 1, m.tokens.begin() + begin + len);
      tokens.push_back(row.following_token);
      step0.add_row(r, tokens, row.cache_length, pages, 0, begin - replica_base);
    }
  }
  if (drafting.empty()) return;
  step0.finish_splits();
  std::vector<Scratch> keep;
  StepOutputs out = draft_->forward(
      step0.in, step0.gather(target.hidden, target.hidden_width, keep), target.hidden_width);
  std::vector<std::vector<int32_t>> proposed(drafting.size());
  std::vector<int32_t> last = argmax_rows(out);
  for (size_t d = 0; d < drafting.size(); ++d) proposed[d].push_back(last[d]);

  // Steps 1..K-1: one token per drafting row, reading the draft's own output row. Those rows are
  // already one per drafting row in replica order, so they go back in as they are (a draft reads
  // its input rows before it writes its output rows, in its devices' in-order queues).
  for (uint32_t j = 1; j < K; ++j) {
    DraftStep step(R, P);
    for (size_t d = 0; d < drafting.size(); ++d) {
      const size_t i = drafting[d], r = b.row_replica[i];
      step.add_row(r, {last[d]}, next_position[d] + j - 1, m.lookup_table.data() + size_t(i) * P,
                   1, step.rows_of_replica[r]);
    }
    step.finish_splits();
    out = draft_->forward(step.in, out.hidden, out.hidden_width);
    last = argmax_rows(out);
    for (size_t d = 0; d < drafting.size(); ++d) proposed[d].push_back(last[d]);
  }
  for (size_t d = 0; d < drafting.size(); ++d) {
    const Live& live = live_.at(b.row_handle[drafting[d]]);
    schedulers_[live.replica].set_drafts(live.local, std::move(proposed[d]));
  }
}

}  // namespace clshard
