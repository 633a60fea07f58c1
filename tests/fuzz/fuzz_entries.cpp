#include "tests/fuzz/fuzz_entries.h"

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string_view>

#include <nlohmann/json.hpp>

#include "models/deepseek_v3/config.h"
#include "models/eagle3_deepseek_v3/config.h"
#include "models/llama3/config.h"
#include "runtime/bounded_json.h"
#include "runtime/engine/batch_io.h"
#include "runtime/engine/deploy_config.h"
#include "runtime/engine/sampling.h"
#include "runtime/engine/structured/response_format.h"
#include "runtime/safetensors.h"
#include "runtime/serve/openai_api.h"
#include "runtime/text/chat_template.h"
#include "runtime/text/tokenizer.h"

namespace clshard::fuzz {
namespace {

[[noreturn]] void bug(const char* what, const std::string& detail) {
  std::fprintf(stderr, "fuzz: %s: %s\n", what, detail.c_str());
  std::abort();
}

// Runs `parse`; a refusal must be a std::exception with a message.
template <typename F>
void expect_clear_outcome(const char* surface, F&& parse) {
  try {
    parse();
  } catch (const std::bad_alloc&) {
    bug(surface, "std::bad_alloc: an input made us allocate without a limit");
  } catch (const std::exception& e) {
    if (std::string_view(e.what()).empty()) bug(surface, "an exception with an empty message");
  } catch (...) {
    bug(surface, "an exception not derived from std::exception");
  }
}

// The input split at its first NUL byte: (before, after); after is empty when there is none.
std::pair<std::string_view, std::string_view> split_at_nul(const uint8_t* data, size_t size) {
  std::string_view all(reinterpret_cast<const char*>(data), size);
  size_t nul = all.find('\0');
  if (nul == std::string_view::npos) return {all, {}};
  return {all.substr(0, nul), all.substr(nul + 1)};
}

// GPT-2's byte-level alphabet: the printable bytes stand for themselves, the others for U+0100 on.
std::string byte_char(int b) {
  const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || b >= 174;
  uint32_t cp = uint32_t(b);
  if (!printable) {
    cp = 256;
    for (int k = 0; k < b; ++k)
      if (!((k >= 33 && k <= 126) || (k >= 161 && k <= 172) || k >= 174)) ++cp;
  }
  std::string out;
  if (cp < 0x80) {
    out += char(cp);
  } else {
    out += char(0xC0 | (cp >> 6));
    out += char(0x80 | (cp & 0x3F));
  }
  return out;
}

// Walks a compiled constraint a few tokens (the first allowed token each time, or the one the
// input's bytes pick), checking the mask against allows() and advance(): a state that neither
// ends nor allows any token would leave the model stuck, and this vocabulary has every byte.
void walk_constraint(const char* surface, const std::shared_ptr<TokenConstraint>& c,
                     std::string_view choices) {
  if (!c) return;
  const uint32_t vocab = uint32_t(fuzz_tokenizer().vocab_size());
  std::vector<uint32_t> bits(bitmask_words(vocab));
  for (size_t step = 0; step < 16; ++step) {
    std::fill(bits.begin(), bits.end(), 0u);
    c->allowed_tokens(bits.data(), vocab);
    std::vector<int32_t> allowed;
    for (uint32_t t = 0; t < vocab; ++t) {
      const bool bit = (bits[t / 32] >> (t % 32)) & 1u;
      if (bit != c->allows(int32_t(t)))
        bug(surface, "the mask and allows() disagree on token " + std::to_string(t));
      if (bit) allowed.push_back(int32_t(t));
    }
    if (allowed.empty()) {
      if (!c->can_end()) bug(surface, "a state that allows no token and cannot end");
      return;
    }
    const size_t pick = step < choices.size() ? uint8_t(choices[step]) % allowed.size() : 0;
    if (!c->advance(allowed[pick]))
      bug(surface, "advance() refused allowed token " + std::to_string(allowed[pick]));
  }
}

}  // namespace

const Tokenizer& fuzz_tokenizer() {
  static const Tokenizer tok = [] {
    nlohmann::ordered_json vocab = nlohmann::ordered_json::object();
    for (int b = 0; b < 256; ++b) vocab[byte_char(b)] = b;
    const std::vector<std::pair<std::string, std::string>> merges = {
        {"{", "\""}, {"\"", ":"}, {"\"", ","}, {"\"", "}"}, {"Ġ", "\""}, {",", "Ġ"},
        {"t", "r"},   {"tr", "u"},  {"tru", "e"}, {"n", "u"},   {"nu", "l"},  {"nul", "l"},
        {"a", "b"},   {"ab", "c"},  {"0", "0"},   {"]", ","},   {"}", "]"},   {"Ã", "©"}};
    nlohmann::ordered_json merge_list = nlohmann::ordered_json::array();
    int next_id = 256;
    for (const auto& [a, b] : merges) {
      vocab[a + b] = next_id++;
      merge_list.push_back(a + " " + b);
    }
    nlohmann::ordered_json added = nlohmann::ordered_json::array();
    for (const char* special : {"<|bos|>", "<|eos|>"})
      added.push_back({{"id", next_id++}, {"content", special}, {"single_word", false},
                       {"lstrip", false}, {"rstrip", false}, {"normalized", false},
                       {"special", true}});
    const nlohmann::ordered_json byte_level = {{"type", "ByteLevel"}, {"add_prefix_space", false},
                                               {"trim_offsets", true}, {"use_regex", true}};
    const nlohmann::ordered_json tokenizer = {
        {"version", "1.0"}, {"added_tokens", added}, {"normalizer", nullptr},
        {"pre_tokenizer", byte_level}, {"post_processor", nullptr}, {"decoder", byte_level},
        {"model", {{"type", "BPE"}, {"dropout", nullptr}, {"unk_token", nullptr},
                   {"fuse_unk", false}, {"byte_fallback", false}, {"ignore_merges", false},
                   {"vocab", vocab}, {"merges", merge_list}}}};
    return Tokenizer::from_json(tokenizer.dump(), R"({"bos_token": "<|bos|>", "eos_token": "<|eos|>"})",
                                "fuzz tokenizer.json");
  }();
  return tok;
}

void safetensors(const uint8_t* data, size_t size) {
  if (size == 0) return;
  const bool index = data[0] & 1;
  expect_clear_outcome("safetensors", [&] {
    if (!index) {
      auto header = parse_safetensors(data + 1, size - 1, "fuzz.safetensors");
      for (const auto& [name, view] : header.tensors)
        if (view.data < data + 1 || view.data + view.bytes > data + size)
          bug("safetensors", "tensor '" + name + "' points outside the file");
    } else {
      auto j = parse_json_bounded(reinterpret_cast<const char*>(data + 1), size - 1);
      safetensors_index_shards(j, "model.safetensors.index.json");
    }
  });
}

void model_config(const uint8_t* data, size_t size) {
  if (size == 0) return;
  const uint8_t which = data[0] % 3;
  expect_clear_outcome("config.json", [&] {
    auto j = parse_json_bounded(reinterpret_cast<const char*>(data + 1), size - 1);
    if (which == 0) llama3::Llama3Config::from_json(j, "config.json");
    if (which == 1) deepseek_v3::DeepseekV3Config::from_json(j, "config.json");
    if (which == 2) eagle3_deepseek_v3::Eagle3Config::from_json(j, "config.json");
  });
}

void tokenizer(const uint8_t* data, size_t size) {
  const auto [json_text_, text_] = split_at_nul(data, size);
  const std::string_view json_text = json_text_, text = text_;  // lambdas cannot capture bindings
  expect_clear_outcome("tokenizer.json", [&] {
    auto tok = Tokenizer::from_json(json_text);
    std::vector<int32_t> ids;
    try {
      ids = tok.encode(text, true);
    } catch (const std::invalid_argument&) {
      return;  // not UTF-8: refused, as documented
    }
    for (int32_t id : ids)
      if (id < 0 || size_t(id) >= tok.vocab_size()) bug("tokenizer.json", "encode gave id " +
                                                             std::to_string(id));
    tok.decode(ids);
  });
}

void chat_template(const uint8_t* data, size_t size) {
  const auto [tmpl_, messages_text_] = split_at_nul(data, size);
  const std::string_view tmpl = tmpl_, messages_text = messages_text_;
  expect_clear_outcome("chat template", [&] {
    nlohmann::json messages = nlohmann::json::array();
    if (!messages_text.empty()) {
      try {
        messages = parse_json_bounded(messages_text);
      } catch (const std::exception&) {
        messages = nlohmann::json::array({{{"role", "user"}, {"content", messages_text}}});
      }
    }
    nlohmann::json context = {{"messages", messages}, {"add_generation_prompt", true},
                              {"bos_token", "<s>"}, {"eos_token", "</s>"}};
    render_chat_template(std::string(tmpl), context);
  });
}

void deploy_yaml(const uint8_t* data, size_t size) {
  std::string text(reinterpret_cast<const char*>(data), size);
  expect_clear_outcome("deployment YAML", [&] { parse_deploy_config(text, "fuzz.yaml"); });
}

void job_lines(const uint8_t* data, size_t size) {
  std::string text(reinterpret_cast<const char*>(data), size);
  expect_clear_outcome("job lines", [&] { parse_batch_input(text, SamplingDefaults{}); });
}

void api_request(const uint8_t* data, size_t size) {
  if (size == 0) return;
  const serve::Endpoint endpoint =
      data[0] & 1 ? serve::Endpoint::ChatCompletions : serve::Endpoint::Completions;
  const std::string body(reinterpret_cast<const char*>(data + 1), size - 1);
  expect_clear_outcome("HTTP request", [&] {
    const serve::ApiRequest req = serve::parse_api_request(endpoint, body, SamplingDefaults{});
    if (!req.response_format && !req.regex) return;
    auto c = compile_response_format(req.response_format ? &*req.response_format : nullptr,
                                     req.regex ? &*req.regex : nullptr, fuzz_tokenizer());
    walk_constraint("HTTP request", c, body);
  });
}

void json_schema(const uint8_t* data, size_t size) {
  const auto [schema_text_, regex_text_] = split_at_nul(data, size);
  const std::string_view schema_text = schema_text_, regex_text = regex_text_;
  expect_clear_outcome("JSON schema", [&] {
    const nlohmann::ordered_json rf = {
        {"type", "json_schema"},
        {"json_schema", {{"name", "f"}, {"schema", parse_ordered_json_bounded(schema_text)}}}};
    walk_constraint("JSON schema", compile_response_format(&rf, nullptr, fuzz_tokenizer()),
                    regex_text);
  });
  if (regex_text.empty()) return;
  expect_clear_outcome("regex", [&] {
    const std::string regex(regex_text);
    walk_constraint("regex", compile_response_format(nullptr, &regex, fuzz_tokenizer()),
                    schema_text);
  });
}

const std::vector<Target>& targets() {
  static const std::vector<Target> all = {
      {"safetensors", safetensors}, {"model_config", model_config},
      {"tokenizer", tokenizer},     {"chat_template", chat_template},
      {"deploy_yaml", deploy_yaml}, {"job_lines", job_lines},
      {"api_request", api_request}, {"json_schema", json_schema}};
  return all;
}

}  // namespace clshard::fuzz
