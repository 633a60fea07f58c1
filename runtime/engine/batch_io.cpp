#include "runtime/engine/batch_io.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <limits>
#include <sstream>
#include <stdexcept>

#include <nlohmann/json.hpp>

#include "runtime/bounded_json.h"
#include "runtime/json_fields.h"

namespace clshard {

namespace fs = std::filesystem;
using json = nlohmann::json;
using ordered_json = nlohmann::ordered_json;

const char* to_string(FinishReason r) { return r == FinishReason::Stop ? "stop" : "length"; }

namespace {

// ---------------------------------------------------------------------------------------------
// Input

// A problem with one input line; caught per line and turned into an InputError.
struct LineError {
  std::string message;
};

[[noreturn]] void bad(const std::string& field, const std::string& what) {
  throw LineError{field.empty() ? what : field + ": " + what};
}

int64_t integer_field(const json& v, const std::string& field, const std::string& expected) {
  if (v.is_number_unsigned()) {
    if (v.get<uint64_t>() > uint64_t(std::numeric_limits<int64_t>::max()))
      bad(field, "expected " + expected + ", got " + json_shown(v));
    return int64_t(v.get<uint64_t>());
  }
  if (!v.is_number_integer()) bad(field, "expected " + expected + ", got " + json_shown(v));
  return v.get<int64_t>();
}

double number_field(const json& v, const std::string& field,
                    std::optional<std::string> (*check)(double)) {
  // Every check rejects NaN, which gives the phrase for values that are not numbers at all.
  if (!v.is_number() || check(v.get<double>()))
    bad(field, "expected " + *check(std::nan("")) + ", got " + json_shown(v));
  return v.get<double>();
}

std::vector<int32_t> token_ids_field(const json& v, const std::string& field, bool allow_empty) {
  if (!v.is_array()) bad(field, "expected a list of token ids, got " + std::string(json_kind(v)));
  if (v.empty() && !allow_empty) bad(field, "is empty (a prompt needs at least one token)");
  std::vector<int32_t> ids;
  ids.reserve(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    std::string item = field + "[" + std::to_string(i) + "]";
    int64_t t = integer_field(v[i], item, *check_stop_token_id(-1));
    if (check_stop_token_id(t))
      bad(item, "expected " + *check_stop_token_id(-1) + ", got " + json_shown(v[i]));
    ids.push_back(int32_t(t));
  }
  return ids;
}

const std::vector<std::string>& sampling_fields() {
  static const std::vector<std::string> f = {
      "temperature",      "top_k",        "top_p",    "min_p",
      "seed",             "max_tokens",   "stop",     "stop_token_ids",
      "frequency_penalty", "presence_penalty", "repetition_penalty", "logprobs",
      "top_logprobs",     "n",            "ignore_eos"};
  return f;
}

// Applies one per-request sampling field; callers pass only keys of sampling_fields() and
// max_completion_tokens (OpenAI's newer name for max_tokens).
void apply_sampling_field(SamplingDefaults& s, const std::string& key, const json& v,
                          const std::string& field) {
  if (key == "temperature") {
    s.temperature = float(number_field(v, field, check_temperature));
  } else if (key == "top_k") {
    int64_t k = integer_field(v, field, *check_top_k(-2));
    if (check_top_k(k)) bad(field, "expected " + *check_top_k(-2) + ", got " + json_shown(v));
    s.top_k = k == 0 ? -1 : int32_t(k);
  } else if (key == "top_p") {
    s.top_p = float(number_field(v, field, check_top_p));
  } else if (key == "min_p") {
    s.min_p = float(number_field(v, field, check_min_p));
  } else if (key == "seed") {
    if (!v.is_number_unsigned() && !(v.is_number_integer() && v.get<int64_t>() >= 0))
      bad(field, "expected an integer >= 0, got " + json_shown(v));
    s.seed = v.get<uint64_t>();
  } else if (key == "max_tokens" || key == "max_completion_tokens") {
    int64_t n = integer_field(v, field, *check_max_tokens(0));
    if (check_max_tokens(n))
      bad(field, "expected " + *check_max_tokens(0) + ", got " + json_shown(v));
    s.max_tokens = int32_t(n);
  } else if (key == "stop") {
    // A string or a list of strings, as in OpenAI's API.
    std::vector<std::string> stop;
    auto add = [&](const json& item, const std::string& where) {
      if (!item.is_string() || item.get_ref<const std::string&>().empty())
        bad(where, "expected a non-empty string, got " + json_shown(item));
      stop.push_back(item.get<std::string>());
    };
    if (v.is_string()) {
      add(v, field);
    } else if (v.is_array()) {
      for (size_t i = 0; i < v.size(); ++i) add(v[i], field + "[" + std::to_string(i) + "]");
    } else {
      bad(field, "expected a string or a list of strings, got " + json_shown(v));
    }
    s.stop = std::move(stop);
  } else if (key == "stop_token_ids") {
    s.stop_token_ids = token_ids_field(v, field, true);
  } else if (key == "frequency_penalty") {
    s.frequency_penalty = float(number_field(v, field, check_penalty));
  } else if (key == "presence_penalty") {
    s.presence_penalty = float(number_field(v, field, check_penalty));
  } else if (key == "repetition_penalty") {
    s.repetition_penalty = float(number_field(v, field, check_repetition_penalty));
  } else if (key == "logprobs") {
    // Chat's boolean, or the completions API's integer (the number of top tokens).
    if (v.is_boolean()) {
      s.logprobs = v.get<bool>();
    } else {
      const std::string expected = "true, false or " + *check_top_logprobs(-1);
      const int64_t k = integer_field(v, field, expected);
      if (check_top_logprobs(k)) bad(field, "expected " + expected + ", got " + json_shown(v));
      s.logprobs = true;
      s.top_logprobs = int32_t(k);
    }
  } else if (key == "top_logprobs") {
    const int64_t k = integer_field(v, field, *check_top_logprobs(-1));
    if (check_top_logprobs(k))
      bad(field, "expected " + *check_top_logprobs(-1) + ", got " + json_shown(v));
    s.top_logprobs = int32_t(k);
  } else if (key == "n") {
    const int64_t n = integer_field(v, field, *check_n(0));
    if (check_n(n)) bad(field, "expected " + *check_n(0) + ", got " + json_shown(v));
    s.n = int32_t(n);
  } else if (key == "ignore_eos") {
    if (!v.is_boolean()) bad(field, "expected true or false, got " + json_shown(v));
    s.ignore_eos = v.get<bool>();
  }
}

// top_logprobs > 0 needs logprobs (OpenAI's rule); `prefix` is "" or "body.".
void check_logprobs_pair(const SamplingDefaults& s, const json& obj, const std::string& prefix) {
  if (s.top_logprobs > 0 && !s.logprobs && obj.contains("top_logprobs"))
    bad(prefix + "top_logprobs", "needs " + prefix + "logprobs: true");
}

std::vector<ChatTurn> messages_field(const json& v, const std::string& field) {
  if (!v.is_array())
    bad(field,
        "expected a list of {\"role\", \"content\"} objects, got " + std::string(json_kind(v)));
  if (v.empty()) bad(field, "is empty");
  std::vector<ChatTurn> turns;
  for (size_t i = 0; i < v.size(); ++i) {
    std::string where = field + "[" + std::to_string(i) + "]";
    const json& m = v[i];
    if (!m.is_object())
      bad(where, "expected an object with role and content, got " + std::string(json_kind(m)));
    for (const auto& [k, _] : m.items())
      if (k != "role" && k != "content") bad(where, "unknown field \"" + k + "\" (expected: role, content)");
    if (!m.contains("role") || !m["role"].is_string() || m["role"].get_ref<const std::string&>().empty())
      bad(where + ".role", "expected a non-empty string, got " +
                               (m.contains("role") ? json_shown(m["role"]) : "nothing"));
    ChatTurn turn{m["role"].get<std::string>(), ""};
    if (!m.contains("content")) bad(where + ".content", "missing");
    const json& c = m["content"];
    if (c.is_string()) {
      turn.content = c.get<std::string>();
    } else if (c.is_array()) {
      // OpenAI's content parts: only text parts can be rendered by a text-only model; they join.
      for (size_t j = 0; j < c.size(); ++j) {
        std::string pw = where + ".content[" + std::to_string(j) + "]";
        const json& part = c[j];
        if (!part.is_object() || part.value("type", "") != "text" || !part.contains("text") ||
            !part["text"].is_string())
          bad(pw,
              "expected a text part {\"type\": \"text\", \"text\": ...}, got " + json_shown(part));
        turn.content += part["text"].get<std::string>();
      }
    } else {
      bad(where + ".content", "expected a string or a list of text parts, got " + json_shown(c));
    }
    turns.push_back(std::move(turn));
  }
  return turns;
}

std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + v[i];
  return s;
}

// Fills the request's prompt from prompt / prompt_token_ids / messages, exactly one of them.
void set_prompt(BatchRequest& r, const json& obj, const std::string& prefix) {
  int given = int(obj.contains("prompt")) + int(obj.contains("prompt_token_ids")) + int(obj.contains("messages"));
  if (given == 0)
    bad(prefix.empty() ? "" : prefix.substr(0, prefix.size() - 1),
        "no prompt: give one of " + prefix + "prompt, " + prefix + "prompt_token_ids or " + prefix + "messages");
  if (given > 1)
    bad(prefix.empty() ? "" : prefix.substr(0, prefix.size() - 1),
        "give only one of " + prefix + "prompt, " + prefix + "prompt_token_ids, " + prefix + "messages");
  if (obj.contains("prompt")) {
    const json& p = obj["prompt"];
    if (p.is_string()) {
      if (p.get_ref<const std::string&>().empty()) bad(prefix + "prompt", "is empty");
      r.prompt = p.get<std::string>();
    } else if (p.is_array() && r.openai_shape && !p.empty() && p[0].is_number()) {
      // OpenAI's completions API takes token ids in "prompt" too.
      r.prompt_token_ids = token_ids_field(p, prefix + "prompt", false);
    } else {
      bad(prefix + "prompt", std::string("expected a string") +
                                 (r.openai_shape ? " or a list of token ids" : "") +
                                 " (one prompt per line), got " + json_shown(p));
    }
  } else if (obj.contains("prompt_token_ids")) {
    r.prompt_token_ids = token_ids_field(obj["prompt_token_ids"], prefix + "prompt_token_ids", false);
  } else {
    r.messages = messages_field(obj["messages"], prefix + "messages");
  }
}

// An id given as a JSON string or integer; as text.
std::string read_id(const json& v, const std::string& field, bool& is_number,
                                   bool strings_only) {
  if (v.is_string()) {
    if (v.get_ref<const std::string&>().empty()) bad(field, "is empty");
    is_number = false;
    return v.get<std::string>();
  }
  if (!strings_only && (v.is_number_integer() || v.is_number_unsigned())) {
    is_number = true;
    return v.dump();
  }
  bad(field, std::string("expected ") + (strings_only ? "a string" : "a string or an integer") +
                 ", got " + json_shown(v));
}

void parse_plain(BatchRequest& r, const json& obj) {
  static const std::vector<std::string> allowed = [] {
    std::vector<std::string> a = {"id", "prompt", "prompt_token_ids", "messages"};
    a.insert(a.end(), sampling_fields().begin(), sampling_fields().end());
    a.insert(a.end(), {"response_format", "regex"});
    a.push_back("lora");
    return a;
  }();
  for (const auto& [k, v] : obj.items()) {
    if (std::find(allowed.begin(), allowed.end(), k) == allowed.end())
      bad("", "unknown field \"" + k + "\" (expected: " + join(allowed) + ")");
    if (k == "id" || k == "prompt" || k == "prompt_token_ids" || k == "messages" || v.is_null()) continue;
    if (k == "response_format" || k == "regex") continue;  // structured_fields()
    if (k == "lora") {
      if (!v.is_string() || v.get_ref<const std::string&>().empty())
        bad(k, "expected the name of a LoRA adapter, got " + json_shown(v));
      r.lora = v.get<std::string>();
      continue;
    }
    apply_sampling_field(r.sampling, k, v, k);
  }
  check_logprobs_pair(r.sampling, obj, "");
  set_prompt(r, obj, "");
}

void parse_openai(BatchRequest& r, const json& obj) {
  for (const auto& [k, v] : obj.items())
    if (k != "custom_id" && k != "method" && k != "url" && k != "body")
      bad("", "unknown field \"" + k + "\" (an OpenAI batch line has custom_id, method, url, body)");
  if (obj.contains("method") && obj["method"] != "POST")
    bad("method", "expected \"POST\", got " + json_shown(obj["method"]));
  std::string url;
  if (obj.contains("url")) {
    const json& u = obj["url"];
    if (!u.is_string() || (u != "/v1/completions" && u != "/v1/chat/completions"))
      bad("url", "expected \"/v1/completions\" or \"/v1/chat/completions\", got " + json_shown(u));
    url = u.get<std::string>();
  }
  if (!obj.contains("body")) bad("body", "missing");
  const json& body = obj["body"];
  if (!body.is_object()) bad("body", "expected an object, got " + std::string(json_kind(body)));

  static const std::vector<std::string> supported = [] {
    std::vector<std::string> a = {"prompt", "messages", "max_completion_tokens", "model",
                                  "stream", "user"};
    a.insert(a.end(), sampling_fields().begin(), sampling_fields().end());
    a.insert(a.end(), {"response_format", "regex"});
    return a;
  }();
  if (body.contains("max_tokens") && body.contains("max_completion_tokens") &&
      !body["max_tokens"].is_null() && !body["max_completion_tokens"].is_null())
    bad("body", "give max_tokens or max_completion_tokens, not both");
  for (const auto& [k, v] : body.items()) {
    std::string field = "body." + k;
    if (std::find(supported.begin(), supported.end(), k) == supported.end())
      bad(field, "unsupported field (supported: " + join(supported) + ")");
    if (v.is_null() || k == "prompt" || k == "messages" || k == "user") continue;
    if (k == "response_format" || k == "regex") continue;  // structured_fields()
    // The deployment decides the model; the field is accepted because every OpenAI batch line has it.
    if (k == "model") continue;
    if (k == "stream") {
      if (v != false)
        bad(field, "expected false (a batch job does not stream), got " + json_shown(v));
      continue;
    }
    apply_sampling_field(r.sampling, k, v, field);
  }
  check_logprobs_pair(r.sampling, body, "body.");
  if (body.contains("prompt_token_ids")) bad("body.prompt_token_ids", "unsupported field (use body.prompt)");
  set_prompt(r, body, "body.");
  if (url == "/v1/chat/completions" && !r.messages)
    bad("body", "url /v1/chat/completions needs body.messages");
  if (url == "/v1/completions" && r.messages)
    bad("body", "url /v1/completions needs body.prompt (body.messages goes to /v1/chat/completions)");
}

// response_format and regex, taken from the line parsed again with its key order kept (a JSON
// schema's properties are generated in the order written). Their contents are checked when the
// job compiles them with the tokenizer.
void structured_fields(BatchRequest& r, const std::string& line) {
  const ordered_json all = ordered_json::parse(line);
  const ordered_json& src = r.openai_shape ? all["body"] : all;
  const std::string prefix = r.openai_shape ? "body." : "";
  r.response_format_field = prefix + "response_format";
  r.regex_field = prefix + "regex";
  if (src.contains("response_format") && !src["response_format"].is_null()) {
    const ordered_json& rf = src["response_format"];
    if (!rf.is_object())
      bad(r.response_format_field, "expected an object like {\"type\": \"json_object\"}, got " +
                                       json_shown(json::parse(rf.dump())));
    r.response_format = rf;
  }
  if (src.contains("regex") && !src["regex"].is_null()) {
    if (!src["regex"].is_string())
      bad(r.regex_field, "expected a string (a pattern the whole output must match), got " +
                             json_shown(json::parse(src["regex"].dump())));
    r.regex = src["regex"].get<std::string>();
  }
}

std::string json_error_message(const json::parse_error& e) {
  // nlohmann's text is "[json.exception.parse_error.101] parse error at line 1, column 5: ...";
  // the line is always 1 here and the prefix is noise.
  std::string what = e.what();
  auto at = what.find("column ");
  if (at == std::string::npos) return "invalid JSON: " + what;
  return "invalid JSON at " + what.substr(at);
}

}  // namespace

