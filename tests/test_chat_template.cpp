// Tests of the chat template renderer: the shipped Llama 3 / DeepSeek-V3 templates against
// chat_rendered.json, and a table of Jinja features against outputs of the reference
// implementation.
#include "runtime/text/chat_template.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "runtime/text/tokenizer.h"

#include "tests/test_util.h"

namespace clshard {
namespace {

using nlohmann::json;

std::filesystem::path tokenizers_dir() { return test::tokenizers_dir(); }
const Tokenizer& llama3() { return test::llama3_tokenizer(); }
const Tokenizer& deepseek_v3() { return test::deepseek_v3_tokenizer(); }

json read_json(const std::filesystem::path& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error("cannot open " + path.string());
  return json::parse(in);
}

std::vector<ChatMessage> to_messages(const json& list) {
  std::vector<ChatMessage> messages;
  for (const json& m : list)
    messages.push_back({m.at("role").get<std::string>(), m.at("content").get<std::string>()});
  return messages;
}

// Every conversation of chat_rendered.json renders to the expected text, and that text encodes to
// the expected ids.
TEST(ChatTemplate, RendersSharedConversationsExactly) {
  const json all = read_json(tokenizers_dir() / "chat_rendered.json");
  ASSERT_EQ(all.size(), 3u);
  size_t checked = 0;
  for (const auto& [name, entry] : all.items()) {
    const Tokenizer& tokenizer = name == "deepseek_v3" ? deepseek_v3() : llama3();
    const ChatTemplate tmpl(entry.at("chat_template").get<std::string>());
    for (const auto& [render_name, render] : entry.at("renders").items()) {
      SCOPED_TRACE(name + "/" + render_name);
      const json context = {{"messages", render.at("messages")},
                            {"add_generation_prompt", render.at("add_generation_prompt")},
                            {"bos_token", entry.at("bos_token")},
                            {"eos_token", entry.at("eos_token")}};
      const std::string rendered = tmpl.render(context);
      EXPECT_EQ(rendered, render.at("rendered").get<std::string>());
      EXPECT_EQ(tokenizer.encode(rendered), render.at("ids").get<std::vector<int32_t>>());
      ++checked;
    }
  }
  EXPECT_EQ(checked, 6u);
}

// apply_chat_template uses the tokenizer's own template and special tokens.
TEST(ChatTemplate, ApplyChatTemplateUsesTokenizerConfig) {
  const json all = read_json(tokenizers_dir() / "chat_rendered.json");
  for (const char* name : {"llama3", "deepseek_v3"}) {
    const Tokenizer& tokenizer = std::string(name) == "llama3" ? llama3() : deepseek_v3();
    const json& entry = all.at(name);
    ASSERT_EQ(tokenizer.chat_template(), entry.at("chat_template").get<std::string>());
    for (const auto& [render_name, render] : entry.at("renders").items()) {
      SCOPED_TRACE(std::string(name) + "/" + render_name);
      EXPECT_EQ(apply_chat_template(tokenizer, to_messages(render.at("messages")),
                                    render.at("add_generation_prompt").get<bool>()),
                render.at("rendered").get<std::string>());
    }
  }
}

TEST(ChatTemplate, ExtraContextOverridesDefaults) {
  const std::string rendered =
      apply_chat_template(deepseek_v3(), {{"user", "Hi"}}, true, {{"bos_token", "[B]"}});
  EXPECT_EQ(rendered, "[B]<｜User｜>Hi<｜Assistant｜>");
}

struct FeatureCase {
  const char* name;
  const char* tmpl;
  const char* context;  // JSON
  const char* expected;
};

// DeepSeek-V3's chat template (its tokenizer_config.json's), for the three ds_tool cases.
const char* const kDeepseekToolsTemplate =
    "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif "
    "%}{% set ns = namespace(is_first=false, is_tool=false, is_output_first=true, "
    "system_prompt='', is_first_sp=true) %}{%- for message in messages %}{%- if message['role'] "
    "== 'system' %}{%- if ns.is_first_sp %}{% set ns.system_prompt = ns.system_prompt + "
    "message['content'] %}{% set ns.is_first_sp = false %}{%- else %}{% set ns.system_prompt = "
    "ns.system_prompt + '\n\n' + message['content'] %}{%- endif %}{%- endif %}{%- endfor "
    "%}{{bos_token}}{{ns.system_prompt}}{%- for message in messages %}{%- if message['role'] == "
    "'user' %}{%- set ns.is_tool = false -%}{{'<｜User｜>' + message['content']}}{%- endif %}{%- "
    "if message['role'] == 'assistant' and message['content'] is none %}{%- set ns.is_tool = "
    "false -%}{%- for tool in message['tool_calls']%}{%- if not ns.is_first "
    "%}{{'<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + "
    "'<｜tool▁sep｜>' + tool['function']['name'] + '\n' + '```json' + '\n' + "
    "tool['function']['arguments'] + '\n' + '```' + '<｜tool▁call▁end｜>'}}{%- set ns.is_first = "
    "true -%}{%- else %}{{'\n' + '<｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + "
    "tool['function']['name'] + '\n' + '```json' + '\n' + tool['function']['arguments'] + '\n' + "
    "'```' + '<｜tool▁call▁end｜>'}}{{'<｜tool▁calls▁end｜><｜end▁of▁sentence｜>'}}{%- endif "
    "%}{%- endfor %}{%- endif %}{%- if message['role'] == 'assistant' and message['content'] is "
    "not none %}{%- if ns.is_tool %}{{'<｜tool▁outputs▁end｜>' + message['content'] + "
    "'<｜end▁of▁sentence｜>'}}{%- set ns.is_tool = false -%}{%- else %}{{'<｜Assistant｜>' + "
    "message['content'] + '<｜end▁of▁sentence｜>'}}{%- endif %}{%- endif %}{%- if message['role'] "
    "== 'tool' %}{%- set ns.is_tool = true -%}{%- if ns.is_output_first "
    "%}{{'<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>' + message['content'] + "
    "'<｜tool▁output▁end｜>'}}{%- set ns.is_output_first = false %}{%- else "
    "%}{{'\n<｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>'}}{%- endif "
    "%}{%- endif %}{%- endfor -%}{% if ns.is_tool %}{{'<｜tool▁outputs▁end｜>'}}{% endif %}{% if "
    "add_generation_prompt and not ns.is_tool %}{{'<｜Assistant｜>'}}{% endif %}";

// Expected outputs come from Jinja2 3.1.6 configured as transformers configures it
// (ImmutableSandboxedEnvironment, trim_blocks, lstrip_blocks, loopcontrols, its tojson and
// raise_exception). Dict contexts use sorted keys: nlohmann::json objects iterate sorted, where
// Python keeps insertion order.
const FeatureCase kFeatureCases[] = {
    {"text_only", "hello\nworld\n", "{}", "hello\nworld"},
    {"trailing_two_newlines", "a\n\n", "{}", "a\n"},
    {"crlf_source", "a\r\nb{% if true %}\r\nc{% endif %}", "{}", "a\nbc"},
    {"var_basic", "{{ x }}|{{ y }}|{{ z }}|{{ n }}|{{ f }}|{{ b }}|{{ u }}|{{ l }}|{{ d }}",
     "{\"b\": true, \"d\": {\"a\": [1], \"k\": \"v\"}, \"f\": 2.5, \"l\": [1, \"a\", null, true, "
     "1.0], \"n\": -7, \"x\": \"s\", \"y\": 3, \"z\": null}",
     "s|3|None|-7|2.5|True||[1, 'a', None, True, 1.0]|{'a': [1], 'k': 'v'}"},
    {"floats",
     "{{ 1.0 }} {{ 0.1 + 0.2 }} {{ 1e20 }} {{ 1.5e-7 }} {{ 3 / 2 }} {{ 4 / 2 }} {{ 123456789.125 "
     "}} {{ 0.0001 }} {{ 1e16 }} {{ 9999999999999998.0 }}",
     "{}",
     "1.0 0.30000000000000004 1e+20 1.5e-07 1.5 2.0 123456789.125 0.0001 1e+16 9999999999999998.0"},
    {"arith",
     "{{ 7 // 2 }} {{ -7 // 2 }} {{ 7 % 3 }} {{ -7 % 3 }} {{ 2 ** 10 }} {{ 7.5 // 2 }} {{ -7.5 % 2 "
     "}} {{ 'ab' * 3 }} {{ [1] * 2 }} {{ 1 + 2 * 3 - 4 }} {{ (1 + 2) * 3 }} {{ -2 ** 2 }}",
     "{}", "3 -4 1 2 1024 3.0 0.5 ababab [1, 1] 3 9 4"},
    {"concat",
     "{{ 'a' ~ 1 ~ none ~ true ~ [1] }}{{ 'x' + 'y' }}{{ [1] + [2, 3] }}{{ undefined_thing ~ 'z' "
     "}}",
     "{}", "a1NoneTrue[1]xy[1, 2, 3]z"},
    {"ws_control", "a  {{- 'b' -}}  c\n  {%- if true -%}  d  {%- endif -%}\n  e", "{}", "abcde"},
    {"trim_blocks", "{% if true %}\nyes\n{% endif %}\nafter\n", "{}", "yes\nafter"},
    {"lstrip_blocks", "line\n    {% if true %}\n    indented\n    {% endif %}\nend", "{}",
     "line\n    indented\nend"},
    {"lstrip_plus", "x\n    {%+ if true %}y{% endif %}", "{}", "x\n    y"},
    {"lstrip_var_not", "x\n    {{ 'v' }}\n", "{}", "x\n    v"},
    {"lstrip_after_tag_same_line", "{% if true %}  {% if true %}z{% endif %}{% endif %}", "{}",
     "  z"},
    {"comment", "a {# comment #} b\n{# line comment #}\nc {#- strip -#} d", "{}", "a  b\ncd"},
    {"comment_lstrip", "a\n   {# c #}\nb", "{}", "a\nb"},
    {"if_elif_else",
     "{% for v in [1,2,3,4] %}{% if v == 1 %}one{% elif v == 2 %}two{% elif v > 3 %}big{% else "
     "%}other{% endif %},{% endfor %}",
     "{}", "one,two,other,big,"},
    {"loop_vars",
     "{% for m in messages %}{{ loop.index }}/{{ loop.index0 }}/{{ loop.revindex }}/{{ "
     "loop.revindex0 }}/{{ loop.first }}/{{ loop.last }}/{{ loop.length }};{% endfor %}",
     "{\"messages\": [{\"content\": \"  Be brief.  \", \"role\": \"system\"}, {\"content\": \"Hi "
     "ünï 😀\", \"role\": \"user\"}, {\"content\": \"Hello!\", \"role\": \"assistant\"}, "
     "{\"content\": \"2+2?\", \"role\": \"user\"}]}",
     "1/0/4/3/True/False/4;2/1/3/2/False/False/4;3/2/2/1/False/False/4;4/3/1/0/False/True/4;"},
    {"loop_prev_next",
     "{% for x in [1,2,3] %}[{{ loop.previtem }}|{{ loop.nextitem }}|{{ loop.previtem is defined "
     "}}]{% endfor %}",
     "{}", "[|2|False][1|3|True][2||True]"},
    {"loop_else",
     "{% for x in [] %}x{% else %}empty{% endfor %}{% for x in none_var %}y{% else %}undef-empty{% "
     "endfor %}",
     "{}", "emptyundef-empty"},
    {"loop_filter",
     "{% for m in messages if m.role != 'system' %}{{ loop.index }}:{{ m.role }} {% endfor %}",
     "{\"messages\": [{\"content\": \"  Be brief.  \", \"role\": \"system\"}, {\"content\": \"Hi "
     "ünï 😀\", \"role\": \"user\"}, {\"content\": \"Hello!\", \"role\": \"assistant\"}, "
     "{\"content\": \"2+2?\", \"role\": \"user\"}]}",
     "1:user 2:assistant 3:user "},
    {"loop_break_continue",
     "{% for i in range(10) %}{% if i == 2 %}{% continue %}{% endif %}{% if i == 5 %}{% break %}{% "
     "endif %}{{ i }}{% endfor %}",
     "{}", "0134"},
    {"loop_unpack",
     "{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}{% for a, b in [[1,2],[3,4]] %}{{ a + "
     "b }}{% endfor %}",
     "{\"d\": {\"a\": 1, \"b\": 2}}", "a=1;b=2;37"},
    {"loop_dict_string",
     "{% for k in d %}{{ k }}{% endfor %}|{% for c in 'hé😀' %}[{{ c }}]{% endfor %}",
     "{\"d\": {\"x\": 2, \"y\": 1}}", "xy|[h][é][😀]"},
    {"scope_loop",
     "{% set x = 1 %}{% for i in [1,2] %}{% set x = x + 10 %}{{ x }},{% endfor %}{{ x }}", "{}",
     "11,11,1"},
    {"scope_if", "{% set x = 1 %}{% if true %}{% set x = 2 %}{% endif %}{{ x }}", "{}", "2"},
    {"namespace",
     "{% set ns = namespace(count=0, names='') %}{% for m in messages %}{% set ns.count = ns.count "
     "+ 1 %}{% set ns.names = ns.names + m.role[0] %}{% endfor %}{{ ns.count }} {{ ns.names }} {{ "
     "ns.missing is defined }}",
     "{\"messages\": [{\"content\": \"  Be brief.  \", \"role\": \"system\"}, {\"content\": \"Hi "
     "ünï 😀\", \"role\": \"user\"}, {\"content\": \"Hello!\", \"role\": \"assistant\"}, "
     "{\"content\": \"2+2?\", \"role\": \"user\"}]}",
     "4 suau False"},
    {"set_block", "{% set greeting %}Hello {{ name }}!{% endset %}[{{ greeting | upper }}]",
     "{\"name\": \"bob\"}", "[HELLO BOB!]"},
    {"tests",
     "{{ x is defined }}{{ y is defined }}{{ y is undefined }}{{ n is none }}{{ x is not none }}{{ "
     "x is string }}{{ 3 is number }}{{ 3 is integer }}{{ 3.0 is float }}{{ d is mapping }}{{ l is "
     "iterable }}{{ l is sequence }}{{ 3 is odd }}{{ 4 is even }}{{ 9 is divisibleby 3 }}{{ 9 is "
     "divisibleby(4) }}{{ true is boolean }}{{ x is eq 'v' }}{{ 1 is equalto 1 }}{{ 'a' is in "
     "'abc' }}{{ 2 is gt 1 }}",
     "{\"d\": {}, \"l\": [1], \"n\": null, \"x\": \"v\"}",
     "TrueFalseTrueTrueTrueTrueTrueTrueTrueTrueTrueTrueTrueTrueTrueFalseTrueTrueTrueTrueTrue"},
    {"compare",
     "{{ 1 < 2 }}{{ 2 <= 2 }}{{ 'a' < 'b' }}{{ 1 == 1.0 }}{{ 1 != 2 }}{{ 1 < 2 < 3 }}{{ 3 > 2 > 2 "
     "}}{{ [1,2] == [1,2] }}{{ none == none }}{{ 'a' in 'cat' }}{{ 2 in [1,2] }}{{ 'k' in {'k':1} "
     "}}{{ 'z' not in 'cat' }}{{ x == y }}",
     "{\"x\": {\"a\": 1}, \"y\": {\"a\": 1}}",
     "TrueTrueTrueTrueTrueTrueFalseTrueTrueTrueTrueTrueTrueTrue"},
    {"logic",
     "{{ true and 'x' }}|{{ false or 'y' }}|{{ '' or 0 or none }}|{{ not [] }}|{{ not 1 and 2 "
     "}}|{{ 1 if x else 2 }}|{{ 'a' if false }}|{{ 'p' if y is defined else 'q' if x else 'r' }}",
     "{\"x\": 1}", "x|y|None|True|False|1||q"},
    {"filters_str",
     "{{ '  a b  ' | trim }}|{{ 'xxhixx' | trim('x') }}|{{ 'Hello' | upper }}|{{ 'Hello' | lower "
     "}}|{{ 'hello world' | capitalize }}|{{ 'hello wORLD' | title }}|{{ 'a-b-c' | replace('-', "
     "'+') }}|{{ 'a-b-c' | replace('-', '', 1) }}|{{ '<a&\"\\'>' | e }}|{{ 5 | string }}|{{ 'x' | "
     "safe }}",
     "{}", "a b|hi|HELLO|hello|Hello world|Hello World|a+b+c|ab-c|&lt;a&amp;&#34;&#39;&gt;|5|x"},
    {"filters_len",
     "{{ 'héllo' | length }}{{ [1,2] | count }}{{ {'a':1} | length }}{{ messages | length }}",
     "{\"messages\": [{\"content\": \"  Be brief.  \", \"role\": \"system\"}, {\"content\": \"Hi "
     "ünï 😀\", \"role\": \"user\"}, {\"content\": \"Hello!\", \"role\": \"assistant\"}, "
     "{\"content\": \"2+2?\", \"role\": \"user\"}]}",
     "5214"},
    {"filters_list",
     "{{ [3,1,2] | first }}{{ [3,1,2] | last }}{{ 'abc' | first }}{{ [1,2,3] | reverse | list }}{{ "
     "'abc' | reverse }}{{ 'ab' | list }}{{ {'a':1,'b':2} | list }}{{ [1,2] | join(', ') }}{{ "
     "['a','b'] | join }}{{ messages | map(attribute='role') | join(',') }}",
     "{\"messages\": [{\"content\": \"  Be brief.  \", \"role\": \"system\"}, {\"content\": \"Hi "
     "ünï 😀\", \"role\": \"user\"}, {\"content\": \"Hello!\", \"role\": \"assistant\"}, "
     "{\"content\": \"2+2?\", \"role\": \"user\"}]}",
     "32a[3, 2, 1]cba['a', 'b']['a', 'b']1, 2absystem,user,assistant,user"},
    {"filters_select",
     "{{ messages | selectattr('role', 'equalto', 'user') | map(attribute='content') | list }}{{ "
     "messages | rejectattr('role', 'eq', 'user') | list | length }}{{ [0,1,2,3] | select('odd') | "
     "list }}{{ [0,1,'',none,2] | select | list }}{{ [1,2,3] | reject('gt', 1) | list }}{{ "
     "messages | selectattr('role', 'in', ['system','assistant']) | list | length }}{{ "
     "[{'a':1},{'b':2}] | selectattr('a', 'defined') | list }}",
     "{\"messages\": [{\"content\": \"  Be brief.  \", \"role\": \"system\"}, {\"content\": \"Hi "
     "ünï 😀\", \"role\": \"user\"}, {\"content\": \"Hello!\", \"role\": \"assistant\"}, "
     "{\"content\": \"2+2?\", \"role\": \"user\"}]}",
     "['Hi ünï 😀', '2+2?']2[1, 3][1, 2][1]2[{'a': 1}]"},
    {"filters_default",
     "{{ x | default('dflt') }}|{{ y | default('dflt') }}|{{ '' | default('e', true) }}|{{ none | "
     "d('n') }}|{{ z | d }}|",
     "{\"y\": \"set\"}", "dflt|set|e|None||"},
    {"filters_num",
     "{{ '42' | int + 1 }}{{ 'x' | int }}{{ 3.9 | int }}{{ '2.5' | float }}{{ 2 | float }}{{ -3 | "
     "abs }}{{ 'zz' | int(7) }}",
     "{}", "43032.52.037"},
    {"filter_items", "{% for k, v in d | items %}{{ k }}{{ v }}{% endfor %}",
     "{\"d\": {\"a\": 2, \"b\": 1}}", "a2b1"},
    {"tojson",
     "{{ d | tojson }}|{{ d | tojson(indent=2) }}|{{ 'é\"\\n\\u0001' | tojson }}|{{ 'é' | "
     "tojson(ensure_ascii=True) }}|{{ [] | tojson }}|{{ {} | tojson(indent=2) }}|{{ [1.5, 2.0, "
     "none, true] | tojson }}|{{ l | tojson(indent=1) }}",
     "{\"d\": {\"name\": \"f\", \"params\": {\"a\": [1, 2], \"b\": {\"c\": null}}, \"z\": \"ü😀\"}, "
     "\"l\": [[1, []], {\"x\": {}}]}",
     "{\"name\": \"f\", \"params\": {\"a\": [1, 2], \"b\": {\"c\": null}}, \"z\": \"ü😀\"}|{\n  "
     "\"name\": \"f\",\n  \"params\": {\n    \"a\": [\n      1,\n      2\n    ],\n    \"b\": {\n   "
     "   \"c\": null\n    }\n  },\n  \"z\": \"ü😀\"\n}|\"é\\\"\\n\\u0001\"|\"\\u00e9\"|[]|{}|[1.5, "
     "2.0, null, true]|[\n [\n  1,\n  []\n ],\n {\n  \"x\": {}\n }\n]"},
    {"indent",
     "{{ 'a\\nb\\n\\nc' | indent }}|{{ 'a\\nb' | indent(2, true) }}|{{ 'a\\n\\nb' | indent(2, "
     "blank=true) }}",
     "{}", "a\n    b\n\n    c|  a\n  b|a\n  \n  b"},
    {"methods",
     "{{ 'Hello'.startswith('He') }}{{ 'Hello'.endswith(('x','lo')) }}{{ '  s  '.strip() }}|{{ "
     "'xxsxx'.lstrip('x') }}|{{ '  s '.rstrip() }}|{{ 'a,b,,c'.split(',') }}{{ ' a  b '.split() "
     "}}{{ 'a b c'.split(' ', 1) }}{{ 'abc'.upper() }}{{ 'ABC'.lower() }}{{ 'ab'.replace('a','x') "
     "}}{{ 'hello'.find('l') }}{{ 'hello'.count('l') }}{{ '-'.join(['a','b']) }}{{ "
     "'l1\\nl2\\r\\nl3'.splitlines() }}{{ 'the cat'.title() }}{{ 'the Cat'.capitalize() }}",
     "{}",
     "TrueTrues|sxx|  s|['a', 'b', '', 'c']['a', 'b']['a', 'b c']ABCabcxb22a-b['l1', 'l2', "
     "'l3']The CatThe cat"},
    {"subscript_slice",
     "{{ l[0] }}{{ l[-1] }}{{ l[1:] }}{{ l[:-1] }}{{ l[::-1] }}{{ l[::2] }}{{ s[1:3] }}{{ s[-2:] "
     "}}{{ s[0] }}{{ s[::-1] }}{{ l[10] is defined }}{{ d['a'] }}{{ d.a }}{{ d['missing'] is "
     "defined }}{{ l.0 }}{{ messages[-1]['content'] }}{{ messages[1:] | length }}",
     "{\"d\": {\"a\": \"A\"}, \"l\": [1, 2, 3, 4, 5], \"messages\": [{\"content\": \"  Be brief.  "
     "\", \"role\": \"system\"}, {\"content\": \"Hi ünï 😀\", \"role\": \"user\"}, {\"content\": "
     "\"Hello!\", \"role\": \"assistant\"}, {\"content\": \"2+2?\", \"role\": \"user\"}], \"s\": "
     "\"héllo\"}",
     "15[2, 3, 4, 5][1, 2, 3, 4][5, 4, 3, 2, 1][1, 3, 5]élloholléhFalseAAFalse12+2?3"},
    {"repr_quotes", "{{ [\"it's\", 'say \"hi\"', 'both \\' \"', 'nl\\n'] }}", "{}",
     "[\"it's\", 'say \"hi\"', 'both \\' \"', 'nl\\n']"},
    {"range",
     "{{ range(3) | list }}{{ range(1, 4) | list }}{{ range(10, 0, -3) | list }}{% for i in "
     "range(2) %}{{ i }}{% endfor %}",
     "{}", "[0, 1, 2][1, 2, 3][10, 7, 4, 1]01"},
    {"none_output", "[{{ none }}][{{ x }}][{{ missing }}]", "{\"x\": null}", "[None][None][]"},
    {"string_cmp_upper", "{% if message['role'] | upper == 'USER' %}yes{% endif %}",
     "{\"message\": {\"role\": \"user\"}}", "yes"},
    {"nested_loops_loopvar",
     "{% for a in [1,2] %}{% for b in [3,4] %}{{ loop.index }}{% endfor %}{{ loop.index }}|{% "
     "endfor %}",
     "{}", "121|122|"},
    {"filter_then_concat_precedence",
     "{{ 'a' + ' b ' | trim + 'c' }}{{ '-x-' ~ ' y ' | trim }}{{ 2 * 3 | string }}", "{}",
     "abc-x-y33"},
    {"ns_in_loop_and_output",
     "{% set ns = namespace(found=false) %}{% for m in messages %}{% if m.role == 'user' %}{% set "
     "ns.found = true %}{% endif %}{% endfor %}{{ ns.found }}",
     "{\"messages\": [{\"content\": \"  Be brief.  \", \"role\": \"system\"}, {\"content\": \"Hi "
     "ünï 😀\", \"role\": \"user\"}, {\"content\": \"Hello!\", \"role\": \"assistant\"}, "
     "{\"content\": \"2+2?\", \"role\": \"user\"}]}",
     "True"},
    {"unicode_text", "ünïcödé {{ 'ß' }} 😀\n{{ s | length }}", "{\"s\": \"😀😀\"}", "ünïcödé ß 😀\n2"},
    {"is_not_defined_precedence",
     "{% if not add_generation_prompt is defined %}undef{% endif %}{% if x is not none and x | "
     "length > 2 %}long{% endif %}",
     "{\"x\": \"abcd\"}", "undeflong"},
    {"whitespace_minus_newlines", "{%- for i in [1,2] -%}\n  {{ i }}\n{%- endfor %}\nend", "{}",
     "12end"},
    {"dict_literal_nested_close", "{{ {'a': {'b': 1}} }}{{ {'a': {'b': 1}}['a']['b'] }}", "{}",
     "{'a': {'b': 1}}1"},
    {"in_tag_newlines", "{{\n  x\n  +\n  1\n}}{%\n if x\n%}ok{%\nendif\n%}", "{\"x\": 1}", "2ok"},
    {"ds_tools_gen",
     kDeepseekToolsTemplate,
     "{\"add_generation_prompt\": true, \"bos_token\": \"<BOS>\", \"messages\": [{\"content\": "
     "\"sys A\", \"role\": \"system\"}, {\"content\": \"sys B\", \"role\": \"system\"}, "
     "{\"content\": \"Weather in Paris and Rome?\", \"role\": \"user\"}, {\"content\": null, "
     "\"role\": \"assistant\", \"tool_calls\": [{\"function\": {\"arguments\": \"{\\\"city\\\": "
     "\\\"Paris\\\"}\", \"name\": \"get_weather\"}, \"type\": \"function\"}, {\"function\": "
     "{\"arguments\": \"{\\\"city\\\": \\\"Rome\\\"}\", \"name\": \"get_weather\"}, \"type\": "
     "\"function\"}]}, {\"content\": \"22C\", \"role\": \"tool\"}, {\"content\": \"25C\", "
     "\"role\": \"tool\"}, {\"content\": \"Paris 22C, Rome 25C.\", \"role\": \"assistant\"}, "
     "{\"content\": \"Thanks\", \"role\": \"user\"}]}",
     "<BOS>sys A\n\nsys B<｜User｜>Weather in Paris and "
     "Rome?<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_"
     "weather\n```json\n{\"city\": "
     "\"Paris\"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n`"
     "``json\n{\"city\": "
     "\"Rome\"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜><"
     "｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>22C<｜tool▁output▁end｜>\n<"
     "｜tool▁output▁begin｜>25C<｜tool▁output▁end｜><｜tool▁outputs▁end｜>Paris 22C, Rome "
     "25C.<｜end▁of▁sentence｜><｜User｜>Thanks<｜Assistant｜>"},
    {"ds_tools_nogen",
     kDeepseekToolsTemplate,
     "{\"bos_token\": \"<BOS>\", \"messages\": [{\"content\": \"sys A\", \"role\": \"system\"}, "
     "{\"content\": \"sys B\", \"role\": \"system\"}, {\"content\": \"Weather in Paris and "
     "Rome?\", \"role\": \"user\"}, {\"content\": null, \"role\": \"assistant\", \"tool_calls\": "
     "[{\"function\": {\"arguments\": \"{\\\"city\\\": \\\"Paris\\\"}\", \"name\": "
     "\"get_weather\"}, \"type\": \"function\"}, {\"function\": {\"arguments\": \"{\\\"city\\\": "
     "\\\"Rome\\\"}\", \"name\": \"get_weather\"}, \"type\": \"function\"}]}, {\"content\": "
     "\"22C\", \"role\": \"tool\"}, {\"content\": \"25C\", \"role\": \"tool\"}]}",
     "<BOS>sys A\n\nsys B<｜User｜>Weather in Paris and "
     "Rome?<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_"
     "weather\n```json\n{\"city\": "
     "\"Paris\"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n`"
     "``json\n{\"city\": "
     "\"Rome\"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜><"
     "｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>22C<｜tool▁output▁end｜>\n<"
     "｜tool▁output▁begin｜>25C<｜tool▁output▁end｜><｜tool▁outputs▁end｜>"},
    {"ds_tool_last_gen",
     kDeepseekToolsTemplate,
     "{\"add_generation_prompt\": true, \"bos_token\": \"<BOS>\", \"messages\": [{\"content\": "
     "\"sys A\", \"role\": \"system\"}, {\"content\": \"sys B\", \"role\": \"system\"}, "
     "{\"content\": \"Weather in Paris and Rome?\", \"role\": \"user\"}, {\"content\": null, "
     "\"role\": \"assistant\", \"tool_calls\": [{\"function\": {\"arguments\": \"{\\\"city\\\": "
     "\\\"Paris\\\"}\", \"name\": \"get_weather\"}, \"type\": \"function\"}, {\"function\": "
     "{\"arguments\": \"{\\\"city\\\": \\\"Rome\\\"}\", \"name\": \"get_weather\"}, \"type\": "
     "\"function\"}]}, {\"content\": \"22C\", \"role\": \"tool\"}, {\"content\": \"25C\", "
     "\"role\": \"tool\"}]}",
     "<BOS>sys A\n\nsys B<｜User｜>Weather in Paris and "
     "Rome?<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_"
     "weather\n```json\n{\"city\": "
     "\"Paris\"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n`"
     "``json\n{\"city\": "
     "\"Rome\"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜><"
     "｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>22C<｜tool▁output▁end｜>\n<"
     "｜tool▁output▁begin｜>25C<｜tool▁output▁end｜><｜tool▁outputs▁end｜>"},
    {"ll_instruct",
     "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
     "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim "
     "+ '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif "
     "%}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ "
     "'<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}",
     "{\"add_generation_prompt\": true, \"bos_token\": \"<B>\", \"messages\": [{\"content\": \"sys "
     "A\", \"role\": \"system\"}, {\"content\": \"sys B\", \"role\": \"system\"}, {\"content\": "
     "\"Weather in Paris and Rome?\", \"role\": \"user\"}, {\"content\": \"  spaced  \\n\", "
     "\"role\": \"assistant\"}]}",
     "<B><|start_header_id|>system<|end_header_id|>\n\nsys "
     "A<|eot_id|><|start_header_id|>system<|end_header_id|>\n\nsys "
     "B<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nWeather in Paris and "
     "Rome?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nspaced<|eot_id|><|start_"
     "header_id|>assistant<|end_header_id|>\n\n"},
};

TEST(ChatTemplate, JinjaFeaturesMatchReference) {
  for (const FeatureCase& c : kFeatureCases) {
    SCOPED_TRACE(c.name);
    try {
      EXPECT_EQ(render_chat_template(c.tmpl, json::parse(c.context)), c.expected);
    } catch (const std::exception& e) {
      ADD_FAILURE() << "threw: " << e.what();
    }
  }
}

TEST(ChatTemplate, GenerationBlockRendersItsBody) {
  const json context = {{"messages", json::array({{{"role", "user"}, {"content", "q"}},
                                                  {{"role", "assistant"}, {"content", "a"}}})}};
  EXPECT_EQ(render_chat_template("{% for m in messages %}{% if m.role == 'assistant' %}"
                                 "{% generation %}[{{ m.content }}]{% endgeneration %}"
                                 "{% else %}{{ m.content }}{% endif %}{% endfor %}",
                                 context),
            "q[a]");
}

TEST(ChatTemplate, NamespaceKeepsUndefinedAndNestedValues) {
  EXPECT_EQ(render_chat_template(
                "{% set ns = namespace(a=missing, inner=namespace(x=1)) %}"
                "{{ ns.a is defined }} {{ ns.inner.x }}{% set ns.inner = 5 %} {{ ns.inner }}",
                json::object()),
            "False 1 5");
}

TEST(ChatTemplate, ParsedTemplateRendersManyContexts) {
  const ChatTemplate tmpl("{% for m in messages %}{{ m.role }}:{{ m.content }};{% endfor %}");
  EXPECT_EQ(tmpl.render({{"messages", json::array({{{"role", "a"}, {"content", "1"}}})}}), "a:1;");
  EXPECT_EQ(tmpl.render({{"messages", json::array()}}), "");
  EXPECT_EQ(tmpl.render(json::object()), "");
}

// Throws and returns the message.
template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const std::runtime_error& e) {
    return e.what();
  }
  return "(no exception)";
}

