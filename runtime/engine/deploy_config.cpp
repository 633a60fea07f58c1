#include "runtime/engine/deploy_config.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <fstream>
#include <limits>
#include <set>
#include <sstream>
#include <stdexcept>

#include "parallel/topology.h"

namespace clshard {

namespace fs = std::filesystem;

const char* to_string(ModelDType d) {
  switch (d) {
    case ModelDType::Auto: return "auto";
    case ModelDType::F32: return "f32";
    case ModelDType::BF16: return "bf16";
    case ModelDType::FP8: return "fp8";
  }
  return "?";
}

const char* to_string(Placement p) {
  switch (p) {
    case Placement::Even: return "even";
    case Placement::Balanced: return "balanced";
  }
  return "?";
}

const char* to_string(ClusterTransport t) {
  switch (t) {
    case ClusterTransport::Local: return "local";
    case ClusterTransport::Mpi: return "mpi";
  }
  return "?";
}

const char* to_string(SpeculativeMethod m) {
  switch (m) {
    case SpeculativeMethod::None: return "none";
    case SpeculativeMethod::Mtp: return "mtp";
    case SpeculativeMethod::Eagle3: return "eagle3";
  }
  return "?";
}

std::optional<std::string> check_temperature(double v) {
  if (!(v >= 0) || !std::isfinite(v)) return "a number >= 0";
  return std::nullopt;
}
std::optional<std::string> check_top_k(int64_t v) {
  if (v < -1 || v > std::numeric_limits<int32_t>::max())
    return "an integer >= -1 (-1 or 0: no top-k)";
  return std::nullopt;
}
std::optional<std::string> check_top_p(double v) {
  if (!(v > 0 && v <= 1)) return "a number in (0, 1]";
  return std::nullopt;
}
std::optional<std::string> check_min_p(double v) {
  if (!(v >= 0 && v <= 1)) return "a number in [0, 1]";
  return std::nullopt;
}
std::optional<std::string> check_max_tokens(int64_t v) {
  if (v < 1 || v > std::numeric_limits<int32_t>::max()) return "a positive integer";
  return std::nullopt;
}
std::optional<std::string> check_penalty(double v) {
  if (!(v >= -2 && v <= 2)) return "a number in [-2, 2]";
  return std::nullopt;
}
std::optional<std::string> check_repetition_penalty(double v) {
  if (!(v > 0) || !std::isfinite(v)) return "a number > 0";
  return std::nullopt;
}
std::optional<std::string> check_top_logprobs(int64_t v) {
  if (v < 0 || v > kMaxTopLogprobs)
    return "an integer in [0, " + std::to_string(kMaxTopLogprobs) + "]";
  return std::nullopt;
}
std::optional<std::string> check_n(int64_t v) {
  if (v < 1 || v > kMaxChoices) return "an integer in [1, " + std::to_string(kMaxChoices) + "]";
  return std::nullopt;
}
std::optional<std::string> check_stop_token_id(int64_t v) {
  if (v < 0 || v > std::numeric_limits<int32_t>::max()) return "a token id (an integer >= 0)";
  return std::nullopt;
}

std::string DeployConfig::where(const std::string& key_path) const {
  auto it = key_lines.find(key_path);
  if (it == key_lines.end()) return source + ": " + key_path;
  return source + ":" + std::to_string(it->second) + ": " + key_path;
}

std::optional<size_t> DeployConfig::known_device_count() const {
  if (devices.all) return std::nullopt;
  size_t chosen = devices.ids.empty() ? 1 : devices.ids.size();
  if (devices.split.empty()) return chosen;
  // Only CPU devices split, so the count is known only when the type says CPU; cores and numa
  // depend on the machine.
  if (devices.type != "cpu" || devices.split == "cores" || devices.split == "numa")
    return std::nullopt;
  return chosen * size_t(std::stoul(devices.split));
}

const std::vector<std::string>& deploy_config_keys() {
  static const std::vector<std::string> keys = {
      "model.path",
      "model.dtype",
      "model.max_length",
      "model.fp8_activations",
      "model.compute_dtype",
      "model.mmap",
      "devices.platform",
      "devices.type",
      "devices.ids",
      "devices.all",
      "devices.split",
      "devices.kernel_shape",
      "parallel.data",
      "parallel.expert",
      "parallel.tensor",
      "parallel.placement",
      "cluster.transport",
      "kv_cache.page_size",
      "kv_cache.memory_fraction",
      "kv_cache.pages",
      "kv_cache.prefix_caching",
      "kv_cache.dtype",
      "batch.max_batch_size",
      "batch.max_batch_input_tokens",
      "sampling.temperature",
      "sampling.top_k",
      "sampling.top_p",
      "sampling.min_p",
      "sampling.seed",
      "sampling.max_tokens",
      "sampling.stop",
      "sampling.stop_token_ids",
      "sampling.frequency_penalty",
      "sampling.presence_penalty",
      "sampling.repetition_penalty",
      "sampling.logprobs_mode",
      "speculative.method",
      "speculative.num_speculative_tokens",
      "speculative.draft_model",
      "speculative.acceptance",
      "speculative.relaxed_topk",
      "speculative.relaxed_delta",
      "lora.adapters",
      "lora.max_rank",
      "lora.max_loaded",
      "job.input",
      "job.output",
      "serve.host",
      "serve.port",
      "serve.max_waiting",
      "serve.api_key",
      "serve.request_deadline_s",
      "serve.shutdown_deadline_s",
      "serve.model_name",
      "serve.max_connections",
  };
  return keys;
}

namespace {

// The keys of one section, in schema order (for "expected one of" in messages).
std::vector<std::string> section_keys(const std::string& section) {
  std::vector<std::string> out;
  for (const auto& k : deploy_config_keys())
    if (k.compare(0, section.size() + 1, section + ".") == 0) out.push_back(k.substr(section.size() + 1));
  return out;
}

const std::vector<std::string>& section_names() {
  static const std::vector<std::string> names = {"model",    "devices",     "parallel", "cluster", "kv_cache",
                                                 "batch",    "sampling",    "speculative", "lora",
                                                 "job",      "serve"};
  return names;
}

std::string join(const std::vector<std::string>& v, const char* sep = ", ") {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? sep : "") + v[i];
  return s;
}

std::string quoted(const std::string& s) {
  std::string q = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') {
      q += '\\';
      q += c;
    } else if (c == '\n') {
      q += "\\n";
    } else if (c == '\t') {
      q += "\\t";
    } else {
      q += c;
    }
  }
  return q + "\"";
}

