// Prefix caching in the page pool and the scheduler, host-side only (no model):
//   * the pool's reference counts, publication, lookup and least-recently-released eviction;
//   * the scheduler reuses leading published pages, keeps one token to compute, waits a step for a
//     prefix a running request is computing, keeps a preempted request's prefix, keys on the
//     adapter, and counts cached and computed positions (32 prompts sharing 200 tokens);
//   * a stress test over random prompt trees under a page budget that forces eviction and
//     preemption, with and without speculative drafts: the test plays the device, writing what
//     each position of the target's and the draft's caches would hold (a hash of the tokens up to
//     it), and asserts at every step that every row reads only its own tokens' contents below its
//     cache length, that every published page holds what its hash says, and that every page's
//     reference count is the number of requests holding it;
//   * cache-aware routing (parallel::Topology::route_request).
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <random>
#include <set>

#include "parallel/topology.h"
#include "runtime/engine/kv_pages.h"
#include "runtime/engine/scheduler.h"

namespace clshard {
namespace {

TEST(PrefixCachePool, PublishedPagesStayCachedAndAreEvictedLeastRecentlyReleasedFirst) {
  KvPagePool pool(4);
  const uint32_t a = pool.allocate(), b = pool.allocate(), c = pool.allocate();
  EXPECT_TRUE(pool.publish(a, 100));
  EXPECT_TRUE(pool.publish(b, 200));
  EXPECT_TRUE(pool.publish(a, 100));    // again, same hash: still true, nothing changes
  EXPECT_FALSE(pool.publish(c, 100));   // another page holds 100: c stays private
  EXPECT_FALSE(pool.publish(a, 300));   // a holds 100 already
  EXPECT_EQ(pool.cached_count(), 2u);
  EXPECT_EQ(pool.find_cached(100), std::optional<uint32_t>(a));
  EXPECT_EQ(pool.find_cached(300), std::nullopt);
  // A second owner of a: two references; freeing one keeps it in use.
  pool.acquire(a);
  EXPECT_EQ(pool.ref_count(a), 2u);
  pool.free(a);
  EXPECT_EQ(pool.ref_count(a), 1u);
  EXPECT_EQ(pool.free_count(), 1u);
  // Released: b first, then a; c (private) goes back to the free list.
  pool.free(b);
  pool.free(a);
  pool.free(c);
  EXPECT_EQ(pool.free_count(), 4u);
  EXPECT_EQ(pool.used_count(), 0u);
  EXPECT_EQ(pool.evictable_count(), 2u);
  EXPECT_THROW(pool.free(a), std::logic_error);  // no reference left: a double free
  // Free pages go first (c, then the never-used page), then b (released before a).
  EXPECT_EQ(pool.allocate(), c);
  pool.allocate();
  EXPECT_EQ(pool.evictions(), 0u);
  EXPECT_EQ(pool.allocate(), b);
  EXPECT_EQ(pool.evictions(), 1u);
  EXPECT_EQ(pool.find_cached(200), std::nullopt);  // evicted: no longer found
  EXPECT_EQ(pool.hash_of(b), std::nullopt);
  // a is still cached; taking it makes it unevictable, so the pool is now exhausted.
  pool.acquire(a);
  EXPECT_EQ(pool.evictable_count(), 0u);
  EXPECT_FALSE(pool.try_allocate().has_value());
}

TEST(PrefixCachePool, AcquiringAPageNeitherReferencedNorCachedIsALogicError) {
  KvPagePool pool(2);
  EXPECT_THROW(pool.acquire(0), std::logic_error);
  EXPECT_THROW(pool.publish(1, 7), std::logic_error);  // nobody references it
}

TEST(PrefixCacheHashes, ChainCoversEverythingBeforeAndTheAdapter) {
  std::vector<int32_t> t(40);
  for (int i = 0; i < 40; ++i) t[i] = i + 1;
  std::vector<uint64_t> h, h2, h_adapter, h_diff;
  extend_prefix_page_hashes(h, t, 16, 0);
  ASSERT_EQ(h.size(), 2u);  // 40 tokens: 2 full pages
  // Computed in pieces: the same chain.
  extend_prefix_page_hashes(h2, std::span<const int32_t>(t).first(20), 16, 0);
  ASSERT_EQ(h2.size(), 1u);
  extend_prefix_page_hashes(h2, t, 16, 0);
  EXPECT_EQ(h2, h);
  extend_prefix_page_hashes(h_adapter, t, 16, 3);
  EXPECT_NE(h_adapter[0], h[0]);
  // A different first token changes the second page's hash too.
  auto u = t;
  u[0] = 999;
  extend_prefix_page_hashes(h_diff, u, 16, 0);
  EXPECT_NE(h_diff[0], h[0]);
  EXPECT_NE(h_diff[1], h[1]);
}

SchedulerLimits caching_limits(uint32_t pages = 64) {
  SchedulerLimits l;
  l.max_batch_size = 8;
  l.max_batch_input_tokens = 256;
  l.page_size = 16;
  l.total_pages = pages;
  l.max_length = 4096;
  l.prefix_caching = true;
  return l;
}

std::vector<int32_t> seq(int32_t from, size_t n) {
  std::vector<int32_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = from + int32_t(i);
  return v;
}

std::vector<int32_t> cat(std::vector<int32_t> a, const std::vector<int32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// Runs every request to the end, one sampled token (7) per row.
void drain(Scheduler& s) {
  while (auto step = s.schedule()) s.commit(*step, std::vector<int32_t>(step->num_samples(), 7));
  s.take_finished();
}

TEST(PrefixCacheScheduler, ASecondRequestTakesThePublishedPagesAndComputesTheRest) {
  Scheduler s(caching_limits());
  const auto shared = seq(1, 40);  // pages 0 and 1 full, 8 tokens into page 2
  const uint64_t a = s.add(cat(shared, seq(100, 5)), 2);
  auto step = s.schedule();
  ASSERT_TRUE(step);
  EXPECT_EQ(step->rows.size(), 1u);
  EXPECT_EQ(step->rows[0].cache_length, 0u);
  s.commit(*step, std::vector<int32_t>{7});
  EXPECT_EQ(s.pool().cached_count(), 2u);  // 45 positions computed: 2 full pages published
  const std::vector<uint32_t> a_pages = s.pages_of(a);
  const uint64_t b = s.add(cat(shared, seq(200, 9)), 2);
  step = s.schedule();
  ASSERT_TRUE(step);
  ASSERT_EQ(step->rows.size(), 2u);
  EXPECT_EQ(step->rows[1].handle, b);
  EXPECT_EQ(step->rows[1].cache_length, 32u);  // two pages taken
  EXPECT_EQ(step->rows[1].num_tokens, 49u - 32u);
  EXPECT_EQ(s.pages_of(b)[0], a_pages[0]);
  EXPECT_EQ(s.pages_of(b)[1], a_pages[1]);
  EXPECT_NE(s.pages_of(b)[2], a_pages[2]);
  EXPECT_EQ(s.pool().ref_count(a_pages[0]), 2u);
  EXPECT_EQ(s.cached_tokens(), 32u);
  EXPECT_EQ(s.prefill_tokens(), 45u + 17u);
  s.commit(*step, std::vector<int32_t>{7, 7});
  drain(s);
  EXPECT_EQ(s.pages_in_use(), 0u);
  EXPECT_GE(s.pool().cached_count(), 3u);  // a's pages 0, 1 and b's page 2 (49 + 1 positions)
}

TEST(PrefixCacheScheduler, APromptOfWholeCachedPagesKeepsItsLastTokenToCompute) {
  Scheduler s(caching_limits());
  s.add(seq(1, 40), 1);
  drain(s);
  // 32 tokens: both pages are cached, but the last token must be computed for logits: one page
  // is taken, the second computed again.
  s.add(seq(1, 32), 1);
  auto step = s.schedule();
  ASSERT_TRUE(step);
  EXPECT_EQ(step->rows[0].cache_length, 16u);
  EXPECT_EQ(step->rows[0].num_tokens, 16u);
  EXPECT_TRUE(step->rows[0].needs_sample);
  s.commit(*step, std::vector<int32_t>{7});
}

TEST(PrefixCacheScheduler, AdmissionWaitsAStepForAPrefixARunningRequestIsComputing) {
  Scheduler s(caching_limits());
  const auto shared = seq(1, 64);
  s.add(cat(shared, seq(100, 3)), 4);
  const uint64_t b = s.add(cat(shared, seq(200, 3)), 4);
  auto step = s.schedule();
  ASSERT_TRUE(step);
  EXPECT_EQ(step->rows.size(), 1u) << "b should wait for a's pages";
  EXPECT_EQ(s.state(b), RequestState::Waiting);
  s.commit(*step, std::vector<int32_t>{7});
  step = s.schedule();
  ASSERT_TRUE(step);
  ASSERT_EQ(step->rows.size(), 2u);
  EXPECT_EQ(step->rows[1].cache_length, 64u);
  EXPECT_EQ(step->rows[1].num_tokens, 3u);
  s.commit(*step, std::vector<int32_t>{7, 7});
  // A different prompt does not wait.
  Scheduler t(caching_limits());
  t.add(cat(shared, seq(100, 3)), 4);
  t.add(seq(500, 70), 4);
  step = t.schedule();
  ASSERT_TRUE(step);
  EXPECT_EQ(step->rows.size(), 2u);
}

TEST(PrefixCacheScheduler, TheSameTokensUnderAnotherAdapterAreAnotherPrefix) {
  Scheduler s(caching_limits());
  s.add(seq(1, 40), 1, 0);
  drain(s);
  s.add(seq(1, 40), 1, 2);
  auto step = s.schedule();
  ASSERT_TRUE(step);
  EXPECT_EQ(step->rows[0].cache_length, 0u);
  s.commit(*step, std::vector<int32_t>{7});
  s.add(seq(1, 40), 1, 2);
  step = s.schedule();
  ASSERT_TRUE(step);
  EXPECT_EQ(step->rows[0].cache_length, 32u);
  s.commit(*step, std::vector<int32_t>{7});
}

TEST(PrefixCacheScheduler, APreemptedRequestTakesItsOwnPagesBackWhenNobodyEvictedThem) {
  SchedulerLimits l = caching_limits(6);
  l.max_batch_input_tokens = 64;
  Scheduler s(l);
  // a: 40-token prompt (3 pages), b: 40-token prompt; together they need 6 pages, and b's decode
  // past position 47 needs a 4th page for one of them: the newest (b) is preempted.
  const uint64_t a = s.add(seq(1, 40), 20);
  const uint64_t b = s.add(seq(300, 40), 20);
  uint64_t preempted_at = 0;
  for (int i = 0; i < 40 && s.has_unfinished(); ++i) {
    auto step = s.schedule();
    ASSERT_TRUE(step);
    if (s.preemptions() > 0 && preempted_at == 0) {
      preempted_at = s.steps();
      // b gave its pages up; its full pages stay cached.
      EXPECT_EQ(s.state(b), RequestState::Waiting);
      EXPECT_GE(s.pool().evictable_count(), 2u);
    }
    s.commit(*step, std::vector<int32_t>(step->num_samples(), 7));
  }
  EXPECT_FALSE(s.has_unfinished());
  EXPECT_GT(s.preemptions(), 0u);
  // b's re-admission took cached pages instead of recomputing all of them.
  EXPECT_GE(s.cached_tokens(), 32u);
  auto done = s.take_finished();
  ASSERT_EQ(done.size(), 2u);
  for (const auto& f : done) {
    EXPECT_EQ(f.generated.size(), 20u);
    if (f.handle == b) {
      EXPECT_GE(f.cached_tokens, 32u);
    }
    if (f.handle == a) {
      EXPECT_EQ(f.preemptions, 0u);
    }
  }
}

// 32 prompts sharing a 200-token prefix: the counted prefill positions with caching off and on.
TEST(PrefixCacheScheduler, ThirtyTwoPromptsSharingTwoHundredTokensComputeEightyPercentLess) {
  auto run = [](bool caching) {
    SchedulerLimits l = caching_limits(512);
    l.max_batch_size = 32;
    l.max_batch_input_tokens = 2048;
    l.prefix_caching = caching;
    Scheduler s(l);
    for (int i = 0; i < 32; ++i) s.add(cat(seq(1, 200), seq(1000 + 10 * i, 8)), 4);
    drain(s);
    return std::pair{s.prefill_tokens(), s.cached_tokens()};
  };
  const auto [off_computed, off_cached] = run(false);
  const auto [on_computed, on_cached] = run(true);
  EXPECT_EQ(off_computed, 32u * 208u);
  EXPECT_EQ(off_cached, 0u);
  // The first request computes all 208; each other takes 12 pages (192 tokens: page 12 holds
  // prefix and suffix) and computes 16.
  EXPECT_EQ(on_cached, 31u * 192u);
  EXPECT_EQ(on_computed, 208u + 31u * 16u);
  EXPECT_LE(double(on_computed), 0.2 * double(off_computed));
}

// ---- The stress test -------------------------------------------------------------------------

uint64_t mix(uint64_t h, int32_t token) {
  h = (h ^ uint64_t(uint32_t(token))) * 0x100000001b3ull;
  return h ^ (h >> 29);
}

// What position p of a cache holds when computed after `tokens` (tokens[0..p]).
std::vector<uint64_t> contents(const std::vector<int32_t>& tokens) {
  std::vector<uint64_t> c(tokens.size());
  uint64_t h = 0xcbf29ce484222325ull;
  for (size_t i = 0; i < tokens.size(); ++i) c[i] = h = mix(h, tokens[i]);
  return c;
}

struct StressCase {
  uint32_t K;
  uint32_t seed;
};

class PrefixCacheStress : public ::testing::TestWithParam<StressCase> {};

TEST_P(PrefixCacheStress, NoRowEverReadsAnotherSequencesContentAndRefcountsAreExact) {
  const auto [K, seed] = GetParam();
  std::mt19937 rng(seed);
  auto uni = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  SchedulerLimits l;
  l.max_batch_size = 5;
  l.max_batch_input_tokens = 24;
  l.page_size = 4;
  l.total_pages = 28;
  l.max_length = 256;
  l.num_speculative_tokens = K;
  l.prefix_caching = true;
  Scheduler s(l);
  const uint32_t P = l.page_size, slots = (l.total_pages + 1) * P;
  // The device: the target's cache and the draft's (same page ids), one content per position.
  std::vector<uint64_t> target(slots, 1), draft(slots, 1);
  // Random prompt trees: a few roots, branches off them, random tails, small vocabulary.
  std::vector<std::vector<int32_t>> trunks;
  for (int i = 0; i < 4; ++i) {
    std::vector<int32_t> t;
    for (int j = uni(0, 30); j > 0; --j) t.push_back(uni(1, 5));
    trunks.push_back(t);
  }
  auto new_prompt = [&] {
    std::vector<int32_t> p = trunks[uni(0, int(trunks.size()) - 1)];
    for (int j = uni(1, 12); j > 0; --j) p.push_back(uni(1, 3));
    if (uni(0, 3) == 0) trunks.push_back(p);  // later prompts may branch off this one
    return p;
  };
  struct Live {
    std::vector<int32_t> prompt, tokens;  // tokens: prompt + what the scheduler kept
    uint32_t adapter = 0;
  };
  std::map<uint64_t, Live> live;
  std::map<uint64_t, std::vector<uint64_t>> expected_page;  // page hash -> its positions' contents
  auto note_pages = [&](const Live& r) {
    std::vector<uint64_t> hashes;
    extend_prefix_page_hashes(hashes, r.tokens, P, r.adapter);
    const auto c = contents(r.tokens);
    for (size_t i = 0; i < hashes.size(); ++i)
      expected_page[hashes[i]].assign(c.begin() + i * P, c.begin() + (i + 1) * P);
  };
  auto add = [&] {
    Live r;
    r.prompt = r.tokens = new_prompt();
    r.adapter = uni(0, 5) == 0 ? 1 : 0;
    const uint64_t h = s.add(r.prompt, uint32_t(uni(1, 14)), r.adapter);
    note_pages(r);
    if (s.state(h) != RequestState::Finished) live[h] = r;
  };
  for (int i = 0; i < 12; ++i) add();
  int added = 12, steps = 0;
  uint64_t rows_checked = 0, positions_checked = 0;
  while (s.has_unfinished() || added < 60) {
    if (added < 60 && uni(0, 2) == 0) {
      add();
      ++added;
    }
    auto step = s.schedule();
    if (!step) continue;
    ASSERT_LT(++steps, 5000) << "no progress";
    const StepInputs& in = step->inputs;
    auto slot = [&](size_t b, uint32_t pos) {
      return size_t(in.lookup_table[b * in.pages_per_row + pos / P]) * P + pos % P;
    };
    // Every row reads only its own sequence's contents below its cache length, in both caches.
    for (size_t b = 0; b < step->rows.size(); ++b) {
      const ScheduledRow& row = step->rows[b];
      const auto want = contents(live.at(row.handle).tokens);
      for (uint32_t p = 0; p < row.cache_length; ++p) {
        ASSERT_EQ(target[slot(b, p)], want[p])
            << "request " << row.handle << " position " << p << " step " << steps;
        if (K > 0) {
          ASSERT_EQ(draft[slot(b, p)], want[p])
              << "draft cache, request " << row.handle << " position " << p << " step " << steps;
        }
        ++positions_checked;
      }
      ++rows_checked;
    }
    // The target writes every token of every row (drafts included, accepted or not).
    for (size_t b = 0; b < step->rows.size(); ++b) {
      const ScheduledRow& row = step->rows[b];
      const auto& t = live.at(row.handle).tokens;
      std::vector<int32_t> written(t.begin(), t.begin() + row.cache_length);
      written.insert(written.end(), in.tokens.begin() + in.input_row_offsets[b],
                     in.tokens.begin() + in.input_row_offsets[b + 1]);
      const auto c = contents(written);
      for (uint32_t p = row.cache_length; p < written.size(); ++p) target[slot(b, p)] = c[p];
    }
    // Sampling: each drafting row accepts a random prefix of its drafts; requests stop at random.
    std::vector<std::vector<int32_t>> committed;
    for (size_t b = 0; b < step->rows.size(); ++b) {
      const ScheduledRow& row = step->rows[b];
      if (!row.needs_sample) continue;
      const uint32_t end = in.input_row_offsets[b + 1];
      const uint32_t n = uint32_t(uni(0, int(row.num_drafts)));
      std::vector<int32_t> kept(in.tokens.begin() + (end - row.num_drafts),
                                in.tokens.begin() + (end - row.num_drafts + n));
      kept.push_back(uni(1, 3));
      if (uni(0, 15) == 0) s.finish(row.handle, EndReason::Stop);
      committed.push_back(kept);
    }
    s.commit(*step, committed);
    for (auto& [h, r] : live) {
      if (s.state(h) == RequestState::Finished) continue;
      const auto gen = s.generated_tokens(h);
      r.tokens = r.prompt;
      r.tokens.insert(r.tokens.end(), gen.begin(), gen.end());
      note_pages(r);
    }
    // The draft runs over each row after commit unless its request ended: step 0 writes the
    // positions just computed (an intermediate chunk's, or a verified row's up to the last kept
    // token), steps 1..K-1 the K - 1 positions after them (junk for this test).
    if (K > 0) {
      for (size_t b = 0, i = 0; b < step->rows.size(); ++b) {
        const ScheduledRow& row = step->rows[b];
        const size_t kept = row.needs_sample ? committed[i++].size() : 0;
        if (s.state(row.handle) == RequestState::Finished) continue;
        const auto c = contents(live.at(row.handle).tokens);
        const uint32_t end = row.needs_sample
                                 ? row.cache_length + (row.num_tokens - row.num_drafts) +
                                       uint32_t(kept) - 1
                                 : row.cache_length + row.num_tokens;
        for (uint32_t p = row.cache_length; p < end; ++p) draft[slot(b, p)] = c[p];
        if (row.needs_sample)
          for (uint32_t j = 1; j < K; ++j) draft[slot(b, end + j - 1)] = uint64_t(rng());
      }
    }
    for (auto& f : s.take_finished()) live.erase(f.handle);
    // Reference counts: each page's is the number of live requests holding it.
    std::map<uint32_t, uint32_t> holders;
    for (const auto& [h, r] : live)
      for (uint32_t page : s.pages_of(h)) ++holders[page];
    for (uint32_t page = 0; page < l.total_pages; ++page) {
      const auto it = holders.find(page);
      ASSERT_EQ(s.pool().ref_count(page), it == holders.end() ? 0u : it->second)
          << "page " << page << " step " << steps;
    }
    ASSERT_EQ(s.pool().used_count(), holders.size());
    // Every published page holds what its hash says, in both caches.
    for (uint32_t page = 0; page < l.total_pages; ++page) {
      const auto hash = s.pool().hash_of(page);
      if (!hash) continue;
      const auto& want = expected_page.at(*hash);
      for (uint32_t j = 0; j < P; ++j) {
        ASSERT_EQ(target[size_t(page) * P + j], want[j]) << "published page " << page;
        if (K > 0) {
          ASSERT_EQ(draft[size_t(page) * P + j], want[j]) << "published page " << page;
        }
      }
    }
  }
  EXPECT_GT(rows_checked, 100u);
  EXPECT_GT(positions_checked, 1000u);
  // The budget was small enough to exercise what the test is about.
  EXPECT_GT(s.preemptions(), 0u);
  EXPECT_GT(s.pool().evictions(), 0u);
  EXPECT_GT(s.cached_tokens(), 0u);
}

INSTANTIATE_TEST_SUITE_P(Seeds, PrefixCacheStress,
                         ::testing::Values(StressCase{0, 1}, StressCase{0, 2}, StressCase{0, 3},
                                           StressCase{2, 1}, StressCase{2, 2}, StressCase{3, 3}),
                         [](const auto& info) {
                           return "K" + std::to_string(info.param.K) + "_seed" +
                                  std::to_string(info.param.seed);
                         });

TEST(PrefixCacheRouting, LongestPrefixWithinTheLoadMarginElseLeastLoaded) {
  using parallel::Topology;
  // Nothing cached anywhere: the least loaded.
  EXPECT_EQ(Topology::route_request({0, 0, 0}, {3, 1, 2}, 4), 1u);
  // Replica 2 holds 64 tokens and is within the margin of the least loaded.
  EXPECT_EQ(Topology::route_request({0, 16, 64}, {3, 1, 5}, 4), 2u);
  // ... but not when it is busier by more than the margin.
  EXPECT_EQ(Topology::route_request({0, 16, 64}, {3, 1, 6}, 4), 1u);
  // Equal prefixes: the less loaded of them, then the lower index.
  EXPECT_EQ(Topology::route_request({64, 64, 0}, {3, 2, 0}, 4), 1u);
  EXPECT_EQ(Topology::route_request({64, 64, 0}, {2, 2, 0}, 4), 0u);
  EXPECT_THROW(Topology::route_request({0}, {1, 2}, 4), std::invalid_argument);
}

}  // namespace
}  // namespace clshard
