// Constrained generation on the tiny model (random weights, temperature 1):
// whatever the model would say, every output is in the constraint's
// language, checked here without xgrammar (nlohmann, std::regex, the
// choice list), and ends with finish reason stop.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <random>
#include <regex>

#include "runtime/engine/engine.h"
#include "runtime/grammar/grammar.h"
#include "tests/test_paths.h"

namespace mlarun {
namespace {

using Kind = StructuredOutput::Kind;

struct Tiny {
  std::unique_ptr<Model> model;
  std::unique_ptr<text::Tokenizer> tokenizer;
  std::shared_ptr<GrammarCompiler> grammar;
};

Tiny LoadTiny() {
  Tiny t;
  auto m = Model::Load(TinyYaml(), ModelOverrides{});
  EXPECT_TRUE(m.ok()) << m.status();
  auto tok = text::Tokenizer::Load(TinyYaml());
  EXPECT_TRUE(tok.ok()) << tok.status();
  if (!m.ok() || !tok.ok()) return t;
  t.model = std::move(m).value();
  t.tokenizer = std::move(tok).value();
  const ModelConfig& c = t.model->config();
  auto g = GrammarCompiler::Create(*t.tokenizer, c.vocab_size, c.eos_token_ids);
  EXPECT_TRUE(g.ok()) << g.status();
  if (g.ok()) t.grammar = *g;
  return t;
}

std::vector<int32_t> RandomPrompt(int n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int32_t> d(2, 511);
  std::vector<int32_t> p(static_cast<size_t>(n));
  for (auto& t : p) t = d(rng);
  return p;
}

GenerationRequest Constrained(const StructuredOutput& so, uint64_t seed, bool ignore_eos = false) {
  return {
      RandomPrompt(5 + static_cast<int>(seed % 7), static_cast<uint32_t>(seed)),
      SamplingParams{.temperature = 1.0, .seed = seed, .max_tokens = 120, .ignore_eos = ignore_eos, .structured = so}};
}

// The output's text without its trailing EOS.
std::string Text(const Tiny& t, const GenerationOutput& out) {
  std::vector<int32_t> ids(out.tokens.begin(), out.tokens.end());
  const auto& eos = t.model->config().eos_token_ids;
  if (!ids.empty() && std::find(eos.begin(), eos.end(), ids.back()) != eos.end()) ids.pop_back();
  return t.tokenizer->Decode(ids, /*skip_special_tokens=*/false);
}

std::vector<StatusOr<GenerationOutput>> RunAll(const Tiny& t, std::vector<GenerationRequest> reqs) {
  auto engine =
      std::move(Engine::Create(*t.model, EngineConfig{.cache_budget_bytes = 64 << 20, .grammar = t.grammar})).value();
  return engine->Generate(std::move(reqs));
}

constexpr const char* kSchema = R"({
  "type": "object",
  "properties": {
    "name": {"type": "string", "maxLength": 6},
    "ok": {"type": "boolean"},
    "n": {"type": "integer", "minimum": -5, "maximum": 300},
    "tag": {"enum": ["red", "green", "blue"]}
  },
  "required": ["name", "ok", "n", "tag"]
})";

TEST(StructuredEngine, JsonSchemaOutputsParseAndSatisfyTheSchema) {
  Tiny t = LoadTiny();
  ASSERT_NE(t.grammar, nullptr);
  std::vector<GenerationRequest> reqs;
  for (uint64_t seed = 1; seed <= 12; ++seed)
    reqs.push_back(Constrained({.kind = Kind::kJsonSchema, .spec = kSchema, .any_whitespace = false}, seed));
  for (const auto& r : RunAll(t, std::move(reqs))) {
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->finish_reason, FinishReason::kStop);
    const std::string text = Text(t, *r);
    const auto j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
    std::string hex;
    for (unsigned char ch : text) hex += std::to_string(ch) + " ";
    ASSERT_TRUE(j.is_object()) << text << " " << hex << ::testing::PrintToString(r->tokens);
    EXPECT_EQ(j.size(), 4u) << text;
    ASSERT_TRUE(j.contains("name") && j["name"].is_string()) << text;
    EXPECT_LE(j["name"].get<std::string>().size(), 6u * 4) << text;  // 6 characters, up to 4 bytes each
    ASSERT_TRUE(j.contains("ok") && j["ok"].is_boolean()) << text;
    ASSERT_TRUE(j.contains("n") && j["n"].is_number_integer()) << text;
    EXPECT_GE(j["n"].get<int64_t>(), -5) << text;
    EXPECT_LE(j["n"].get<int64_t>(), 300) << text;
    ASSERT_TRUE(j.contains("tag") && j["tag"].is_string()) << text;
    const std::string tag = j["tag"];
    EXPECT_TRUE(tag == "red" || tag == "green" || tag == "blue") << text;
  }
}