// What a node holds, for "got ..." in messages.
std::string describe(const YAML::Node& n) {
  switch (n.Type()) {
    case YAML::NodeType::Scalar: return quoted(n.Scalar());
    case YAML::NodeType::Sequence: return "a list";
    case YAML::NodeType::Map: return "a mapping";
    default: return "nothing";
  }
}

// A scalar written without quotes (or tagged as a number): quoted scalars are strings in YAML, and
// a number field given a string is a type error even when the text looks like a number.
bool is_plain_scalar(const YAML::Node& n) {
  if (!n.IsScalar()) return false;
  const std::string& tag = n.Tag();
  return tag == "?" || tag == "tag:yaml.org,2002:int" || tag == "tag:yaml.org,2002:float";
}

// Reads one deployment document into a DeployConfig, failing on the first problem.
class Parser {
 public:
  Parser(std::string file, fs::path base_dir, DeployConfig& cfg)
      : file_(std::move(file)), base_dir_(std::move(base_dir)), cfg_(cfg) {}

  void parse_root(const YAML::Node& root) {
    if (root.IsNull()) return;
    if (!root.IsMap())
      fail(line_of(root, 1), "(top level)",
           "expected a mapping of sections (" + join(section_names()) + "), got " + describe(root));
    for_each_key(root, "", section_names(), [&](const std::string& name, const YAML::Node& v, int line) {
      if (v.IsNull()) return;  // an empty section keeps its defaults
      if (!v.IsMap()) fail(line_of(v, line), name, "expected a mapping of keys, got " + describe(v));
      if (name == "model") parse_model(v);
      else if (name == "devices") parse_devices(v);
      else if (name == "parallel") parse_parallel(v);
      else if (name == "cluster") parse_cluster(v);
      else if (name == "kv_cache") parse_kv_cache(v);
      else if (name == "batch") parse_batch(v);
      else if (name == "sampling") parse_sampling(v);
      else if (name == "speculative") parse_speculative(v);
      else if (name == "lora") parse_lora(v);
      else if (name == "job") parse_job(v);
      else if (name == "serve") parse_serve(v);
    });
  }

