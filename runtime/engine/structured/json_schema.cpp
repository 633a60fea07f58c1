#include "runtime/engine/structured/json_schema.h"

#include <algorithm>
#include <cstddef>
#include <map>
#include <set>
#include <stdexcept>

#include "runtime/engine/structured/byte_dfa.h"

namespace clshard::structured {

using ordered_json = nlohmann::ordered_json;

namespace {

Regex ws() { return repeat(byte_set([] {
                             std::bitset<256> b;
                             for (char c : {' ', '\n', '\t', '\r'}) b.set(uint8_t(c));
                             return b;
                           }()),
                           0, kMaxWhitespace); }

Regex chars(std::string_view set) {
  std::bitset<256> b;
  for (unsigned char c : set) b.set(c);
  return byte_set(b);
}

Regex digit() { return byte_range('0', '9'); }
Regex hex_digit() { return chars("0123456789abcdefABCDEF"); }

// One character of a JSON string: a code point other than " \ and controls, or an escape
// (\uXXXX only for non-surrogates or a well-formed surrogate pair: parsers reject lone halves).
Regex string_char() {
  static const Regex r = [] {
    Regex plain = utf8_class(complement({{'"', '"'}, {'\\', '\\'}, {0, 0x1F}}));
    Regex non_surrogate = alt({concat({chars("0123456789abcefABCEF"), hex_digit(), hex_digit(),
                                       hex_digit()}),
                               concat({chars("dD"), byte_range('0', '7'), hex_digit(),
                                       hex_digit()})});
    Regex pair = concat({chars("dD"), chars("89abAB"), hex_digit(), hex_digit(), literal("\\u"),
                         chars("dD"), chars("cdefCDEF"), hex_digit(), hex_digit()});
    Regex escape = concat({literal("\\"), alt({chars("\"\\/bfnrt"),
                                               concat({literal("u"), alt({non_surrogate, pair})})})});
    return alt({plain, escape});
  }();
  return r;
}

Regex string_value(uint32_t min, uint32_t max) {
  return concat({literal("\""), repeat(string_char(), min, max), literal("\"")});
}

Regex integer_value() {
  return concat({optional(literal("-")),
                 alt({literal("0"), concat({byte_range('1', '9'), repeat(digit(), 0, 15)})})});
}

// At most 2 exponent digits: with at most 16 integer digits the largest magnitude is below
// 1e16 * 1e99 = 1e115, well inside a double (up to about 1.8e308), so every number generated
// parses as a finite double in any JSON library (nlohmann refuses 471e658, which 3 digits allowed).
Regex number_value() {
  return concat({integer_value(), optional(concat({literal("."), repeat(digit(), 1, 16)})),
                 optional(concat({chars("eE"), optional(chars("+-")),
                                  repeat(digit(), 1, kMaxExponentDigits)}))});
}

Regex boolean_value() { return alt({literal("true"), literal("false")}); }

Regex list_separator() { return concat({ws(), literal(","), ws()}); }

Regex generic_value(uint32_t depth);

Regex generic_object(uint32_t depth) {
  Regex member = concat({string_value(0, kUnbounded), ws(), literal(":"), ws(),
                         generic_value(depth - 1)});
  return concat({literal("{"), ws(), repeat(member, 0, kUnbounded, list_separator()), ws(),
                 literal("}")});
}

Regex generic_array(uint32_t depth) {
  return concat({literal("["), ws(), repeat(generic_value(depth - 1), 0, kUnbounded,
                                            list_separator()),
                 ws(), literal("]")});
}

// Any JSON value with at most `depth` nested containers.
Regex generic_value(uint32_t depth) {
  std::vector<Regex> options = {string_value(0, kUnbounded), number_value(), boolean_value(),
                                literal("null")};
  if (depth > 0) {
    options.push_back(generic_object(depth));
    options.push_back(generic_array(depth));
  }
  return alt(std::move(options));
}

const std::set<std::string>& known_keywords() {
  static const std::set<std::string> k = {
      "type",      "properties", "required", "additionalProperties", "items",   "minItems",
      "maxItems",  "enum",       "const",    "minLength",            "maxLength", "anyOf",
      "$ref",      "$defs",      "definitions", "title",           "description", "default",
      "examples",  "$schema",    "$id",      "$comment",             "strict"};
  return k;
}

bool type_matches(const ordered_json& v, const std::string& type) {
  if (type == "string") return v.is_string();
  if (type == "integer") return v.is_number_integer() || v.is_number_unsigned();
  if (type == "number") return v.is_number();
  if (type == "boolean") return v.is_boolean();
  if (type == "null") return v.is_null();
  if (type == "object") return v.is_object();
  if (type == "array") return v.is_array();
  return false;
}

class SchemaCompiler {
 public:
  SchemaCompiler(const ordered_json& root, const std::string& root_path)
      : root_(root), root_path_(root_path) {}

