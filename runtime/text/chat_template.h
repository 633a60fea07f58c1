// Chat templates: a Jinja2 subset large enough for Hugging Face chat templates (tokenizer_config's
// "chat_template"), rendered the way transformers renders them: trim_blocks and lstrip_blocks on,
// the template's single trailing newline dropped, and the helpers it adds (raise_exception,
// strftime_now, a tojson that keeps non-ASCII text).
//
// Supported: {{ }}, {% %}, {# #} with -/+ whitespace control; if/elif/else, for (with else,
// an "if" filter, tuple targets, loop.index/index0/revindex/revindex0/first/last/length/
// previtem/nextitem, break/continue), set (also ns.attr = and {% set x %}...{% endset %}),
// generation blocks; literals (strings, numbers, lists, dicts, tuples), attribute/item access,
// slices, calls, the operators of Jinja (or and not, comparisons, in/not in, is [not] tests,
// + - * / // % ** ~, x if c else y) and the filters, tests, globals and str/dict methods listed in
// chat_template.cpp. Unknown tags, filters, tests and methods are errors, never silently ignored.
//
// Values are nlohmann::json, so dicts iterate in key order (json objects are sorted), where Python
// keeps insertion order.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace clshard {

class Tokenizer;

struct ChatMessage {
  std::string role, content;
};

// A parsed template, reusable for many renders.
class ChatTemplate {
 public:
  // Throws std::runtime_error "chat template line L col C: ..." on a syntax error.
  explicit ChatTemplate(std::string source);
  ~ChatTemplate();
  ChatTemplate(ChatTemplate&&) noexcept;
  ChatTemplate& operator=(ChatTemplate&&) noexcept;

  // context: an object whose members are the template's variables. Throws std::runtime_error
  // with the template position on evaluation errors and on raise_exception().
  std::string render(const nlohmann::json& context) const;

 private:
  struct Program;
  std::unique_ptr<Program> program_;
};

std::string render_chat_template(const std::string& tmpl, const nlohmann::json& context);

// Renders the tokenizer's chat template with messages, add_generation_prompt and the tokenizer's
// bos_token / eos_token. extra_context adds variables (tools, date_string, ...) or overrides
// those. Throws std::runtime_error when the tokenizer has no chat template.
std::string apply_chat_template(const Tokenizer& tokenizer,
                                const std::vector<ChatMessage>& messages,
                                bool add_generation_prompt,
                                const nlohmann::json& extra_context = nlohmann::json::object());
// The same with messages as a JSON array (for messages with more than role and content, e.g.
// tool_calls). A separate name, since a braced list would fit both parameter types.
std::string apply_chat_template_json(
    const Tokenizer& tokenizer, const nlohmann::json& messages, bool add_generation_prompt,
    const nlohmann::json& extra_context = nlohmann::json::object());

}  // namespace clshard
