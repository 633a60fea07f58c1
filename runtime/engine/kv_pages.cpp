#include "runtime/engine/kv_pages.h"

#include <limits>
#include <stdexcept>
#include <string>
#include <utility>

namespace clshard {

KvPagePool::KvPagePool(uint32_t total_pages)
    : total_pages_(total_pages), allocated_(total_pages, false) {
  // The null page's id is total_pages, so it must itself be a representable uint32 page id.
  if (total_pages == std::numeric_limits<uint32_t>::max())
    throw std::invalid_argument("KvPagePool: total_pages must leave room for the null page id");
  free_list_.reserve(total_pages);
  for (uint32_t p = total_pages; p > 0; --p) free_list_.push_back(p - 1);
}

std::optional<uint32_t> KvPagePool::try_allocate() {
  if (free_list_.empty()) return std::nullopt;
  const uint32_t page = free_list_.back();
  free_list_.pop_back();
  allocated_[page] = true;
  return page;
}

uint32_t KvPagePool::allocate() {
  if (auto page = try_allocate()) return *page;
  throw std::runtime_error("KvPagePool: all " + std::to_string(total_pages_) +
                           " KV pages are in use");
}

void KvPagePool::free(uint32_t page) {
  if (page == null_page())
    throw std::logic_error("KvPagePool: freeing the null page " + std::to_string(page));
  if (page > total_pages_)
    throw std::logic_error("KvPagePool: freeing page " + std::to_string(page) +
                           ", which is not in this pool of " + std::to_string(total_pages_));
  if (!allocated_[page])
    throw std::logic_error("KvPagePool: double free of page " + std::to_string(page));
  allocated_[page] = false;
  free_list_.push_back(page);
}

KvPageTable::KvPageTable(KvPagePool& pool, uint32_t page_size) : pool_(&pool), page_size_(page_size) {
  if (page_size == 0) throw std::invalid_argument("KvPageTable: page_size must be positive");
}

KvPageTable::KvPageTable(KvPageTable&& other) noexcept
    : pool_(other.pool_), page_size_(other.page_size_), pages_(std::move(other.pages_)) {
  other.pages_.clear();
}

KvPageTable& KvPageTable::operator=(KvPageTable&& other) noexcept {
  if (this != &other) {
    release();
    pool_ = other.pool_;
    page_size_ = other.page_size_;
    pages_ = std::move(other.pages_);
    other.pages_.clear();
  }
  return *this;
}

uint32_t KvPageTable::pages_for(uint64_t positions, uint32_t page_size) {
  return uint32_t((positions + page_size - 1) / page_size);
}

uint32_t KvPageTable::pages_missing(uint64_t positions) const {
  const uint32_t needed = pages_for(positions, page_size_);
  return needed > pages_.size() ? needed - uint32_t(pages_.size()) : 0;
}

bool KvPageTable::ensure_capacity(uint64_t positions) {
  const uint32_t missing = pages_missing(positions);
  if (missing > pool_->free_count()) return false;
  for (uint32_t i = 0; i < missing; ++i) pages_.push_back(*pool_->try_allocate());
  return true;
}

void KvPageTable::release() {
  // Back to front, so that the pool's stack hands them out again in this table's order.
  while (!pages_.empty()) {
    pool_->free(pages_.back());
    pages_.pop_back();
  }
}

}  // namespace clshard