  Regex compile(const ordered_json& s, const std::string& path) {
    if (depth_ >= kMaxSchemaDepth)
      fail(path, "nested deeper than " + std::to_string(kMaxSchemaDepth) +
                     " levels (counting each $ref followed)");
    ++depth_;
    Regex out = compile_here(s, path);
    --depth_;
    return out;
  }

 private:
  const ordered_json& root_;
  std::string root_path_;
  std::vector<std::string> ref_stack_;
  // Each definition's expression, made once: the tree shares it wherever it is referenced (a
  // definition used twice by each of the next makes the schema's tree exponential otherwise).
  std::map<std::string, Regex> compiled_refs_;
  uint32_t depth_ = 0;

  Regex compile_here(const ordered_json& s, const std::string& path) {
    if (s.is_boolean()) {
      if (s.get<bool>()) return generic_value(kMaxJsonDepth);
      fail(path, "the schema false matches no value");
    }
    if (!s.is_object()) fail(path, "expected a schema (a JSON object), got " + s.dump());
    for (const auto& [k, v] : s.items())
      if (!known_keywords().count(k)) fail(path, "unsupported keyword '" + k + "'");

    if (s.contains("$ref")) return reference(s, path);
    if (s.contains("anyOf")) {
      const ordered_json& any = s["anyOf"];
      if (!any.is_array() || any.empty()) fail(path + ".anyOf", "expected a non-empty list");
      for (const char* k : {"type", "enum", "const", "properties", "items"})
        if (s.contains(k))
          fail(path, std::string("'") + k + "' beside 'anyOf' is not supported (move it into "
                                            "each option)");
      std::vector<Regex> options;
      for (size_t i = 0; i < any.size(); ++i)
        options.push_back(compile(any[i], path + ".anyOf[" + std::to_string(i) + "]"));
      return alt_of(std::move(options), path);
    }
    std::vector<std::string> types = type_list(s, path);
    if (s.contains("const")) {
      check_type(s["const"], types, path + ".const");
      return literal(s["const"].dump());
    }
    if (s.contains("enum")) {
      const ordered_json& e = s["enum"];
      if (!e.is_array() || e.empty()) fail(path + ".enum", "expected a non-empty list");
      std::vector<Regex> options;
      for (size_t i = 0; i < e.size(); ++i) {
        check_type(e[i], types, path + ".enum[" + std::to_string(i) + "]");
        options.push_back(literal(e[i].dump()));
      }
      return alt_of(std::move(options), path);
    }
    if (types.empty()) {
      if (s.contains("properties")) {
        types = {"object"};
      } else if (s.contains("items")) {
        types = {"array"};
      } else {
        return generic_value(kMaxJsonDepth);
      }
    }
    std::vector<Regex> options;
    for (const std::string& t : types) options.push_back(of_type(s, t, path));
    return alt_of(std::move(options), path);
  }

  // alt() and concat() of compiled parts, sized before they are built. A definition used twice
  // by each of the next (anyOf options, properties) doubles the expanded size per level however
  // much the tree shares, and alt() and concat() copied the children of every nested alternation
  // or sequence, so the copying doubled too (tests/fuzz/regressions/json_schema/
  // anyof_refs_doubling_distinct: 25 s and 0.9 GB in the fuzz build, over 24 GB in Release).
  // They copy only small ones now (kMaxFlattenedChildren, regex_ast.h), and the parts' expanded
  // sizes together (RegexNode::nfa_states, each $ref counted wherever it is used) must stay
  // within ByteDfa::kMaxBuildNfaStates, the limit build() puts on the whole tree: such a schema is
  // refused where it passes the limit, naming that place. What is refused here is what build()
  // would refuse, but for the few states alt() and concat() save (2 per flattened alternation,
  // 1 per empty part, the single bytes merged into one set).
  static Regex alt_of(std::vector<Regex> parts, const std::string& path) {
    within_budget(parts, path);
    return alt(std::move(parts));
  }
  static Regex concat_of(std::vector<Regex> parts, const std::string& path) {
    within_budget(parts, path);
    return concat(std::move(parts));
  }
  static void within_budget(const std::vector<Regex>& parts, const std::string& path) {
    uint64_t states = 0;
    for (const Regex& p : parts)
      states = states > UINT64_MAX - p->nfa_states ? UINT64_MAX : states + p->nfa_states;
    if (states > ByteDfa::kMaxBuildNfaStates)
      fail(path, "the schema is too large: expanded (each $ref wherever it is used), its "
                 "automaton would exceed " + std::to_string(ByteDfa::kMaxBuildNfaStates) +
                 " NFA states");
  }