const std::vector<std::string>& request_sampling_fields() { return sampling_fields(); }

void apply_request_sampling_field(SamplingDefaults& s, const std::string& key, const json& value,
                                  const std::string& field) {
  try {
    apply_sampling_field(s, key, value, field);
  } catch (const LineError& e) {
    throw std::invalid_argument(e.message);
  }
}

BatchInput parse_batch_input(const std::string& text, const SamplingDefaults& defaults) {
  BatchInput out;
  struct FirstUse {
    size_t line;
    bool implicit;  // the line had no id and took its line number
  };
  std::map<std::string, FirstUse> ids_seen;
  size_t line_no = 0;
  size_t pos = 0;
  while (pos < text.size()) {
    size_t end = text.find('\n', pos);
    if (end == std::string::npos) end = text.size();
    std::string line = text.substr(pos, end - pos);
    pos = end + 1;
    ++line_no;
    if (line_no == 1 && line.compare(0, 3, "\xEF\xBB\xBF") == 0) line.erase(0, 3);  // UTF-8 BOM
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;

    BatchRequest r;
    r.line = line_no;
    r.sampling = defaults;
    bool has_id = false;
    try {
      json obj;
      try {
        obj = parse_json_bounded(line);
      } catch (const json::parse_error& e) {
        bad("", json_error_message(e));
      } catch (const std::runtime_error& e) {
        bad("", e.what());
      }
      if (!obj.is_object()) bad("", std::string("expected a JSON object, got ") + json_kind(obj));
      r.openai_shape = obj.contains("body") || obj.contains("custom_id");
      if (r.openai_shape) {
        if (!obj.contains("custom_id")) bad("custom_id", "missing (the OpenAI batch shape needs one per line)");
        r.id = read_id(obj["custom_id"], "custom_id", r.id_is_number, true);
        has_id = true;
      } else if (obj.contains("id") && !obj["id"].is_null()) {
        r.id = read_id(obj["id"], "id", r.id_is_number, false);
        has_id = true;
      }
      bool implicit = !has_id;
      if (implicit) {
        r.id = std::to_string(line_no);
        r.id_is_number = true;
      }
      if (auto first = ids_seen.find(r.id); first != ids_seen.end()) {
        std::string shown_id = r.id_is_number ? r.id : "\"" + r.id + "\"";
        if (implicit)
          bad("id", "none given, and the line number " + r.id + " is already the id of line " +
                        std::to_string(first->second.line));
        bad("id", "duplicate id " + shown_id + " (first used by line " + std::to_string(first->second.line) +
                      (first->second.implicit ? ", which has no id and took its line number)" : ")"));
      }
      ids_seen[r.id] = {line_no, implicit};
      if (r.openai_shape) parse_openai(r, obj);
      else parse_plain(r, obj);
      const json& fields = r.openai_shape ? obj["body"] : obj;
      if (fields.contains("response_format") || fields.contains("regex")) structured_fields(r, line);
      out.requests.push_back(std::move(r));
    } catch (const LineError& e) {
      InputError err;
      err.line = line_no;
      err.message = e.message;
      err.openai_shape = r.openai_shape;
      if (has_id) {
        err.id = r.id;
        err.id_is_number = r.id_is_number;
      }
      out.errors.push_back(std::move(err));
    }
  }
  return out;
}

