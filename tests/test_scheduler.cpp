// The scheduler and KV page bookkeeping, checked against a fake model that really goes through the
// paged cache: every row's new tokens are written at cache_lengths[b] + j through the lookup table,
// then the row's whole sequence is read back through the table and the next token is a hash of it.
// Wrong pages, cache lengths, offsets or a page shared by two live requests change the tokens, so
// "batched == solo" below checks the step inputs themselves, not just the scheduler's counters.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
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
class PagedHashModel {
 public:
  PagedHashModel(uint32_t page_size, uint32_t total_pages)
      : page_size_(page_size),
        total_pages_(total_pages),
        kv_(size_t(total_pages + 1) * page_size, kUnwritten) {}

  // Returns the token of every row with needs_sample, in row order.
  std::vector<int32_t> forward(const ScheduledStep& step) {
    const StepInputs& in = step.inputs;
    in.validate(page_size_, total_pages_);  // throws (failing the test) on malformed inputs
    EXPECT_EQ(in.return_logits, ReturnLogits::LastToken);
    EXPECT_EQ(step.rows.size(), in.num_rows());
    auto slot = [&](size_t b, uint32_t pos) {
      const uint32_t page = in.lookup_table[b * in.pages_per_row + pos / page_size_];
      return size_t(page) * page_size_ + pos % page_size_;
    };
    // As a real layer does: store every row's new K/V first, then attend.
    for (size_t b = 0; b < in.num_rows(); ++b)
      for (uint32_t j = 0; j < in.row_length(b); ++j)
        kv_[slot(b, in.cache_lengths[b] + j)] = in.tokens[in.input_row_offsets[b] + j];
    std::vector<int32_t> sampled;
    for (size_t b = 0; b < in.num_rows(); ++b) {
      const uint32_t end = in.cache_lengths[b] + in.row_length(b);
      std::vector<int32_t> sequence(end);
      for (uint32_t pos = 0; pos < end; ++pos) sequence[pos] = kv_[slot(b, pos)];
      EXPECT_EQ(std::count(sequence.begin(), sequence.end(), kUnwritten), 0)
          << "row " << b << " reads a position nothing wrote";
      if (step.rows[b].needs_sample) sampled.push_back(next_token_of(sequence));
    }
    return sampled;
  }

 private:
  uint32_t page_size_, total_pages_;
  std::vector<int32_t> kv_;
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
// under it.
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

  uint64_t add(const Job& job) { return sched.add(job.prompt, job.max_new); }

  // One engine iteration; false when the scheduler has nothing left.
  bool step() {
    std::optional<ScheduledStep> step = sched.schedule();
    if (!step) return false;
    check_limits(*step);
    check_page_ownership(*step);
    std::vector<int32_t> sampled = model.forward(*step);
    // Stop conditions are checked before commit, as the engine does: finish() then takes effect
    // at commit, with the stop token kept.
    size_t k = 0;
    for (const ScheduledRow& row : step->rows)
      if (row.needs_sample) {
        EXPECT_EQ(row.num_generated, sched.generated_tokens(row.handle).size());
        if (stop && k < sampled.size() && stop(sampled[k])) sched.finish(row.handle, EndReason::Stop);
        ++k;
      }
    sched.commit(*step, sampled);
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

 private:
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
    for (size_t b = 0; b < s.rows.size(); ++b) {
      const uint64_t h = s.rows[b].handle;
      const uint32_t end = in.cache_lengths[b] + in.row_length(b);
      const uint32_t used = KvPageTable::pages_for(end, limits.page_size);
      std::vector<uint32_t> pages(in.lookup_table.begin() + b * in.pages_per_row,
                                  in.lookup_table.begin() + b * in.pages_per_row + used);
      for (uint32_t i = used; i < in.pages_per_row; ++i)
        EXPECT_EQ(in.lookup_table[b * in.pages_per_row + i], null_page)
            << "row " << b << " holds pages beyond what its positions need";
      auto known = pages_of_.find(h);
      if (in.cache_lengths[b] == 0) {
        EXPECT_TRUE(known == pages_of_.end()) << "request " << h << " restarts holding pages";
      } else {
        ASSERT_TRUE(known != pages_of_.end()) << "request " << h << " continues with no pages";
        ASSERT_LE(known->second.size(), pages.size());
        EXPECT_TRUE(std::equal(known->second.begin(), known->second.end(), pages.begin()))
            << "request " << h << "'s pages changed while it ran";
      }
      for (uint32_t p : pages) {
        auto [it, fresh] = owner_.emplace(p, h);
        EXPECT_EQ(it->second, h) << "page " << p << " of running request " << it->second
                                 << " given to request " << h;
      }
      pages_of_[h] = pages;
    }
    size_t tracked = 0;
    for (auto& [h, pages] : pages_of_) tracked += pages.size();
    EXPECT_EQ(tracked, sched.pages_in_use());
  }

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

// Many shapes of limits, down to one-token pages and one-row steps.
TEST(Scheduler, CompletionsMatchAcrossLimits) {
  const std::vector<Job> jobs = twelve_jobs();
  struct Case {
    SchedulerLimits limits;
    size_t added_at_start;  // the others join one per step
    bool expect_preemption;
  };
  const Case cases[] = {
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
  for (const Case& c : cases) {
    SCOPED_TRACE("batch " + std::to_string(c.limits.max_batch_size) + ", tokens " +
                 std::to_string(c.limits.max_batch_input_tokens) + ", page_size " +
                 std::to_string(c.limits.page_size) + ", pages " +
                 std::to_string(c.limits.total_pages));
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
  const SchedulerLimits limits{.max_batch_size = 5, .max_batch_input_tokens = 96,
                               .page_size = 8, .total_pages = 60, .max_length = 4096};
  Harness first(limits), second(limits);
  run_staggered(first, jobs, 3);
  run_staggered(second, jobs, 3);
  EXPECT_GT(first.sched.preemptions(), 0u);
  ASSERT_EQ(first.steps.size(), second.steps.size());
  for (size_t s = 0; s < first.steps.size(); ++s) {
    const StepInputs &x = first.steps[s].inputs, &y = second.steps[s].inputs;
    EXPECT_EQ(x.tokens, y.tokens);
    EXPECT_EQ(x.input_row_offsets, y.input_row_offsets);
    EXPECT_EQ(x.cache_lengths, y.cache_lengths);
    EXPECT_EQ(x.lookup_table, y.lookup_table);
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
  EXPECT_THROW(s.commit(*step, {}), std::invalid_argument);  // one row needs a sample
  EXPECT_EQ(s.generated_tokens(h).size(), 0u);  // the failed commit changed nothing
  s.commit(*step, {42});
  EXPECT_THROW(s.commit(*step, {42}), std::logic_error);  // committed already
  EXPECT_EQ(std::vector<int32_t>(s.generated_tokens(h).begin(), s.generated_tokens(h).end()),
            std::vector<int32_t>{42});
  EXPECT_THROW(s.state(77), std::logic_error);
}

}  // namespace
}  // namespace clshard