  [[noreturn]] static void fail(const std::string& path, const std::string& what) {
    throw std::invalid_argument(path + ": " + what);
  }

  static std::vector<std::string> type_list(const ordered_json& s, const std::string& path) {
    std::vector<std::string> types;
    if (!s.contains("type")) return types;
    const ordered_json& t = s["type"];
    auto add = [&](const ordered_json& v, const std::string& where) {
      static const std::set<std::string> names = {"string",  "number", "integer", "boolean",
                                                  "null",    "object", "array"};
      if (!v.is_string() || !names.count(v.get<std::string>()))
        fail(where, "expected one of string, number, integer, boolean, null, object, array; got " +
                        v.dump());
      types.push_back(v.get<std::string>());
    };
    if (t.is_array()) {
      if (t.empty()) fail(path + ".type", "is an empty list");
      for (size_t i = 0; i < t.size(); ++i) add(t[i], path + ".type[" + std::to_string(i) + "]");
    } else {
      add(t, path + ".type");
    }
    return types;
  }

  static void check_type(const ordered_json& v, const std::vector<std::string>& types,
                         const std::string& where) {
    if (types.empty()) return;
    for (const auto& t : types)
      if (type_matches(v, t)) return;
    fail(where, v.dump() + " does not have the schema's type");
  }

  static uint32_t count_keyword(const ordered_json& s, const char* key, const std::string& path,
                                uint32_t fallback) {
    if (!s.contains(key)) return fallback;
    const ordered_json& v = s[key];
    if (!v.is_number_unsigned() && !(v.is_number_integer() && v.get<int64_t>() >= 0))
      fail(path + "." + key, "expected an integer >= 0, got " + v.dump());
    if (v.get<uint64_t>() > kMaxBoundedCount)
      fail(path + "." + key, "above the supported " + std::to_string(kMaxBoundedCount));
    return uint32_t(v.get<uint64_t>());
  }

  Regex reference(const ordered_json& s, const std::string& path) {
    const ordered_json& r = s["$ref"];
    if (!r.is_string()) fail(path + ".$ref", "expected a string");
    const std::string ref = r.get<std::string>();
    std::string section, name;
    for (const char* prefix : {"#/$defs/", "#/definitions/"})
      if (ref.rfind(prefix, 0) == 0) {
        section = std::string(prefix).substr(2, std::string(prefix).size() - 3);
        name = ref.substr(std::string(prefix).size());
      }
    if (section.empty() || name.find('/') != std::string::npos)
      fail(path + ".$ref", "only references to #/$defs/NAME or #/definitions/NAME are supported, "
                           "got '" + ref + "'");
    if (!root_.is_object() || !root_.contains(section) || !root_[section].is_object() ||
        !root_[section].contains(name))
      fail(path + ".$ref", "'" + ref + "' is not defined");
    if (std::find(ref_stack_.begin(), ref_stack_.end(), ref) != ref_stack_.end())
      fail(path + ".$ref", "recursive reference '" + ref + "' is not supported");
    if (auto it = compiled_refs_.find(ref); it != compiled_refs_.end()) return it->second;
    ref_stack_.push_back(ref);
    Regex out = compile(root_[section][name], root_path_ + "." + section + "." + name);
    ref_stack_.pop_back();
    compiled_refs_.emplace(ref, out);
    return out;
  }

  Regex of_type(const ordered_json& s, const std::string& type, const std::string& path) {
    if (type == "string") {
      const uint32_t lo = count_keyword(s, "minLength", path, 0);
      const uint32_t hi = s.contains("maxLength") ? count_keyword(s, "maxLength", path, 0)
                                                  : kUnbounded;
      if (hi < lo) fail(path, "maxLength is below minLength");
      return string_value(lo, hi);
    }
    if (type == "integer") return integer_value();
    if (type == "number") return number_value();
    if (type == "boolean") return boolean_value();
    if (type == "null") return literal("null");
    if (type == "array") return array(s, path);
    return object(s, path);
  }