  [[noreturn]] void fail(int line, const std::string& key, const std::string& what) const {
    throw std::runtime_error(file_ + ":" + std::to_string(line) + ": " + key + ": " + what);
  }

  // The line of a key the file sets (fail() with it), or none for defaults.
  [[noreturn]] void fail_at(const std::string& key, const std::string& what) const {
    auto it = cfg_.key_lines.find(key);
    if (it == cfg_.key_lines.end()) throw std::runtime_error(file_ + ": " + key + ": " + what);
    fail(it->second, key, what);
  }

 private:
  static int line_of(const YAML::Node& n, int fallback) {
    // Null values carry no position of their own (yaml-cpp reports the next token's), so callers
    // pass the key's line.
    return n.IsNull() || n.Mark().line < 0 ? fallback : n.Mark().line + 1;
  }

  // Calls handle(key, value, line_of_key) for each key of a mapping in file order, after checking
  // it against the schema. A null value ("key:" or "key: null") is recorded but not handled: the
  // key keeps its default.
  template <class F>
  void for_each_key(const YAML::Node& map, const std::string& section,
                    const std::vector<std::string>& allowed, F handle) {
    std::map<std::string, int> seen;
    for (auto it = map.begin(); it != map.end(); ++it) {
      // Copies: yaml-cpp's operator-> returns a temporary proxy, so references into it dangle.
      // (Nodes are handles; copying one is cheap.)
      const YAML::Node k = it->first;
      const YAML::Node v = it->second;
      int line = line_of(k, 1);
      std::string prefix = section.empty() ? "" : section + ".";
      if (!k.IsScalar()) fail(line, section.empty() ? "(top level)" : section, "expected a key name, got " + describe(k));
      std::string name = k.Scalar();
      std::string path = prefix + name;
      if (std::find(allowed.begin(), allowed.end(), name) == allowed.end())
        fail(line, path, "unknown key (expected one of: " + join(allowed) + ")");
      if (auto s = seen.find(name); s != seen.end())
        fail(line, path, "duplicate key (first set at line " + std::to_string(s->second) + ")");
      seen[name] = line;
      cfg_.key_lines[path] = line;
      if (v.IsNull()) continue;
      handle(name, v, line);
    }
  }

  template <class F>
  void for_each_section_key(const YAML::Node& map, const std::string& section, F handle) {
    for_each_key(map, section, section_keys(section), [&](const std::string& name, const YAML::Node& v, int line) {
      handle(name, v, section + "." + name, line_of(v, line));
    });
  }

  int64_t integer(const YAML::Node& n, const std::string& path, int line, const std::string& expected,
                  int64_t min, int64_t max) {
    int64_t v = 0;
    if (!is_plain_scalar(n) || !parse_int(n.Scalar(), v))
      fail(line, path, "expected " + expected + ", got " + describe(n));
    if (v < min || v > max) {
      std::string bound = v > max ? " (at most " + std::to_string(max) + ")" : "";
      fail(line, path, "expected " + expected + bound + ", got " + describe(n));
    }
    return v;
  }

  uint64_t unsigned_integer(const YAML::Node& n, const std::string& path, int line,
                            const std::string& expected) {
    uint64_t v = 0;
    const std::string& s = n.Scalar();
    auto r = std::from_chars(s.data(), s.data() + s.size(), v);
    if (!is_plain_scalar(n) || s.empty() || r.ec != std::errc() || r.ptr != s.data() + s.size())
      fail(line, path, "expected " + expected + ", got " + describe(n));
    return v;
  }

  // `check` returns what was expected for out-of-range values; every check rejects NaN, which
  // gives the phrase for values that are not numbers at all.
  double number(const YAML::Node& n, const std::string& path, int line,
                std::optional<std::string> (*check)(double)) {
    double v = 0;
    if (!is_plain_scalar(n) || !parse_double(n.Scalar(), v) || check(v))
      fail(line, path, "expected " + *check(std::nan("")) + ", got " + describe(n));
    return v;
  }

  bool boolean(const YAML::Node& n, const std::string& path, int line) {
    // YAML 1.2's booleans only: yes/no/on/off are strings there (and a classic source of surprise).
    static const std::set<std::string> t = {"true", "True", "TRUE"}, f = {"false", "False", "FALSE"};
    if (is_plain_scalar(n) && t.count(n.Scalar())) return true;
    if (is_plain_scalar(n) && f.count(n.Scalar())) return false;
    fail(line, path, "expected true or false, got " + describe(n));
  }

