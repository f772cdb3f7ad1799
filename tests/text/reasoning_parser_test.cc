// The deepseek_r1 reasoning split: the whole-text form against a reference
// written here, and the incremental form, over random splits of random
// texts with markers (whole and cut) at random places, against the same.
#include "text/reasoning_parser.h"

#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

namespace mlarun::text {
namespace {

// vLLM's DeepSeekR1ReasoningParser on a whole answer, but keeping text
// before `<think>`: partition at the first `</think>`; its left side, less
// its first `<think>`, is the reasoning.
ReasoningSplit Reference(const std::string& text) {
  ReasoningSplit r;
  const std::string close = "</think>", open = "<think>";
  size_t end = text.find(close);
  std::string left = end == std::string::npos ? text : text.substr(0, end);
  if (end != std::string::npos) r.content = text.substr(end + close.size());
  size_t at = left.find(open);
  r.reasoning = at == std::string::npos ? left : left.substr(0, at) + left.substr(at + open.size());
  return r;
}

std::string RandomText(std::mt19937_64& rng) {
  static const std::vector<std::string> pieces = {"a",     "b c",  "\n",     "<",       ">",        "/",
                                                  "think", "<thi", "</thin", "<think>", "</think>", "é",
                                                  "<<",    "</",   "<think", "</think"};
  std::string s;
  const int n = static_cast<int>(rng() % 24);
  for (int i = 0; i < n; ++i) s += pieces[rng() % pieces.size()];
  return s;
}

ReasoningSplit Streamed(const std::string& text, std::mt19937_64& rng) {
  ReasoningParser p;
  ReasoningSplit all;
  size_t at = 0;
  while (at < text.size()) {
    const size_t len = std::min(text.size() - at, static_cast<size_t>(rng() % 6));
    ReasoningSplit d = p.Add(std::string_view(text).substr(at, len));
    all.reasoning += d.reasoning;
    all.content += d.content;
    at += len;
  }
  ReasoningSplit d = p.Finish();
  all.reasoning += d.reasoning;
  all.content += d.content;
  return all;
}

TEST(ReasoningParser, Examples) {
  ReasoningSplit s = SplitReasoning("<think>\nwhy</think>\n\nanswer");
  EXPECT_EQ(s.reasoning, "\nwhy");
  EXPECT_EQ(s.content, "\n\nanswer");
  s = SplitReasoning("why, with <think> already in the prompt</think>answer <think>x</think>");
  EXPECT_EQ(s.reasoning, "why, with  already in the prompt");
  EXPECT_EQ(s.content, "answer <think>x</think>");
  s = SplitReasoning("still thinking <thi");
  EXPECT_EQ(s.reasoning, "still thinking <thi");
  EXPECT_EQ(s.content, "");
}

TEST(ReasoningParser, WholeMatchesReference) {
  std::mt19937_64 rng(1);
  for (int i = 0; i < 20000; ++i) {
    const std::string text = RandomText(rng);
    const ReasoningSplit want = Reference(text), got = SplitReasoning(text);
    ASSERT_EQ(got.reasoning, want.reasoning) << text;
    ASSERT_EQ(got.content, want.content) << text;
  }
}

TEST(ReasoningParser, RandomSplitsMatchTheWholeText) {
  std::mt19937_64 rng(2);
  for (int i = 0; i < 20000; ++i) {
    const std::string text = RandomText(rng);
    const ReasoningSplit want = Reference(text), got = Streamed(text, rng);
    ASSERT_EQ(got.reasoning, want.reasoning) << text;
    ASSERT_EQ(got.content, want.content) << text;
  }
}

// Only a possible marker prefix is held back: plain text comes out at once.
TEST(ReasoningParser, HoldsBackOnlyAMarkerPrefix) {
  ReasoningParser p;
  EXPECT_EQ(p.Add("abc").reasoning, "abc");
  EXPECT_EQ(p.Add("x</th").reasoning, "x");
  ReasoningSplit d = p.Add("ink>y<");
  EXPECT_EQ(d.reasoning, "");
  EXPECT_EQ(d.content, "y<");
  EXPECT_EQ(p.Add("/think>").content, "/think>");
  ReasoningParser q;
  EXPECT_EQ(q.Add("a <b").reasoning, "a <b");
  EXPECT_EQ(q.Add("<").reasoning, "");
  EXPECT_EQ(q.Finish().reasoning, "<");
}

}  // namespace
}  // namespace mlarun::text
