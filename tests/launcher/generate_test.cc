// `mlarun generate` as a user sees it: JSON lines in input order, errors in
// their slots, the exit code.
#include "launcher/generate/generate.h"

#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "tests/test_paths.h"
#include "text/tokenizer.h"

namespace mlarun {
namespace {

std::vector<nlohmann::json> Lines(const std::string& text) {
  std::vector<nlohmann::json> out;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) out.push_back(nlohmann::json::parse(line));
  return out;
}

TEST(Generate, ParseRequestLine) {
  const SamplingParams defaults{.max_tokens = 7};
  auto r = ParseRequestLine(R"({"prompt_ids": [4, 5], "temperature": 0.5, "top_k": 3, "seed": 9,
                                 "stop_token_ids": [8], "ignore_eos": true, "logprobs": 4,
                                 "prompt_logprobs": 0})",
                            defaults);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->prompt, (std::vector<int32_t>{4, 5}));
  EXPECT_EQ(r->sampling.max_tokens, 7);
  EXPECT_EQ(r->sampling.temperature, 0.5);
  EXPECT_EQ(r->sampling.top_k, 3);
  EXPECT_EQ(r->sampling.seed, 9u);
  EXPECT_EQ(r->sampling.stop_token_ids, (std::vector<int64_t>{8}));
  EXPECT_TRUE(r->sampling.ignore_eos);
  EXPECT_EQ(r->sampling.logprobs, 4);
  EXPECT_EQ(r->sampling.prompt_logprobs, 0);
  EXPECT_EQ(ParseRequestLine(R"({"prompt_ids": [1]})", defaults)->sampling.prompt_logprobs, -1) << "off unless asked";
  for (const auto& [line, field] :
       std::vector<std::pair<std::string, std::string>>{{R"({"max_tokens": 3})", "prompt_ids"},
                                                        {R"({"prompt_ids": "1,2"})", "prompt_ids"},
                                                        {R"({"prompt_ids": [1, 2.5]})", "prompt_ids"},
                                                        {R"({"prompt_ids": [1], "max_tokens": 2.5})", "max_tokens"},
                                                        {R"({"prompt_ids": [1], "seed": -1})", "seed"},
                                                        {R"({"prompt_ids": [1], "ignore_eos": 1})", "ignore_eos"},
                                                        {R"({"prompt_ids": [1], "logprobs": true})", "logprobs"},
                                                        {R"(not json)", "JSON"}}) {
    const Status st = ParseRequestLine(line, defaults).status();
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << line;
    EXPECT_NE(st.message().find(field), std::string::npos) << st;
  }
}

TEST(Generate, ParseRequestLineStructured) {
  auto r = ParseRequestLine(R"({"prompt_ids": [4], "structured": {"kind": "json_schema", "spec": {"type": "object"},
                                 "any_whitespace": false}})",
                            SamplingParams{});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->sampling.structured.kind, StructuredOutput::Kind::kJsonSchema);
  EXPECT_EQ(nlohmann::json::parse(r->sampling.structured.spec), nlohmann::json({{"type", "object"}}));
  EXPECT_FALSE(r->sampling.structured.any_whitespace);
  // A schema's properties keep their order (nlohmann::json would sort them).
  r = ParseRequestLine(
      R"({"prompt_ids": [4], "structured": {"kind": "json_schema", "spec": {"type": "object", "properties": {"z": {}, "a": {}}}}})",
      SamplingParams{});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->sampling.structured.spec, R"({"type":"object","properties":{"z":{},"a":{}}})");
  r = ParseRequestLine(R"({"prompt_ids": [4], "structured": {"kind": "choice", "choices": ["a", "b"]}})", {});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->sampling.structured.kind, StructuredOutput::Kind::kChoice);
  EXPECT_EQ(r->sampling.structured.choices, (std::vector<std::string>{"a", "b"}));
  for (const std::string& line :
       {R"({"prompt_ids": [1], "structured": "regex"})", R"({"prompt_ids": [1], "structured": {"kind": "xml"}})",
        R"({"prompt_ids": [1], "structured": {"kind": "regex", "spec": 3}})",
        R"({"prompt_ids": [1], "structured": {"kind": "choice", "choices": [1]}})"}) {
    const Status st = ParseRequestLine(line, {}).status();
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << line;
    EXPECT_NE(st.message().find("structured"), std::string::npos) << st;
  }
}