  std::string string(const YAML::Node& n, const std::string& path, int line) {
    if (!n.IsScalar()) fail(line, path, "expected a string, got " + describe(n));
    return n.Scalar();
  }

  fs::path path_value(const YAML::Node& n, const std::string& path, int line) {
    std::string s = string(n, path, line);
    if (s.empty()) return {};
    fs::path p(s);
    if (p.is_absolute() || base_dir_.empty()) return p;
    return (base_dir_ / p).lexically_normal();
  }

  std::string choice(const YAML::Node& n, const std::string& path, int line,
                     const std::vector<std::string>& options) {
    if (n.IsScalar() && std::find(options.begin(), options.end(), n.Scalar()) != options.end())
      return n.Scalar();
    fail(line, path, "expected one of " + join(options, " | ") + ", got " + describe(n));
  }

  static bool parse_int(const std::string& s, int64_t& v) {
    const char* b = s.data();
    const char* e = s.data() + s.size();
    if (b != e && *b == '+') ++b;
    auto r = std::from_chars(b, e, v);
    return b != e && r.ec == std::errc() && r.ptr == e;
  }

  static bool parse_double(const std::string& s, double& v) {
    const char* b = s.data();
    const char* e = s.data() + s.size();
    if (b != e && *b == '+') ++b;
    auto r = std::from_chars(b, e, v, std::chars_format::general);
    return b != e && r.ec == std::errc() && r.ptr == e && std::isfinite(v);
  }

  // A list of items, or a single item where a list is expected (`stop: "\n"`).
  template <class F>
  void list_items(const YAML::Node& n, const std::string& path, int line, bool allow_single, F item) {
    if (n.IsScalar() && allow_single) {
      item(n, path, line);
      return;
    }
    if (!n.IsSequence()) fail(line, path, "expected a list, got " + describe(n));
    for (size_t i = 0; i < n.size(); ++i)
      item(n[i], path + "[" + std::to_string(i) + "]", line_of(n[i], line));
  }

  void parse_model(const YAML::Node& m) {
    for_each_section_key(m, "model", [&](const std::string& k, const YAML::Node& v, const std::string& p, int line) {
      if (k == "path") {
        cfg_.model.path = path_value(v, p, line);
      } else if (k == "dtype") {
        std::string d = choice(v, p, line, {"auto", "f32", "bf16", "fp8"});
        cfg_.model.dtype = d == "f32" ? ModelDType::F32 : d == "bf16" ? ModelDType::BF16
                         : d == "fp8" ? ModelDType::FP8 : ModelDType::Auto;
      } else if (k == "max_length") {
        cfg_.model.max_length = integer(v, p, line, "a positive integer", 1, std::numeric_limits<int32_t>::max());
      } else if (k == "fp8_activations") {
        cfg_.model.quantize_fp8_activations = choice(v, p, line, {"f32", "fp8"}) == "fp8";
      } else if (k == "compute_dtype") {
        cfg_.model.compute_dtype =
            choice(v, p, line, {"f32", "bf16"}) == "bf16" ? ComputeDType::BF16 : ComputeDType::F32;
      } else if (k == "mmap") {
        cfg_.model.mmap = boolean(v, p, line);
      }
    });
  }

