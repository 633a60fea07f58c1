#include "runtime/serve/openai_api.h"

#include <algorithm>
#include <random>

#include "runtime/bounded_json.h"
#include "runtime/engine/sampling.h"
#include "runtime/json_fields.h"

namespace clshard::serve {

using json = nlohmann::json;
using ordered_json = nlohmann::ordered_json;

ApiError::ApiError(int status_, std::string type_, const std::string& message, std::string param_,
                   std::string code_)
    : std::runtime_error(message),
      status(status_),
      type(std::move(type_)),
      param(std::move(param_)),
      code(std::move(code_)) {}

ordered_json ApiError::body() const {
  ordered_json e;
  e["message"] = what();
  e["type"] = type;
  e["param"] = param.empty() ? ordered_json(nullptr) : ordered_json(param);
  e["code"] = code.empty() ? ordered_json(nullptr) : ordered_json(code);
  return ordered_json{{"error", e}};
}

ApiError bad_field(const std::string& field, const std::string& what) {
  return ApiError(400, "invalid_request_error", field + ": " + what, field);
}

namespace {

std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + v[i];
  return s;
}

bool boolean_field(const json& v, const std::string& field) {
  if (!v.is_boolean()) throw bad_field(field, "expected true or false, got " + json_shown(v));
  return v.get<bool>();
}

std::vector<int32_t> token_ids(const json& v, const std::string& field) {
  std::vector<int32_t> ids;
  for (size_t i = 0; i < v.size(); ++i) {
    const json& t = v[i];
    if (!t.is_number_integer() || t.get<int64_t>() < 0 || t.get<int64_t>() > INT32_MAX)
      throw bad_field(field + "[" + std::to_string(i) + "]",
                      "expected a token id (an integer >= 0), got " + json_shown(t));
    ids.push_back(int32_t(t.get<int64_t>()));
  }
  return ids;
}

// OpenAI's content: a string or a list of text parts, joined.
std::string message_content(const json& c, const std::string& field) {
  if (c.is_string()) return c.get<std::string>();
  if (!c.is_array())
    throw bad_field(field, "expected a string or a list of text parts, got " + json_shown(c));
  std::string text;
  for (size_t j = 0; j < c.size(); ++j) {
    const json& part = c[j];
    if (!part.is_object() || part.value("type", "") != "text" || !part.contains("text") ||
        !part["text"].is_string())
      throw bad_field(
          field + "[" + std::to_string(j) + "]",
          "expected a text part {\"type\": \"text\", \"text\": ...}, got " + json_shown(part));
    text += part["text"].get<std::string>();
  }
  return text;
}

json messages_field(const json& v) {
  if (!v.is_array() || v.empty())
    throw bad_field("messages", std::string("expected a non-empty list of {\"role\", "
                                            "\"content\"} objects, got ") +
                                    (v.is_array() ? "an empty list" : json_kind(v)));
  json out = json::array();
  for (size_t i = 0; i < v.size(); ++i) {
    const std::string where = "messages[" + std::to_string(i) + "]";
    const json& m = v[i];
    if (!m.is_object())
      throw bad_field(where,
                      std::string("expected an object with role and content, got ") + json_kind(m));
    for (const auto& [k, _] : m.items())
      if (k != "role" && k != "content" && k != "name")
        throw bad_field(where + "." + k, "unsupported field (supported: role, content, name)");
    if (!m.contains("role") || !m["role"].is_string() ||
        m["role"].get_ref<const std::string&>().empty())
      throw bad_field(where + ".role",
                      "expected a non-empty string, got " +
                          (m.contains("role") ? json_shown(m["role"]) : "nothing"));
    json turn = {{"role", m["role"]}};
    if (!m.contains("content") || m["content"].is_null())
      throw bad_field(where + ".content", "missing");
    turn["content"] = message_content(m["content"], where + ".content");
    if (m.contains("name") && !m["name"].is_null()) {
      if (!m["name"].is_string())
        throw bad_field(where + ".name", "expected a string, got " + json_shown(m["name"]));
      turn["name"] = m["name"];
    }
    out.push_back(std::move(turn));
  }
  return out;
}

// The prompt of /v1/completions: a string, a list of token ids, or a list of one of either.
void completion_prompt(ApiRequest& r, const json& p) {
  const char* expected = "expected a string or a list of token ids (one prompt per request)";
  if (p.is_string()) {
    r.prompt = p.get<std::string>();
    return;
  }
  if (!p.is_array() || p.empty())
    throw bad_field("prompt", std::string(expected) + ", got " + json_shown(p));
  if (p.size() == 1 && (p[0].is_string() || p[0].is_array())) {
    completion_prompt(r, p[0]);
    return;
  }
  if (!p[0].is_number())
    throw bad_field("prompt", std::string(expected) + ", got " + json_shown(p));
  r.prompt_token_ids = token_ids(p, "prompt");
}

}  // namespace

