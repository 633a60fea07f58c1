// The scheduler and KV page bookkeeping, checked against a fake model that really goes through the
// paged cache: every row's new tokens are written at cache_lengths[b] + j through the lookup table,
// then the row's whole sequence is read back through the table and the next token is a hash of it.
// Wrong pages, cache lengths, offsets or a page shared by two live requests change the tokens, so
// "batched == solo" below checks the step inputs themselves, not just the scheduler's counters.
// Speculative steps (num_speculative_tokens K > 0) add a fake draft model with a paged cache of its
// own over the same lookup tables: it stores, at each position, the token at the next position
// (what an MTP layer reads), writes K - 1 positions past the accepted ones through the lookahead
// pages, and proposes the true continuation made wrong from a pseudo-random draft on, so that a
// pseudo-random number of drafts is accepted; the completions must still equal the solo ones.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "runtime/engine/kv_pages.h"
#include "runtime/engine/scheduler.h"
#include "runtime/step.h"

namespace clshard {
namespace {

constexpr int32_t kVocab = 1000;
constexpr int32_t kUnwritten = -1;

// The fake model's "forward pass": a deterministic, order-sensitive hash of the whole sequence.
int32_t next_token_of(std::span<const int32_t> sequence) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a, with an extra mix so nearby sequences spread
  for (int32_t t : sequence) {
    h ^= uint32_t(t);
    h *= 1099511628211ull;
    h ^= h >> 29;
  }
  return int32_t(h % kVocab);
}

using StopFn = std::function<bool(int32_t)>;

// What one request produces alone, without any scheduler: the reference completions.
std::vector<int32_t> solo_completion(std::vector<int32_t> sequence, uint32_t max_new,
                                     const StopFn& stop = {}) {
  std::vector<int32_t> out;
  while (out.size() < max_new) {
    const int32_t t = next_token_of(sequence);
    out.push_back(t);
    sequence.push_back(t);
    if (stop && stop(t)) break;
  }
  return out;
}

// A model whose only state is a paged KV store of tokens: [total_pages + 1 (null page)][page_size].
// The draft model's cache is a second store of the same shape, addressed through the same tables.
class PagedHashModel {
 public:
  PagedHashModel(uint32_t page_size, uint32_t total_pages)
      : page_size_(page_size),
        total_pages_(total_pages),
        kv_(size_t(total_pages + 1) * page_size, kUnwritten),
        draft_kv_(kv_.size(), kUnwritten) {}

  // Returns the token of every row with needs_sample, in row order.
  std::vector<int32_t> forward(const ScheduledStep& step) {
    std::vector<int32_t> sampled;
    for (const std::vector<int32_t>& row : predict(step)) sampled.push_back(row.back());
    return sampled;
  }

  // For every row with needs_sample, in row order: the next token after each of the positions the
  // step returns logits for (inputs.logit_token_indices(): the last token of each row, or the last
  // logits_per_row[b] when that is set).
  std::vector<std::vector<int32_t>> predict(const ScheduledStep& step) {
    const StepInputs& in = step.inputs;
    in.validate(page_size_, total_pages_);  // throws (failing the test) on malformed inputs
    EXPECT_EQ(in.return_logits, ReturnLogits::LastToken);
    EXPECT_EQ(step.rows.size(), in.num_rows());
    // As a real layer does: store every row's new K/V first, then attend.
    for (size_t b = 0; b < in.num_rows(); ++b)
      for (uint32_t j = 0; j < in.row_length(b); ++j)
        kv_[slot(in, b, in.cache_lengths[b] + j)] = in.tokens[in.input_row_offsets[b] + j];
    const std::vector<uint32_t> logit_tokens = in.logit_token_indices();
    std::vector<std::vector<int32_t>> predicted;
    size_t next_logit = 0;
    for (size_t b = 0; b < in.num_rows(); ++b) {
      std::vector<int32_t> row;
      for (; next_logit < logit_tokens.size() &&
             logit_tokens[next_logit] < in.input_row_offsets[b + 1];
           ++next_logit) {
        // The positions up to and including the logit's token.
        const uint32_t end =
            in.cache_lengths[b] + logit_tokens[next_logit] - in.input_row_offsets[b] + 1;
        std::vector<int32_t> sequence(end);
        for (uint32_t pos = 0; pos < end; ++pos) sequence[pos] = kv_[slot(in, b, pos)];
        EXPECT_EQ(std::count(sequence.begin(), sequence.end(), kUnwritten), 0)
            << "row " << b << " reads a position nothing wrote";
        row.push_back(next_token_of(sequence));
      }
      if (step.rows[b].needs_sample) {
        EXPECT_FALSE(row.empty()) << "row " << b << " needs a sample but returns no logits";
        predicted.push_back(std::move(row));
      }
    }
    return predicted;
  }

  int32_t read(const StepInputs& in, size_t b, uint32_t pos) const { return kv_[slot(in, b, pos)]; }
  int32_t draft_read(const StepInputs& in, size_t b, uint32_t pos) const {
    return draft_kv_[slot(in, b, pos)];
  }
  void draft_write(const StepInputs& in, size_t b, uint32_t pos, int32_t token) {
    draft_kv_[slot(in, b, pos)] = token;
  }

 private:
  // Where position pos of row b lives. Positions past the row's tokens (the draft's lookahead)
  // must also lie in real pages of the row's table.
  size_t slot(const StepInputs& in, size_t b, uint32_t pos) const {
    const uint32_t index = pos / page_size_;
    EXPECT_LT(index, in.pages_per_row) << "row " << b << " position " << pos << " past its table";
    const uint32_t page =
        in.lookup_table[b * in.pages_per_row + std::min(index, in.pages_per_row - 1)];
    EXPECT_LT(page, total_pages_) << "row " << b << " position " << pos << " is in the null page";
    return size_t(page) * page_size_ + pos % page_size_;
  }

  uint32_t page_size_, total_pages_;
  std::vector<int32_t> kv_;
  std::vector<int32_t> draft_kv_;
};

struct Job {
  std::vector<int32_t> prompt;
  uint32_t max_new = 0;
};

std::vector<int32_t> make_prompt(uint32_t length, uint32_t seed) {
  std::vector<int32_t> p(length);
  uint32_t x = seed * 2654435761u + 12345u;
  for (auto& t : p) {
    x = x * 1664525u + 1013904223u;
    t = int32_t((x >> 8) % kVocab);
  }
  return p;
}

// 12 requests, prompts of 1..300 tokens, 5..40 new tokens each.
std::vector<Job> twelve_jobs() {
  const uint32_t lengths[] = {1, 300, 17, 128, 64, 255, 3, 190, 33, 97, 211, 150};
  const uint32_t max_new[] = {5, 40, 12, 33, 7, 21, 40, 9, 28, 16, 37, 25};
  std::vector<Job> jobs;
  for (uint32_t i = 0; i < 12; ++i) jobs.push_back({make_prompt(lengths[i], i + 1), max_new[i]});
  return jobs;
}

// The engine loop, plus bookkeeping that checks every step: batch limits, and that each row's pages
// are its own — pages of a request that is still running never show up in another request's row
// (so a preemption freed the victim's pages only), and a running request's pages never change
// under it — and that each row's description (positions, tokens, drafts, following token, logits)
// matches the request's sequence. With K > 0 it runs the speculative loop: verify the drafts,
// commit the accepted ones and the next token, run the draft model, set the next drafts.
class Harness {
 public:
  explicit Harness(const SchedulerLimits& limits)
      : limits(limits), sched(limits), model(limits.page_size, limits.total_pages) {}

  SchedulerLimits limits;
  Scheduler sched;
  PagedHashModel model;
  StopFn stop;  // the engine's stop condition, checked on every sampled token
  std::map<uint64_t, FinishedRequest> finished;
  std::vector<ScheduledStep> steps;  // every step handed out, for tests that look at their shape
  size_t max_rows_seen = 0;
  // Speculative runs: drafts fed in rows, accepted at commit, and set but not fed (the budget or
  // the free pages cut them).
  uint64_t drafts_fed = 0, drafts_accepted = 0, drafts_cut = 0;
  uint64_t rng = 88172645463325252ull;  // the draft model's pseudo-random choices

  uint64_t add(const Job& job) {
    const uint64_t h = sched.add(job.prompt, job.max_new);
    prompts_[h] = job.prompt;
    return h;
  }

  // One engine iteration; false when the scheduler has nothing left.
  bool step() {
    std::optional<ScheduledStep> step = sched.schedule();
    if (!step) return false;
    check_limits(*step);
    check_rows(*step);
    check_page_ownership(*step);
    if (limits.num_speculative_tokens == 0)
      plain_step(*step);
    else
      speculative_step(*step);
    collect();
    steps.push_back(std::move(*step));
    return true;
  }

  void run(size_t step_limit = 100000) {
    while (step_limit-- > 0 && step()) {
    }
    ASSERT_FALSE(sched.has_unfinished()) << "scheduler still busy after the step limit";
    collect();
  }

  void collect() {
    for (FinishedRequest& f : sched.take_finished()) {
      const uint64_t h = f.handle;
      EXPECT_TRUE(finished.emplace(h, std::move(f)).second) << "request " << h << " finished twice";
    }
  }

  // Everything is released at the end: no pages held, nothing queued, nothing more to schedule.
  void expect_drained() {
    EXPECT_EQ(sched.pages_in_use(), 0u);
    EXPECT_EQ(sched.free_pages(), limits.total_pages);
    EXPECT_EQ(sched.num_running(), 0u);
    EXPECT_EQ(sched.num_waiting(), 0u);
    EXPECT_FALSE(sched.schedule().has_value());
    EXPECT_EQ(sched.pool().used_count(), 0u);
  }

