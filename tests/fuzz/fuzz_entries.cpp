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
#include "runtime/safetensors.h"
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

}  // namespace

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

const std::vector<Target>& targets() {
  static const std::vector<Target> all = {
      {"safetensors", safetensors}, {"model_config", model_config},
      {"tokenizer", tokenizer},     {"chat_template", chat_template},
      {"deploy_yaml", deploy_yaml}, {"job_lines", job_lines}};
  return all;
}

}  // namespace clshard::fuzz