ApiRequest parse_api_request(Endpoint endpoint, const std::string& body,
                             const SamplingDefaults& defaults) {
  json obj;
  try {
    // Bounded: the body (a schema inside it above all) is copied and walked recursively.
    obj = parse_json_bounded(body);
  } catch (const std::runtime_error& e) {
    throw ApiError(400, "invalid_request_error",
                   std::string("the body is not valid JSON: ") + e.what());
  } catch (const json::parse_error& e) {
    std::string what = e.what();
    auto at = what.find("column ");
    throw ApiError(400, "invalid_request_error",
                   "the body is not valid JSON" +
                       (at == std::string::npos ? ": " + what : " (at " + what.substr(at) + ")"));
  }
  if (!obj.is_object())
    throw ApiError(400, "invalid_request_error",
                   std::string("the body must be a JSON object, got ") + json_kind(obj));
  ApiRequest r;
  r.endpoint = endpoint;
  r.sampling = defaults;
  const bool chat = endpoint == Endpoint::ChatCompletions;
  std::vector<std::string> supported = {"model", chat ? "messages" : "prompt", "stream",
                                        "stream_options", "user", "return_token_ids"};
  if (chat) supported.push_back("max_completion_tokens");
  else supported.push_back("echo");
  const auto& sampling = request_sampling_fields();
  for (const std::string& f : sampling)
    if (chat || f != "top_logprobs") supported.push_back(f);  // completions: logprobs: n
  supported.insert(supported.end(), {"response_format", "regex"});
  for (const auto& [k, v] : obj.items())
    if (std::find(supported.begin(), supported.end(), k) == supported.end())
      throw bad_field(k, "unsupported field (supported: " + join(supported) + ")");
  auto given = [&](const char* k) { return obj.contains(k) && !obj[k].is_null(); };

  if (!given("model")) throw bad_field("model", "required (the served model's name)");
  if (!obj["model"].is_string())
    throw bad_field("model", "expected a string, got " + json_shown(obj["model"]));
  r.model = obj["model"].get<std::string>();
  if (chat) {
    if (!given("messages")) throw bad_field("messages", "required");
    r.messages = messages_field(obj["messages"]);
  } else {
    if (!given("prompt")) throw bad_field("prompt", "required");
    completion_prompt(r, obj["prompt"]);
  }
  if (given("max_tokens") && given("max_completion_tokens"))
    throw bad_field("max_completion_tokens", "give max_tokens or max_completion_tokens, not both");
  // OpenAI's logprobs: chat's is true/false (the top tokens in top_logprobs), completions' the
  // number of top tokens.
  if (given("logprobs")) {
    const json& lp = obj["logprobs"];
    if (chat && !lp.is_boolean())
      throw bad_field("logprobs",
                      "expected true or false (the number of top tokens goes in "
                      "top_logprobs), got " +
                          json_shown(lp));
    if (!chat && !lp.is_number_integer())
      throw bad_field("logprobs",
                      "expected the number of top tokens to return (an integer in [0, " +
                          std::to_string(kMaxTopLogprobs) + "]), got " + json_shown(lp));
  }
  for (const auto& [k, v] : obj.items()) {
    const bool is_sampling = std::find(sampling.begin(), sampling.end(), k) != sampling.end() ||
                             k == "max_completion_tokens";
    if (v.is_null() || !is_sampling) continue;
    try {
      apply_request_sampling_field(r.sampling, k, v, k);
    } catch (const std::invalid_argument& e) {
      throw ApiError(400, "invalid_request_error", e.what(), k);
    }
  }
  if (given("top_logprobs") && r.sampling.top_logprobs > 0 && !r.sampling.logprobs)
    throw bad_field("top_logprobs", "needs logprobs: true");
  if (given("response_format") || given("regex")) {
    // Again with the key order kept: a schema's properties are generated in the order written.
    const ordered_json ordered = parse_ordered_json_bounded(body);
    if (given("response_format")) {
      if (!ordered["response_format"].is_object())
        throw bad_field("response_format",
                        "expected an object like {\"type\": "
                        "\"json_object\"}, got " +
                            json_shown(obj["response_format"]));
      r.response_format = ordered["response_format"];
    }
    if (given("regex")) {
      if (!obj["regex"].is_string())
        throw bad_field("regex", "expected a string (a pattern the whole output must match), got " +
                                     json_shown(obj["regex"]));
      r.regex = obj["regex"].get<std::string>();
    }
  }
  if (given("echo") && boolean_field(obj["echo"], "echo"))
    throw bad_field("echo",
                    "true is not supported (the completion is returned without its prompt)");
  if (given("user") && !obj["user"].is_string())
    throw bad_field("user", "expected a string, got " + json_shown(obj["user"]));
  if (given("stream")) r.stream = boolean_field(obj["stream"], "stream");
  if (given("return_token_ids"))
    r.return_token_ids = boolean_field(obj["return_token_ids"], "return_token_ids");
  if (given("stream_options")) {
    const json& so = obj["stream_options"];
    if (!so.is_object())
      throw bad_field("stream_options", "expected an object, got " + json_shown(so));
    if (!r.stream) throw bad_field("stream_options", "only allowed with stream: true");
    for (const auto& [k, v] : so.items()) {
      if (k != "include_usage")
        throw bad_field("stream_options." + k, "unsupported field (supported: include_usage)");
      if (!v.is_null()) r.include_usage = boolean_field(v, "stream_options.include_usage");
    }
  }
  return r;
}