TEST(ChatTemplate, RaiseExceptionReportsMessageAndPosition) {
  const std::string tmpl =
      "{% if messages[0].role != 'user' %}\n"
      "  {{ raise_exception('Conversation roles must alternate') }}\n"
      "{% endif %}";
  const json context = {{"messages", json::array({{{"role", "system"}, {"content", "x"}}})}};
  EXPECT_EQ(error_of([&] { render_chat_template(tmpl, context); }),
            "chat template line 2 col 6: raise_exception: Conversation roles must alternate");
}

// A template is code from a checkpoint: its arithmetic, its work and its output are bounded
// (found by fuzzing: tests/fuzz/regressions/chat_template/). Each case names what went wrong.
TEST(ChatTemplate, HostileTemplatesEndWithAnError) {
  auto what = [](const std::string& tmpl) {
    std::string message = error_of([&] { render_chat_template(tmpl, json::object()); });
    const size_t colon = message.find(": ");  // after "chat template line L col C"
    return colon == std::string::npos ? message : message.substr(colon + 2);
  };
  EXPECT_EQ(what("{{ 9223372036854775807 + 1 }}"), "integer overflow in +");
  EXPECT_EQ(what("{{ -9223372036854775807 - 2 }}"), "integer overflow in -");
  EXPECT_EQ(what("{{ 9223372036854775807 * 3 }}"), "integer overflow in *");
  EXPECT_EQ(what("{{ (-9223372036854775807 - 1) // -1 }}"), "integer overflow in //");
  EXPECT_EQ(what("{{ -(-9223372036854775807 - 1) }}"), "integer overflow in unary -");
  EXPECT_EQ(what("{{ (-9223372036854775807 - 1) | abs }}"), "filter 'abs': integer overflow");
  EXPECT_EQ(render_chat_template("{{ -(-9223372036854775807) }} {{ (-9223372036854775807) | abs }}",
                                 json::object()),
            "9223372036854775807 9223372036854775807");
  EXPECT_EQ(what("{{ 1e300 | int }}"), "filter 'int': integer overflow");
  EXPECT_EQ(what("{{ -9.3e18 | int }}"), "filter 'int': integer overflow");
  EXPECT_EQ(render_chat_template("{{ 9007199254740993 | int }} {{ -2.7 | int }} {{ (1e308 * 10 - "
                                 "1e308 * 10) | int(7) }} {{ -9.2e18 | int }}",
                                 json::object()),
            "9007199254740993 -2 7 -9200000000000000000");
  EXPECT_EQ(what("{{ 2 ** 1000000000000000000 }}"), "integer overflow in **");
  EXPECT_EQ(what("{{ 'a' * 100000000000 }}"), "the template built a value or output over 16 MiB");
  EXPECT_EQ(what("{% for i in range(1000000000) %}x{% endfor %}"),
            "the template ran more than 100000 steps (a loop that does not end?)");
  EXPECT_EQ(what("{% set x = [1] * 1000 %}{% for a in x %}{% for b in x %}{% endfor %}"
                 "{% endfor %}"),
            "the template ran more than 100000 steps (a loop that does not end?)");
  // What real templates do stays well inside the limits.
  EXPECT_EQ(render_chat_template("{{ 2 ** 62 }} {{ range(3) | join(',') }} {{ 'ab' * 3 }}",
                                 json::object()),
            "4611686018427387904 0,1,2 ababab");
}