BatchInput read_batch_input(const fs::path& path, const SamplingDefaults& defaults) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read the job's input " + path.string() + ": " + std::strerror(errno));
  std::ostringstream text;
  text << in.rdbuf();
  return parse_batch_input(text.str(), defaults);
}

// ---------------------------------------------------------------------------------------------
// Output files

namespace {

struct OutputRecord {
  std::optional<std::string> id;  // null id: an input line without a usable id
  size_t line = 0;                // 0 when the record has none
  bool is_error = false;
  std::string text;               // the line without its newline
};

struct ScannedFile {
  std::vector<OutputRecord> records;
  uint64_t valid_bytes = 0;
  uint64_t file_bytes = 0;
};

// Reads a file of records; a last line without a newline (torn by a kill) is not a record.
ScannedFile scan_records(const fs::path& file) {
  ScannedFile out;
  std::ifstream in(file, std::ios::binary);
  if (!in) return out;
  std::string line;
  size_t line_no = 0;
  while (std::getline(in, line)) {
    ++line_no;
    if (in.eof()) {  // no newline after it
      out.file_bytes = out.valid_bytes + line.size();
      return out;
    }
    out.valid_bytes += line.size() + 1;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    json j;
    try {
      j = json::parse(line);
    } catch (const json::parse_error& e) {
      throw std::runtime_error(file.string() + ":" + std::to_string(line_no) +
                               ": not a clshard output record (" + json_error_message(e) +
                               "); refusing to append to it");
    }
    if (!j.is_object() || !j.contains("id") ||
        !(j["id"].is_string() || j["id"].is_number_integer() || j["id"].is_null()))
      throw std::runtime_error(file.string() + ":" + std::to_string(line_no) +
                               ": not a clshard output record (no \"id\"); refusing to append to it");
    OutputRecord r;
    if (!j["id"].is_null()) r.id = j["id"].is_string() ? j["id"].get<std::string>() : j["id"].dump();
    if (j.contains("line") && j["line"].is_number_unsigned()) r.line = j["line"].get<size_t>();
    r.is_error = j.contains("error") && !j["error"].is_null();
    r.text = std::move(line);
    out.records.push_back(std::move(r));
  }
  out.file_bytes = out.valid_bytes;
  return out;
}

// Appends whole records or nothing: when the disk fills (or a file size limit is hit) part way,
// the file is cut back to where it was, so what is on disk stays a list of complete records.
void write_all(int fd, const std::string& data, const fs::path& file) {
  const off_t before = ::lseek(fd, 0, SEEK_END);
  size_t done = 0;
  while (done < data.size()) {
    ssize_t n = ::write(fd, data.data() + done, data.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      const int error = errno;
      if (before >= 0 && done > 0) (void)!::ftruncate(fd, before);
      throw std::runtime_error("writing " + file.string() + ": " + std::strerror(error) +
                               " (the records written so far are intact; free space and rerun "
                               "to resume)");
    }
    done += size_t(n);
  }
}

void sync(int fd, const fs::path& file) {
  if (::fdatasync(fd) != 0) throw std::runtime_error("syncing " + file.string() + ": " + std::strerror(errno));
}

int open_append(const fs::path& file, bool truncate) {
  int fd = ::open(file.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC | (truncate ? O_TRUNC : 0), 0644);
  if (fd < 0) throw std::runtime_error("cannot open " + file.string() + " for writing: " + std::strerror(errno));
  return fd;
}

}  // namespace