  void parse_devices(const YAML::Node& m) {
    for_each_section_key(m, "devices", [&](const std::string& k, const YAML::Node& v, const std::string& p, int line) {
      if (k == "platform") {
        cfg_.devices.platform = string(v, p, line);
      } else if (k == "type") {
        cfg_.devices.type = choice(v, p, line, {"cpu", "gpu", "accelerator", "any"});
      } else if (k == "ids") {
        cfg_.devices.ids.clear();
        list_items(v, p, line, false, [&](const YAML::Node& item, const std::string& ip, int il) {
          int id = int(integer(item, ip, il, "a device index (an integer >= 0)", 0, 1 << 20));
          if (std::find(cfg_.devices.ids.begin(), cfg_.devices.ids.end(), id) != cfg_.devices.ids.end())
            fail(il, ip, "device " + std::to_string(id) + " is listed twice");
          cfg_.devices.ids.push_back(id);
        });
      } else if (k == "all") {
        cfg_.devices.all = boolean(v, p, line);
      } else if (k == "split") {
        std::string s = v.IsScalar() ? v.Scalar() : "";
        int64_t n = 0;
        // A mixed field (words or a count), so a quoted count is taken as a count too.
        bool number = v.IsScalar() && parse_int(s, n);
        if (!(s.empty() || s == "cores" || s == "numa" || (number && n >= 1 && n <= 4096)))
          fail(line, p, "expected \"\" (no split), cores, numa or a positive number of sub-devices, got " + describe(v));
        cfg_.devices.split = number ? std::to_string(n) : s;
      } else if (k == "kernel_shape") {
        const std::string shape = choice(v, p, line, {"auto", "cpu", "gpu"});
        cfg_.devices.kernel_shape =
            shape == "cpu"   ? std::optional<KernelShape>(KernelShape::Chunks)
            : shape == "gpu" ? std::optional<KernelShape>(KernelShape::WorkGroups)
                             : std::nullopt;
      }
    });
  }

  void parse_parallel(const YAML::Node& m) {
    for_each_section_key(m, "parallel", [&](const std::string& k, const YAML::Node& v, const std::string& p, int line) {
      if (k == "placement") {
        cfg_.parallel.placement = choice(v, p, line, {"even", "balanced"}) == "balanced"
                                      ? Placement::Balanced : Placement::Even;
        return;
      }
      int n = int(integer(v, p, line, "a positive integer", 1, 4096));
      if (k == "data") cfg_.parallel.data = n;
      else if (k == "expert") cfg_.parallel.expert = n;
      else if (k == "tensor") cfg_.parallel.tensor = n;
    });
  }

  void parse_cluster(const YAML::Node& m) {
    for_each_section_key(m, "cluster", [&](const std::string& k, const YAML::Node& v, const std::string& p, int line) {
      if (k == "transport")
        cfg_.cluster.transport = choice(v, p, line, {"local", "mpi"}) == "mpi"
                                     ? ClusterTransport::Mpi : ClusterTransport::Local;
    });
  }

  void parse_kv_cache(const YAML::Node& m) {
    for_each_section_key(m, "kv_cache", [&](const std::string& k, const YAML::Node& v, const std::string& p, int line) {
      if (k == "page_size") {
        int64_t n = integer(v, p, line, "a positive multiple of 16", 1, 1 << 20);
        if (n % 16 != 0) fail(line, p, "expected a positive multiple of 16, got " + describe(v));
        cfg_.kv_cache.page_size = int(n);
      } else if (k == "memory_fraction") {
        cfg_.kv_cache.memory_fraction = number(v, p, line, [](double x) -> std::optional<std::string> {
          if (!(x > 0 && x <= 1)) return "a number in (0, 1]";
          return std::nullopt;
        });
      } else if (k == "pages") {
        cfg_.kv_cache.pages = integer(v, p, line, "an integer >= 0 (0: derive from memory_fraction)", 0,
                                      std::numeric_limits<int32_t>::max());
      } else if (k == "prefix_caching") {
        cfg_.kv_cache.prefix_caching = boolean(v, p, line);
      } else if (k == "dtype") {
        const std::string d = choice(v, p, line, {"f32", "bf16", "fp8"});
        cfg_.kv_cache.dtype = d == "bf16" ? DType::BF16 : d == "fp8" ? DType::F8_E4M3 : DType::F32;
      }
    });
  }

  void parse_batch(const YAML::Node& m) {
    for_each_section_key(m, "batch", [&](const std::string& k, const YAML::Node& v, const std::string& p, int line) {
      int n = int(integer(v, p, line, "a positive integer", 1, std::numeric_limits<int32_t>::max()));
      if (k == "max_batch_size") cfg_.batch.max_batch_size = n;
      else if (k == "max_batch_input_tokens") cfg_.batch.max_batch_input_tokens = n;
    });
  }