  Regex array(const ordered_json& s, const std::string& path) {
    const uint32_t lo = count_keyword(s, "minItems", path, 0);
    const uint32_t hi = s.contains("maxItems") ? count_keyword(s, "maxItems", path, 0) : kUnbounded;
    if (hi < lo) fail(path, "maxItems is below minItems");
    Regex item = s.contains("items") ? compile(s["items"], path + ".items")
                                     : generic_value(kMaxJsonDepth - 1);
    return concat_of({literal("["), ws(), repeat(item, lo, hi, list_separator()), ws(),
                      literal("]")},
                     path);
  }

  Regex object(const ordered_json& s, const std::string& path) {
    if (s.contains("additionalProperties")) {
      const ordered_json& a = s["additionalProperties"];
      if (!a.is_boolean() && !(a.is_object() && !s.contains("properties")))
        fail(path + ".additionalProperties",
             "only true or false is supported beside properties");
    }
    if (!s.contains("properties")) {
      if (s.contains("required")) fail(path + ".required", "required properties need 'properties'");
      if (s.contains("additionalProperties") && s["additionalProperties"] == false)
        return concat({literal("{"), ws(), literal("}")});
      if (s.contains("additionalProperties") && s["additionalProperties"].is_object()) {
        // A map: string keys, values of one schema.
        Regex member = concat_of({string_value(0, kUnbounded), ws(), literal(":"), ws(),
                                  compile(s["additionalProperties"],
                                          path + ".additionalProperties")},
                                 path);
        return concat_of({literal("{"), ws(), repeat(member, 0, kUnbounded, list_separator()),
                          ws(), literal("}")},
                         path);
      }
      return generic_object(kMaxJsonDepth);
    }
    const ordered_json& props = s["properties"];
    if (!props.is_object()) fail(path + ".properties", "expected an object of property schemas");
    std::set<std::string> required;
    if (s.contains("required")) {
      const ordered_json& r = s["required"];
      if (!r.is_array()) fail(path + ".required", "expected a list of property names");
      for (size_t i = 0; i < r.size(); ++i) {
        const std::string where = path + ".required[" + std::to_string(i) + "]";
        if (!r[i].is_string()) fail(where, "expected a property name, got " + r[i].dump());
        if (!props.contains(r[i].get<std::string>()))
          fail(where, "'" + r[i].get<std::string>() + "' is not among the properties");
        required.insert(r[i].get<std::string>());
      }
    }
    std::vector<Regex> members;
    std::vector<bool> is_required;
    for (const auto& [name, sub] : props.items()) {
      members.push_back(concat_of({literal(ordered_json(name).dump()), ws(), literal(":"), ws(),
                                   compile(sub, path + ".properties." + name)},
                                  path));
      is_required.push_back(required.count(name) > 0);
    }
    // One item per member as written after another one: a comma and the member, optional unless
    // required. The members from k on, when one was already written, are the items from k on;
    // when none was, member k and the items after it, or (k optional) the members from k + 1 on.
    // Only the sequences an alternative needs are built: from the first required member on the
    // rest is one sequence (building each of its suffixes copied n^2/2 items: 3,000 required
    // properties took 9.8 s and 2.4 GB in Release, 1,000 took 4.9 s in the fuzz build).
    const size_t n = members.size();
    std::vector<Regex> items;
    for (size_t k = 0; k < n; ++k) {
      Regex with_comma = concat_of({list_separator(), members[k]}, path);
      items.push_back(is_required[k] ? with_comma : optional(with_comma));
    }
    auto items_from = [&](size_t k) {
      return concat_of(std::vector<Regex>(items.begin() + std::ptrdiff_t(k), items.end()), path);
    };
    size_t first_required = 0;
    while (first_required < n && !is_required[first_required]) ++first_required;
    Regex first = first_required < n
                      ? concat_of({members[first_required], items_from(first_required + 1)}, path)
                      : empty();
    for (size_t k = first_required; k-- > 0;)
      first = alt_of({concat_of({members[k], items_from(k + 1)}, path), first}, path);
    return concat_of({literal("{"), ws(), first, ws(), literal("}")}, path);
  }
};

}  // namespace

Regex json_schema_regex(const ordered_json& schema, const std::string& path) {
  return SchemaCompiler(schema, path).compile(schema, path);
}

Regex json_object_regex() { return generic_object(kMaxJsonDepth); }

}  // namespace clshard::structured