TEST(StructuredEngine, JsonObjectOutputsAreObjects) {
  Tiny t = LoadTiny();
  ASSERT_NE(t.grammar, nullptr);
  std::vector<GenerationRequest> reqs;
  for (uint64_t seed = 1; seed <= 6; ++seed) {
    GenerationRequest r = Constrained({.kind = Kind::kJsonObject, .any_whitespace = false}, seed);
    r.sampling.max_tokens = 400;
    reqs.push_back(r);
  }
  for (const auto& r : RunAll(t, std::move(reqs))) {
    ASSERT_TRUE(r.ok()) << r.status();
    // A random model may nest or ramble past any budget; what it finished
    // must parse, and what it did not must be a cut object.
    const std::string text = Text(t, *r);
    if (r->finish_reason == FinishReason::kStop) {
      const auto j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
      EXPECT_TRUE(j.is_object()) << text;
    } else {
      EXPECT_EQ(r->finish_reason, FinishReason::kLength);
      EXPECT_TRUE(text.starts_with("{")) << text;
    }
  }
}

TEST(StructuredEngine, RegexAndChoiceOutputsAreInTheLanguage) {
  Tiny t = LoadTiny();
  ASSERT_NE(t.grammar, nullptr);
  const std::string regex = "[ab]{2,4}c|x(yz)*";
  const std::vector<std::string> choices = {"alpha", "beta", "be", "\"quoted\"", "caf\xc3\xa9"};
  std::vector<GenerationRequest> reqs;
  for (uint64_t seed = 1; seed <= 16; ++seed) {
    // With ignore_eos the grammar's end alone finishes the request.
    reqs.push_back(Constrained({.kind = Kind::kRegex, .spec = regex}, seed, /*ignore_eos=*/seed % 2 == 0));
    reqs.push_back(Constrained({.kind = Kind::kChoice, .choices = choices}, 100 + seed, seed % 2 == 1));
  }
  std::set<std::string> seen_choices;
  auto results = RunAll(t, std::move(reqs));
  for (size_t i = 0; i < results.size(); ++i) {
    ASSERT_TRUE(results[i].ok()) << results[i].status();
    EXPECT_EQ(results[i]->finish_reason, FinishReason::kStop);
    const std::string text = Text(t, *results[i]);
    if (i % 2 == 0) {
      EXPECT_TRUE(std::regex_match(text, std::regex(regex))) << text;
    } else {
      EXPECT_NE(std::find(choices.begin(), choices.end(), text), choices.end()) << text;
      seen_choices.insert(text);
    }
  }
  EXPECT_GE(seen_choices.size(), 2u) << "temperature 1 over 16 seeds picks more than one choice";
}

// start_after (a reasoning end marker): a logit_bias forces the marker
// first, a token the regex refuses, so the grammar did not hold before it;
// the text after it is in the regex's language.
TEST(StructuredEngine, TheGrammarHoldsAfterStartAfter) {
  Tiny t = LoadTiny();
  ASSERT_NE(t.grammar, nullptr);
  const std::string regex = "[ab]{2,4}c|x(yz)*";
  const std::vector<int32_t> marker = t.tokenizer->Encode("#", false);
  ASSERT_EQ(marker.size(), 1u);
  std::vector<GenerationRequest> reqs;
  for (uint64_t seed = 1; seed <= 8; ++seed) {
    GenerationRequest r = Constrained({.kind = Kind::kRegex, .spec = regex, .start_after = {marker[0]}}, seed);
    r.sampling.logit_bias = {{marker[0], 100.0}};
    reqs.push_back(std::move(r));
  }
  auto results = RunAll(t, std::move(reqs));
  for (auto& result : results) {
    ASSERT_TRUE(result.ok()) << result.status();
    ASSERT_FALSE(result->tokens.empty());
    EXPECT_EQ(result->tokens[0], marker[0]);
    EXPECT_EQ(result->finish_reason, FinishReason::kStop);
    GenerationOutput after = *result;
    after.tokens.erase(after.tokens.begin());
    const std::string text = Text(t, after);
    EXPECT_TRUE(std::regex_match(text, std::regex(regex))) << text;
  }
}

TEST(StructuredEngine, UnconstrainedRequestsBesideConstrainedOnesAreUnchanged) {
  Tiny t = LoadTiny();
  ASSERT_NE(t.grammar, nullptr);
  std::vector<GenerationRequest> plain, mixed;
  for (uint32_t i = 0; i < 4; ++i) {
    GenerationRequest g{RandomPrompt(9, 50 + i), SamplingParams{.max_tokens = 12, .ignore_eos = true}};
    GenerationRequest s{RandomPrompt(6, 60 + i),
                        SamplingParams{.temperature = 1.0, .seed = i, .max_tokens = 12, .ignore_eos = true}};
    plain.push_back(g);
    plain.push_back(s);
    mixed.push_back(g);
    mixed.push_back(s);
    mixed.push_back(Constrained({.kind = Kind::kRegex, .spec = "[ab]{2,4}c"}, 70 + i));
  }
  auto a = RunAll(t, plain);
  auto b = RunAll(t, mixed);
  for (size_t i = 0; i < plain.size(); ++i) {
    ASSERT_TRUE(a[i].ok() && b[i + i / 2].ok());
    EXPECT_EQ(a[i]->tokens, b[i + i / 2]->tokens) << "request " << i;
  }
}