TEST(ChatTemplate, EvaluationErrorsNameTheProblem) {
  EXPECT_EQ(error_of([] { render_chat_template("ab{{ foo.bar }}", json::object()); }),
            "chat template line 1 col 6: 'foo' is undefined (reading its attribute 'bar')");
  EXPECT_EQ(error_of([] { render_chat_template("{{ 'a' + 1 }}", json::object()); }),
            "chat template line 1 col 8: unsupported operand types for +: 'str' and 'int'");
  EXPECT_EQ(error_of([] { render_chat_template("{{ x | nosuchfilter }}", json::object()); }),
            "chat template line 1 col 6: unknown filter 'nosuchfilter'");
  EXPECT_EQ(error_of([] { render_chat_template("{{ 's'.nosuch() }}", json::object()); }),
            "chat template line 1 col 4: 's'.nosuch(): 'str' has no method 'nosuch'");
  EXPECT_EQ(
      error_of([] { render_chat_template("{% set x = 1 %}{% set x.y = 2 %}", json::object()); }),
      "chat template line 1 col 16: cannot set attribute 'y' on 'x' (a int): only namespace() "
      "objects can be changed");
}

TEST(ChatTemplate, SyntaxErrorsNameTheProblem) {
  EXPECT_EQ(error_of([] { ChatTemplate("{% if x %}abc"); }),
            "chat template line 1 col 14: missing {% endif %}");
  EXPECT_EQ(error_of([] { ChatTemplate("{% for x in y %}\n{% endif %}"); }),
            "chat template line 2 col 1: unexpected {% endif %}");
  EXPECT_EQ(error_of([] { ChatTemplate("{% macro m() %}{% endmacro %}"); }),
            "chat template line 1 col 1: unsupported tag 'macro'");
  EXPECT_EQ(error_of([] { ChatTemplate("{{ 'abc }}"); }),
            "chat template line 1 col 4: unterminated string literal");
  EXPECT_EQ(error_of([] { ChatTemplate("{{ a + }}"); }),
            "chat template line 1 col 8: expected an expression, found '}}'");
  EXPECT_EQ(error_of([] { ChatTemplate("x {{ a "); }), "chat template line 1 col 3: unclosed '{{'");
  EXPECT_EQ(error_of([] { ChatTemplate("{% break %}"); }),
            "chat template line 1 col 1: 'break' outside a for loop");
}