fs::path pending_journal_path(const fs::path& output) {
  fs::path p = output;
  p += ".pending";
  return p;
}

OutputState read_output_state(const fs::path& output) {
  OutputState st;
  ScannedFile main = scan_records(output);
  st.valid_bytes = main.valid_bytes;
  st.file_bytes = main.file_bytes;
  for (const auto& r : main.records) {
    ++st.records;
    if (r.is_error) ++st.error_records;
    if (r.id) st.ids.insert(*r.id);
  }
  for (const auto& r : scan_records(pending_journal_path(output)).records)
    if (r.id) st.ids.insert(*r.id);
  return st;
}

std::set<std::string> completed_ids(const fs::path& output) { return read_output_state(output).ids; }

uint64_t truncate_torn_tail(const fs::path& file) {
  std::error_code ec;
  if (!fs::exists(file, ec)) return 0;
  ScannedFile s = scan_records(file);
  if (s.file_bytes == s.valid_bytes) return 0;
  fs::resize_file(file, s.valid_bytes);
  return s.file_bytes - s.valid_bytes;
}

// ---------------------------------------------------------------------------------------------
// Writer

BatchOutputWriter::BatchOutputWriter(const fs::path& output, const BatchInput& input,
                                     const BatchOutputOptions& options)
    : output_(output), journal_(pending_journal_path(output)), options_(options) {
  if (output_.has_parent_path()) fs::create_directories(output_.parent_path());

  // Resume: what earlier runs wrote. Requests are done when their id has a record; input errors
  // are matched by line instead, because an error record may have no id.
  std::set<size_t> error_lines_done;
  if (options_.resume) {
    truncate_torn_tail(output_);
    truncate_torn_tail(journal_);
    ScannedFile main = scan_records(output_);
    ScannedFile journal = scan_records(journal_);
    for (const auto& r : main.records) {
      if (r.id) resumed_.insert(*r.id);
      if (r.is_error && r.line) error_lines_done.insert(r.line);
    }
    // Records that finished out of order before the kill: they go into the output now, in line
    // order, so the journal can go.
    std::vector<const OutputRecord*> recovered;
    for (const auto& r : journal.records)
      if (r.id && !resumed_.count(*r.id)) recovered.push_back(&r);
    std::stable_sort(recovered.begin(), recovered.end(),
                     [](const OutputRecord* a, const OutputRecord* b) { return a->line < b->line; });
    fd_ = open_append(output_, false);
    for (const OutputRecord* r : recovered) {
      write_all(fd_, r->text + "\n", output_);
      resumed_.insert(*r->id);
      if (r->is_error && r->line) error_lines_done.insert(r->line);
    }
    if (!recovered.empty() && options_.fsync) sync(fd_, output_);
  } else {
    fd_ = open_append(output_, true);
  }
  std::error_code ec;
  fs::remove(journal_, ec);

  // The slots of this run: requests and input errors not yet written, in line order.
  auto req = input.requests.begin();
  auto err = input.errors.begin();
  while (req != input.requests.end() || err != input.errors.end()) {
    bool take_request = err == input.errors.end() || (req != input.requests.end() && req->line < err->line);
    if (take_request) {
      const BatchRequest& r = *req++;
      if (resumed_.count(r.id)) continue;
      request_slot_[r.id] = slots_.size();
      slots_.push_back({r.id, r.id_is_number, r.line, r.openai_shape, r.is_chat(), std::nullopt, false});
    } else {
      const InputError& e = *err++;
      if (error_lines_done.count(e.line)) continue;
      Slot s{e.id, e.id_is_number, e.line, e.openai_shape, false, std::nullopt, true};
      s.record = error_line(s, e.message);
      slots_.push_back(std::move(s));
    }
  }
  write_ready_prefix();
}