  void parse_sampling(const YAML::Node& m) {
    SamplingDefaults& s = cfg_.sampling;
    for_each_section_key(m, "sampling", [&](const std::string& k, const YAML::Node& v, const std::string& p, int line) {
      if (k == "temperature") {
        s.temperature = float(number(v, p, line, check_temperature));
      } else if (k == "top_k") {
        std::string expected = *check_top_k(-2);
        int64_t n = integer(v, p, line, expected, std::numeric_limits<int64_t>::min(),
                            std::numeric_limits<int64_t>::max());
        if (check_top_k(n)) fail(line, p, "expected " + expected + ", got " + describe(v));
        s.top_k = n == 0 ? -1 : int32_t(n);
      } else if (k == "top_p") {
        s.top_p = float(number(v, p, line, check_top_p));
      } else if (k == "min_p") {
        s.min_p = float(number(v, p, line, check_min_p));
      } else if (k == "seed") {
        s.seed = unsigned_integer(v, p, line, "an integer >= 0");
      } else if (k == "max_tokens") {
        s.max_tokens = int32_t(integer(v, p, line, "a positive integer", 1, std::numeric_limits<int32_t>::max()));
      } else if (k == "stop") {
        s.stop.clear();
        list_items(v, p, line, true, [&](const YAML::Node& item, const std::string& ip, int il) {
          if (!item.IsScalar() || item.Scalar().empty())
            fail(il, ip, "expected a non-empty string, got " + describe(item));
          s.stop.push_back(item.Scalar());
        });
      } else if (k == "stop_token_ids") {
        s.stop_token_ids.clear();
        list_items(v, p, line, false, [&](const YAML::Node& item, const std::string& ip, int il) {
          s.stop_token_ids.push_back(int32_t(integer(item, ip, il, *check_stop_token_id(-1), 0,
                                                     std::numeric_limits<int32_t>::max())));
        });
      } else if (k == "frequency_penalty") {
        s.frequency_penalty = float(number(v, p, line, check_penalty));
      } else if (k == "presence_penalty") {
        s.presence_penalty = float(number(v, p, line, check_penalty));
      } else if (k == "repetition_penalty") {
        s.repetition_penalty = float(number(v, p, line, check_repetition_penalty));
      } else if (k == "logprobs_mode") {
        s.logprobs_mode = choice(v, p, line, {"raw", "processed"}) == "processed"
                              ? LogprobsMode::Processed
                              : LogprobsMode::Raw;
      }
    });
  }

  void parse_speculative(const YAML::Node& m) {
    for_each_section_key(m, "speculative", [&](const std::string& k, const YAML::Node& v, const std::string& p, int line) {
      if (k == "method") {
        std::string s = choice(v, p, line, {"none", "mtp", "eagle3"});
        cfg_.speculative.method = s == "mtp" ? SpeculativeMethod::Mtp
                                : s == "eagle3" ? SpeculativeMethod::Eagle3 : SpeculativeMethod::None;
      } else if (k == "num_speculative_tokens") {
        cfg_.speculative.num_speculative_tokens = int(integer(v, p, line, "an integer >= 0", 0, 16));
      } else if (k == "draft_model") {
        cfg_.speculative.draft_model = path_value(v, p, line);
      } else if (k == "acceptance") {
        cfg_.speculative.acceptance = choice(v, p, line, {"strict", "relaxed_thinking"}) == "strict"
                                          ? SpeculativeAcceptance::Strict
                                          : SpeculativeAcceptance::RelaxedThinking;
      } else if (k == "relaxed_topk") {
        cfg_.speculative.relaxed_topk = int(integer(v, p, line, "an integer >= 1", 1, 1024));
      } else if (k == "relaxed_delta") {
        cfg_.speculative.relaxed_delta = number(v, p, line, [](double x) -> std::optional<std::string> {
          if (x >= 0.0 && x <= 1.0) return std::nullopt;
          return "a number in [0, 1]";
        });
      }
    });
  }

  void parse_lora(const YAML::Node& m) {
    for_each_section_key(m, "lora", [&](const std::string& k, const YAML::Node& v,
                                        const std::string& p, int line) {
      if (k == "adapters") {
        if (!v.IsMap())
          fail(line, p, "expected a mapping of adapter names to directories, got " + describe(v));
        for (auto it = v.begin(); it != v.end(); ++it) {
          const YAML::Node name = it->first, dir = it->second;
          const int at = line_of(name, line);
          if (!name.IsScalar() || name.Scalar().empty())
            fail(at, p, "expected an adapter name, got " + describe(name));
          const std::string key = p + "." + name.Scalar();
          for (const auto& [n, d] : cfg_.lora.adapters)
            if (n == name.Scalar()) fail(at, key, "duplicate adapter name");
          fs::path dir_path = path_value(dir, key, line_of(dir, at));
          if (dir_path.empty()) fail(at, key, "expected the adapter's directory, got nothing");
          cfg_.lora.adapters.emplace_back(name.Scalar(), dir_path);
        }
      } else if (k == "max_rank") {
        cfg_.lora.max_rank = int(integer(v, p, line, "a positive integer", 1, 4096));
      } else if (k == "max_loaded") {
        cfg_.lora.max_loaded = int(integer(v, p, line, "a positive integer", 1, 4096));
      }
    });
  }