  // Prompt and generated tokens of a waiting or running request.
  std::vector<int32_t> sequence(uint64_t h) const {
    std::vector<int32_t> seq = prompts_.at(h);
    const std::span<const int32_t> gen = sched.generated_tokens(h);
    seq.insert(seq.end(), gen.begin(), gen.end());
    return seq;
  }

 private:
  void plain_step(const ScheduledStep& step) {
    std::vector<int32_t> sampled = model.forward(step);
    // Stop conditions are checked before commit, as the engine does: finish() then takes effect
    // at commit, with the stop token kept.
    size_t k = 0;
    for (const ScheduledRow& row : step.rows)
      if (row.needs_sample) {
        EXPECT_EQ(row.num_generated, sched.generated_tokens(row.handle).size());
        if (stop && k < sampled.size() && stop(sampled[k])) sched.finish(row.handle, EndReason::Stop);
        ++k;
      }
    sched.commit(step, sampled);
  }

  uint32_t next_random(uint32_t bound) {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return uint32_t(rng % bound);
  }

  void speculative_step(const ScheduledStep& step) {
    const std::vector<std::vector<int32_t>> predicted = model.predict(step);
    ASSERT_EQ(predicted.size(), step.num_samples());
    std::vector<std::vector<int32_t>> committed;
    for (size_t b = 0; b < step.rows.size(); ++b) {
      const ScheduledRow& row = step.rows[b];
      if (!row.needs_sample) continue;
      const std::vector<int32_t>& target = predicted[committed.size()];
      EXPECT_EQ(row.num_generated, sched.generated_tokens(row.handle).size());
      ASSERT_EQ(target.size(), row.num_drafts + 1u);
      // Greedy verification: target[j] is the token after the row's pending tokens and drafts
      // 0 .. j-1; a draft is kept while it equals it, then the target's token follows.
      const int32_t* drafts = step.inputs.tokens.data() + step.inputs.input_row_offsets[b + 1] -
                              row.num_drafts;
      std::vector<int32_t> kept;
      for (uint32_t j = 0; j <= row.num_drafts; ++j) {
        kept.push_back(target[j]);
        if (j == row.num_drafts || drafts[j] != target[j]) break;
      }
      drafts_accepted += kept.size() - 1;
      // Stop conditions over the whole run, as the engine does: cut after the first stop token.
      if (stop)
        if (auto it = std::find_if(kept.begin(), kept.end(), stop); it != kept.end()) {
          kept.erase(it + 1, kept.end());
          sched.finish(row.handle, EndReason::Stop);
        }
      // Drafts are cut to what can be kept, so the engine never needs to cut for the length.
      EXPECT_LE(kept.size(), sched.remaining_tokens(row.handle));
      committed.push_back(std::move(kept));
    }
    sched.commit(step, committed);
    draft_pass(step, committed);
  }

  // The draft model after commit, over the step's rows and lookup table. Position p of its cache
  // holds the token at p + 1 (an MTP layer's input): draft step 0 writes every position of the
  // row, then K - 1 one-token steps write the drafts past the accepted positions.
  void draft_pass(const ScheduledStep& step, const std::vector<std::vector<int32_t>>& committed) {
    const StepInputs& in = step.inputs;
    const uint32_t K = limits.num_speculative_tokens;
    constexpr int32_t kRejected = kVocab + 7;  // what a rejected position's next token is to us
    size_t next_commit = 0;
    for (size_t b = 0; b < step.rows.size(); ++b) {
      const ScheduledRow& row = step.rows[b];
      const std::vector<int32_t>* kept = row.needs_sample ? &committed[next_commit++] : nullptr;
      if (sched.state(row.handle) != RequestState::Running) continue;  // finished at commit
      const uint32_t c = row.cache_length, n = row.num_tokens;
      // The positions the cache now holds for good: [0, end).
      const uint32_t end = kept ? c + (n - row.num_drafts) + uint32_t(kept->size()) - 1 : c + n;
      for (uint32_t j = 0; j < n; ++j) {
        const uint32_t pos = c + j;
        int32_t next = kRejected;
        if (pos + 1 < end) next = in.tokens[in.input_row_offsets[b] + j + 1];
        if (pos + 1 == end) next = kept ? kept->back() : row.following_token;
        model.draft_write(in, b, pos, next);
      }
      // The draft's cache must now spell the request's sequence up to position end, shifted by one.
      std::vector<int32_t> seq{model.read(in, b, 0)};
      for (uint32_t pos = 0; pos < end; ++pos) seq.push_back(model.draft_read(in, b, pos));
      std::vector<int32_t> want = sequence(row.handle);
      ASSERT_LE(seq.size(), want.size());
      if (kept) {
        EXPECT_EQ(seq.size(), want.size());  // all of it, up to the new pending token
      }
      want.resize(seq.size());
      EXPECT_EQ(seq, want) << "request " << row.handle << " at step " << step.step_index;
      if (!kept) continue;
      // K drafts: the true continuation, made wrong from a pseudo-random one on (or never).
      const uint32_t wrong_from = next_random(K + 1);
      std::vector<int32_t> drafts;
      for (uint32_t j = 0; j < K; ++j) {
        int32_t d = next_token_of(seq);
        if (j >= wrong_from) d = (d + 1) % kVocab;
        drafts.push_back(d);
        if (j + 1 == K) break;
        model.draft_write(in, b, end + j, d);  // the lookahead positions
        seq.push_back(model.draft_read(in, b, end + j));
      }
      drafts.resize(next_random(K + 1));  // sometimes fewer, or none
      sched.set_drafts(row.handle, drafts);
      drafts_set_[row.handle] = std::move(drafts);
    }
  }

  void check_limits(const ScheduledStep& s) {
    EXPECT_GE(s.rows.size(), 1u);
    EXPECT_LE(s.rows.size(), limits.max_batch_size);
    EXPECT_LE(s.inputs.num_tokens(), limits.max_batch_input_tokens);
    max_rows_seen = std::max(max_rows_seen, s.rows.size());
    std::vector<uint64_t> handles;
    for (const ScheduledRow& r : s.rows) handles.push_back(r.handle);
    std::sort(handles.begin(), handles.end());
    EXPECT_EQ(std::adjacent_find(handles.begin(), handles.end()), handles.end())
        << "a request has two rows in one step";
  }

  // Each row feeds its request's pending tokens, then (only for a decode row) a prefix of the
  // drafts set for it; its fields and logits_per_row agree with the inputs.
  void check_rows(const ScheduledStep& s) {
    const StepInputs& in = s.inputs;
    const uint32_t K = limits.num_speculative_tokens;
    // A preempted request's drafts are gone with its cache.
    std::erase_if(drafts_set_, [&](const auto& entry) {
      return sched.state(entry.first) != RequestState::Running;
    });
    if (K == 0) {
      EXPECT_TRUE(in.logits_per_row.empty());
    } else {
      ASSERT_EQ(in.logits_per_row.size(), s.rows.size());
    }
    for (size_t b = 0; b < s.rows.size(); ++b) {
      const ScheduledRow& row = s.rows[b];
      EXPECT_EQ(row.cache_length, in.cache_lengths[b]);
      EXPECT_EQ(row.num_tokens, in.row_length(b));
      ASSERT_LT(row.num_drafts, row.num_tokens);
      if (K > 0) {
        EXPECT_EQ(in.logits_per_row[b], row.needs_sample ? row.num_drafts + 1 : 0u);
      }
      const std::vector<int32_t> seq = sequence(row.handle);
      const uint32_t pending = row.num_tokens - row.num_drafts;
      ASSERT_LE(row.cache_length + pending, seq.size());
      EXPECT_EQ(row.needs_sample, row.cache_length + pending == seq.size());
      const int32_t* fed = in.tokens.data() + in.input_row_offsets[b];
      EXPECT_TRUE(std::equal(fed, fed + pending, seq.begin() + row.cache_length));
      EXPECT_EQ(row.following_token, row.needs_sample ? -1 : seq[row.cache_length + pending]);
      auto set = drafts_set_.find(row.handle);
      const size_t available = set == drafts_set_.end() ? 0 : set->second.size();
      ASSERT_LE(row.num_drafts, available) << "request " << row.handle;
      if (row.num_drafts > 0) {
        EXPECT_EQ(pending, 1u);
        EXPECT_TRUE(std::equal(fed + 1, fed + row.num_tokens, set->second.begin()));
        EXPECT_LT(row.num_drafts, sched.remaining_tokens(row.handle));
      }
      drafts_fed += row.num_drafts;
      drafts_cut += available - row.num_drafts;
      if (set != drafts_set_.end()) drafts_set_.erase(set);  // consumed
    }
  }