// A structured line on the tiny model (whose YAML names its tokenizer): the
// output is one of the choices; a regex that does not compile is that
// line's error.
TEST(Generate, StructuredLines) {
  const std::string path = testing::TempDir() + "/structured.jsonl";
  std::ofstream(path) << R"({"prompt_ids": [3, 4, 5], "temperature": 1, "seed": 4, "max_tokens": 30, )"
                         R"("structured": {"kind": "choice", "choices": ["left", "right"]}})"
                      << "\n"
                      << R"({"prompt_ids": [3, 4], "structured": {"kind": "regex", "spec": "(a"}})"
                      << "\n";
  GenerateOptions o{.deployment = {.model = TinyYaml()}, .prompts_path = path, .json = true};
  std::ostringstream out, log;
  EXPECT_EQ(RunGenerate(o, out, log), 1) << log.str();
  const auto lines = Lines(out.str());
  ASSERT_EQ(lines.size(), 2u) << out.str();
  EXPECT_EQ(lines[0]["finish_reason"], "stop") << out.str();
  auto tok = text::Tokenizer::Load(TinyYaml());
  ASSERT_TRUE(tok.ok()) << tok.status();
  const std::vector<int32_t> ids = lines[0]["tokens"].get<std::vector<int32_t>>();
  const std::string text = (*tok)->Decode(ids, /*skip_special_tokens=*/true);
  EXPECT_TRUE(text == "left" || text == "right") << text;
  EXPECT_NE(lines[1]["error"].get<std::string>().find("regex"), std::string::npos) << out.str();
}

TEST(Generate, JsonLinesInInputOrder) {
  const std::string path = testing::TempDir() + "/prompts.jsonl";
  std::ofstream(path)
      << R"({"prompt_ids": [3, 4, 5], "max_tokens": 4, "ignore_eos": true})"
      << "\n"
      << R"({"prompt_ids": [], "max_tokens": 3})"
      << "\n\n"
      << R"({"prompt_ids": [9, 10], "max_tokens": 5, "temperature": 0.7, "seed": 3, "ignore_eos": true})"
      << "\n"
      << R"({"prompt_ids": [7, 99999]})"
      << "\n";
  GenerateOptions o{.deployment = {.model = TinyYaml()}, .prompts_path = path, .json = true};
  std::ostringstream out, log;
  EXPECT_EQ(RunGenerate(o, out, log), 1) << "a rejected request makes the exit code 1";
  const auto lines = Lines(out.str());
  ASSERT_EQ(lines.size(), 4u) << out.str();
  EXPECT_EQ(lines[0]["tokens"].size(), 4u);
  EXPECT_EQ(lines[0]["logprobs"].size(), 4u);
  EXPECT_EQ(lines[0]["finish_reason"], "length");
  EXPECT_FALSE(lines[0].contains("top_logprobs")) << "not asked for";
  EXPECT_NE(lines[1]["error"].get<std::string>().find("empty"), std::string::npos);
  EXPECT_EQ(lines[2]["tokens"].size(), 5u);
  EXPECT_NE(lines[3]["error"].get<std::string>().find("vocabulary"), std::string::npos);
  // The same request alone gives the same tokens.
  GenerateOptions one{.deployment = {.model = TinyYaml()}, .prompt_ids = {3, 4, 5}, .json = true};
  one.sampling.max_tokens = 4;
  one.sampling.ignore_eos = true;
  std::ostringstream out1;
  EXPECT_EQ(RunGenerate(one, out1, log), 0);
  const auto alone = Lines(out1.str());
  ASSERT_EQ(alone.size(), 1u) << out1.str();
  EXPECT_EQ(alone[0]["tokens"], lines[0]["tokens"]);
  // Asking for the most likely tokens changes no token; each step lists 3,
  // best first, the greedy token first with its own logprob.
  one.sampling.logprobs = 3;
  std::ostringstream out3;
  EXPECT_EQ(RunGenerate(one, out3, log), 0);
  const auto top = Lines(out3.str());
  ASSERT_EQ(top.size(), 1u) << out3.str();
  EXPECT_EQ(top[0]["tokens"], lines[0]["tokens"]);
  ASSERT_EQ(top[0]["top_logprobs"].size(), 4u) << out3.str();
  for (size_t t = 0; t < 4; ++t) {
    const auto& step = top[0]["top_logprobs"][t];
    ASSERT_EQ(step.size(), 3u);
    EXPECT_EQ(step[0][0], top[0]["tokens"][t]);
    EXPECT_EQ(step[0][1], top[0]["logprobs"][t]);
    EXPECT_GE(step[0][1].get<double>(), step[1][1].get<double>());
    EXPECT_GE(step[1][1].get<double>(), step[2][1].get<double>());
  }
}

TEST(Generate, UnloadableModelIsExitCode2) {
  GenerateOptions o{.deployment = {.model = "/nonexistent/model"}, .prompt_ids = {1, 2}};
  std::ostringstream out, log;
  EXPECT_EQ(RunGenerate(o, out, log), 2);
  EXPECT_NE(log.str().find("/nonexistent/model"), std::string::npos) << log.str();
}

}  // namespace
}  // namespace mlarun
