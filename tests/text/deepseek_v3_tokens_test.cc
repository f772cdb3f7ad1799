// DeepSeek-V3's added tokens (the chat, tool-call and reasoning markers),
// each one token id: a fixture tokenizer (bpe6k plus those tokens with
// DeepSeek-V3's `special` flags, make_deepseek_v3_fixtures.py) against
// Hugging Face tokenizers' encode and decode of strings holding them, and
// the tool-call and reasoning parsers over a token stream in which every
// marker is a single id, whole and one token per delta.
#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "tests/test_paths.h"
#include "text/reasoning_parser.h"
#include "text/tokenizer.h"
#include "text/tool_call_parser.h"

namespace mlarun::text {
namespace {

using nlohmann::json;

std::string Fixture(const std::string& rel) { return std::string(MLARUN_FIXTURES_DIR) + "/" + rel; }

std::unique_ptr<Tokenizer> LoadFixture() {
  auto t = Tokenizer::Load(Fixture("bpe6k_dsv3"));
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  return t.ok() ? std::move(*t) : nullptr;
}

// DeepSeek-V3's markers and whether its tokenizer.json calls each special,
// written here rather than read from the fixture.
const std::vector<std::pair<std::string, bool>> kMarkers = {
    {"<｜begin▁of▁sentence｜>", true},
    {"<｜end▁of▁sentence｜>", true},
    {"<｜▁pad▁｜>", true},
    {"<|EOT|>", true},
    {"<think>", false},
    {"</think>", false},
    {"<｜User｜>", false},
    {"<｜Assistant｜>", false},
    {"<｜fim▁hole｜>", false},
    {"<｜fim▁begin｜>", false},
    {"<｜fim▁end｜>", false},
    {"<｜tool▁calls▁begin｜>", false},
    {"<｜tool▁calls▁end｜>", false},
    {"<｜tool▁call▁begin｜>", false},
    {"<｜tool▁call▁end｜>", false},
    {"<｜tool▁outputs▁begin｜>", false},
    {"<｜tool▁outputs▁end｜>", false},
    {"<｜tool▁output▁begin｜>", false},
    {"<｜tool▁output▁end｜>", false},
    {"<｜tool▁sep｜>", false},
};

TEST(DeepSeekV3Tokens, EachMarkerIsOneIdWithItsSpecialFlag) {
  auto tok = LoadFixture();
  ASSERT_NE(tok, nullptr);
  for (const auto& [marker, special] : kMarkers) {
    const std::optional<int32_t> id = tok->TokenToId(marker);
    ASSERT_TRUE(id.has_value()) << marker;
    EXPECT_EQ(tok->Encode(marker, false), std::vector<int32_t>{*id}) << marker;
    EXPECT_EQ(tok->IsSpecial(*id), special) << marker;
    EXPECT_EQ(tok->Decode(std::vector<int32_t>{*id}, false), marker);
    EXPECT_EQ(tok->Decode(std::vector<int32_t>{*id}, true), special ? "" : marker);
  }
}

TEST(DeepSeekV3Tokens, EncodeAndDecodeMatchHuggingFace) {
  auto tok = LoadFixture();
  ASSERT_NE(tok, nullptr);
  std::ifstream f(Fixture("bpe6k_dsv3_cases.jsonl"));
  ASSERT_TRUE(f.good());
  std::string line;
  int n = 0;
  while (std::getline(f, line)) {
    const json c = json::parse(line);
    const std::string text = c["text"];
    const std::vector<int32_t> want = c["ids"];
    EXPECT_EQ(tok->Encode(text, false), want) << text;
    EXPECT_EQ(tok->Decode(want, false), c["text_keep"].get<std::string>()) << text;
    EXPECT_EQ(tok->Decode(want, true), c["text_skip"].get<std::string>()) << text;
    for (const bool skip : {false, true}) {
      IncrementalDecoder d(*tok, skip);
      std::string streamed;
      for (int32_t id : want) streamed += d.Add(id);
      streamed += d.Finish();
      EXPECT_EQ(streamed, c[skip ? "text_skip" : "text_keep"].get<std::string>()) << text;
    }
    ++n;
  }
  EXPECT_GE(n, 80);
}

// The answer as the model writes it: reasoning, content, two tool calls,
// then the end of the sentence.
constexpr char kAnswer[] =
    "<think>The user wants the weather.\nCall the tool.</think>I will check."
    "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
    "{\"city\": \"Paris\", \"unit\": \"c\"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function"
    "<｜tool▁sep｜>get_time\n```json\n{\"tz\": \"CET\"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
    "<｜end▁of▁sentence｜>";

struct Parsed {
  std::string reasoning, content;
  std::vector<ToolCall> calls;
};

// Reasoning first, then tool calls in what is content (the HTTP API's
// order), over `deltas`.
Parsed ParseDeltas(const std::vector<std::string>& deltas) {
  Parsed out;
  ReasoningParser reasoning;
  ToolCallParser tools;
  auto take_tools = [&](const ToolCallsDelta& d) {
    out.content += d.content;
    for (const ToolCallDelta& c : d.calls) {
      if (c.begins) out.calls.push_back(ToolCall{.name = c.name});
      EXPECT_EQ(c.index + 1, out.calls.size());
      out.calls.back().arguments += c.arguments;
    }
  };
  auto take = [&](const ReasoningSplit& s) {
    out.reasoning += s.reasoning;
    take_tools(tools.Add(s.content));
  };
  for (const std::string& d : deltas) take(reasoning.Add(d));
  take(reasoning.Finish());
  take_tools(tools.Finish());
  return out;
}

void ExpectTheAnswer(const Parsed& p) {
  EXPECT_EQ(p.reasoning, "The user wants the weather.\nCall the tool.");
  EXPECT_EQ(p.content, "I will check.");
  ASSERT_EQ(p.calls.size(), 2u);
  EXPECT_EQ(p.calls[0].name, "get_weather");
  EXPECT_EQ(p.calls[0].arguments, "{\"city\": \"Paris\", \"unit\": \"c\"}");
  EXPECT_EQ(p.calls[1].name, "get_time");
  EXPECT_EQ(p.calls[1].arguments, "{\"tz\": \"CET\"}");
}

TEST(DeepSeekV3Tokens, ParsersReadATokenStreamOfSingleIdMarkers) {
  auto tok = LoadFixture();
  ASSERT_NE(tok, nullptr);
  const std::vector<int32_t> ids = tok->Encode(kAnswer, false);
  // Every marker of the answer is one id of the stream.
  for (const auto& [marker, special] : kMarkers) {
    size_t in_text = 0;
    for (size_t at = 0; (at = std::string_view(kAnswer).find(marker, at)) != std::string_view::npos; ++at) ++in_text;
    const int32_t id = *tok->TokenToId(marker);
    EXPECT_EQ(static_cast<size_t>(std::count(ids.begin(), ids.end(), id)), in_text) << marker;
  }
  // One token per delta, as the HTTP API streams them (special tokens
  // skipped: the end of the sentence goes, the markers stay).
  IncrementalDecoder decoder(*tok, /*skip_special_tokens=*/true);
  std::vector<std::string> deltas;
  for (int32_t id : ids) deltas.push_back(decoder.Add(id));
  deltas.push_back(decoder.Finish());
  std::string whole;
  for (const std::string& d : deltas) whole += d;
  EXPECT_EQ(whole, tok->Decode(ids, true));
  EXPECT_FALSE(whole.ends_with("<｜end▁of▁sentence｜>"));
  ExpectTheAnswer(ParseDeltas(deltas));
  ExpectTheAnswer(ParseDeltas({whole}));
  // Each marker's token arrives as its own delta, whole.
  for (size_t i = 0; i < ids.size(); ++i) {
    if (const auto text = tok->IdToToken(ids[i]); text && IsToolCallMarker(*text)) {
      EXPECT_EQ(deltas[i], *text);
    }
  }
}

}  // namespace
}  // namespace mlarun::text
