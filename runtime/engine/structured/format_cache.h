// Compiled structured-output formats (TokenAutomaton) by key, kept within a byte budget rather
// than a count of entries: a few huge automata from a hostile client would otherwise fill memory
// even with few entries. Each entry counts its automaton's max_bytes() (the DFA's tables and
// every mask it may cache, fixed when it is built) plus its key, so the total stays within the
// budget however far the automata's mask caches fill in later. Least recently used entries go
// first; an automaton bigger than the whole budget is not kept (its request still uses it).
// Thread-safe.
#pragma once

#include <cstddef>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "runtime/engine/structured/token_automaton.h"

namespace clshard::structured {

// The budget of the process-wide cache that compile_response_format uses: 256 MiB holds about
// nine "any JSON object" automata over a 128,256-token vocabulary with all their masks (27 MiB
// each), or hundreds of typical small schemas.
inline constexpr size_t kFormatCacheBytes = size_t(256) << 20;

class FormatCache {
 public:
  explicit FormatCache(size_t budget_bytes = kFormatCacheBytes) : budget_(budget_bytes) {}

  // The automaton under `key`, which becomes the most recently used; null when absent.
  std::shared_ptr<const TokenAutomaton> find(const std::string& key);
  // Keeps the automaton under `key` (an entry already there stays and becomes the most recently
  // used), evicting least recently used entries until the total fits the budget. Returns false,
  // keeping nothing and evicting nothing, when the entry alone is bigger than the budget.
  bool put(const std::string& key, std::shared_ptr<const TokenAutomaton> automaton);
  // Changes the budget, evicting least recently used entries down to it.
  void set_budget(size_t budget_bytes);
  void clear();

  size_t budget() const;
  // The bytes the entries count together (<= budget()).
  size_t bytes() const;
  // The keys held, most recently used first (for the tests).
  std::vector<std::string> keys() const;
  // What an entry counts: the automaton's max_bytes() plus its key's length.
  static size_t entry_bytes(const std::string& key, const TokenAutomaton& automaton) {
    return automaton.max_bytes() + key.size();
  }

 private:
  struct Entry {
    std::shared_ptr<const TokenAutomaton> automaton;
    size_t bytes = 0;
    std::list<const std::string*>::iterator lru;  // its place in lru_
  };
  void evict_to(size_t budget_bytes);  // mu_ held

  mutable std::mutex mu_;
  size_t budget_;
  size_t bytes_ = 0;
  std::unordered_map<std::string, Entry> entries_;  // node-based: the keys stay where they are
  std::list<const std::string*> lru_;               // keys of entries_, most recently used first
};

// The cache compile_response_format uses (budget kFormatCacheBytes at start).
FormatCache& format_cache();

}  // namespace clshard::structured
