#include "runtime/engine/kv_pages.h"

#include <limits>
#include <stdexcept>
#include <string>
#include <utility>

namespace clshard {

KvPagePool::KvPagePool(uint32_t total_pages)
    : total_pages_(total_pages), refs_(total_pages, 0), hash_of_page_(total_pages),
      evictable_pos_(total_pages) {
  // The null page's id is total_pages, so it must itself be a representable uint32 page id.
  if (total_pages == std::numeric_limits<uint32_t>::max())
    throw std::invalid_argument("KvPagePool: total_pages must leave room for the null page id");
  free_list_.reserve(total_pages);
  for (uint32_t p = total_pages; p > 0; --p) free_list_.push_back(p - 1);
}

std::optional<uint32_t> KvPagePool::try_allocate() {
  uint32_t page;
  if (!free_list_.empty()) {
    page = free_list_.back();
    free_list_.pop_back();
  } else if (!evictable_.empty()) {
    page = evictable_.front();
    evictable_.pop_front();
    page_of_hash_.erase(*hash_of_page_[page]);
    hash_of_page_[page].reset();
    ++evictions_;
  } else {
    return std::nullopt;
  }
  refs_[page] = 1;
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
  if (refs_[page] == 0)
    throw std::logic_error("KvPagePool: double free of page " + std::to_string(page));
  if (--refs_[page] > 0) return;
  if (hash_of_page_[page]) {
    evictable_pos_[page] = evictable_.insert(evictable_.end(), page);
  } else {
    free_list_.push_back(page);
  }
}

std::optional<uint32_t> KvPagePool::find_cached(uint64_t hash) const {
  auto it = page_of_hash_.find(hash);
  if (it == page_of_hash_.end()) return std::nullopt;
  return it->second;
}

void KvPagePool::acquire(uint32_t page) {
  if (page >= total_pages_ || (refs_[page] == 0 && !hash_of_page_[page]))
    throw std::logic_error("KvPagePool: acquiring page " + std::to_string(page) +
                           ", which is neither referenced nor cached");
  if (refs_[page]++ == 0) evictable_.erase(evictable_pos_[page]);
}

bool KvPagePool::publish(uint32_t page, uint64_t hash) {
  if (page >= total_pages_ || refs_[page] == 0)
    throw std::logic_error("KvPagePool: publishing page " + std::to_string(page) +
                           ", which nobody references");
  if (hash_of_page_[page]) return *hash_of_page_[page] == hash;
  if (!page_of_hash_.try_emplace(hash, page).second) return false;
  hash_of_page_[page] = hash;
  return true;
}

std::optional<uint64_t> KvPagePool::hash_of(uint32_t page) const {
  return page < total_pages_ ? hash_of_page_[page] : std::nullopt;
}

namespace {
// splitmix64's finaliser: every input bit reaches every output bit.
uint64_t mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
}  // namespace

void extend_prefix_page_hashes(std::vector<uint64_t>& hashes, std::span<const int32_t> tokens,
                               uint32_t page_size, uint32_t adapter_id) {
  const size_t full = tokens.size() / page_size;
  // The chain starts from the adapter: the same tokens under another adapter are another prefix.
  uint64_t h = hashes.empty() ? mix64(0x9e3779b97f4a7c15ull ^ adapter_id) : hashes.back();
  for (size_t i = hashes.size(); i < full; ++i) {
    for (size_t t = i * page_size; t < (i + 1) * page_size; ++t)
      h = mix64(h ^ (uint64_t(uint32_t(tokens[t])) + 0x632be59bd9b4e019ull));
    h = mix64(h + i);  // the page index too, so no two positions of one chain share a hash
    hashes.push_back(h);
  }
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

void KvPageTable::append_cached(uint32_t page) {
  pool_->acquire(page);
  pages_.push_back(page);
}

void KvPageTable::release() {
  // Back to front, so that the pool's stack hands them out again in this table's order.
  while (!pages_.empty()) {
    pool_->free(pages_.back());
    pages_.pop_back();
  }
}

}  // namespace clshard
