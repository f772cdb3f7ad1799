// The chat-template interpreter against Python's jinja2 set up as
// transformers sets it up (fixtures from make_chat_template_fixtures.py): the
// DeepSeek-V2, V2.5, V3 and R1 and a ChatML template over many conversations,
// and small templates exercising one feature each. Then what Parse refuses,
// how runtime errors read, and the runaway guards.
#include "text/chat_template.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <sstream>
#include <thread>

#include "tests/test_paths.h"

namespace mlarun::text {
namespace {

std::string FixturePath(const std::string& rel) { return std::string(MLARUN_FIXTURES_DIR) + "/" + rel; }

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in.good()) << "cannot open " << path;
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::vector<nlohmann::json> ReadJsonl(const std::string& path) {
  std::vector<nlohmann::json> out;
  std::ifstream in(path);
  EXPECT_TRUE(in.good()) << "cannot open " << path << " (run tests/text/make_chat_template_fixtures.py)";
  std::string line;
  while (std::getline(in, line)) {
    if (!line.empty()) out.push_back(nlohmann::json::parse(line));
  }
  return out;
}

std::shared_ptr<const ChatTemplate> MustParse(const std::string& source) {
  auto t = ChatTemplate::Parse(source);
  EXPECT_TRUE(t.ok()) << t.status();
  return t.ok() ? *t : nullptr;
}

// One fixture case: the same output as jinja2, or an error where it raised
// (with the raised message where the template raised it itself).
void CheckCase(const nlohmann::json& c, const std::string& source) {
  const std::string name = c["name"].get<std::string>();
  SCOPED_TRACE(name);
  auto t = ChatTemplate::Parse(source);
  ASSERT_TRUE(t.ok()) << t.status();
  auto out = (*t)->Render(c["context"]);
  if (c.contains("output")) {
    ASSERT_TRUE(out.ok()) << out.status();
    EXPECT_EQ(*out, c["output"].get<std::string>());
    return;
  }
  const std::string error = c["error"].get<std::string>();
  ASSERT_FALSE(out.ok()) << "jinja2 raised " << error << " but the render gave: " << *out;
  EXPECT_EQ(out.status().code(), StatusCode::kInvalidArgument) << out.status();
  const std::string raised = "TemplateError: ";
  if (error.rfind(raised, 0) == 0) {
    EXPECT_NE(out.status().message().find(error.substr(raised.size())), std::string::npos) << out.status();
  }
}

TEST(ChatTemplateTest, CheckpointTemplatesMatchJinja2) {
  auto cases = ReadJsonl(FixturePath("chat_template_cases.jsonl"));
  ASSERT_GE(cases.size(), 150u);
  std::set<std::string> templates;
  for (const auto& c : cases) {
    std::string file = c["template"].get<std::string>();
    templates.insert(file);
    CheckCase(c, ReadFile(FixturePath("chat_templates/" + file)));
  }
  for (const char* want : {"deepseek_v2.jinja", "deepseek_v2_5.jinja", "deepseek_v3.jinja", "deepseek_r1.jinja",
                           "deepseek_r1_distill_multiline.jinja", "chatml.jinja"}) {
    EXPECT_TRUE(templates.count(want)) << want;
  }
}

TEST(ChatTemplateTest, SnippetsMatchJinja2) {
  auto cases = ReadJsonl(FixturePath("chat_template_snippets.jsonl"));
  ASSERT_GE(cases.size(), 80u);
  for (const auto& c : cases) CheckCase(c, c["template"].get<std::string>());
}

// A DeepSeek-V3 prompt spelled out: the shape the engine relies on.
TEST(ChatTemplateTest, DeepSeekV3Prompt) {
  auto t = MustParse(ReadFile(FixturePath("chat_templates/deepseek_v3.jinja")));
  ASSERT_NE(t, nullptr);
  nlohmann::json ctx = {{"messages",
                         {{{"role", "system"}, {"content", "S"}},
                          {{"role", "user"}, {"content", "Hi"}},
                          {{"role", "assistant"}, {"content", "Yo"}},
                          {{"role", "user"}, {"content", "Q"}}}},
                        {"bos_token", "<｜begin▁of▁sentence｜>"},
                        {"eos_token", "<｜end▁of▁sentence｜>"},
                        {"add_generation_prompt", true}};
  auto out = t->Render(ctx);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(*out,
            "<｜begin▁of▁sentence｜>S<｜User｜>Hi<｜Assistant｜>Yo<｜end▁of▁sentence｜><｜User｜>Q<"
            "｜Assistant｜>");
}

// Parse refuses what the interpreter does not implement, naming it and its
// line, and pointing at /v1/completions.
TEST(ChatTemplateTest, RefusesUnsupportedConstructs) {
  struct Case {
    const char* source;
    const char* construct;
    int line;
  };
  const Case cases[] = {
      {"a\n{% include 'other.jinja' %}", "{% include %}", 2},
      {"{% extends 'base.jinja' %}", "{% extends %}", 1},
      {"{% import 'macros.jinja' as m %}", "{% import %}", 1},
      {"x\ny\n{% block body %}{% endblock %}", "{% block %}", 3},
      {"{% call m() %}x{% endcall %}", "{% call %}", 1},
      {"{% do xs.append(1) %}", "{% do %}", 1},
      {"{{ x }}\n{{ x|wordwrap(10) }}", "filter 'wordwrap'", 2},
      {"{% if x is prime %}{% endif %}", "test 'prime'", 1},
      {"\n\n{% for x in xs recursive %}{{ loop(x) }}{% endfor %}", "recursive", 3},
      {"{% frobnicate %}", "unknown tag {% frobnicate %}", 1},
      {"{{ f(*args) }}", "*args", 1},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.source);
    auto t = ChatTemplate::Parse(c.source);
    ASSERT_FALSE(t.ok());
    EXPECT_EQ(t.status().code(), StatusCode::kInvalidArgument);
    const std::string& msg = t.status().message();
    EXPECT_NE(msg.find(c.construct), std::string::npos) << msg;
    EXPECT_NE(msg.find("line " + std::to_string(c.line) + ":"), std::string::npos) << msg;
    EXPECT_NE(msg.find("/v1/completions"), std::string::npos) << msg;
  }
}