BatchOutputWriter::~BatchOutputWriter() {
  if (journal_fd_ >= 0) ::close(journal_fd_);
  if (fd_ >= 0) ::close(fd_);
}

std::vector<const BatchRequest*> BatchOutputWriter::requests_to_run(const BatchInput& input) const {
  std::vector<const BatchRequest*> out;
  for (const BatchRequest& r : input.requests)
    if (should_run(r)) out.push_back(&r);
  return out;
}

namespace {
ordered_json id_value(const std::string& id, bool is_number) {
  if (id.empty()) return nullptr;
  if (is_number) return ordered_json::parse(id);
  return id;
}

std::string to_line(const ordered_json& j) {
  // Generated text can end inside a UTF-8 character (max_tokens cuts anywhere): such bytes become
  // U+FFFD rather than making the record unwritable.
  return j.dump(-1, ' ', false, ordered_json::error_handler_t::replace) + "\n";
}
}  // namespace

namespace {

// A log-probability as JSON: -inf (a token the distribution excludes) has no JSON number and is
// written as null.
ordered_json logprob_value(float lp) {
  return std::isfinite(lp) ? ordered_json(lp) : ordered_json(nullptr);
}

ordered_json plain_logprobs(const std::vector<RecordLogprobs>& lps) {
  ordered_json out = ordered_json::array();
  for (const RecordLogprobs& e : lps) {
    ordered_json top = ordered_json::array();
    for (const auto& t : e.top)
      top.push_back({{"token_id", t.token_id}, {"token", t.token},
                     {"logprob", logprob_value(t.logprob)}});
    out.push_back({{"token_id", e.chosen.token_id}, {"token", e.chosen.token},
                   {"logprob", logprob_value(e.chosen.logprob)}, {"top_logprobs", top}});
  }
  return out;
}

ordered_json token_bytes(const std::string& s) {
  ordered_json b = ordered_json::array();
  for (unsigned char c : s) b.push_back(int(c));
  return b;
}

ordered_json token_bytes(const TokenLogprobText& t) {
  return token_bytes(t.bytes.empty() ? t.token : t.bytes);
}

}  // namespace

