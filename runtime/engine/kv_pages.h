// Host-side bookkeeping of the paged KV cache: which page ids are free and which pages each request
// holds. The device cache (one buffer of total_pages + 1 pages per device) never sees this; it only
// receives the per-step lookup tables built from it (runtime/step.h). Page ids are shared by every
// layer and every device of a replica, as in MAX (max-reference.md §4).
#pragma once

#include <cstdint>
#include <optional>
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
  uint32_t free_count() const { return uint32_t(free_list_.size()); }
  uint32_t used_count() const { return total_pages_ - free_count(); }

  // A free page id, or nullopt when every page is in use (the scheduler then preempts).
  std::optional<uint32_t> try_allocate();
  // As try_allocate, but exhaustion is a std::runtime_error (for callers that cannot wait).
  uint32_t allocate();
  // Returns a page to the pool. Freeing a page that is not allocated (double free), the null page or
  // an id outside the pool is a std::logic_error: it means two owners think they hold one page.
  void free(uint32_t page);
  bool is_allocated(uint32_t page) const { return page < total_pages_ && allocated_[page]; }

 private:
  uint32_t total_pages_;
  // A stack: pages come out in id order at first, and a freed page is the next one handed out, so
  // allocation is deterministic given the same sequence of calls.
  std::vector<uint32_t> free_list_;
  std::vector<bool> allocated_;
};

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
  // Gives every page back to the pool.
  void release();

 private:
  KvPagePool* pool_;
  uint32_t page_size_;
  std::vector<uint32_t> pages_;
};

}  // namespace clshard