  void parse_job(const YAML::Node& m) {
    for_each_section_key(m, "job", [&](const std::string& k, const YAML::Node& v, const std::string& p, int line) {
      if (k == "input") cfg_.job.input = path_value(v, p, line);
      else if (k == "output") cfg_.job.output = path_value(v, p, line);
    });
  }

  void parse_serve(const YAML::Node& m) {
    ServeSection& s = cfg_.serve;
    auto seconds = [](double x) -> std::optional<std::string> {
      if (x >= 0 && x <= 1e7) return std::nullopt;
      return "a number of seconds >= 0";
    };
    for_each_section_key(m, "serve", [&](const std::string& k, const YAML::Node& v,
                                         const std::string& p, int line) {
      if (k == "host") {
        s.host = string(v, p, line);
        if (s.host.empty())
          fail(line, p, "expected an address to bind (127.0.0.1, 0.0.0.0, ...), got \"\"");
      } else if (k == "port") {
        s.port = int(integer(v, p, line, "a TCP port (0 to 65535; 0: any free port)", 0, 65535));
      } else if (k == "max_waiting") {
        s.max_waiting = int(integer(v, p, line, "an integer >= 0", 0, 1 << 20));
      } else if (k == "api_key") {
        s.api_key = string(v, p, line);
      } else if (k == "request_deadline_s") {
        s.request_deadline_s = number(v, p, line, seconds);
      } else if (k == "shutdown_deadline_s") {
        s.shutdown_deadline_s = number(v, p, line, seconds);
      } else if (k == "model_name") {
        s.model_name = string(v, p, line);
      } else if (k == "max_connections") {
        s.max_connections = int(integer(v, p, line, "an integer in [4, 65536]", 4, 65536));
      }
    });
  }

  std::string file_;
  fs::path base_dir_;
  DeployConfig& cfg_;
};

// Checks that involve more than one key, once every key is read.
void check_consistency(const DeployConfig& cfg, const Parser& parser) {
  if (cfg.model.path.empty())
    parser.fail_at("model.path", "required (the model directory, Hugging Face layout)");

  const DeviceSection& d = cfg.devices;
  if (d.all && !d.ids.empty())
    parser.fail_at("devices.ids", "cannot be combined with devices.all: true (all takes every matching device)");
  if (!d.split.empty() && (d.type == "gpu" || d.type == "accelerator"))
    parser.fail_at("devices.split", "only CPU devices split into sub-devices, but devices.type is " + d.type);

  if (cfg.kv_cache.pages > 0 && cfg.has_key("kv_cache.memory_fraction"))
    parser.fail_at("kv_cache.memory_fraction",
                   "give kv_cache.pages or kv_cache.memory_fraction, not both (pages: " +
                       std::to_string(cfg.kv_cache.pages) + " fixes the page count)");

  const SpeculativeSection& sp = cfg.speculative;
  if (sp.method == SpeculativeMethod::None) {
    // The defaults may be written out (configs/example.yaml does); other values mean nothing.
    const SpeculativeSection defaults;
    const std::pair<const char*, bool> keys[] = {
        {"speculative.num_speculative_tokens", sp.num_speculative_tokens != 0},
        {"speculative.draft_model", !sp.draft_model.empty()},
        {"speculative.acceptance", sp.acceptance != defaults.acceptance},
        {"speculative.relaxed_topk", sp.relaxed_topk != defaults.relaxed_topk},
        {"speculative.relaxed_delta", sp.relaxed_delta != defaults.relaxed_delta}};
    for (const auto& [key, set] : keys)
      if (set) parser.fail_at(key, "set, but speculative.method is none");
  } else {
    if (sp.num_speculative_tokens < 1)
      parser.fail_at(cfg.has_key("speculative.num_speculative_tokens") ? "speculative.num_speculative_tokens" : "speculative.method",
                     std::string("method ") + to_string(sp.method) + " needs speculative.num_speculative_tokens >= 1");
    if (sp.method == SpeculativeMethod::Eagle3 && sp.draft_model.empty())
      parser.fail_at(cfg.has_key("speculative.draft_model") ? "speculative.draft_model" : "speculative.method",
                     "method eagle3 needs speculative.draft_model (the Eagle3 draft checkpoint)");
  }

  if (!cfg.job.output.empty() && cfg.job.input.empty())
    parser.fail_at("job.output", "set, but job.input is not");
  if (!cfg.job.input.empty() && cfg.job.output.lexically_normal() == cfg.job.input.lexically_normal())
    parser.fail_at("job.output", "is the same file as job.input");
}