ordered_json openai_chat_logprobs(const std::vector<RecordLogprobs>& lps) {
  ordered_json content = ordered_json::array();
  for (const RecordLogprobs& e : lps) {
    ordered_json top = ordered_json::array();
    for (const auto& t : e.top)
      top.push_back({{"token", t.token}, {"logprob", logprob_value(t.logprob)},
                     {"bytes", token_bytes(t)}});
    content.push_back({{"token", e.chosen.token}, {"logprob", logprob_value(e.chosen.logprob)},
                       {"bytes", token_bytes(e.chosen)}, {"top_logprobs", top}});
  }
  return {{"content", content}};
}

ordered_json openai_completion_logprobs(const std::vector<RecordLogprobs>& lps,
                                        size_t text_offset) {
  ordered_json tokens = ordered_json::array(), lp = ordered_json::array(),
               top = ordered_json::array(), offsets = ordered_json::array();
  size_t offset = text_offset;
  for (const RecordLogprobs& e : lps) {
    tokens.push_back(e.chosen.token);
    lp.push_back(logprob_value(e.chosen.logprob));
    ordered_json t = ordered_json::object();
    for (const auto& x : e.top) t[x.token] = logprob_value(x.logprob);
    top.push_back(t);
    offsets.push_back(offset);
    offset += e.chosen.bytes.empty() ? e.chosen.token.size() : e.chosen.bytes.size();
  }
  return {{"tokens", tokens}, {"token_logprobs", lp}, {"top_logprobs", top},
          {"text_offset", offsets}};
}

