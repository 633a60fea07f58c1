#include "runtime/engine/structured/format_cache.h"

namespace clshard::structured {

std::shared_ptr<const TokenAutomaton> FormatCache::find(const std::string& key) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = entries_.find(key);
  if (it == entries_.end()) return nullptr;
  lru_.splice(lru_.begin(), lru_, it->second.lru);
  return it->second.automaton;
}

bool FormatCache::put(const std::string& key, std::shared_ptr<const TokenAutomaton> automaton) {
  const size_t bytes = entry_bytes(key, *automaton);
  std::lock_guard<std::mutex> lock(mu_);
  auto it = entries_.find(key);
  if (it != entries_.end()) {  // compiled twice by concurrent requests: the first one stays
    lru_.splice(lru_.begin(), lru_, it->second.lru);
    return true;
  }
  if (bytes > budget_) return false;
  evict_to(budget_ - bytes);
  it = entries_.emplace(key, Entry{std::move(automaton), bytes, {}}).first;
  lru_.push_front(&it->first);
  it->second.lru = lru_.begin();
  bytes_ += bytes;
  return true;
}

void FormatCache::evict_to(size_t budget_bytes) {
  while (bytes_ > budget_bytes && !lru_.empty()) {
    auto it = entries_.find(*lru_.back());
    bytes_ -= it->second.bytes;
    lru_.pop_back();
    entries_.erase(it);
  }
}

void FormatCache::set_budget(size_t budget_bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  budget_ = budget_bytes;
  evict_to(budget_);
}

void FormatCache::clear() {
  std::lock_guard<std::mutex> lock(mu_);
  evict_to(0);
}

size_t FormatCache::budget() const {
  std::lock_guard<std::mutex> lock(mu_);
  return budget_;
}

size_t FormatCache::bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return bytes_;
}

std::vector<std::string> FormatCache::keys() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::string> out;
  for (const std::string* k : lru_) out.push_back(*k);
  return out;
}

FormatCache& format_cache() {
  static FormatCache cache;
  return cache;
}

}  // namespace clshard::structured
