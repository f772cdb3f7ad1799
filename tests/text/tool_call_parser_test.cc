// The deepseek_v3 tool-call parser: random answers built from known calls
// (the calls they were built from are the reference), whole and over random
// splits; random texts of marker pieces and cut answers, streamed against
// whole; and a conversation rendered by DeepSeek-V3's chat template, the
// model's call parsed back out and rendered again with the tool's result.
#include "text/tool_call_parser.h"

#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "text/chat_template.h"

namespace mlarun::text {
namespace {

const std::string kCallsBegin = "<｜tool▁calls▁begin｜>", kCallsEnd = "<｜tool▁calls▁end｜>",
                  kCallBegin = "<｜tool▁call▁begin｜>", kCallEnd = "<｜tool▁call▁end｜>", kSep = "<｜tool▁sep｜>";

std::string RandomPiece(std::mt19937_64& rng, const std::vector<std::string>& pieces, int max) {
  std::string s;
  const int n = static_cast<int>(rng() % static_cast<uint64_t>(max + 1));
  for (int i = 0; i < n; ++i) s += pieces[rng() % pieces.size()];
  return s;
}

// An answer as DeepSeek-V3 writes one: content, then (maybe) a block of
// calls, each `function<sep>NAME\n```json\nARGS\n```<call end>`.
struct Answer {
  std::string text;
  ToolCalls want;
};
Answer RandomAnswer(std::mt19937_64& rng) {
  static const std::vector<std::string> text = {"a", " b", "\n", "<", "｜", "`", "```", "é", "<｜tool"};
  static const std::vector<std::string> args = {"{", "}", "\"x\": 1", ", ", "\n", "`", "```", "<｜", "é", "\"s\\n\""};
  Answer a;
  a.want.content = RandomPiece(rng, text, 6);
  a.text = a.want.content;
  if (rng() % 4 == 0) return a;
  a.text += kCallsBegin;
  const int calls = 1 + static_cast<int>(rng() % 3);
  for (int i = 0; i < calls; ++i) {
    ToolCall c{.name = "f" + std::to_string(rng() % 100) + (rng() % 2 ? "_get" : ""),
               .arguments = RandomPiece(rng, args, 8)};
    a.text += (i > 0 ? "\n" : "") + kCallBegin + "function" + kSep + c.name + "\n```json\n" + c.arguments + "\n```" +
              kCallEnd;
    a.want.calls.push_back(std::move(c));
  }
  a.text += kCallsEnd;
  return a;
}

// All of ToolCallParser's deltas, joined: content, and per call its name and
// arguments.
ToolCalls Streamed(std::string_view text, std::mt19937_64& rng) {
  ToolCallParser p;
  ToolCalls all;
  auto take = [&](const ToolCallsDelta& d) {
    all.content += d.content;
    for (const ToolCallDelta& c : d.calls) {
      if (c.begins) {
        EXPECT_EQ(c.index, all.calls.size()) << "a new call's index";
        all.calls.push_back({.name = c.name, .arguments = ""});
      }
      EXPECT_LT(c.index, all.calls.size()) << "arguments before their call's name";
      if (c.index < all.calls.size()) all.calls[c.index].arguments += c.arguments;
    }
  };
  size_t at = 0;
  while (at < text.size()) {
    const size_t len = std::min(text.size() - at, static_cast<size_t>(rng() % 8));
    take(p.Add(text.substr(at, len)));
    at += len;
  }
  take(p.Finish());
  EXPECT_EQ(p.called(), !all.calls.empty());
  return all;
}

void ExpectEqual(const ToolCalls& got, const ToolCalls& want, const std::string& text) {
  EXPECT_EQ(got.content, want.content) << text;
  ASSERT_EQ(got.calls.size(), want.calls.size()) << text;
  for (size_t i = 0; i < want.calls.size(); ++i) {
    EXPECT_EQ(got.calls[i].name, want.calls[i].name) << text;
    EXPECT_EQ(got.calls[i].arguments, want.calls[i].arguments) << text;
  }
}

TEST(ToolCallParser, AnswersGiveTheirCallsWholeAndStreamed) {
  std::mt19937_64 rng(std::random_device{}());
  for (int i = 0; i < 5000; ++i) {
    const Answer a = RandomAnswer(rng);
    ExpectEqual(ParseToolCalls(a.text), a.want, a.text);
    ExpectEqual(Streamed(a.text, rng), a.want, a.text);
    if (HasFatalFailure() || HasFailure()) return;
  }
}

// Cut answers (max_tokens) and texts of marker pieces at random: whatever
// the whole parse says, the stream says too.
TEST(ToolCallParser, RandomSplitsMatchTheWholeText) {
  std::mt19937_64 rng(std::random_device{}());
  static const std::vector<std::string> pieces = {"x",      "\n",           "`",         "```json\n", "\n```",
                                                  "<｜",    "<｜tool▁call", kCallsBegin, kCallsEnd,   kCallBegin,
                                                  kCallEnd, kSep,           "function",  "name\n",    "{}"};
  for (int i = 0; i < 20000; ++i) {
    std::string text;
    if (i % 2 == 0) {
      const Answer a = RandomAnswer(rng);
      text = a.text.substr(0, rng() % (a.text.size() + 1));
    } else {
      text = RandomPiece(rng, pieces, 16);
    }
    ExpectEqual(Streamed(text, rng), ParseToolCalls(text), text);
    if (HasFailure()) return;
  }
}

TEST(ToolCallParser, MarkersAreKnown) {
  for (const std::string& m : {kCallsBegin, kCallsEnd, kCallBegin, kCallEnd, kSep}) EXPECT_TRUE(IsToolCallMarker(m));
  EXPECT_FALSE(IsToolCallMarker("<｜end▁of▁sentence｜>"));
  EXPECT_FALSE(IsToolCallMarker("<｜tool▁outputs▁begin｜>"));
}

#ifdef MLARUN_FIXTURES_DIR
std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// DeepSeek-V3's template renders an assistant's call as the model writes
// it: parsed back, the call is the one given; with the tool's result after
// it, the conversation renders both.
TEST(ToolCallParser, DeepSeekV3TemplateRoundTrip) {
  using json = nlohmann::ordered_json;
  auto tmpl = ChatTemplate::Parse(ReadFile(MLARUN_FIXTURES_DIR "/chat_templates/deepseek_v3.jinja"));
  ASSERT_TRUE(tmpl.ok()) << tmpl.status().ToString();
  const std::string args = R"({"city": "Paris", "days": 3})";
  json call = {{"id", "call_1"}, {"type", "function"}, {"function", {{"name", "get_weather"}, {"arguments", args}}}};
  json messages = json::array({{{"role", "user"}, {"content", "Weather in Paris?"}},
                               {{"role", "assistant"}, {"content", nullptr}, {"tool_calls", json::array({call})}}});
  auto rendered = (*tmpl)->Render(json{{"messages", messages}, {"bos_token", "<BOS>"}, {"eos_token", "<EOS>"}});
  ASSERT_TRUE(rendered.ok()) << rendered.status().ToString();
  const size_t at = rendered->find("<｜Assistant｜>");
  ASSERT_NE(at, std::string::npos) << *rendered;
  const std::string answer = rendered->substr(at + std::string("<｜Assistant｜>").size()) + kCallsEnd;
  std::mt19937_64 rng(3);
  for (const ToolCalls& got : {ParseToolCalls(answer), Streamed(answer, rng)}) {
    EXPECT_EQ(got.content, "");
    ASSERT_EQ(got.calls.size(), 1u) << answer;
    EXPECT_EQ(got.calls[0].name, "get_weather");
    EXPECT_EQ(json::parse(got.calls[0].arguments), json::parse(args));
  }
  messages.push_back({{"role", "tool"}, {"tool_call_id", "call_1"}, {"content", "18 C, sunny"}});
  auto with_result = (*tmpl)->Render(
      json{{"messages", messages}, {"add_generation_prompt", true}, {"bos_token", "<BOS>"}, {"eos_token", "<EOS>"}});
  ASSERT_TRUE(with_result.ok()) << with_result.status().ToString();
  EXPECT_NE(with_result->find(kSep + "get_weather\n```json\n" + args + "\n```" + kCallEnd), std::string::npos)
      << *with_result;
  EXPECT_NE(with_result->find("<｜tool▁output▁begin｜>18 C, sunny<｜tool▁output▁end｜>"), std::string::npos)
      << *with_result;
}
#endif

}  // namespace
}  // namespace mlarun::text