std::string new_response_id(Endpoint endpoint) {
  static thread_local std::mt19937_64 rng{std::random_device{}()};
  static const char* hex = "0123456789abcdef";
  std::string id = endpoint == Endpoint::ChatCompletions ? "chatcmpl-" : "cmpl-";
  for (int i = 0; i < 24; ++i) id += hex[rng() & 15];
  return id;
}

const char* finish_reason_name(EndReason r) { return r == EndReason::Stop ? "stop" : "length"; }

ordered_json usage_json(const Usage& u) {
  return ordered_json{{"prompt_tokens", u.prompt_tokens},
                      {"completion_tokens", u.completion_tokens},
                      {"total_tokens", u.prompt_tokens + u.completion_tokens}};
}

namespace {

ordered_json envelope(const ApiRequest& req, const ResponseMeta& meta, const char* object) {
  ordered_json j;
  j["id"] = meta.id;
  j["object"] = object;
  j["created"] = meta.created;
  j["model"] = meta.model;
  return j;
}

}  // namespace

ordered_json response_json(const ApiRequest& req, const ResponseMeta& meta,
                           const std::vector<ChoiceOutput>& choices, const Usage& usage) {
  const bool chat = req.endpoint == Endpoint::ChatCompletions;
  ordered_json j = envelope(req, meta, chat ? "chat.completion" : "text_completion");
  ordered_json list = ordered_json::array();
  for (size_t i = 0; i < choices.size(); ++i) {
    const ChoiceOutput& c = choices[i];
    ordered_json choice;
    choice["index"] = i;
    if (chat)
      choice["message"] = ordered_json{{"role", "assistant"}, {"content", c.text}};
    else
      choice["text"] = c.text;
    choice["logprobs"] = !c.logprobs ? ordered_json(nullptr)
                         : chat      ? openai_chat_logprobs(*c.logprobs)
                                     : openai_completion_logprobs(*c.logprobs);
    choice["finish_reason"] = finish_reason_name(c.reason);
    if (req.return_token_ids) choice["token_ids"] = c.token_ids;
    list.push_back(std::move(choice));
  }
  j["choices"] = std::move(list);
  j["usage"] = usage_json(usage);
  return j;
}

ordered_json stream_chunk(const ApiRequest& req, const ResponseMeta& meta, uint32_t index,
                          const std::string& text, const std::vector<int32_t>& token_ids,
                          bool first, std::optional<EndReason> finish,
                          const std::vector<RecordLogprobs>* logprobs, size_t text_offset) {
  const bool chat = req.endpoint == Endpoint::ChatCompletions;
  ordered_json j = envelope(req, meta, chat ? "chat.completion.chunk" : "text_completion");
  ordered_json choice;
  choice["index"] = index;
  if (chat) {
    ordered_json delta = ordered_json::object();
    if (first) delta["role"] = "assistant";
    if (!text.empty() || first) delta["content"] = text;
    choice["delta"] = std::move(delta);
  } else {
    choice["text"] = text;
  }
  choice["logprobs"] = !logprobs ? ordered_json(nullptr)
                       : chat     ? openai_chat_logprobs(*logprobs)
                                  : openai_completion_logprobs(*logprobs, text_offset);
  choice["finish_reason"] = finish ? ordered_json(finish_reason_name(*finish)) : ordered_json();
  if (req.return_token_ids) choice["token_ids"] = token_ids;
  j["choices"] = ordered_json::array({std::move(choice)});
  if (req.include_usage) j["usage"] = nullptr;
  return j;
}

ordered_json usage_chunk(const ApiRequest& req, const ResponseMeta& meta, const Usage& usage) {
  const bool chat = req.endpoint == Endpoint::ChatCompletions;
  ordered_json j = envelope(req, meta, chat ? "chat.completion.chunk" : "text_completion");
  j["choices"] = ordered_json::array();
  j["usage"] = usage_json(usage);
  return j;
}

std::string sse_event(const ordered_json& j) {
  return "data: " + j.dump(-1, ' ', false, ordered_json::error_handler_t::replace) + "\n\n";
}

}  // namespace clshard::serve