TEST(ChatTemplateTest, SyntaxErrorsNameTheirLine) {
  struct Case {
    const char* source;
    const char* what;
    int line;
  };
  const Case cases[] = {
      {"{% if x %}never closed", "{% endif %}", 1},
      {"ok\n{{ x + }}", "an expression was expected", 2},
      {"{{ 'unterminated }}", "not closed", 1},
      {"a\nb\n{% endfor %}", "without its opening tag", 3},
      {"{% for x in %}{% endfor %}", "an expression was expected", 1},
      {"{{ x", "not closed", 1},
      {"{# comment", "not closed", 1},
      {"{% break %}", "outside a loop", 1},
      {"{% set = 1 %}", "variable name", 1},
      {"{{ a.b.c[ }}", "not closed", 1},
      {"{{ 1 2 }}", "unexpected", 1},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.source);
    auto t = ChatTemplate::Parse(c.source);
    ASSERT_FALSE(t.ok());
    EXPECT_EQ(t.status().code(), StatusCode::kInvalidArgument);
    const std::string& msg = t.status().message();
    EXPECT_NE(msg.find(c.what), std::string::npos) << msg;
    EXPECT_NE(msg.find("line " + std::to_string(c.line) + ":"), std::string::npos) << msg;
  }
}

// Python's dicts keep the order a request gave its keys, and so does an
// ordered_json context: tojson, items() and loops see that order (expected
// strings: json.dumps(..., ensure_ascii=False), as transformers' tojson).
// A plain nlohmann::json context has its keys sorted.
TEST(ChatTemplateTest, ContextObjectsKeepTheirKeyOrder) {
  auto t = MustParse("{{ messages[0] | tojson }}|{% for k, v in messages[0].items() %}{{ k }},{% endfor %}");
  ASSERT_NE(t, nullptr);
  const auto ordered =
      nlohmann::ordered_json::parse(R"({"messages": [{"role": "user", "content": "hi", "name": "x"}]})");
  auto out = t->Render(ordered);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(*out, R"({"role": "user", "content": "hi", "name": "x"}|role,content,name,)");
  auto sorted = t->Render(nlohmann::json::parse(ordered.dump()));
  ASSERT_TRUE(sorted.ok()) << sorted.status();
  EXPECT_EQ(*sorted, R"({"content": "hi", "name": "x", "role": "user"}|content,name,role,)");
}