  void check_page_ownership(const ScheduledStep& s) {
    // Requests that stopped running (finished or preempted) gave their pages back.
    for (auto it = pages_of_.begin(); it != pages_of_.end();) {
      if (sched.state(it->first) != RequestState::Running) {
        for (uint32_t p : it->second) owner_.erase(p);
        it = pages_of_.erase(it);
      } else {
        ++it;
      }
    }
    const StepInputs& in = s.inputs;
    const uint32_t null_page = sched.pool().null_page();
    const uint32_t K = limits.num_speculative_tokens;
    for (size_t b = 0; b < s.rows.size(); ++b) {
      const uint64_t h = s.rows[b].handle;
      // A row with needs_sample also holds the draft's K - 1 lookahead positions.
      const uint32_t lookahead = K > 0 && s.rows[b].needs_sample ? K - 1 : 0;
      const uint32_t end = in.cache_lengths[b] + in.row_length(b) + lookahead;
      const uint32_t used = KvPageTable::pages_for(end, limits.page_size);
      ASSERT_LE(used, in.pages_per_row) << "row " << b << " lacks pages for its lookahead";
      std::vector<uint32_t> pages(in.lookup_table.begin() + b * in.pages_per_row,
                                  in.lookup_table.begin() + b * in.pages_per_row + used);
      for (uint32_t i = used; i < in.pages_per_row; ++i)
        EXPECT_EQ(in.lookup_table[b * in.pages_per_row + i], null_page)
            << "row " << b << " holds pages beyond what its positions need";
      for (uint32_t p : pages) EXPECT_NE(p, null_page) << "row " << b << " lacks a page";
      auto known = pages_of_.find(h);
      if (in.cache_lengths[b] == 0) {
        EXPECT_TRUE(known == pages_of_.end()) << "request " << h << " restarts holding pages";
      } else {
        ASSERT_TRUE(known != pages_of_.end()) << "request " << h << " continues with no pages";
        // With K > 0 a row may list fewer pages than its request holds (fewer drafts than before).
        if (K == 0) {
          ASSERT_LE(known->second.size(), pages.size());
        }
        const size_t common = std::min(known->second.size(), pages.size());
        EXPECT_TRUE(
            std::equal(known->second.begin(), known->second.begin() + common, pages.begin()))
            << "request " << h << "'s pages changed while it ran";
      }
      for (uint32_t p : pages) {
        auto [it, fresh] = owner_.emplace(p, h);
        EXPECT_EQ(it->second, h) << "page " << p << " of running request " << it->second
                                 << " given to request " << h;
      }
      if (known == pages_of_.end() || known->second.size() <= pages.size()) pages_of_[h] = pages;
    }
    size_t tracked = 0;
    for (auto& [h, pages] : pages_of_) tracked += pages.size();
    EXPECT_EQ(tracked, sched.pages_in_use());
  }

