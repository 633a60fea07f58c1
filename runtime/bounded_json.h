// JSON from files other people write (checkpoint headers, config.json, tokenizer.json, job lines,
// requests): parsed with a nesting limit, so a hostile input is a clear error, not a stack that
// code walking the value recursively runs out of.
#pragma once

#include <cstddef>
#include <stdexcept>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

namespace clshard {

// Deeper than any real configuration or request (tokenizer.json nests 6 levels, a JSON schema a
// few dozen).
inline constexpr int kMaxJsonDepth = 128;

// nlohmann::json::parse with the depth limit. Throws nlohmann::json::parse_error for bad JSON and
// std::runtime_error "JSON nested deeper than 128 levels" past the limit. (Header-only: the
// tokenizer's layer links no library of ours.)
template <typename Json>
Json parse_json_bounded_as(std::string_view text) {
  using Event = typename Json::parse_event_t;
  auto limit = [](int depth, Event event, Json&) {
    if ((event == Event::object_start || event == Event::array_start) && depth >= kMaxJsonDepth)
      throw std::runtime_error("JSON nested deeper than " + std::to_string(kMaxJsonDepth) +
                               " levels");
    return true;
  };
  return Json::parse(text.begin(), text.end(), limit);
}
inline nlohmann::json parse_json_bounded(std::string_view text) {
  return parse_json_bounded_as<nlohmann::json>(text);
}
// The same keeping the objects' key order (request bodies whose schemas list properties in order).
inline nlohmann::ordered_json parse_ordered_json_bounded(std::string_view text) {
  return parse_json_bounded_as<nlohmann::ordered_json>(text);
}
inline nlohmann::json parse_json_bounded(const char* text, size_t size) {
  return parse_json_bounded(std::string_view(text, size));
}

}  // namespace clshard