std::string BatchOutputWriter::completion_line(const Slot& s, const CompletionRecord& r) const {
  ordered_json j;
  j["id"] = id_value(s.id, s.id_is_number);
  if (s.openai_shape) j["custom_id"] = s.id;
  j["line"] = s.line;
  j["text"] = r.text;
  j["token_ids"] = r.token_ids;
  j["finish_reason"] = to_string(r.finish_reason);
  j["prompt_tokens"] = r.prompt_tokens;
  j["completion_tokens"] = r.completion_tokens;
  if (r.logprobs) j["logprobs"] = plain_logprobs(*r.logprobs);
  // The choices: r itself, or r.choices when there are several.
  std::vector<const CompletionRecord*> choices;
  if (r.choices.empty()) choices.push_back(&r);
  for (const CompletionRecord& c : r.choices) choices.push_back(&c);
  if (!r.choices.empty()) {
    ordered_json list = ordered_json::array();
    for (size_t i = 0; i < choices.size(); ++i) {
      ordered_json c;
      c["index"] = i;
      c["text"] = choices[i]->text;
      c["token_ids"] = choices[i]->token_ids;
      c["finish_reason"] = to_string(choices[i]->finish_reason);
      c["completion_tokens"] = choices[i]->completion_tokens;
      if (choices[i]->logprobs) c["logprobs"] = plain_logprobs(*choices[i]->logprobs);
      list.push_back(c);
    }
    j["choices"] = list;
  }
  if (s.openai_shape) {
    ordered_json list = ordered_json::array();
    for (size_t i = 0; i < choices.size(); ++i) {
      const CompletionRecord& c = *choices[i];
      ordered_json choice;
      choice["index"] = i;
      if (s.chat) choice["message"] = {{"role", "assistant"}, {"content", c.text}};
      else choice["text"] = c.text;
      if (c.logprobs)
        choice["logprobs"] = s.chat ? openai_chat_logprobs(*c.logprobs)
                                    : openai_completion_logprobs(*c.logprobs);
      choice["finish_reason"] = to_string(c.finish_reason);
      list.push_back(choice);
    }
    ordered_json body;
    body["object"] = s.chat ? "chat.completion" : "text_completion";
    if (!options_.model_name.empty()) body["model"] = options_.model_name;
    body["choices"] = list;
    body["usage"] = {{"prompt_tokens", r.prompt_tokens},
                     {"completion_tokens", r.completion_tokens},
                     {"total_tokens", r.prompt_tokens + r.completion_tokens}};
    j["response"] = {{"status_code", 200}, {"body", body}};
  }
  return to_line(j);
}