  std::map<uint64_t, std::vector<int32_t>> prompts_;
  std::map<uint64_t, std::vector<int32_t>> drafts_set_;  // set_drafts() not yet consumed
  std::map<uint32_t, uint64_t> owner_;                // page -> running request holding it
  std::map<uint64_t, std::vector<uint32_t>> pages_of_;  // running request -> its pages
};

// Adds jobs[0..first) now and the rest one per step after that, so requests join mid-run.
std::vector<uint64_t> run_staggered(Harness& h, const std::vector<Job>& jobs, size_t first) {
  std::vector<uint64_t> handles;
  for (size_t i = 0; i < std::min(first, jobs.size()); ++i) handles.push_back(h.add(jobs[i]));
  for (size_t i = first; i < jobs.size(); ++i) {
    h.step();
    handles.push_back(h.add(jobs[i]));
  }
  h.run();
  return handles;
}

void expect_solo_completions(const Harness& h, const std::vector<Job>& jobs,
                             const std::vector<uint64_t>& handles, const StopFn& stop = {}) {
  ASSERT_EQ(h.finished.size(), jobs.size()) << "requests lost";
  for (size_t i = 0; i < jobs.size(); ++i) {
    auto it = h.finished.find(handles[i]);
    ASSERT_TRUE(it != h.finished.end()) << "request " << i << " never finished";
    const FinishedRequest& f = it->second;
    const std::vector<int32_t> want = solo_completion(jobs[i].prompt, jobs[i].max_new, stop);
    EXPECT_EQ(f.generated, want) << "request " << i << " (prompt " << jobs[i].prompt.size() << ")";
    EXPECT_EQ(f.prompt_tokens, jobs[i].prompt.size());
    const bool stopped = stop && !want.empty() && stop(want.back());
    EXPECT_EQ(f.reason, stopped ? EndReason::Stop : EndReason::Length) << "request " << i;
    EXPECT_TRUE(f.error.empty());
  }
}

TEST(KvPagePool, HandsOutEveryPageOnceThenReportsExhaustion) {
  KvPagePool pool(4);
  EXPECT_EQ(pool.null_page(), 4u);
  std::vector<uint32_t> got;
  for (int i = 0; i < 4; ++i) got.push_back(pool.allocate());
  EXPECT_EQ(got, (std::vector<uint32_t>{0, 1, 2, 3}));
  EXPECT_EQ(pool.free_count(), 0u);
  EXPECT_EQ(pool.used_count(), 4u);
  EXPECT_FALSE(pool.try_allocate().has_value());
  EXPECT_THROW(pool.allocate(), std::runtime_error);
  pool.free(2);
  EXPECT_FALSE(pool.is_allocated(2));
  EXPECT_EQ(pool.try_allocate(), std::optional<uint32_t>(2));  // a freed page is reused first
  EXPECT_EQ(pool.free_count(), 0u);
}

TEST(KvPagePool, DoubleFreeNullPageAndForeignIdsAreLogicErrors) {
  KvPagePool pool(3);
  const uint32_t p = pool.allocate();
  pool.free(p);
  EXPECT_THROW(pool.free(p), std::logic_error);                // double free
  EXPECT_THROW(pool.free(1), std::logic_error);                // never allocated
  EXPECT_THROW(pool.free(pool.null_page()), std::logic_error); // the padding page
  EXPECT_THROW(pool.free(99), std::logic_error);               // not this pool's
  EXPECT_EQ(pool.free_count(), 3u);
}

TEST(KvPageTable, GrowsByWholePagesAllOrNothingAndReleases) {
  KvPagePool pool(5);
  {
    KvPageTable a(pool, 16);
    EXPECT_EQ(a.pages_missing(1), 1u);
    EXPECT_TRUE(a.ensure_capacity(17));  // positions 0..16: two pages
    EXPECT_EQ(a.num_pages(), 2u);
    EXPECT_EQ(a.capacity(), 32u);
    EXPECT_TRUE(a.ensure_capacity(32));  // still fits
    EXPECT_EQ(a.num_pages(), 2u);
    KvPageTable b(pool, 16);
    EXPECT_FALSE(b.ensure_capacity(16 * 4));  // needs 4, only 3 free: takes none
    EXPECT_EQ(b.num_pages(), 0u);
    EXPECT_EQ(pool.free_count(), 3u);
    EXPECT_TRUE(b.ensure_capacity(16 * 3));
    EXPECT_EQ(pool.free_count(), 0u);
    b.release();
    EXPECT_EQ(pool.free_count(), 3u);
    KvPageTable moved = std::move(a);  // ownership moves; the pages are freed once, below
    EXPECT_EQ(moved.num_pages(), 2u);
    EXPECT_EQ(a.num_pages(), 0u);
  }
  EXPECT_EQ(pool.free_count(), 5u);
}

TEST(Scheduler, BatchedCompletionsEqualSoloCompletions) {
  const std::vector<Job> jobs = twelve_jobs();
  const SchedulerLimits limits{.max_batch_size = 8, .max_batch_input_tokens = 256,
                               .page_size = 16, .total_pages = 512, .max_length = 4096};
  Harness h(limits);
  const std::vector<uint64_t> handles = run_staggered(h, jobs, 6);
  expect_solo_completions(h, jobs, handles);
  EXPECT_EQ(h.sched.preemptions(), 0u);  // ample pages
  EXPECT_EQ(h.max_rows_seen, limits.max_batch_size);  // 12 requests: the row limit was binding
  EXPECT_EQ(h.sched.steps(), h.steps.size());
  h.expect_drained();

  // And each request alone through the scheduler gives the same as alone without it.
  for (size_t i = 0; i < jobs.size(); ++i) {
    Harness solo(limits);
    const uint64_t handle = solo.add(jobs[i]);
    solo.run();
    EXPECT_EQ(solo.finished.at(handle).generated, h.finished.at(handles[i]).generated);
  }
}

TEST(Scheduler, PreemptionUnderTinyPageBudgetKeepsCompletionsIdentical) {
  const std::vector<Job> jobs = twelve_jobs();
  // The largest request needs (300 + 40 - 1) / 16 -> 22 pages; the pool has 24.
  const SchedulerLimits limits{.max_batch_size = 8, .max_batch_input_tokens = 128,
                               .page_size = 16, .total_pages = 24, .max_length = 4096};
  Harness h(limits);
  const std::vector<uint64_t> handles = run_staggered(h, jobs, 12);
  EXPECT_GT(h.sched.preemptions(), 0u);
  expect_solo_completions(h, jobs, handles);
  uint64_t per_request = 0;
  for (auto& [handle, f] : h.finished) per_request += f.preemptions;
  EXPECT_EQ(per_request, h.sched.preemptions());
  h.expect_drained();
}

// Many shapes of limits, down to one-token pages and one-row steps (for the twelve jobs).
struct LimitsCase {
  SchedulerLimits limits;
  size_t added_at_start;  // the others join one per step
  bool expect_preemption;
};
const LimitsCase kLimitsCases[] = {
    {{.max_batch_size = 1, .max_batch_input_tokens = 1000, .page_size = 16, .total_pages = 64,
      .max_length = 4096}, 4, false},
    {{.max_batch_size = 64, .max_batch_input_tokens = 7, .page_size = 5, .total_pages = 400,
      .max_length = 4096}, 12, false},
    {{.max_batch_size = 4, .max_batch_input_tokens = 64, .page_size = 1, .total_pages = 360,
      .max_length = 4096}, 4, true},
    {{.max_batch_size = 16, .max_batch_input_tokens = 512, .page_size = 128, .total_pages = 3,
      .max_length = 4096}, 1, true},
    {{.max_batch_size = 12, .max_batch_input_tokens = 2048, .page_size = 32, .total_pages = 12,
      .max_length = 4096}, 12, true},
};

std::string describe(const SchedulerLimits& l) {
  return "batch " + std::to_string(l.max_batch_size) + ", tokens " +
         std::to_string(l.max_batch_input_tokens) + ", page_size " + std::to_string(l.page_size) +
         ", pages " + std::to_string(l.total_pages) + ", K " +
         std::to_string(l.num_speculative_tokens);
}

TEST(Scheduler, CompletionsMatchAcrossLimits) {
  const std::vector<Job> jobs = twelve_jobs();
  for (const LimitsCase& c : kLimitsCases) {
    SCOPED_TRACE(describe(c.limits));
    Harness h(c.limits);
    const std::vector<uint64_t> handles = run_staggered(h, jobs, c.added_at_start);
    expect_solo_completions(h, jobs, handles);
    if (c.expect_preemption) {
      EXPECT_GT(h.sched.preemptions(), 0u);
    }
    h.expect_drained();
  }
}

TEST(Scheduler, PreemptsTheNewestRequestAndFreesOnlyItsPages) {
  // Pages of 4 tokens, 6 in all; three requests a, b, c (prompts 5, 6, 4; 6 new tokens each: 3
  // pages each at most) run together and hold two pages each from step 1 on. At step 3 b, the
  // middle one, reaches position 8 and needs a third page: the victim must be c, the newest, not
  // a (the oldest) nor b itself. d waits for a row (max_batch_size 3) and must stay behind c.
  const SchedulerLimits limits{.max_batch_size = 3, .max_batch_input_tokens = 64,
                               .page_size = 4, .total_pages = 6, .max_length = 4096};
  Harness h(limits);
  const std::vector<Job> jobs = {{make_prompt(5, 100), 6}, {make_prompt(6, 101), 6},
                                 {make_prompt(4, 102), 6}, {make_prompt(4, 103), 6}};
  std::vector<uint64_t> handles;
  for (const Job& j : jobs) handles.push_back(h.add(j));
  const uint64_t a = handles[0], b = handles[1], c = handles[2], d = handles[3];

  while (h.sched.preemptions() == 0) ASSERT_TRUE(h.step());
  const ScheduledStep& preempting = h.steps.back();
  EXPECT_EQ(preempting.step_index, 3u);
  EXPECT_EQ(h.sched.preemptions(), 1u);
  ASSERT_EQ(preempting.rows.size(), 2u);
  EXPECT_EQ(preempting.rows[0].handle, a);
  EXPECT_EQ(preempting.rows[1].handle, b);
  // The survivors kept their pages (the harness checks that they are unchanged) and b grew into
  // one the victim gave up.
  EXPECT_EQ(preempting.inputs.cache_lengths, (std::vector<uint32_t>{7, 8}));
  EXPECT_EQ(h.sched.state(a), RequestState::Running);
  EXPECT_EQ(h.sched.state(b), RequestState::Running);
  EXPECT_EQ(h.sched.state(c), RequestState::Waiting);
  EXPECT_EQ(h.sched.state(d), RequestState::Waiting);
  EXPECT_EQ(h.sched.generated_tokens(c).size(), 3u);  // kept, not lost

  h.run();
  expect_solo_completions(h, jobs, handles);
  EXPECT_EQ(h.sched.preemptions(), 1u);
  for (uint64_t handle : {a, b, d}) EXPECT_EQ(h.finished.at(handle).preemptions, 0u);
  EXPECT_EQ(h.finished.at(c).preemptions, 1u);
  // The victim came back ahead of d, which was waiting before it, as one prefill of its prompt and
  // the 3 tokens it had generated.
  auto recompute = std::find_if(h.steps.begin() + 4, h.steps.end(), [&](const ScheduledStep& s) {
    return std::any_of(s.rows.begin(), s.rows.end(),
                       [&](const ScheduledRow& r) { return r.handle == c || r.handle == d; });
  });
  ASSERT_NE(recompute, h.steps.end());
  ASSERT_EQ(recompute->rows.size(), 2u);
  EXPECT_EQ(recompute->rows[0].handle, c);
  EXPECT_EQ(recompute->rows[1].handle, d);
  EXPECT_EQ(recompute->inputs.cache_lengths[0], 0u);
  EXPECT_EQ(recompute->inputs.row_length(0), 7u);
  EXPECT_TRUE(recompute->rows[0].needs_sample);
  EXPECT_EQ(recompute->rows[0].num_generated, 3u);
  h.expect_drained();
}

TEST(Scheduler, ChunkedPrefillSplitsALongPromptWithinTheTokenBudget) {
  const SchedulerLimits limits{.max_batch_size = 4, .max_batch_input_tokens = 64,
                               .page_size = 16, .total_pages = 64, .max_length = 4096};
  const Job long_job{make_prompt(300, 7), 3};
  {
    Harness h(limits);
    const uint64_t handle = h.add(long_job);
    h.run();
    // 300 = 4 x 64 + 44: five prefill steps, only the last one samples, then two decode steps.
    ASSERT_EQ(h.steps.size(), 7u);
    const uint32_t want_lengths[] = {64, 64, 64, 64, 44, 1, 1};
    for (size_t s = 0; s < h.steps.size(); ++s) {
      const ScheduledStep& step = h.steps[s];
      ASSERT_EQ(step.rows.size(), 1u);
      EXPECT_EQ(step.inputs.row_length(0), want_lengths[s]) << "step " << s;
      EXPECT_EQ(step.inputs.cache_lengths[0], s < 5 ? 64 * s : 300 + (s - 5)) << "step " << s;
      EXPECT_EQ(step.rows[0].needs_sample, s >= 4) << "step " << s;
    }
    EXPECT_EQ(h.finished.at(handle).generated, solo_completion(long_job.prompt, 3));
    h.expect_drained();
  }
  {
    // With a request decoding: its decode row comes first and the prompt gets the other 63 tokens.
    Harness h(limits);
    const Job short_job{make_prompt(10, 8), 20};
    const uint64_t decoding = h.add(short_job);
    h.step();
    const uint64_t prefilling = h.add(long_job);
    size_t prefill_steps = 0;
    uint32_t prefilled = 0;
    while (h.step()) {
      const ScheduledStep& s = h.steps.back();
      for (size_t b = 0; b < s.rows.size(); ++b) {
        if (s.rows[b].handle != prefilling || s.inputs.cache_lengths[b] >= 300) continue;
        ++prefill_steps;
        EXPECT_EQ(s.inputs.cache_lengths[b], prefilled);
        prefilled += s.inputs.row_length(b);
        if (prefilled < 300) {
          ASSERT_EQ(s.rows.size(), 2u);
          EXPECT_EQ(s.rows[0].handle, decoding);
          EXPECT_EQ(s.inputs.row_length(0), 1u);
          EXPECT_EQ(s.inputs.num_tokens(), 64u);  // the budget is filled
          EXPECT_FALSE(s.rows[b].needs_sample);
        } else {
          EXPECT_TRUE(s.rows[b].needs_sample);
        }
      }
    }
    h.collect();
    EXPECT_EQ(prefilled, 300u);
    EXPECT_EQ(prefill_steps, 5u);  // 300 = 4 x 63 + 48
    expect_solo_completions(h, {short_job, long_job}, {decoding, prefilling});
    h.expect_drained();
  }
}

TEST(Scheduler, RequestThatCanNeverFitFailsWithAClearErrorAndOthersComplete) {
  // 8 pages of 16: at most 128 KV positions for one request.
  const SchedulerLimits limits{.max_batch_size = 4, .max_batch_input_tokens = 64,
                               .page_size = 16, .total_pages = 8, .max_length = 4096};
  Harness h(limits);
  const std::vector<Job> ok = {{make_prompt(20, 1), 10}, {make_prompt(50, 2), 20},
                               {make_prompt(100, 3), 29}};  // 128 positions: exactly fits
  const uint64_t a = h.add(ok[0]);
  const uint64_t too_long_prompt = h.add({make_prompt(200, 4), 5});
  const uint64_t b = h.add(ok[1]);
  const uint64_t too_long_total = h.add({make_prompt(100, 5), 40});  // 139 positions: 9 pages
  const uint64_t c = h.add(ok[2]);
  h.run();
  for (uint64_t bad : {too_long_prompt, too_long_total}) {
    const FinishedRequest& f = h.finished.at(bad);
    EXPECT_EQ(f.reason, EndReason::Error);
    EXPECT_TRUE(f.generated.empty());
    EXPECT_NE(f.error.find("KV pages"), std::string::npos) << f.error;
    EXPECT_NE(f.error.find("only 8 pages"), std::string::npos) << f.error;
  }
  EXPECT_NE(h.finished.at(too_long_total).error.find("needs 9 KV pages"), std::string::npos);
  for (size_t i = 0; i < ok.size(); ++i)
    EXPECT_EQ(h.finished.at(std::vector<uint64_t>{a, b, c}[i]).generated,
              solo_completion(ok[i].prompt, ok[i].max_new));
  EXPECT_EQ(h.finished.size(), 5u);
  h.expect_drained();
}

TEST(Scheduler, MaxLengthCapsTheCompletion) {
  const SchedulerLimits limits{.max_batch_size = 4, .max_batch_input_tokens = 64,
                               .page_size = 16, .total_pages = 64, .max_length = 64};
  Harness h(limits);
  const Job capped{make_prompt(10, 1), 100};
  const uint64_t capped_h = h.add(capped);
  const uint64_t one_left = h.add({make_prompt(63, 2), 10});
  const uint64_t no_room = h.add({make_prompt(64, 3), 10});
  const uint64_t empty = h.add({{}, 10});
  const uint64_t zero_new = h.add({make_prompt(5, 4), 0});
  h.run();
  EXPECT_EQ(h.finished.at(capped_h).generated, solo_completion(capped.prompt, 54));
  EXPECT_EQ(h.finished.at(capped_h).reason, EndReason::Length);
  EXPECT_EQ(h.finished.at(one_left).generated.size(), 1u);
  EXPECT_EQ(h.finished.at(one_left).reason, EndReason::Length);
  EXPECT_EQ(h.finished.at(no_room).reason, EndReason::Error);
  EXPECT_NE(h.finished.at(no_room).error.find("max_length 64"), std::string::npos);
  EXPECT_EQ(h.finished.at(empty).reason, EndReason::Error);
  EXPECT_NE(h.finished.at(empty).error.find("empty prompt"), std::string::npos);
  EXPECT_EQ(h.finished.at(zero_new).reason, EndReason::Length);
  EXPECT_TRUE(h.finished.at(zero_new).generated.empty());
  h.expect_drained();
}

TEST(Scheduler, EngineFinishEndsRequestsAndFreesTheirPages) {
  const std::vector<Job> jobs = twelve_jobs();
  const SchedulerLimits limits{.max_batch_size = 6, .max_batch_input_tokens = 128,
                               .page_size = 16, .total_pages = 40, .max_length = 4096};
  const StopFn stop = [](int32_t t) { return t % 16 == 3; };
  Harness h(limits);
  h.stop = stop;
  const std::vector<uint64_t> handles = run_staggered(h, jobs, 12);
  expect_solo_completions(h, jobs, handles, stop);
  size_t stopped = 0;
  for (auto& [handle, f] : h.finished) stopped += f.reason == EndReason::Stop;
  EXPECT_GT(stopped, 0u);             // the stop condition fired for some requests ...
  EXPECT_LT(stopped, jobs.size());    // ... and others ran to their length
  h.expect_drained();
  EXPECT_FALSE(h.sched.finish(handles[0], EndReason::Stop));  // already finished
  EXPECT_THROW(h.sched.finish(999, EndReason::Stop), std::logic_error);
  EXPECT_THROW(h.sched.finish(0, EndReason::Stop), std::logic_error);
}

TEST(Scheduler, CancellingWaitingAndRunningRequests) {
  const SchedulerLimits limits{.max_batch_size = 1, .max_batch_input_tokens = 64,
                               .page_size = 16, .total_pages = 16, .max_length = 4096};
  Harness h(limits);
  const Job a{make_prompt(30, 1), 10}, b{make_prompt(40, 2), 10}, c{make_prompt(50, 3), 10};
  const uint64_t ha = h.add(a), hb = h.add(b), hc = h.add(c);
  ASSERT_TRUE(h.step());  // a is running, b and c wait (one row per step)
  EXPECT_EQ(h.sched.state(hb), RequestState::Waiting);
  EXPECT_TRUE(h.sched.finish(hb, EndReason::Error, "cancelled"));
  EXPECT_EQ(h.sched.state(hb), RequestState::Finished);
  EXPECT_EQ(h.sched.num_waiting(), 1u);
  ASSERT_TRUE(h.step());
  const uint32_t pages_before = h.sched.pages_in_use();
  EXPECT_GT(pages_before, 0u);
  EXPECT_TRUE(h.sched.finish(ha, EndReason::Stop));  // between steps: ends now, pages freed
  EXPECT_EQ(h.sched.pages_in_use(), 0u);
  h.run();
  EXPECT_EQ(h.finished.at(hb).reason, EndReason::Error);
  EXPECT_EQ(h.finished.at(hb).error, "cancelled");
  EXPECT_TRUE(h.finished.at(hb).generated.empty());
  EXPECT_EQ(h.finished.at(ha).reason, EndReason::Stop);
  EXPECT_EQ(h.finished.at(ha).generated, solo_completion(a.prompt, 2));
  EXPECT_EQ(h.finished.at(hc).generated, solo_completion(c.prompt, 10));
  for (const ScheduledStep& s : h.steps)
    for (const ScheduledRow& r : s.rows) EXPECT_NE(r.handle, hb);
  h.expect_drained();
}

TEST(Scheduler, IsDeterministic) {
  const std::vector<Job> jobs = twelve_jobs();
  for (uint32_t K : {0u, 3u}) {  // plain, and speculative with the harness's pseudo-random drafts
    const SchedulerLimits limits{.max_batch_size = 5, .max_batch_input_tokens = 96,
                                 .page_size = 8, .total_pages = 60, .max_length = 4096,
                                 .num_speculative_tokens = K};
    SCOPED_TRACE(describe(limits));
    Harness first(limits), second(limits);
    run_staggered(first, jobs, 3);
    run_staggered(second, jobs, 3);
    EXPECT_GT(first.sched.preemptions(), 0u);
    EXPECT_EQ(first.drafts_accepted > 0, K > 0);
    ASSERT_EQ(first.steps.size(), second.steps.size());
    for (size_t s = 0; s < first.steps.size(); ++s) {
      const StepInputs &x = first.steps[s].inputs, &y = second.steps[s].inputs;
      EXPECT_EQ(x.tokens, y.tokens);
      EXPECT_EQ(x.input_row_offsets, y.input_row_offsets);
      EXPECT_EQ(x.cache_lengths, y.cache_lengths);
      EXPECT_EQ(x.lookup_table, y.lookup_table);
      EXPECT_EQ(x.logits_per_row, y.logits_per_row);
    }
  }
}

TEST(Scheduler, RejectsMisuse) {
  EXPECT_THROW(Scheduler(SchedulerLimits{.total_pages = 0}), std::invalid_argument);
  EXPECT_THROW(Scheduler(SchedulerLimits{.max_batch_size = 0, .total_pages = 4}),
               std::invalid_argument);
  const SchedulerLimits limits{.max_batch_size = 4, .max_batch_input_tokens = 64,
                               .page_size = 16, .total_pages = 16, .max_length = 4096};
  Scheduler s(limits);
  const uint64_t h = s.add(make_prompt(20, 1), 3);
  std::optional<ScheduledStep> step = s.schedule();
  ASSERT_TRUE(step);
  EXPECT_THROW(s.schedule(), std::logic_error);  // the previous step is not committed
  EXPECT_THROW(s.commit(*step, std::vector<int32_t>{}), std::invalid_argument);  // one row samples
  EXPECT_EQ(s.generated_tokens(h).size(), 0u);  // the failed commit changed nothing
  s.commit(*step, std::vector<int32_t>{42});
  EXPECT_THROW(s.commit(*step, std::vector<int32_t>{42}), std::logic_error);  // committed already
  EXPECT_EQ(std::vector<int32_t>(s.generated_tokens(h).begin(), s.generated_tokens(h).end()),
            std::vector<int32_t>{42});
  EXPECT_THROW(s.state(77), std::logic_error);
}


// ---- Speculative steps (num_speculative_tokens K > 0) ----

// The message of the E that f throws (an std::logic_error that is not an std::invalid_argument when
// E is std::logic_error); fails the test when f throws nothing or something else.
template <typename E, typename F>
std::string message_of(F&& f) {
  try {
    f();
  } catch (const E& e) {
    if constexpr (std::is_same_v<E, std::logic_error>) {
      EXPECT_EQ(dynamic_cast<const std::invalid_argument*>(&e), nullptr) << e.what();
    }
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "threw another exception: " << e.what();
    return {};
  }
  ADD_FAILURE() << "did not throw";
  return {};
}

std::vector<int32_t> generated_of(const Scheduler& s, uint64_t h) {
  const std::span<const int32_t> g = s.generated_tokens(h);
  return {g.begin(), g.end()};
}

std::vector<uint32_t> row_pages(const StepInputs& in, size_t b) {
  return {in.lookup_table.begin() + b * in.pages_per_row,
          in.lookup_table.begin() + (b + 1) * in.pages_per_row};
}

using Tokens = std::vector<int32_t>;
using Runs = std::vector<std::vector<int32_t>>;

TEST(SchedulerSpeculative, DraftsFollowThePendingTokenWithLookaheadPages) {
  // K = 3, pages of 4 tokens: a row with needs_sample holds positions < cache_length +
  // num_tokens + 2.
  const SchedulerLimits limits{.max_batch_size = 4, .max_batch_input_tokens = 64, .page_size = 4,
                               .total_pages = 16, .max_length = 4096,
                               .num_speculative_tokens = 3};
  Scheduler s(limits);
  const Tokens prompt = make_prompt(5, 1);
  const uint64_t h = s.add(prompt, 10);
  const uint32_t null_page = s.pool().null_page();

  std::optional<ScheduledStep> step = s.schedule();  // the prompt: positions 0..4, lookahead < 7
  ASSERT_TRUE(step);
  EXPECT_EQ(step->inputs.tokens, prompt);
  EXPECT_EQ(step->inputs.logits_per_row, (std::vector<uint32_t>{1}));
  EXPECT_EQ(step->inputs.return_logits, ReturnLogits::LastToken);
  EXPECT_EQ(step->inputs.pages_per_row, 2u);
  EXPECT_EQ(step->inputs.lookup_table, (std::vector<uint32_t>{0, 1}));
  ASSERT_EQ(step->rows.size(), 1u);
  EXPECT_TRUE(step->rows[0].needs_sample);
  EXPECT_EQ(step->rows[0].num_drafts, 0u);
  EXPECT_EQ(step->rows[0].cache_length, 0u);
  EXPECT_EQ(step->rows[0].num_tokens, 5u);
  EXPECT_EQ(step->rows[0].following_token, -1);
  s.commit(*step, Runs{{100}});
  s.set_drafts(h, {11, 12, 13});

  step = s.schedule();  // [pending, 3 drafts] at positions 5..8, lookahead < 11: three pages
  ASSERT_TRUE(step);
  EXPECT_EQ(step->inputs.tokens, (Tokens{100, 11, 12, 13}));
  EXPECT_EQ(step->inputs.cache_lengths, (std::vector<uint32_t>{5}));
  EXPECT_EQ(step->inputs.logits_per_row, (std::vector<uint32_t>{4}));
  EXPECT_EQ(step->inputs.lookup_table, (std::vector<uint32_t>{0, 1, 2}));
  EXPECT_EQ(step->inputs.logit_token_indices(), (std::vector<uint32_t>{0, 1, 2, 3}));
  EXPECT_EQ(step->rows[0].num_drafts, 3u);
  EXPECT_EQ(step->rows[0].cache_length, 5u);
  EXPECT_EQ(step->rows[0].num_tokens, 4u);
  EXPECT_EQ(step->rows[0].num_generated, 1u);
  EXPECT_EQ(step->rows[0].following_token, -1);
  s.commit(*step, Runs{{11, 200}});  // draft 11 accepted, 12 rejected, 200 is the next token
  EXPECT_EQ(generated_of(s, h), (Tokens{100, 11, 200}));

  step = s.schedule();  // no drafts set: one token at position 7 (where 12 was), lookahead < 10
  ASSERT_TRUE(step);
  EXPECT_EQ(step->inputs.tokens, (Tokens{200}));
  EXPECT_EQ(step->inputs.cache_lengths, (std::vector<uint32_t>{7}));
  EXPECT_EQ(step->inputs.logits_per_row, (std::vector<uint32_t>{1}));
  EXPECT_EQ(step->inputs.lookup_table, (std::vector<uint32_t>{0, 1, 2}));
  EXPECT_EQ(step->rows[0].num_drafts, 0u);
  EXPECT_EQ(step->rows[0].num_generated, 3u);
  s.commit(*step, Runs{{300}});
  s.set_drafts(h, {1, 2});

  step = s.schedule();  // positions 8..10, lookahead < 13: a fourth page
  ASSERT_TRUE(step);
  EXPECT_EQ(step->inputs.tokens, (Tokens{300, 1, 2}));
  EXPECT_EQ(step->inputs.cache_lengths, (std::vector<uint32_t>{8}));
  EXPECT_EQ(step->inputs.pages_per_row, 4u);
  EXPECT_EQ(step->inputs.lookup_table, (std::vector<uint32_t>{0, 1, 2, 3}));
  s.commit(*step, Runs{{1, 2, 400}});  // both accepted, then the next token
  EXPECT_EQ(generated_of(s, h), (Tokens{100, 11, 200, 300, 1, 2, 400}));

  step = s.schedule();
  ASSERT_TRUE(step);
  EXPECT_EQ(step->inputs.cache_lengths, (std::vector<uint32_t>{11}));
  EXPECT_EQ(step->inputs.tokens, (Tokens{400}));
  EXPECT_EQ(row_pages(step->inputs, 0), (std::vector<uint32_t>{0, 1, 2, 3}));  // < 14
  EXPECT_NE(step->inputs.lookup_table.back(), null_page);
  EXPECT_EQ(s.pages_in_use(), 4u);
}

TEST(SchedulerSpeculative, VariableCommitAdvancesEachRowByItsAcceptedDrafts) {
  const SchedulerLimits limits{.max_batch_size = 4, .max_batch_input_tokens = 64, .page_size = 4,
                               .total_pages = 16, .max_length = 4096,
                               .num_speculative_tokens = 2};
  Scheduler s(limits);
  const uint64_t a = s.add(make_prompt(3, 1), 20);
  const uint64_t b = s.add(make_prompt(6, 2), 20);
  std::optional<ScheduledStep> step = s.schedule();
  ASSERT_TRUE(step);
  EXPECT_EQ(step->inputs.logits_per_row, (std::vector<uint32_t>{1, 1}));
  s.commit(*step, Runs{{10}, {20}});
  s.set_drafts(a, {11, 12});
  s.set_drafts(b, {21, 22});

  step = s.schedule();
  ASSERT_TRUE(step);
  EXPECT_EQ(step->inputs.tokens, (Tokens{10, 11, 12, 20, 21, 22}));
  EXPECT_EQ(step->inputs.input_row_offsets, (std::vector<uint32_t>{0, 3, 6}));
  EXPECT_EQ(step->inputs.cache_lengths, (std::vector<uint32_t>{3, 6}));
  EXPECT_EQ(step->inputs.logits_per_row, (std::vector<uint32_t>{3, 3}));
  // a: positions 3..5, lookahead < 7 (2 pages); b: positions 6..8, lookahead < 10 (3 pages).
  EXPECT_EQ(step->inputs.pages_per_row, 3u);
  EXPECT_EQ(row_pages(step->inputs, 1).back() == s.pool().null_page(), false);
  EXPECT_EQ(row_pages(step->inputs, 0).back(), s.pool().null_page());
  s.commit(*step, Runs{{11, 12, 13}, {30}});  // a keeps both drafts, b none

  EXPECT_EQ(generated_of(s, a), (Tokens{10, 11, 12, 13}));
  EXPECT_EQ(generated_of(s, b), (Tokens{20, 30}));
  EXPECT_EQ(s.remaining_tokens(a), 16u);
  EXPECT_EQ(s.remaining_tokens(b), 18u);
  step = s.schedule();
  ASSERT_TRUE(step);
  // a: 3 + 1 pending + 2 accepted; b: 6 + 1 pending (its rejected drafts' positions are reused).
  EXPECT_EQ(step->inputs.cache_lengths, (std::vector<uint32_t>{6, 7}));
  EXPECT_EQ(step->inputs.tokens, (Tokens{13, 30}));
  EXPECT_EQ(step->rows[0].num_generated, 4u);
  EXPECT_EQ(step->rows[1].num_generated, 2u);
  s.commit(*step, Tokens{14, 31});  // one token per row
  s.set_drafts(a, {15});
  s.set_drafts(b, {32, 33});

  step = s.schedule();
  ASSERT_TRUE(step);
  EXPECT_EQ(step->inputs.cache_lengths, (std::vector<uint32_t>{7, 8}));
  EXPECT_EQ(step->inputs.tokens, (Tokens{14, 15, 31, 32, 33}));
  s.commit(*step, Tokens{16, 34});  // the one-token commit keeps no draft
  EXPECT_EQ(generated_of(s, a), (Tokens{10, 11, 12, 13, 14, 16}));
  EXPECT_EQ(generated_of(s, b), (Tokens{20, 30, 31, 34}));
  step = s.schedule();
  ASSERT_TRUE(step);
  EXPECT_EQ(step->inputs.cache_lengths, (std::vector<uint32_t>{8, 9}));
}

TEST(SchedulerSpeculative, AcceptedRunEndsAtMaxNewTokens) {
  const SchedulerLimits limits{.max_batch_size = 4, .max_batch_input_tokens = 64, .page_size = 4,
                               .total_pages = 16, .max_length = 12,
                               .num_speculative_tokens = 4};
  Scheduler s(limits);
  const uint64_t a = s.add(make_prompt(5, 1), 4);
  const uint64_t capped = s.add(make_prompt(9, 2), 100);  // max_length 12: 3 new tokens
  const uint64_t stopped = s.add(make_prompt(3, 3), 20);
  EXPECT_EQ(s.remaining_tokens(a), 4u);
  EXPECT_EQ(s.remaining_tokens(capped), 3u);
  std::optional<ScheduledStep> step = s.schedule();
  ASSERT_TRUE(step);
  s.commit(*step, Runs{{100}, {200}, {300}});
  EXPECT_EQ(s.remaining_tokens(a), 3u);
  EXPECT_EQ(s.remaining_tokens(capped), 2u);
  s.set_drafts(a, {1, 2, 3, 4});
  s.set_drafts(capped, {5, 6, 7, 8});
  s.set_drafts(stopped, {9, 10, 11});

  step = s.schedule();
  ASSERT_TRUE(step);
  // Drafts beyond what could be kept are not fed: a can keep 3 tokens (2 drafts + the next one),
  // capped 2 (1 draft).
  ASSERT_EQ(step->rows.size(), 3u);
  EXPECT_EQ(step->rows[0].num_drafts, 2u);
  EXPECT_EQ(step->rows[1].num_drafts, 1u);
  EXPECT_EQ(step->rows[2].num_drafts, 3u);
  EXPECT_EQ(step->inputs.tokens, (Tokens{100, 1, 2, 200, 5, 300, 9, 10, 11}));
  EXPECT_EQ(step->inputs.logits_per_row, (std::vector<uint32_t>{3, 2, 4}));
  // The engine saw a stop token (10) inside stopped's accepted run: it keeps the run up to it.
  EXPECT_TRUE(s.finish(stopped, EndReason::Stop));
  s.commit(*step, Runs{{1, 2, 7}, {5, 8}, {9, 10}});
  std::vector<FinishedRequest> done = s.take_finished();
  ASSERT_EQ(done.size(), 3u);
  EXPECT_EQ(done[0].handle, a);
  EXPECT_EQ(done[0].generated, (Tokens{100, 1, 2, 7}));
  EXPECT_EQ(done[0].reason, EndReason::Length);
  EXPECT_EQ(done[1].handle, capped);
  EXPECT_EQ(done[1].generated, (Tokens{200, 5, 8}));
  EXPECT_EQ(done[1].reason, EndReason::Length);
  EXPECT_EQ(done[2].handle, stopped);
  EXPECT_EQ(done[2].generated, (Tokens{300, 9, 10}));
  EXPECT_EQ(done[2].reason, EndReason::Stop);
  EXPECT_EQ(s.remaining_tokens(a), 0u);  // finished
  EXPECT_EQ(s.pages_in_use(), 0u);
  EXPECT_FALSE(s.schedule().has_value());
}

TEST(SchedulerSpeculative, TokenBudgetCutsDraftsNotRows) {
  const SchedulerLimits limits{.max_batch_size = 8, .max_batch_input_tokens = 6, .page_size = 4,
                               .total_pages = 32, .max_length = 4096,
                               .num_speculative_tokens = 4};
  Scheduler s(limits);
  const uint64_t a = s.add(make_prompt(2, 1), 20);
  const uint64_t b = s.add(make_prompt(2, 2), 20);
  const uint64_t c = s.add(make_prompt(2, 3), 20);
  std::optional<ScheduledStep> step = s.schedule();
  ASSERT_TRUE(step);
  ASSERT_EQ(step->rows.size(), 3u);
  s.commit(*step, Tokens{10, 20, 30});
  for (uint64_t h : {a, b, c}) s.set_drafts(h, {1, 2, 3, 4});

  // 6 tokens: the three decode rows first, then the oldest row's drafts in what is left.
  step = s.schedule();
  ASSERT_TRUE(step);
  ASSERT_EQ(step->rows.size(), 3u);
  EXPECT_EQ(step->rows[0].num_drafts, 3u);
  EXPECT_EQ(step->rows[1].num_drafts, 0u);
  EXPECT_EQ(step->rows[2].num_drafts, 0u);
  EXPECT_EQ(step->inputs.tokens, (Tokens{10, 1, 2, 3, 20, 30}));
  EXPECT_EQ(step->inputs.logits_per_row, (std::vector<uint32_t>{4, 1, 1}));
  s.commit(*step, Runs{{1, 2, 11}, {21}, {31}});
  // b's and c's drafts were consumed by that step, though not fed.
  step = s.schedule();
  ASSERT_TRUE(step);
  EXPECT_EQ(step->inputs.tokens, (Tokens{11, 21, 31}));
  EXPECT_EQ(step->inputs.logits_per_row, (std::vector<uint32_t>{1, 1, 1}));
  s.commit(*step, Tokens{12, 22, 32});

  // A fourth request joins (the decode rows' 3 tokens and its prompt's 3 fill the budget); then
  // the four decode rows leave room for 2 drafts, the oldest row's.
  const uint64_t d = s.add(make_prompt(3, 4), 20);
  step = s.schedule();
  ASSERT_TRUE(step);
  ASSERT_EQ(step->rows.size(), 4u);
  EXPECT_EQ(step->rows[3].handle, d);
  s.commit(*step, Tokens{13, 23, 33, 40});
  for (uint64_t h : {a, b, c, d}) s.set_drafts(h, {1, 2, 3, 4});
  step = s.schedule();
  ASSERT_TRUE(step);
  ASSERT_EQ(step->rows.size(), 4u);
  EXPECT_EQ(step->rows[0].num_drafts, 2u);
  for (size_t r = 1; r < 4; ++r) EXPECT_EQ(step->rows[r].num_drafts, 0u);
  EXPECT_EQ(step->inputs.num_tokens(), 6u);
}

TEST(SchedulerSpeculative, DraftsTakeOnlyFreePagesAndLookaheadPreemptsWithDraftsInFlight) {
  // Pages of 2 tokens, 5 in all, K = 2 (lookahead: 1 position past a sampling row).
  const SchedulerLimits limits{.max_batch_size = 4, .max_batch_input_tokens = 64, .page_size = 2,
                               .total_pages = 5, .max_length = 4096,
                               .num_speculative_tokens = 2};
  Scheduler s(limits);
  const Tokens prompt_b = make_prompt(3, 2);
  const uint64_t a = s.add(make_prompt(2, 1), 6);
  const uint64_t b = s.add(prompt_b, 6);
  std::optional<ScheduledStep> step = s.schedule();  // a: < 3 (2 pages), b: < 4 (2 pages)
  ASSERT_TRUE(step);
  EXPECT_EQ(s.pages_in_use(), 4u);
  s.commit(*step, Tokens{10, 20});
  s.set_drafts(a, {11, 12});
  s.set_drafts(b, {21, 22});

  // a's row fits in its pages (< 4); b's takes the last free page (< 5). Drafts never preempt:
  // a's would need a page more, and b's second one too — a gets none, b one.
  step = s.schedule();
  ASSERT_TRUE(step);
  EXPECT_EQ(s.preemptions(), 0u);
  ASSERT_EQ(step->rows.size(), 2u);
  EXPECT_EQ(step->rows[0].num_drafts, 0u);
  EXPECT_EQ(step->rows[1].num_drafts, 1u);
  EXPECT_EQ(step->inputs.tokens, (Tokens{10, 20, 21}));
  EXPECT_EQ(s.free_pages(), 0u);
  s.commit(*step, Runs{{13}, {21, 23}});
  s.set_drafts(a, {14, 15});
  s.set_drafts(b, {24, 25});

  // a (cache length 3) needs positions < 5: a third page, none free. The lookahead preempts b,
  // the newest, with its drafts in flight; a's drafts then fit in the pages b gave back.
  step = s.schedule();
  ASSERT_TRUE(step);
  EXPECT_EQ(s.preemptions(), 1u);
  ASSERT_EQ(step->rows.size(), 1u);
  EXPECT_EQ(step->rows[0].handle, a);
  EXPECT_EQ(step->rows[0].num_drafts, 2u);
  EXPECT_EQ(step->inputs.tokens, (Tokens{13, 14, 15}));
  EXPECT_EQ(s.state(b), RequestState::Waiting);
  EXPECT_EQ(generated_of(s, b), (Tokens{20, 21, 23}));  // kept, not lost
  EXPECT_NE(message_of<std::logic_error>([&] { s.set_drafts(b, {1}); }).find("is not running"),
            std::string::npos);
  s.commit(*step, Runs{{14, 16}});
  s.set_drafts(a, {17, 18});

  // a may generate 2 more tokens: 1 draft is fed. b's prompt cannot be admitted yet (it needs 4
  // pages with its lookahead; 1 is free).
  step = s.schedule();
  ASSERT_TRUE(step);
  ASSERT_EQ(step->rows.size(), 1u);
  EXPECT_EQ(step->rows[0].num_drafts, 1u);
  EXPECT_EQ(step->inputs.tokens, (Tokens{16, 17}));
  s.commit(*step, Runs{{17, 60}});
  std::vector<FinishedRequest> done = s.take_finished();
  ASSERT_EQ(done.size(), 1u);
  EXPECT_EQ(done[0].generated, (Tokens{10, 13, 14, 16, 17, 60}));

  // b comes back as one prefill of its prompt and its 3 tokens, without drafts.
  step = s.schedule();
  ASSERT_TRUE(step);
  ASSERT_EQ(step->rows.size(), 1u);
  const ScheduledRow& row = step->rows[0];
  EXPECT_EQ(row.handle, b);
  EXPECT_EQ(row.cache_length, 0u);
  EXPECT_EQ(row.num_tokens, 6u);
  EXPECT_EQ(row.num_drafts, 0u);
  EXPECT_EQ(row.num_generated, 3u);
  EXPECT_TRUE(row.needs_sample);
  Tokens want = prompt_b;
  want.insert(want.end(), {20, 21, 23});
  EXPECT_EQ(step->inputs.tokens, want);
  s.commit(*step, Runs{{50}});
  EXPECT_EQ(generated_of(s, b), (Tokens{20, 21, 23, 50}));
  EXPECT_EQ(s.take_finished().size(), 0u);
}

TEST(SchedulerSpeculative, IntermediateChunksNameTheirFollowingToken) {
  const SchedulerLimits limits{.max_batch_size = 4, .max_batch_input_tokens = 64, .page_size = 16,
                               .total_pages = 64, .max_length = 4096,
                               .num_speculative_tokens = 2};
  const Job job{make_prompt(150, 7), 3};
  Harness h(limits);
  const uint64_t handle = h.add(job);
  h.run();
  // 150 = 64 + 64 + 22: two intermediate chunks, then the last (which samples), then decode rows.
  ASSERT_GE(h.steps.size(), 3u);
  const uint32_t want_lengths[] = {64, 64, 22};
  for (size_t s = 0; s < 3; ++s) {
    const ScheduledStep& step = h.steps[s];
    ASSERT_EQ(step.rows.size(), 1u);
    const ScheduledRow& row = step.rows[0];
    EXPECT_EQ(row.cache_length, 64 * s);
    EXPECT_EQ(row.num_tokens, want_lengths[s]);
    EXPECT_EQ(row.needs_sample, s == 2);
    EXPECT_EQ(row.following_token, s < 2 ? job.prompt[64 * (s + 1)] : -1) << "step " << s;
    EXPECT_EQ(step.inputs.logits_per_row, (std::vector<uint32_t>{s < 2 ? 0u : 1u}));
    EXPECT_TRUE(step.inputs.logit_token_indices().size() == (s < 2 ? 0u : 1u));
    // Intermediate chunks hold no lookahead; the last chunk holds position 150 too.
    EXPECT_EQ(step.inputs.pages_per_row, s < 2 ? 4 * (s + 1) : 10u);
  }
  for (size_t s = 3; s < h.steps.size(); ++s) EXPECT_EQ(h.steps[s].rows[0].following_token, -1);
  EXPECT_EQ(h.finished.at(handle).generated, solo_completion(job.prompt, 3));
  h.expect_drained();
}

TEST(SchedulerSpeculative, ZeroSpeculativeTokensIsPlainDecoding) {
  const SchedulerLimits limits{.max_batch_size = 4, .max_batch_input_tokens = 64, .page_size = 16,
                               .total_pages = 16, .max_length = 4096};
  EXPECT_EQ(limits.num_speculative_tokens, 0u);  // the default
  Scheduler s(limits);
  const uint64_t h = s.add(make_prompt(20, 1), 5);
  std::optional<ScheduledStep> step = s.schedule();
  ASSERT_TRUE(step);
  EXPECT_TRUE(step->inputs.logits_per_row.empty());
  EXPECT_EQ(step->inputs.return_logits, ReturnLogits::LastToken);
  EXPECT_EQ(step->inputs.pages_per_row, 2u);  // positions 0..19: no lookahead
  EXPECT_EQ(step->rows[0].num_tokens, 20u);
  EXPECT_EQ(step->rows[0].num_drafts, 0u);
  s.commit(*step, Runs{{42}});  // the general commit, one token
  EXPECT_NE(message_of<std::invalid_argument>([&] { s.set_drafts(h, {1}); })
                .find("1 drafts for request 1, more than num_speculative_tokens 0"),
            std::string::npos);
  s.set_drafts(h, {});  // no drafts: allowed, nothing changes
  step = s.schedule();
  ASSERT_TRUE(step);
  EXPECT_EQ(step->inputs.tokens, (Tokens{42}));
  EXPECT_EQ(step->inputs.cache_lengths, (std::vector<uint32_t>{20}));
  EXPECT_TRUE(step->inputs.logits_per_row.empty());
  EXPECT_EQ(step->inputs.pages_per_row, 2u);
  EXPECT_EQ(step->rows[0].cache_length, 20u);
  EXPECT_EQ(step->rows[0].num_tokens, 1u);
  // The existing tests run the same harness with K = 0 and are unchanged.
}

TEST(SchedulerSpeculative, RejectsBadDraftsAndCommitSizesWithClearMessages) {
  const SchedulerLimits limits{.max_batch_size = 4, .max_batch_input_tokens = 16, .page_size = 16,
                               .total_pages = 16, .max_length = 4096,
                               .num_speculative_tokens = 2};
  Scheduler s(limits);
  const uint64_t a = s.add(make_prompt(3, 1), 4);
  const uint64_t b = s.add(make_prompt(40, 2), 5);  // chunked: 13 tokens in the first step
  auto logic = [&](uint64_t h, Tokens drafts) {
    return message_of<std::logic_error>([&] { s.set_drafts(h, drafts); });
  };
  auto has = [](const std::string& text, const std::string& part) {
    return text.find(part) != std::string::npos;
  };
  EXPECT_EQ(logic(a, {1}), "Scheduler::set_drafts: request 1 is not running");
  EXPECT_TRUE(has(logic(99, {1}), "request 99 was never added"));
  EXPECT_EQ(message_of<std::invalid_argument>([&] { s.set_drafts(a, {1, 2, 3}); }),
            "Scheduler::set_drafts: 3 drafts for request 1, more than num_speculative_tokens 2");

  std::optional<ScheduledStep> step = s.schedule();
  ASSERT_TRUE(step);
  ASSERT_EQ(step->rows.size(), 2u);
  EXPECT_FALSE(step->rows[1].needs_sample);
  EXPECT_EQ(logic(a, {1}),
            "Scheduler::set_drafts: request 1 is in step 0, which has not been committed");
  EXPECT_EQ(message_of<std::invalid_argument>([&] { s.commit(*step, Runs{}); }),
            "Scheduler::commit: tokens for 0 rows, but 1 rows of step 0 need a sample");
  EXPECT_EQ(message_of<std::invalid_argument>([&] { s.commit(*step, Runs{{}}); }),
            "Scheduler::commit: row 0 (request 1) keeps 0 tokens; it must keep 1 .. "
            "num_drafts + 1 = 1");
  EXPECT_EQ(message_of<std::invalid_argument>([&] { s.commit(*step, Runs{{5, 6}}); }),
            "Scheduler::commit: row 0 (request 1) keeps 2 tokens; it must keep 1 .. "
            "num_drafts + 1 = 1");
  EXPECT_TRUE(generated_of(s, a).empty());  // the failed commits changed nothing
  EXPECT_THROW(s.schedule(), std::logic_error);  // still awaiting its commit
  s.commit(*step, Runs{{5}});

  EXPECT_EQ(logic(b, {1}),
            "Scheduler::set_drafts: request 2 has 27 tokens to feed and 0 generated; drafts follow "
            "only a last sampled token");
  s.set_drafts(a, {6, 7});
  step = s.schedule();
  ASSERT_TRUE(step);
  ASSERT_EQ(step->rows[0].num_drafts, 2u);
  EXPECT_EQ(message_of<std::invalid_argument>([&] { s.commit(*step, Runs{{6, 7, 8, 9}}); }),
            "Scheduler::commit: row 0 (request 1) keeps 4 tokens; it must keep 1 .. "
            "num_drafts + 1 = 3");
  EXPECT_EQ(message_of<std::invalid_argument>([&] { s.commit(*step, Runs{{6}, {1}}); }),
            "Scheduler::commit: tokens for 2 rows, but 1 rows of step 1 need a sample");
  s.commit(*step, Runs{{6, 7, 8}});  // a reaches its 4 tokens
  EXPECT_EQ(s.state(a), RequestState::Finished);
  EXPECT_EQ(logic(a, {1}), "Scheduler::set_drafts: request 1 has finished");
  EXPECT_EQ(s.remaining_tokens(a), 0u);
  EXPECT_EQ(s.remaining_tokens(b), 5u);
  EXPECT_THROW(s.remaining_tokens(99), std::logic_error);
  EXPECT_THROW(s.remaining_tokens(0), std::logic_error);
}

TEST(SchedulerSpeculative, RequestThatCanNeverFitCountsTheLookahead) {
  // 8 pages of 16: 128 KV positions. With K = 3 a request needs prompt + max_new - 1 + 2.
  const SchedulerLimits limits{.max_batch_size = 4, .max_batch_input_tokens = 64, .page_size = 16,
                               .total_pages = 8, .max_length = 4096,
                               .num_speculative_tokens = 3};
  Harness h(limits);
  const Job fits{make_prompt(100, 1), 27};  // 128 positions
  const uint64_t ok = h.add(fits);
  const uint64_t too_long = h.add({make_prompt(100, 2), 28});  // 129 (fits without speculation)
  h.run();
  EXPECT_EQ(h.finished.at(too_long).reason, EndReason::Error);
  EXPECT_EQ(h.finished.at(too_long).error,
            "request needs 9 KV pages (prompt 100 + max_new_tokens 28 - 1 + num_speculative_tokens "
            "3 - 1 = 129 positions at page_size 16) but the KV cache has only 8 pages");
  EXPECT_EQ(h.finished.at(ok).generated, solo_completion(fits.prompt, fits.max_new));
  EXPECT_EQ(h.finished.at(ok).reason, EndReason::Length);
  h.expect_drained();
}

// The sweep: every K, many shapes of limits (one-token pages, one-row steps, a token budget that
// cuts drafts, pools so small that lookahead preempts), with and without a stop condition. The
// draft model accepts a pseudo-random number of drafts per row; completions equal the solo ones.
TEST(SchedulerSpeculative, CompletionsEqualPlainDecodingAcrossLimitsAndPreemption) {
  const std::vector<Job> jobs = twelve_jobs();
  std::vector<LimitsCase> cases(std::begin(kLimitsCases), std::end(kLimitsCases));
  const SchedulerLimits ample{.max_batch_size = 8, .max_batch_input_tokens = 256, .page_size = 16,
                              .total_pages = 512};
  cases.push_back({ample, 6, false});
  cases.push_back({{.max_batch_size = 8, .max_batch_input_tokens = 128, .page_size = 16,
                    .total_pages = 24}, 12, true});
  const StopFn stop = [](int32_t t) { return t % 16 == 3; };
  uint64_t fed = 0, accepted = 0, cut = 0;
  std::vector<uint64_t> preemptions(cases.size());
  for (uint32_t K = 1; K <= 4; ++K)
    for (size_t i = 0; i < cases.size(); ++i)
      for (bool with_stop : {false, true}) {
        const LimitsCase& c = cases[i];
        SchedulerLimits limits = c.limits;
        limits.num_speculative_tokens = K;
        SCOPED_TRACE(describe(limits) + (with_stop ? ", stop" : ""));
        Harness h(limits);
        if (with_stop) h.stop = stop;
        const std::vector<uint64_t> handles = run_staggered(h, jobs, c.added_at_start);
        expect_solo_completions(h, jobs, handles, with_stop ? stop : StopFn{});
        h.expect_drained();
        preemptions[i] += h.sched.preemptions();
        fed += h.drafts_fed;
        accepted += h.drafts_accepted;
        cut += h.drafts_cut;
        EXPECT_LE(h.drafts_accepted, h.drafts_fed);
      }
  for (size_t i = 0; i < cases.size(); ++i)
    if (cases[i].expect_preemption) {
      EXPECT_GT(preemptions[i], 0u) << "case " << i;
    }
  // The draft model's choices reach every branch: drafts accepted, rejected, and cut.
  EXPECT_GT(accepted, 0u);
  EXPECT_GT(fed - accepted, 0u);
  EXPECT_GT(cut, 0u);
  // Speculation saves steps: with ample pages and K = 4 a run takes fewer steps than K = 0.
  auto steps_with = [&](uint32_t K) {
    SchedulerLimits limits = ample;
    limits.num_speculative_tokens = K;
    Harness h(limits);
    run_staggered(h, jobs, 12);
    return h.steps.size();
  };
  EXPECT_LT(steps_with(4), steps_with(0));
}

}  // namespace
}  // namespace clshard
