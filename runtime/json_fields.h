// Typed reads of a JSON object's fields (config.json and friends) with errors that name the file,
// the field, what was expected and what was found.
#pragma once

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace clshard {

// A JSON value as an error message shows it: its JSON text (strings quoted), long values cut.
inline std::string json_shown(const nlohmann::json& v) {
  std::string s = v.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  return s.size() > 60 ? s.substr(0, 57) + "..." : s;
}

// What a JSON value is, as "expected ..., got <this>" messages say it.
inline const char* json_kind(const nlohmann::json& v) {
  if (v.is_object()) return "an object";
  if (v.is_array()) return "a list";
  if (v.is_string()) return "a string";
  if (v.is_boolean()) return "a boolean";
  if (v.is_null()) return "null";
  return "a number";
}

class JsonFields {
 public:
  JsonFields(const nlohmann::json& obj, std::string where) : obj_(obj), where_(std::move(where)) {}

  bool has(const std::string& key) const { return obj_.contains(key) && !obj_[key].is_null(); }
  const nlohmann::json& raw(const std::string& key) const { return obj_.at(key); }
  const std::string& where() const { return where_; }

  int64_t integer(const std::string& key) const {
    if (!has(key)) error(key, "missing");
    return as_int(key);
  }
  int64_t integer(const std::string& key, int64_t dflt) const {
    return has(key) ? integer(key) : dflt;
  }
  std::optional<int64_t> optional_integer(const std::string& key) const {
    return has(key) ? std::optional<int64_t>(integer(key)) : std::nullopt;
  }
  double number(const std::string& key) const {
    if (!has(key)) error(key, "missing");
    return as_number(key);
  }
  double number(const std::string& key, double dflt) const { return has(key) ? number(key) : dflt; }
  std::optional<double> optional_number(const std::string& key) const {
    return has(key) ? std::optional<double>(number(key)) : std::nullopt;
  }
  bool boolean(const std::string& key, bool dflt) const {
    if (!has(key)) return dflt;
    const auto& v = obj_[key];
    if (!v.is_boolean()) type_error(key, "true or false", v);
    return v.get<bool>();
  }
  std::string string(const std::string& key, const std::string& dflt) const {
    if (!has(key)) return dflt;
    const auto& v = obj_[key];
    if (!v.is_string()) type_error(key, "a string", v);
    return v.get<std::string>();
  }
  // A nested object, for reading its fields; throws if present but not an object.
  std::optional<JsonFields> object(const std::string& key) const {
    if (!has(key)) return std::nullopt;
    const auto& v = obj_[key];
    if (!v.is_object()) type_error(key, "an object", v);
    return JsonFields(v, where_ + ": " + key);
  }

  // An integer or a list of integers (eos_token_id in config.json and generation_config.json).
  std::vector<int64_t> integers(const std::string& key) const {
    std::vector<int64_t> ids;
    if (!has(key)) return ids;
    const auto& v = raw(key);
    if (v.is_number_integer()) {
      ids.push_back(v.get<int64_t>());
    } else if (v.is_array()) {
      for (const auto& x : v) {
        if (!x.is_number_integer()) type_error(key, "an integer or a list of integers", v);
        ids.push_back(x.get<int64_t>());
      }
    } else {
      type_error(key, "an integer or a list of integers", v);
    }
    return ids;
  }

  // config.json's architectures[0], which must be one of `known`; `dflt` when the field is absent.
  std::string architecture(const std::vector<std::string>& known, const std::string& dflt) const {
    if (!has("architectures")) return dflt;
    const auto& a = raw("architectures");
    if (!a.is_array() || a.empty() || !a[0].is_string())
      type_error("architectures", "a list of strings", a);
    const std::string arch = a[0].get<std::string>();
    for (const auto& k : known)
      if (arch == k) return arch;
    std::string list;
    for (const auto& k : known) list += (list.empty() ? "" : ", ") + k;
    error("architectures", "'" + arch + "' is not one of " + list);
  }

  [[noreturn]] void error(const std::string& key, const std::string& msg) const {
    throw std::runtime_error(where_ + ": field '" + key + "': " + msg);
  }
  [[noreturn]] void type_error(const std::string& key, const std::string& expected,
                               const nlohmann::json& got) const {
    error(key, "expected " + expected + ", got " + std::string(got.type_name()) + " " +
                   got.dump().substr(0, 60));
  }

 private:
  int64_t as_int(const std::string& key) const {
    const auto& v = obj_[key];
    if (v.is_number_unsigned() && v.get<uint64_t>() > uint64_t(INT64_MAX))
      type_error(key, "an integer in the int64 range", v);
    if (v.is_number_integer()) return v.get<int64_t>();
    // A whole float (2.0, 1e3) counts; the range check comes first because converting a double
    // outside int64's range is undefined behaviour (found by fuzzing: 5.9e21).
    if (v.is_number_float()) {
      const double d = v.get<double>();
      if (d >= -0x1p63 && d < 0x1p63 && d == std::floor(d)) return int64_t(d);
    }
    type_error(key, "an integer", v);
  }
  double as_number(const std::string& key) const {
    const auto& v = obj_[key];
    if (!v.is_number()) type_error(key, "a number", v);
    return v.get<double>();
  }

  const nlohmann::json& obj_;
  std::string where_;
};

}  // namespace clshard
