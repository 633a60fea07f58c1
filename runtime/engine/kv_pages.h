// Host-side bookkeeping of the paged KV cache: which page ids are free and which pages each request
// holds. The device cache (one buffer of total_pages + 1 pages per device) never sees this; it only
// receives the per-step lookup tables built from it (runtime/step.h). Page ids are shared by every
// layer and every device of a replica, as in MAX (max-reference.md §4), and by a speculative
// draft's cache, so everything here is model-agnostic.
//
// Prefix caching (vLLM's automatic prefix caching): a full page whose positions are computed can be
// published under the hash of its tokens and of everything before them (prefix_page_hashes). Pages
// are reference-counted: a request that starts with the same tokens takes the published pages
// (acquire) instead of computing them. A published page nobody references stays cached, and is
// handed out again — evicted, least recently released first — only when no page is free.
#pragma once

#include <cstdint>
#include <list>
#include <optional>
#include <span>
#include <unordered_map>
#include <vector>

namespace clshard {

class KvPagePool {
 public:
  // total_pages real pages, ids 0 .. total_pages-1; id total_pages is the null page.
  explicit KvPagePool(uint32_t total_pages);
  KvPagePool(const KvPagePool&) = delete;
  KvPagePool& operator=(const KvPagePool&) = delete;

  uint32_t total_pages() const { return total_pages_; }
  // The spare page the device cache also allocates: lookup tables are padded with it so that
  // kernels reading past a row's last page stay in bounds. Never handed out, never freed.
  uint32_t null_page() const { return total_pages_; }
  // Pages try_allocate can hand out now: free ones and cached ones nobody references.
  uint32_t free_count() const { return uint32_t(free_list_.size() + evictable_.size()); }
  // Pages some owner references.
  uint32_t used_count() const { return total_pages_ - free_count(); }
  uint32_t cached_count() const { return uint32_t(page_of_hash_.size()); }  // published pages
  uint32_t evictable_count() const { return uint32_t(evictable_.size()); }  // ... unreferenced
  uint64_t evictions() const { return evictions_; }

  // A page id with one reference, or nullopt when every page is referenced (the scheduler then
  // preempts). A free page if there is one, else the least recently released cached page, which
  // leaves the cache.
  std::optional<uint32_t> try_allocate();
  // As try_allocate, but exhaustion is a std::runtime_error (for callers that cannot wait).
  uint32_t allocate();
  // Drops one reference to a page. The last one makes it free, or, if it is published, evictable
  // (still found by find_cached). Freeing a page nobody references (double free), the null page or
  // an id outside the pool is a std::logic_error: it means two owners think they hold one page.
  void free(uint32_t page);
  bool is_allocated(uint32_t page) const { return page < total_pages_ && refs_[page] > 0; }
  uint32_t ref_count(uint32_t page) const { return page < total_pages_ ? refs_[page] : 0; }

  // Prefix caching. The page published under `hash`, referenced or not.
  std::optional<uint32_t> find_cached(uint64_t hash) const;
  // One more reference to a published page (taking it out of the evictable ones).
  // std::logic_error for a page that is neither referenced nor published.
  void acquire(uint32_t page);
  // Publishes a referenced page whose positions are all computed under the hash of its content.
  // False (and nothing changes) when another page already holds that hash (two requests computed
  // the same prefix side by side; the second copy stays private and is freed with its owner) or
  // this page already holds another one; true when it is (now) published under `hash`.
  bool publish(uint32_t page, uint64_t hash);
  std::optional<uint64_t> hash_of(uint32_t page) const;

 private:
  uint32_t total_pages_;
  // A stack: pages come out in id order at first, and a freed page is the next one handed out, so
  // allocation is deterministic given the same sequence of calls.
  std::vector<uint32_t> free_list_;
  std::vector<uint32_t> refs_;  // references per page
  // Published pages: hash -> page, and per page its hash (when published).
  std::unordered_map<uint64_t, uint32_t> page_of_hash_;
  std::vector<std::optional<uint64_t>> hash_of_page_;
  // Published pages nobody references, least recently released at the front (evicted first).
  std::list<uint32_t> evictable_;
  std::vector<std::list<uint32_t>::iterator> evictable_pos_;
  uint64_t evictions_ = 0;
};

// The hash chain of a token sequence's full pages: hash i covers tokens [0, (i + 1) * page_size)
// and the adapter (0: the base model), so equal hashes mean equal KV contents. Appends to `hashes`
// the hashes of the full pages after the first hashes.size() ones (computing only what is new).
void extend_prefix_page_hashes(std::vector<uint64_t>& hashes, std::span<const int32_t> tokens,
                               uint32_t page_size, uint32_t adapter_id);

// One request's pages, in position order: position p lives in pages()[p / page_size] at slot
// p % page_size. It grows by whole pages as the request needs positions and gives everything back
// on release() or destruction. The pool must outlive the table.
class KvPageTable {
 public:
  KvPageTable(KvPagePool& pool, uint32_t page_size);
  ~KvPageTable() { release(); }
  KvPageTable(KvPageTable&& other) noexcept;
  KvPageTable& operator=(KvPageTable&& other) noexcept;
  KvPageTable(const KvPageTable&) = delete;
  KvPageTable& operator=(const KvPageTable&) = delete;

  // Pages needed to hold positions [0, positions).
  static uint32_t pages_for(uint64_t positions, uint32_t page_size);

  const std::vector<uint32_t>& pages() const { return pages_; }
  uint32_t num_pages() const { return uint32_t(pages_.size()); }
  uint32_t page_size() const { return page_size_; }
  uint64_t capacity() const { return uint64_t(pages_.size()) * page_size_; }
  // How many more pages ensure_capacity(positions) would take from the pool.
  uint32_t pages_missing(uint64_t positions) const;
  // Grows the table to hold positions [0, positions). All or nothing: when the pool has too few
  // free pages it takes none and returns false. Never shrinks.
  bool ensure_capacity(uint64_t positions);
  // Appends a published page (prefix caching), taking a reference to it.
  void append_cached(uint32_t page);
  // Gives every page back to the pool.
  void release();

 private:
  KvPagePool* pool_;
  uint32_t page_size_;
  std::vector<uint32_t> pages_;
};

}  // namespace clshard
