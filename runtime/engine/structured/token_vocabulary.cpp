#include "runtime/engine/structured/token_vocabulary.h"

#include <algorithm>
#include <map>
#include <mutex>
#include <stdexcept>

#include "runtime/text/tokenizer.h"

namespace clshard::structured {

namespace {
uint64_t fnv1a(uint64_t h, std::string_view s) {
  for (unsigned char c : s) h = (h ^ c) * 0x100000001b3ull;
  return h;
}
}  // namespace

std::vector<int32_t>& TokenVocabulary::stack_scratch() {
  thread_local std::vector<int32_t> s;
  return s;
}

TokenVocabulary::TokenVocabulary(const std::vector<std::string>& token_bytes) {
  offsets_.reserve(token_bytes.size() + 1);
  offsets_.push_back(0);
  uint64_t h = 0xcbf29ce484222325ull;
  for (const std::string& b : token_bytes) {
    bytes_ += b;
    offsets_.push_back(uint32_t(bytes_.size()));
    h = fnv1a(h, b);
    h = (h ^ 0xFFu) * 0x100000001b3ull;  // a separator, so "ab","c" differs from "a","bc"
  }
  fingerprint_ = h ^ token_bytes.size();

  // Tokens sorted by their bytes (unsigned), then walked once: each one's path shares the prefix
  // of the previous one, so nodes come out in preorder.
  std::vector<int32_t> order;
  for (size_t i = 0; i < token_bytes.size(); ++i)
    if (!token_bytes[i].empty()) order.push_back(int32_t(i));
  std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    const auto x = bytes(a), y = bytes(b);
    const int c = x.compare(y);  // std::string_view compares as unsigned char
    return c != 0 ? c < 0 : a < b;
  });
  std::vector<uint32_t> path;  // node index at each depth - 1
  std::string_view prev;
  for (int32_t id : order) {
    const std::string_view b = bytes(id);
    if (b.size() > 65535) throw std::invalid_argument("a token longer than 65535 bytes");
    size_t common = 0;
    while (common < prev.size() && common < b.size() && common < path.size() &&
           prev[common] == b[common])
      ++common;
    while (path.size() > common) {
      node_skip_[path.back()] = uint32_t(node_byte_.size());
      path.pop_back();
    }
    for (size_t k = common; k < b.size(); ++k) {
      path.push_back(uint32_t(node_byte_.size()));
      node_byte_.push_back(uint8_t(b[k]));
      node_depth_.push_back(uint16_t(k + 1));
      node_skip_.push_back(0);
      node_tokens_.push_back(uint32_t(tokens_.size()));
    }
    tokens_.push_back(id);
    max_depth_ = std::max<uint32_t>(max_depth_, uint32_t(b.size()));
    prev = b;
  }
  while (!path.empty()) {
    node_skip_[path.back()] = uint32_t(node_byte_.size());
    path.pop_back();
  }
  node_tokens_.push_back(uint32_t(tokens_.size()));
}

std::shared_ptr<const TokenVocabulary> TokenVocabulary::of(const Tokenizer& tok) {
  std::vector<std::string> bytes(tok.vocab_size());
  for (size_t i = 0; i < bytes.size(); ++i) {
    const int32_t id = int32_t(i);
    if (tok.is_special(id)) continue;
    try {
      bytes[i] = tok.token_bytes(id);
    } catch (const std::out_of_range&) {
      // an id with no token: never allowed
    }
  }
  uint64_t h = 0xcbf29ce484222325ull;
  for (const auto& b : bytes) h = (fnv1a(h, b) ^ 0xFFu) * 0x100000001b3ull;
  h ^= bytes.size();
  static std::mutex mu;
  static std::map<uint64_t, std::shared_ptr<const TokenVocabulary>> cache;
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = cache.find(h);
    if (it != cache.end()) return it->second;
  }
  auto v = std::make_shared<const TokenVocabulary>(bytes);
  std::lock_guard<std::mutex> lock(mu);
  if (cache.size() >= 8) cache.clear();  // a process holds one or two tokenizers
  return cache.emplace(h, v).first->second;
}

}  // namespace clshard::structured