TEST(ChatTemplateTest, RuntimeErrorsNameTheExpression) {
  auto t = MustParse("{% for m in messages %}\n{{ m['content'] + 1 }}{% endfor %}");
  ASSERT_NE(t, nullptr);
  auto out = t->Render(nlohmann::json{{"messages", {{{"role", "user"}, {"content", "hi"}}}}});
  ASSERT_FALSE(out.ok());
  EXPECT_EQ(out.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(out.status().message().find("line 2"), std::string::npos) << out.status();
  EXPECT_NE(out.status().message().find("`m['content'] + 1`"), std::string::npos) << out.status();
  EXPECT_NE(out.status().message().find("can only concatenate str"), std::string::npos) << out.status();

  auto raise = MustParse("{{ raise_exception('Only user and assistant roles are supported!') }}");
  ASSERT_NE(raise, nullptr);
  auto r = raise->Render(nlohmann::json::object());
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("Only user and assistant roles are supported!"), std::string::npos);

  auto any = MustParse("x");
  ASSERT_NE(any, nullptr);
  EXPECT_FALSE(any->Render(nlohmann::json::array()).ok());
  auto empty = any->Render(nlohmann::json::object());
  ASSERT_TRUE(empty.ok());
  EXPECT_EQ(*empty, "x");
}

// A template that never ends, or grows without bound, stops with
// RESOURCE_EXHAUSTED, promptly.
TEST(ChatTemplateTest, RunawayTemplatesStop) {
  const char* sources[] = {
      "{% for i in range(1000000) %}{% for j in range(1000000) %}{% endfor %}{% endfor %}",
      "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
      "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% "
      "endfor %}{{ ns.s|length }}",
      "{{ 'x' * 10000000000 }}",
      "{{ range(10000000000)|length }}",
      "{% for i in range(1000000) %}{{ 'some text that adds up quickly, repeated' * 10 }}{% endfor "
      "%}",
      "{% set ns = namespace(x=[]) %}{% for i in range(100000) %}{% set ns.x = [ns.x] %}{% endfor "
      "%}{{ ns.x }}",
      "{% set ns = namespace(x={}) %}{% for i in range(100000) %}{% set ns.x = dict(a=ns.x) %}{% "
      "endfor %}x",
  };
  for (const char* source : sources) {
    SCOPED_TRACE(source);
    auto t = MustParse(source);
    ASSERT_NE(t, nullptr);
    auto start = std::chrono::steady_clock::now();
    auto out = t->Render(nlohmann::json::object());
    double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    ASSERT_FALSE(out.ok());
    EXPECT_EQ(out.status().code(), StatusCode::kResourceExhausted) << out.status();
    EXPECT_NE(out.status().message().find("runaway"), std::string::npos) << out.status();
    EXPECT_LT(secs, 30.0);
  }
  // Deeply nested expressions are refused at Parse rather than overflowing
  // the stack.
  std::string deep = "{{ " + std::string(5000, '(') + "1" + std::string(5000, ')') + " }}";
  auto t = ChatTemplate::Parse(deep);
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find("nests too deeply"), std::string::npos) << t.status();
}