TEST(StructuredEngine, BadOrUnbackedConstraintsAreInvalidArgument) {
  Tiny t = LoadTiny();
  ASSERT_NE(t.grammar, nullptr);
  auto engine =
      std::move(Engine::Create(*t.model, EngineConfig{.cache_budget_bytes = 16 << 20, .grammar = t.grammar})).value();
  const std::vector<std::pair<StructuredOutput, std::string>> bad = {
      {{.kind = Kind::kJsonSchema, .spec = "{not json"}, "json_schema"},
      {{.kind = Kind::kRegex, .spec = "[ab"}, "regex"},
      {{.kind = Kind::kChoice}, "choice"},
  };
  for (const auto& [so, name] : bad) {
    auto id = engine->Add(Constrained(so, 1));
    ASSERT_FALSE(id.ok()) << name;
    EXPECT_EQ(id.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(id.status().message().find(name), std::string::npos) << id.status();
  }
  EXPECT_FALSE(engine->HasWork()) << "a refused request changes nothing";

  auto bare = std::move(Engine::Create(*t.model, EngineConfig{.cache_budget_bytes = 16 << 20})).value();
  auto id = bare->Add(Constrained({.kind = Kind::kRegex, .spec = "a"}, 1));
  ASSERT_FALSE(id.ok());
  EXPECT_EQ(id.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(id.status().message().find("tokenizer"), std::string::npos) << id.status();
}

// A preempted request is recomputed from its prompt and output; its
// grammar, in the sampler, is not fed again: the same tokens as without
// preemption, still in the language.
TEST(StructuredEngine, PreemptionKeepsTheGrammarState) {
  Tiny t = LoadTiny();
  ASSERT_NE(t.grammar, nullptr);
  const std::string regex = "[a-z]{80,100}";
  std::vector<GenerationRequest> reqs;
  for (uint32_t i = 0; i < 4; ++i) {
    reqs.push_back({RandomPrompt(16, 40 + i), SamplingParams{.temperature = 1.0,
                                                             .seed = i,
                                                             .max_tokens = 48,
                                                             .ignore_eos = true,
                                                             .structured = {.kind = Kind::kRegex, .spec = regex}}});
  }
  auto run = [&](int64_t budget, int64_t* preemptions) {
    auto engine =
        std::move(Engine::Create(*t.model,
                                 EngineConfig{.cache_budget_bytes = budget, .block_size = 16, .grammar = t.grammar}))
            .value();
    auto out = engine->Generate(reqs);
    *preemptions = engine->stats().preemptions;
    return out;
  };
  const int64_t block_bytes = t.model->CacheConfig(0, 16).block_bytes();
  int64_t free_preemptions = 0, tight_preemptions = 0;
  const auto free_run = run(16 << 20, &free_preemptions);
  const auto tight = run(8 * block_bytes, &tight_preemptions);
  EXPECT_EQ(free_preemptions, 0);
  EXPECT_GT(tight_preemptions, 0) << "the cache was meant to run out";
  for (size_t i = 0; i < reqs.size(); ++i) {
    ASSERT_TRUE(free_run[i].ok() && tight[i].ok());
    EXPECT_EQ(tight[i]->tokens, free_run[i]->tokens) << "request " << i;
    EXPECT_EQ(tight[i]->finish_reason, FinishReason::kStop);
    EXPECT_TRUE(std::regex_match(Text(t, *tight[i]), std::regex(regex))) << Text(t, *tight[i]);
  }
}

// The grammar compiles off the step loop: a structured request cancelled
// while it may still be compiling ends cancelled, and one queued behind it
// and a plain one still finish.
TEST(StructuredEngine, CancelWhileTheGrammarCompiles) {
  Tiny t = LoadTiny();
  ASSERT_NE(t.grammar, nullptr);
  auto engine =
      std::move(Engine::Create(*t.model, EngineConfig{.cache_budget_bytes = 16 << 20, .grammar = t.grammar})).value();
  const StructuredOutput so{.kind = Kind::kJsonSchema, .spec = kSchema, .any_whitespace = false};
  const int64_t cancelled = engine->Add(Constrained(so, 1)).value();
  const int64_t kept = engine->Add(Constrained(so, 2)).value();
  const int64_t plain = engine->Add({RandomPrompt(4, 9), SamplingParams{.max_tokens = 5, .ignore_eos = true}}).value();
  ASSERT_TRUE(engine->Cancel(cancelled).ok());
  while (engine->HasWork()) ASSERT_TRUE(engine->Step().ok());
  EXPECT_EQ(engine->TakeOutput(cancelled)->finish_reason, FinishReason::kCancelled);
  auto out = engine->TakeOutput(kept);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(out->finish_reason, FinishReason::kStop);
  EXPECT_TRUE(nlohmann::json::parse(Text(t, *out), nullptr, false).is_object()) << Text(t, *out);
  EXPECT_EQ(engine->TakeOutput(plain)->tokens.size(), 5u);
}

}  // namespace
}  // namespace mlarun
