// One entry point per input surface clshard reads from files and requests other people write.
// The libFuzzer drivers (tests/fuzz/fuzz_<target>.cpp) and the regular suite's replay of the
// corpus and of every crasher found (tests/test_fuzz_regressions.cpp) call the same functions.
//
// An entry returns normally when the parser accepted the input, or refused it with an exception
// derived from std::exception whose message is not empty (a clear error). Anything else is a bug:
// a crash, a sanitizer report, a hang, an exception of another kind, or an empty message — the
// entry aborts for those, so libFuzzer keeps the input.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace clshard {
class Tokenizer;
}

namespace clshard::fuzz {

// Byte 0 picks the surface: even = a whole .safetensors file, odd = model.safetensors.index.json.
void safetensors(const uint8_t* data, size_t size);
// Byte 0 picks the reader: config.json for Llama 3, DeepSeek-V3 or an Eagle3 draft.
void model_config(const uint8_t* data, size_t size);
// tokenizer.json, then (after a NUL byte, when there is one) text to encode and decode again.
void tokenizer(const uint8_t* data, size_t size);
// A chat template, then (after a NUL byte) the messages as JSON; rendered with the usual context.
void chat_template(const uint8_t* data, size_t size);
// A YAML deployment file.
void deploy_yaml(const uint8_t* data, size_t size);
// JSONL job lines, both shapes (clshard's own and OpenAI's batch shape).
void job_lines(const uint8_t* data, size_t size);
// An HTTP request body: byte 0 picks the endpoint (even = /v1/completions, odd =
// /v1/chat/completions), the rest is the body read with the default sampling settings; when it is
// accepted with a response_format and/or a regex, they are compiled (fuzz_tokenizer()) and the
// constraint is walked a few tokens.
void api_request(const uint8_t* data, size_t size);
// The structured-output compilers without the request around them: a JSON schema, compiled as
// response_format {"type": "json_schema", "json_schema": {"name": "f", "schema": <input>}}, then
// (after a NUL byte, when there is one) a pattern compiled as the `regex` field alone.
void json_schema(const uint8_t* data, size_t size);

// The tokenizer the structured-output targets compile against, built in memory once: every byte
// as a token (byte-level BPE), a few JSON-shaped merges ("{\"", "\":", "true", ...) so tokens span
// several JSON tokens, and two special tokens the masks must leave out.
const Tokenizer& fuzz_tokenizer();

struct Target {
  const char* name;  // the folder of its corpus: tests/fuzz/corpus/<name>
  void (*run)(const uint8_t*, size_t);
};
const std::vector<Target>& targets();

}  // namespace clshard::fuzz