// yaml-cpp parses nested flow collections by recursion, and on a malformed deep nest ("[[[[..."
// 100 levels, found by fuzzing) it took over 30 s. No deployment nests deeper than a few levels, so
// the text is checked before yaml-cpp sees it: brackets and braces outside quotes and comments.
constexpr int kMaxFlowDepth = 32;

void check_flow_depth(const std::string& text, const std::string& file_name_for_errors) {
  int depth = 0, line = 1;
  char quote = 0;
  bool comment = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (c == '\n') {
      ++line;
      comment = false;
      continue;
    }
    if (comment) continue;
    if (quote) {
      if (quote == '"' && c == '\\') ++i;  // an escaped character, "\"" among them
      else if (c == quote) quote = 0;
      continue;
    }
    if (c == '#' && (i == 0 || text[i - 1] == ' ' || text[i - 1] == '\t' || text[i - 1] == '\n'))
      comment = true;
    else if (c == '"' || c == '\'') quote = c;
    else if (c == '[' || c == '{') {
      if (++depth > kMaxFlowDepth)
        throw std::runtime_error(file_name_for_errors + ":" + std::to_string(line) +
                                 ": invalid YAML: flow collections ([ ] or { }) nested deeper than " +
                                 std::to_string(kMaxFlowDepth) + " levels");
    } else if ((c == ']' || c == '}') && depth > 0) {
      --depth;
    }
  }
}

}  // namespace

DeployConfig parse_deploy_config(const std::string& yaml_text, const std::string& file_name_for_errors,
                                 const fs::path& base_dir) {
  DeployConfig cfg;
  cfg.source = file_name_for_errors;
  YAML::Node root;
  check_flow_depth(yaml_text, file_name_for_errors);
  try {
    root = YAML::Load(yaml_text);
  } catch (const YAML::ParserException& e) {
    throw std::runtime_error(file_name_for_errors + ":" + std::to_string(e.mark.line + 1) +
                             ": invalid YAML: " + e.msg);
  }
  Parser parser(file_name_for_errors, base_dir, cfg);
  parser.parse_root(root);
  check_consistency(cfg, parser);

  if (!cfg.job.input.empty() && cfg.job.output.empty()) {
    fs::path out = cfg.job.input;
    if (out.extension() == ".jsonl") out.replace_extension();
    out += ".completions.jsonl";
    cfg.job.output = out;
  }
  // Over MPI the ranks are processes: Deployment::open checks the degrees against their number.
  if (auto n = cfg.known_device_count(); n && cfg.cluster.transport == ClusterTransport::Local)
    check_device_count(cfg, *n);
  return cfg;
}

DeployConfig load_deploy_config(const fs::path& file) {
  std::ifstream in(file, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read deployment file " + file.string());
  std::ostringstream text;
  text << in.rdbuf();
  return parse_deploy_config(text.str(), file.string(), file.parent_path());
}

void check_device_count(const DeployConfig& cfg, size_t device_count) {
  const ParallelSection& p = cfg.parallel;
  try {
    parallel::check_degrees({size_t(p.data), size_t(p.tensor), size_t(p.expert),
                             p.placement == Placement::Balanced},
                            device_count);
  } catch (const parallel::TopologyError& e) {
    // Point at the first key at fault that the file sets (the section when it sets none of
    // several).
    std::string key = e.keys().size() == 1 ? e.keys()[0] : "parallel";
    for (const auto& k : e.keys())
      if (cfg.has_key(k)) {
        key = k;
        break;
      }
    throw std::runtime_error(cfg.where(key) + ": " + e.detail());
  }
}

}  // namespace clshard