// A context nested deeper than any conversation is refused before it is
// converted (the conversion recurses).
TEST(ChatTemplateTest, DeepContextRefused) {
  auto t = MustParse("{{ messages|length }}");
  ASSERT_NE(t, nullptr);
  nlohmann::json deep = nlohmann::json::parse(std::string(5000, '[') + std::string(5000, ']'));
  auto out = t->Render(nlohmann::json{{"messages", deep}});
  ASSERT_FALSE(out.ok());
  EXPECT_EQ(out.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(out.status().message().find("nests more than"), std::string::npos) << out.status();
  nlohmann::json ok = nlohmann::json::parse(std::string(50, '[') + std::string(50, ']'));
  auto fine = t->Render(nlohmann::json{{"messages", ok}});
  ASSERT_TRUE(fine.ok()) << fine.status();
  EXPECT_EQ(*fine, "1");
}

// Namespaces are mutable: a template can make one hold itself, or chain
// a long list of them. Printing stays bounded and freeing does not recurse.
TEST(ChatTemplateTest, NamespaceCyclesAndChains) {
  auto cycle = MustParse("{% set ns = namespace(a=1) %}{% set ns.self = ns %}{{ ns }}");
  ASSERT_NE(cycle, nullptr);
  auto printed = cycle->Render(nlohmann::json::object());
  ASSERT_TRUE(printed.ok()) << printed.status();
  EXPECT_EQ(printed->rfind("<Namespace {'a': 1, 'self': <Namespace", 0), 0u) << printed->substr(0, 80);
  EXPECT_NE(printed->find("..."), std::string::npos);

  auto chain = MustParse(
      "{% set ns = namespace(last=namespace()) %}{% for i in range(300000) %}{% set n = "
      "namespace() %}"
      "{% set m = ns.last %}{% set m.next = n %}{% set ns.last = n %}{% endfor %}done");
  ASSERT_NE(chain, nullptr);
  auto out = chain->Render(nlohmann::json::object());
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(*out, "done");
}

// One parsed template rendered from several threads at once.
TEST(ChatTemplateTest, ConcurrentRenders) {
  auto t = MustParse(ReadFile(FixturePath("chat_templates/deepseek_v3.jinja")));
  ASSERT_NE(t, nullptr);
  std::vector<std::thread> threads;
  std::vector<int> failures(8, 0);
  for (int k = 0; k < 8; ++k) {
    threads.emplace_back([&, k] {
      for (int i = 0; i < 200; ++i) {
        std::string text = "thread " + std::to_string(k) + " turn " + std::to_string(i);
        nlohmann::json ctx = {{"messages", {{{"role", "user"}, {"content", text}}}},
                              {"bos_token", "<s>"},
                              {"add_generation_prompt", true}};
        auto out = t->Render(ctx);
        if (!out.ok() || *out != "<s><｜User｜>" + text + "<｜Assistant｜>") ++failures[k];
      }
    });
  }
  for (auto& th : threads) th.join();
  for (int k = 0; k < 8; ++k) EXPECT_EQ(failures[k], 0) << "thread " << k;
}

// Random soups of template fragments: Parse and Render either succeed or
// return a Status; nothing crashes or hangs.
TEST(ChatTemplateTest, RandomFragmentsNeverCrash) {
  const char* fragments[] = {
      "{% if x %}",
      "{% elif y %}",
      "{% else %}",
      "{% endif %}",
      "{% for a in xs %}",
      "{% for k, v in d.items() %}",
      "{% endfor %}",
      "{% break %}",
      "{% continue %}",
      "{{ x }}",
      "{{ a }}",
      "{{- a|trim -}}",
      "{{ xs[1:] }}",
      "{{ d.items() }}",
      "{% set y = x ~ 1 %}",
      "{%- set ns.n = ns.n + 1 -%}",
      "{% macro m(a, b=2) %}",
      "{% endmacro %}",
      "{{ m(x) }}",
      "{{ m(m(1)) }}",
      "{% raw %}",
      "{% endraw %}",
      "{# c #}",
      "text\n",
      "  \t",
      "{{ (",
      ")",
      "'s'",
      "[1, ",
      "]",
      "{'k': ",
      "}",
      " | length",
      " is defined",
      " is not none",
      " + ",
      " * 3",
      " ~ ",
      " // 0",
      " if x else ",
      "not ",
      " and ",
      " in xs",
      "{{ xs|tojson(indent=2) }}",
      "{{ y.split(',') }}",
      "{% set ns = namespace(n=0) %}",
      "{{ raise_exception('boom') }}",
      "{{ range(3)|join }}",
      "{{ x|int + 1 }}",
      "}}",
      "%}",
      "{{",
      "{%",
      "{%-",
      "-%}",
      "\n",
  };
  nlohmann::json ctx = {
      {"x", "a,b"}, {"y", "1,2"}, {"xs", {1, "two", nullptr, 3.5}}, {"d", {{"k", 1}}}, {"n", nullptr}};
  std::mt19937 rng(1234);
  const size_t count = std::size(fragments);
  int parsed = 0;
  for (int iter = 0; iter < 3000; ++iter) {
    std::string source;
    int len = 1 + static_cast<int>(rng() % 24);
    for (int k = 0; k < len; ++k) source += fragments[rng() % count];
    auto t = ChatTemplate::Parse(source);
    if (!t.ok()) {
      EXPECT_EQ(t.status().code(), StatusCode::kInvalidArgument) << source;
      continue;
    }
    ++parsed;
    auto out = (*t)->Render(ctx);
    if (!out.ok()) {
      EXPECT_TRUE(out.status().code() == StatusCode::kInvalidArgument ||
                  out.status().code() == StatusCode::kResourceExhausted)
          << source << ": " << out.status();
    }
  }
  EXPECT_GT(parsed, 100);
}

TEST(ChatTemplateTest, StrftimeNowRenders) {
  auto t = MustParse("{{ strftime_now('%Y') }}");
  ASSERT_NE(t, nullptr);
  auto out = t->Render(nlohmann::json::object());
  ASSERT_TRUE(out.ok()) << out.status();
  ASSERT_EQ(out->size(), 4u);
  EXPECT_TRUE(std::all_of(out->begin(), out->end(), [](char c) { return c >= '0' && c <= '9'; }));
}

}  // namespace
}  // namespace mlarun::text
