// OpenAI's HTTP API as clshard serves it: request bodies of /v1/completions and
// /v1/chat/completions read into what the engine needs (every problem an OpenAI-shaped error
// naming the field), and the response bodies and stream chunks written back. No I/O here: the
// server (http_server.h) moves the bytes.
#pragma once

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "runtime/engine/batch_io.h"
#include "runtime/engine/deploy_config.h"
#include "runtime/engine/scheduler.h"

namespace clshard::serve {

// An error answered in OpenAI's shape, {"error": {"message", "type", "param", "code"}}, with its
// HTTP status: 400 invalid_request_error (a bad field: param names it), 401 (API key), 404
// model_not_found, 429 (queue full), 503 (not ready, shutting down), 504 (request deadline).
struct ApiError : std::runtime_error {
  ApiError(int status, std::string type, const std::string& message, std::string param = {},
           std::string code = {});
  int status;
  std::string type, param, code;
  nlohmann::ordered_json body() const;
};

// 400 invalid_request_error "FIELD: what" with param FIELD.
ApiError bad_field(const std::string& field, const std::string& what);

enum class Endpoint { Completions, ChatCompletions };

struct ApiRequest {
  Endpoint endpoint = Endpoint::Completions;
  std::string model;
  // Exactly one: a text prompt, token ids (completions), or chat messages (chat completions, as
  // JSON objects with role and content, content parts joined into one string).
  std::optional<std::string> prompt;
  std::optional<std::vector<int32_t>> prompt_token_ids;
  std::optional<nlohmann::json> messages;
  // The deployment's defaults with the body's fields applied: temperature, top_k, top_p, min_p,
  // seed, max_tokens / max_completion_tokens, stop, stop_token_ids, the penalties, logprobs
  // (chat: true/false with top_logprobs; completions: the number of top tokens), n, and vLLM's
  // ignore_eos (the model's EOS does not end the completion).
  SamplingDefaults sampling;
  bool stream = false;
  bool include_usage = false;     // stream_options.include_usage
  bool return_token_ids = false;  // vLLM's extension: token ids in every choice and chunk
  // Structured output as given (key order kept: a schema's properties come out in its order);
  // checked when the server compiles it with the tokenizer (Deployment::generation_request).
  std::optional<nlohmann::ordered_json> response_format;
  std::optional<std::string> regex;  // the extension field: a pattern the whole output matches
};

// Reads a body. Unknown and unsupported fields are 400 errors naming them (a field set to null is
// the same as a field left out). `model` is required; whether it is served is the caller's check.
ApiRequest parse_api_request(Endpoint endpoint, const std::string& body,
                             const SamplingDefaults& defaults);

// What one finished choice holds.
struct ChoiceOutput {
  std::string text;
  std::vector<int32_t> token_ids;
  EndReason reason = EndReason::Length;
  std::optional<std::vector<RecordLogprobs>> logprobs;  // per token, when the request asked
};

struct ResponseMeta {
  std::string id;  // "cmpl-..." or "chatcmpl-..."
  int64_t created = 0;
  std::string model;
};

// "cmpl-" / "chatcmpl-" followed by 24 random hex digits.
std::string new_response_id(Endpoint endpoint);
const char* finish_reason_name(EndReason r);  // "stop" | "length"

struct Usage {
  uint64_t prompt_tokens = 0, completion_tokens = 0;
};
nlohmann::ordered_json usage_json(const Usage& u);

// The non-streaming response: text_completion or chat.completion.
nlohmann::ordered_json response_json(const ApiRequest& req, const ResponseMeta& meta,
                                     const std::vector<ChoiceOutput>& choices, const Usage& usage);

// One chunk of a stream (OpenAI's text_completion / chat.completion.chunk objects) for choice
// `index`: `text` is the delta; `first` adds the assistant role to a chat delta; `finish` ends the
// choice. With include_usage every chunk carries "usage": null. `logprobs`: those of the chunk's
// tokens when the request asked (null otherwise), in the endpoint's shape; a completions chunk's
// text_offset counts from `text_offset`, the bytes of the choice's text sent before it.
nlohmann::ordered_json stream_chunk(const ApiRequest& req, const ResponseMeta& meta,
                                    uint32_t index, const std::string& text,
                                    const std::vector<int32_t>& token_ids, bool first,
                                    std::optional<EndReason> finish,
                                    const std::vector<RecordLogprobs>* logprobs = nullptr,
                                    size_t text_offset = 0);
// The last chunk with include_usage: no choices, the usage of the whole request.
nlohmann::ordered_json usage_chunk(const ApiRequest& req, const ResponseMeta& meta,
                                   const Usage& usage);

// "data: <json>\n\n"
std::string sse_event(const nlohmann::ordered_json& j);
inline const char* sse_done() { return "data: [DONE]\n\n"; }

}  // namespace clshard::serve