// Bounded nesting: deep templates fail cleanly instead of overflowing the stack.
TEST(ChatTemplate, DeepNestingIsAnError) {
  const std::string parens = "{{ " + std::string(5000, '(') + "1" + std::string(5000, ')') + " }}";
  EXPECT_NE(error_of([&] { ChatTemplate{parens}; }).find("template nested too deeply"),
            std::string::npos);
  std::string sum = "{{ 1";
  for (int i = 0; i < 5000; ++i) sum += " + 1";
  EXPECT_NE(error_of([&] { ChatTemplate{sum + " }}"}; }).find("expression nested too deeply"),
            std::string::npos);
  std::string ifs;
  for (int i = 0; i < 5000; ++i) ifs += "{% if true %}";
  EXPECT_NE(error_of([&] { ChatTemplate{ifs}; }).find("template nested too deeply"),
            std::string::npos);
  // Well within the limits.
  std::string fine = "{{ 0";
  for (int i = 0; i < 100; ++i) fine += " + 1";
  EXPECT_EQ(render_chat_template(fine + " }}", json::object()), "100");
}

TEST(ChatTemplate, TokenizerWithoutTemplateIsAnError) {
  const std::filesystem::path dir = std::filesystem::temp_directory_path() /
                                    ("clshard_test_no_template_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "tokenizer.json") << R"({
    "model": {"type": "BPE", "vocab": {"a": 0, "b": 1}, "merges": []},
    "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "use_regex": true},
    "decoder": {"type": "ByteLevel"}})";
  const Tokenizer tokenizer = Tokenizer::from_dir(dir);
  EXPECT_EQ(error_of([&] {
              apply_chat_template(tokenizer, {{"user", "a"}}, true);
            }),
            "apply_chat_template: the tokenizer has no chat template");
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace clshard