std::string BatchOutputWriter::error_line(const Slot& s, const std::string& message) const {
  ordered_json j;
  j["id"] = id_value(s.id, s.id_is_number);
  if (s.openai_shape) j["custom_id"] = s.id.empty() ? ordered_json(nullptr) : ordered_json(s.id);
  j["line"] = s.line;
  j["error"] = message;
  if (s.openai_shape) j["response"] = nullptr;
  return to_line(j);
}

void BatchOutputWriter::complete(const std::string& id, const CompletionRecord& record) {
  auto it = request_slot_.find(id);
  if (it == request_slot_.end()) throw std::invalid_argument("batch output: no pending request with id " + id);
  finish_slot(it->second, completion_line(slots_[it->second], record), false);
}

void BatchOutputWriter::error(const std::string& id, const std::string& message) {
  auto it = request_slot_.find(id);
  if (it == request_slot_.end()) throw std::invalid_argument("batch output: no pending request with id " + id);
  finish_slot(it->second, error_line(slots_[it->second], message), true);
}

void BatchOutputWriter::finish_slot(size_t index, std::string line, bool is_error) {
  Slot& s = slots_[index];
  if (s.record || index < next_) throw std::logic_error("batch output: request " + s.id + " finished twice");
  s.is_error = is_error;
  if (index != next_) {
    // It must wait for earlier lines; the journal keeps it safe from a kill meanwhile.
    if (journal_fd_ < 0) journal_fd_ = open_append(journal_, false);
    write_all(journal_fd_, line, journal_);
    if (options_.fsync) sync(journal_fd_, journal_);
  }
  s.record = std::move(line);
  write_ready_prefix();
}

void BatchOutputWriter::write_ready_prefix() {
  size_t first = next_;
  while (next_ < slots_.size() && slots_[next_].record) {
    Slot& s = slots_[next_];
    write_all(fd_, *s.record, output_);  // one write per record: a kill tears at most this one
    if (s.is_error) ++errors_written_;
    s.record.reset();  // written; index < next_ marks it finished
    ++next_;
  }
  if (next_ != first && options_.fsync) sync(fd_, output_);
  if (done() && journal_fd_ >= 0) {
    ::close(journal_fd_);
    journal_fd_ = -1;
    std::error_code ec;
    fs::remove(journal_, ec);
  }
}

}  // namespace clshard
