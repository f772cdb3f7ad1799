// runtime/grammar's token masks against a brute-force reference on the tiny
// model's tokenizer (configs/models/tiny-tokenizer, 512 byte-level tokens):
// for a language that can be listed, token t may follow the output so far
// iff that output's bytes plus t's are a prefix of some string of the
// language, and the EOS id iff the output is one of them.
#include "runtime/grammar/grammar.h"

#include <gtest/gtest.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <future>
#include <random>
#include <set>

#include "tests/test_paths.h"

namespace mlarun {
namespace {

std::unique_ptr<text::Tokenizer> TinyTokenizer() {
  auto t = text::Tokenizer::Load(ConfigPath("models/tiny-tokenizer"));
  EXPECT_TRUE(t.ok()) << t.status();
  return t.ok() ? std::move(t).value() : nullptr;
}

bool Allowed(std::span<const uint32_t> words, int64_t t) {
  return (words[static_cast<size_t>(t / 32)] >> (t % 32)) & 1u;
}

// Every string over {a, b} of length 2 to 4, then "c": [ab]{2,4}c.
std::vector<std::string> RegexLanguage() {
  std::vector<std::string> out;
  for (int n = 2; n <= 4; ++n)
    for (int bits = 0; bits < (1 << n); ++bits) {
      std::string s;
      for (int i = 0; i < n; ++i) s += (bits >> i) & 1 ? 'b' : 'a';
      out.push_back(s + "c");
    }
  return out;
}

// Walks random paths through `so`'s language: at each step the constraint's
// mask must equal the reference over the whole model vocabulary (which is
// wider than the tokenizer's: those ids are never allowed), then a random
// allowed token is taken. Returns how many steps were compared.
int64_t CompareWalks(const text::Tokenizer& tok, const StructuredOutput& so, const std::vector<std::string>& language,
                     uint32_t seed) {
  const int64_t eos = *tok.eos_id();
  const int64_t model_vocab = tok.vocab_size() + 40;
  const std::vector<int64_t> stops = {eos};
  auto compiler = GrammarCompiler::Create(tok, model_vocab, stops);
  EXPECT_TRUE(compiler.ok()) << compiler.status();
  if (!compiler.ok()) return 0;
  std::mt19937 rng(seed);
  int64_t steps = 0;
  for (int walk = 0; walk < 30; ++walk) {
    auto c = (*compiler)->Compile(so);
    EXPECT_TRUE(c.ok()) << c.status();
    if (!c.ok()) return steps;
    std::string out;
    std::vector<uint32_t> words(static_cast<size_t>((model_vocab + 31) / 32), 0xdeadbeefu);
    for (;;) {
      (*c)->FillAllowed(words);
      std::vector<int64_t> expected;
      for (int64_t t = 0; t < model_vocab; ++t) {
        bool want = false;
        if (t == eos) {
          want = std::find(language.begin(), language.end(), out) != language.end();
        } else if (t < tok.vocab_size() && !tok.IsSpecial(static_cast<int32_t>(t))) {
          const std::string bytes = tok.TokenBytes(static_cast<int32_t>(t), false);
          const std::string next = out + bytes;
          want = !bytes.empty() && std::any_of(language.begin(), language.end(),
                                               [&](const std::string& s) { return s.starts_with(next); });
        }
        EXPECT_EQ(Allowed(words, t), want) << "token " << t << " after '" << out << "'";
        if (want) expected.push_back(t);
      }
      ++steps;
      if (expected.empty()) {
        ADD_FAILURE() << "nothing allowed after '" << out << "'";
        break;
      }
      const int64_t t = expected[std::uniform_int_distribution<size_t>(0, expected.size() - 1)(rng)];
      EXPECT_FALSE((*c)->terminated());
      (*c)->Accept(t);
      if (t == eos) break;
      out += tok.TokenBytes(static_cast<int32_t>(t), false);
    }
    EXPECT_TRUE((*c)->terminated()) << "after '" << out << "' and EOS";
  }
  return steps;
}

TEST(Grammar, ChoiceMaskMatchesBruteForce) {
  auto tok = TinyTokenizer();
  ASSERT_NE(tok, nullptr);
  // Escaping (a quote, a backslash, a newline), a choice that is a prefix of
  // another, and a character of two UTF-8 bytes.
  const std::vector<std::string> choices = {"yes", "no", "nope", "say \"hi\"", "a\\b", "line\nbreak", "caf\xc3\xa9"};
  StructuredOutput so{.kind = StructuredOutput::Kind::kChoice, .choices = choices};
  EXPECT_GT(CompareWalks(*tok, so, choices, 1), 60);
}

TEST(Grammar, RegexMaskMatchesBruteForce) {
  auto tok = TinyTokenizer();
  ASSERT_NE(tok, nullptr);
  StructuredOutput so{.kind = StructuredOutput::Kind::kRegex, .spec = "[ab]{2,4}c"};
  EXPECT_GT(CompareWalks(*tok, so, RegexLanguage(), 2), 60);
}

TEST(Grammar, ChoiceGrammarEscapes) {
  const std::vector<std::string> choices = {"a\"b", "c\\d", "e\nf"};
  EXPECT_EQ(ChoiceGrammar(choices), "root ::= \"a\\\"b\" | \"c\\\\d\" | \"e\\u000af\"\n");
}

TEST(Grammar, BadSpecsAreInvalidArgumentNamingTheKind) {
  auto tok = TinyTokenizer();
  ASSERT_NE(tok, nullptr);
  const std::vector<int64_t> stops = {*tok->eos_id()};
  auto compiler = GrammarCompiler::Create(*tok, tok->vocab_size(), stops);
  ASSERT_TRUE(compiler.ok()) << compiler.status();
  using Kind = StructuredOutput::Kind;
  struct Case {
    StructuredOutput so;
    std::string names;
  };
  const std::vector<Case> cases = {
      {{.kind = Kind::kJsonSchema, .spec = "{\"type\": "}, "json_schema"},
      {{.kind = Kind::kJsonSchema, .spec = "{\"type\": \"no-such-type\"}"}, "json_schema"},
      {{.kind = Kind::kRegex, .spec = "(ab"}, "regex"},
      {{.kind = Kind::kChoice}, "choice"},
      {{.kind = Kind::kGrammar, .spec = "root ::= undefined_rule"}, "grammar"},
  };
  for (const Case& c : cases) {
    auto r = (*compiler)->Compile(c.so);
    ASSERT_FALSE(r.ok()) << c.names << " " << c.so.spec;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << r.status();
    EXPECT_NE(r.status().message().find(c.names), std::string::npos) << r.status();
    EXPECT_EQ(r.status().message().find(".cc:"), std::string::npos) << "no xgrammar source path: " << r.status();
    EXPECT_EQ((*compiler)->Check(c.so), r.status()) << "Check finds what Compile finds";
  }
  for (const StructuredOutput& good :
       {StructuredOutput{.kind = Kind::kJsonObject},
        StructuredOutput{.kind = Kind::kJsonSchema, .spec = "{\"type\": \"integer\"}"},
        StructuredOutput{.kind = Kind::kRegex, .spec = "a+"}, StructuredOutput{.kind = Kind::kChoice, .choices = {"x"}},
        StructuredOutput{.kind = Kind::kGrammar, .spec = "root ::= \"x\""}})
    EXPECT_TRUE((*compiler)->Check(good).ok()) << (*compiler)->Check(good);
}

TEST(Grammar, TokenizerWiderThanTheModelIsRefused) {
  auto tok = TinyTokenizer();
  ASSERT_NE(tok, nullptr);
  auto compiler = GrammarCompiler::Create(*tok, tok->vocab_size() - 1, {});
  ASSERT_FALSE(compiler.ok());
  EXPECT_EQ(compiler.status().code(), StatusCode::kInvalidArgument);
}

// The process's threads of that name, from /proc.
int ThreadsNamed(const std::string& name) {
  int n = 0;
  for (const auto& task : std::filesystem::directory_iterator("/proc/self/task")) {
    std::ifstream f(task.path() / "comm");
    std::string comm;
    if (std::getline(f, comm) && comm == name) ++n;
  }
  return n;
}

// Many compiles at once queue on the compiler's two threads instead of
// starting one each; a compile abandoned before its turn is skipped, the
// others compile, each to the constraint of its own request.
TEST(Grammar, CompilesQueueOnAFewThreadsAndAbandonedOnesAreSkipped) {
  auto tok = TinyTokenizer();
  ASSERT_NE(tok, nullptr);
  const std::vector<int64_t> stops = {*tok->eos_id()};
  auto compiler = GrammarCompiler::Create(*tok, tok->vocab_size(), stops);
  ASSERT_TRUE(compiler.ok()) << compiler.status();
  std::mt19937 rng(7);
  struct Asked {
    std::future<GrammarCompiler::Compiled> result;
    bool abandoned;
    std::string choice;
  };
  std::vector<Asked> asked;
  for (int i = 0; i < 64; ++i) {
    const bool abandoned = rng() % 3 == 0;
    const std::string choice = "c" + std::to_string(rng() % 1000);
    auto flag = std::make_shared<std::atomic<bool>>(abandoned);
    StructuredOutput so{.kind = StructuredOutput::Kind::kChoice, .choices = {choice}};
    asked.push_back({(*compiler)->CompileAsync(so, flag), abandoned, choice});
  }
  for (Asked& a : asked) {
    GrammarCompiler::Compiled c = a.result.get();
    if (a.abandoned) {
      EXPECT_EQ(c.status().code(), StatusCode::kCancelled) << c.status();
      continue;
    }
    ASSERT_TRUE(c.ok()) << c.status();
    // The constraint is this request's: the choice's first byte is allowed,
    // a byte no choice starts with is not.
    std::vector<uint32_t> words(static_cast<size_t>((tok->vocab_size() + 31) / 32), 0);
    (*c)->FillAllowed(words);
    auto allowed = [&](int64_t id) { return (words[static_cast<size_t>(id / 32)] >> (id % 32)) & 1u; };
    const std::vector<int32_t> first = tok->Encode("c", false);
    const std::vector<int32_t> other = tok->Encode("z", false);
    ASSERT_EQ(first.size(), 1u);
    ASSERT_EQ(other.size(), 1u);
    EXPECT_TRUE(allowed(first[0])) << a.choice;
    EXPECT_FALSE(allowed(other[0])) << a.choice;
  }
  // Every compile ran on the compiler's own threads, which stay; xgrammar's
  // helpers inside a compile (named after them) are gone once it ends.
  EXPECT_EQ(ThreadsNamed(GrammarCompiler::kCompileThreadName), GrammarCompiler::kCompileThreads);
}

}  // namespace
}  // namespace mlarun
