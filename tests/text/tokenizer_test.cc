// The tokenizer against Hugging Face tokenizers / transformers (fixtures made
// by tests/text/make_tokenizer_fixtures.py), the UTF-8 repair, streaming
// detokenization, stop strings, refusals, `mlarun tokenize`'s function.
#include "text/tokenizer.h"

#include <gtest/gtest.h>
#include <malloc.h>

#include <fstream>
#include <latch>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <thread>

#include "bench/tokenize_bench.h"
#include "launcher/tokenize/tokenize.h"
#include "tests/test_paths.h"
#include "text/pretokenize.h"
#include "text/utf8.h"

namespace mlarun::text {
namespace {

using nlohmann::json;

std::string Fixture(const std::string& rel) { return std::string(MLARUN_FIXTURES_DIR) + "/" + rel; }

std::string ReadAll(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  EXPECT_TRUE(f.good()) << path;
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

std::vector<json> ReadLines(const std::string& path) {
  std::vector<json> out;
  std::ifstream f(path);
  EXPECT_TRUE(f.good()) << path;
  std::string line;
  while (std::getline(f, line))
    if (!line.empty()) out.push_back(json::parse(line));
  return out;
}

std::string Unhex(const std::string& hex) {
  std::string out;
  for (size_t i = 0; i + 1 < hex.size(); i += 2) out.push_back(char(std::stoi(hex.substr(i, 2), nullptr, 16)));
  return out;
}

std::string Hex(std::string_view s) {
  static const char* d = "0123456789abcdef";
  std::string out;
  for (unsigned char c : s) {
    out.push_back(d[c >> 4]);
    out.push_back(d[c & 15]);
  }
  return out;
}

std::unique_ptr<Tokenizer> LoadOrDie(const std::string& path) {
  auto t = Tokenizer::Load(path);
  EXPECT_TRUE(t.ok()) << t.status();
  return t.ok() ? std::move(*t) : nullptr;
}

std::vector<int32_t> Ids(const json& j) { return j.get<std::vector<int32_t>>(); }

// ---- UTF-8 repair: Rust's from_utf8_lossy / Python's errors="replace".

TEST(Utf8, LossyReplacesMaximalSubparts) {
  const std::string r(utf8::kReplacement);
  EXPECT_EQ(utf8::Lossy("\xF0\x9F\x98"
                        "A"),
            r + "A");
  EXPECT_EQ(utf8::Lossy("\xED\xA0\x80"), r + r + r);
  EXPECT_EQ(utf8::Lossy("\xC0\x80"), r + r);
  EXPECT_EQ(utf8::Lossy("\xE2\x82"), r);
  EXPECT_EQ(utf8::Lossy("\xF4\x90\x80\x80"), r + r + r + r);
  EXPECT_EQ(utf8::Lossy("\xE0\x80\xAF"), r + r + r);
  EXPECT_EQ(utf8::Lossy("a\xFF"
                        "b\xC3"),
            "a" + r + "b" + r);
  EXPECT_EQ(utf8::Lossy("\xF0\x9F\x98\x80"), "\xF0\x9F\x98\x80");
  EXPECT_EQ(utf8::Lossy("\xF0\x9F\x98\x80\x80"), "\xF0\x9F\x98\x80" + r);
  EXPECT_TRUE(utf8::IsValid("h\xC3\xA9llo \xE4\xB8\xAD"));
  EXPECT_FALSE(utf8::IsValid("\xED\xA0\x80"));
}

TEST(Utf8, FinalPrefixHoldsOnlyAnIncompleteTail) {
  EXPECT_EQ(utf8::FinalPrefixLength("ab\xF0\x9F\x98"), 2u);
  EXPECT_EQ(utf8::FinalPrefixLength("ab\xF0\x9F"), 2u);
  EXPECT_EQ(utf8::FinalPrefixLength("ab\xF0"), 2u);
  EXPECT_EQ(utf8::FinalPrefixLength("ab\xF0\x9F\x98\x80"), 6u);
  EXPECT_EQ(utf8::FinalPrefixLength("ab\xED\xA0"), 4u);  // ED A0 can never complete
  EXPECT_EQ(utf8::FinalPrefixLength("ab\xC0"), 3u);
  EXPECT_EQ(utf8::FinalPrefixLength("\x80\x80"), 2u);
  EXPECT_EQ(utf8::FinalPrefixLength(""), 0u);
}

// ---- Against the fixtures.

class Fixtures : public ::testing::TestWithParam<std::string> {};

TEST_P(Fixtures, EncodeMatchesHf) {
  const std::string name = GetParam();
  auto t = LoadOrDie(name == "tiny" ? TinyYaml() : Fixture(name));
  ASSERT_NE(t, nullptr);
  const auto lines = ReadLines(Fixture(name + "_encode.jsonl"));
  ASSERT_GT(lines.size(), 100u);
  int roundtrips = 0;
  for (const json& l : lines) {
    const std::string bytes = Unhex(l["hex"].get<std::string>());
    const auto ids = Ids(l["ids"]);
    ASSERT_EQ(t->Encode(bytes, false), ids) << "hex " << l["hex"];
    ASSERT_EQ(t->Encode(bytes, true), Ids(l["ids_special"])) << "hex " << l["hex"];
    if (l["roundtrip"].get<bool>()) {
      ASSERT_EQ(t->Decode(ids, false), utf8::Lossy(bytes)) << "hex " << l["hex"];
      ++roundtrips;
    }
  }
  EXPECT_GT(roundtrips, int(lines.size()) * 9 / 10);
}

TEST_P(Fixtures, DecodeMatchesHf) {
  const std::string name = GetParam();
  auto t = LoadOrDie(name == "tiny" ? TinyYaml() : Fixture(name));
  ASSERT_NE(t, nullptr);
  for (const json& l : ReadLines(Fixture(name + "_decode.jsonl"))) {
    const auto ids = Ids(l["ids"]);
    ASSERT_EQ(Hex(t->Decode(ids, false)), Hex(l["text"].get<std::string>())) << l["ids"];
    ASSERT_EQ(Hex(t->Decode(ids, true)), Hex(l["text_skip"].get<std::string>())) << l["ids"];
  }
}

std::string Incremental(const Tokenizer& t, const std::vector<int32_t>& ids, bool skip) {
  IncrementalDecoder d(t, skip);
  std::string out;
  for (int32_t id : ids) {
    const std::string delta = d.Add(id);
    EXPECT_TRUE(utf8::IsValid(delta));
    out += delta;
  }
  return out + d.Finish();
}

TEST_P(Fixtures, IncrementalEqualsFullDecode) {
  const std::string name = GetParam();
  auto t = LoadOrDie(name == "tiny" ? TinyYaml() : Fixture(name));
  ASSERT_NE(t, nullptr);
  for (const json& l : ReadLines(Fixture(name + "_decode.jsonl"))) {
    const auto ids = Ids(l["ids"]);
    for (bool skip : {false, true}) ASSERT_EQ(Hex(Incremental(*t, ids, skip)), Hex(t->Decode(ids, skip))) << l["ids"];
  }
  for (const json& l : ReadLines(Fixture(name + "_encode.jsonl"))) {
    const auto ids = Ids(l["ids_special"]);
    for (bool skip : {false, true}) ASSERT_EQ(Incremental(*t, ids, skip), t->Decode(ids, skip));
  }
  std::mt19937 rng(7);
  std::uniform_int_distribution<int32_t> id(-3, int32_t(t->vocab_size()) + 3);
  for (int i = 0; i < 3000; ++i) {
    std::vector<int32_t> ids(rng() % 24);
    for (int32_t& x : ids) x = id(rng);
    for (bool skip : {false, true}) ASSERT_EQ(Hex(Incremental(*t, ids, skip)), Hex(t->Decode(ids, skip)));
  }
}

INSTANTIATE_TEST_SUITE_P(Tokenizers, Fixtures, ::testing::Values("bpe6k", "tiny"));

// The tiny tokenizer with each Split behavior, invert, a String pattern and
// ByteLevel's own prefix space and regex.
TEST(Tokenizer, PreTokenizerVariantsMatchHf) {
  const json base = json::parse(ReadAll(ConfigPath("models/tiny-tokenizer/tokenizer.json")));
  const auto variants = ReadLines(Fixture("tiny_variants.jsonl"));
  ASSERT_GE(variants.size(), 14u);
  for (const json& v : variants) {
    json j = base;
    j["pre_tokenizer"] = v["pre_tokenizer"];
    auto t = Tokenizer::FromJson(j.dump(), "");
    ASSERT_TRUE(t.ok()) << t.status() << " " << v["pre_tokenizer"];
    for (const json& c : v["cases"])
      ASSERT_EQ((*t)->Encode(Unhex(c["hex"].get<std::string>()), false), Ids(c["ids"]))
          << v["pre_tokenizer"] << " hex " << c["hex"];
  }
}

TEST(Tokenizer, TinyModelYaml) {
  auto t = LoadOrDie(TinyYaml());
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->vocab_size(), 512);
  EXPECT_EQ(t->bos_id(), 0);
  EXPECT_EQ(t->eos_id(), 1);
  EXPECT_EQ(t->bos_token(), "<｜begin▁of▁sentence｜>");
  EXPECT_EQ(t->eos_token(), "<｜end▁of▁sentence｜>");
  EXPECT_TRUE(t->IsSpecial(0));
  EXPECT_TRUE(t->IsSpecial(1));
  EXPECT_FALSE(t->IsSpecial(2));
  EXPECT_FALSE(t->chat_template().empty());
  EXPECT_EQ(t->TokenToId("<｜end▁of▁sentence｜>"), 1);
  EXPECT_EQ(t->IdToToken(1), "<｜end▁of▁sentence｜>");
  EXPECT_EQ(t->IdToToken(512), std::nullopt);
  EXPECT_EQ(t->IdToToken(-1), std::nullopt);
  const auto ids = t->Encode("hello world", true);
  ASSERT_FALSE(ids.empty());
  EXPECT_EQ(ids[0], 0);
  EXPECT_EQ(t->Decode(ids, true), "hello world");
  EXPECT_EQ(t->Decode(ids, false), "<｜begin▁of▁sentence｜>hello world");
  // The directory and the tokenizer.json itself load the same tokenizer.
  for (const std::string& p :
       {ConfigPath("models/tiny-tokenizer"), ConfigPath("models/tiny-tokenizer/tokenizer.json")}) {
    auto u = LoadOrDie(p);
    ASSERT_NE(u, nullptr);
    EXPECT_EQ(u->Encode("hello world", true), ids);
  }
}

TEST(Tokenizer, NotFound) {
  auto t = Tokenizer::Load(std::string(MLARUN_FIXTURES_DIR) + "/no-such-dir");
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), StatusCode::kNotFound);
  EXPECT_NE(t.status().message().find("no-such-dir: no such file or directory"), std::string::npos) << t.status();
  auto y = Tokenizer::Load(ConfigPath("models/deepseek-v3.yaml"));
  if (!y.ok()) {
    EXPECT_EQ(y.status().code(), StatusCode::kNotFound) << y.status();
  }
}

// Small variants of the tiny tokenizer.json, each with one unsupported part.
TEST(Tokenizer, RefusesUnsupportedComponentsByPath) {
  const json base = json::parse(ReadAll(ConfigPath("models/tiny-tokenizer/tokenizer.json")));
  struct Case {
    std::function<void(json&)> edit;
    std::string message;
  };
  const std::vector<Case> cases = {
      {[](json& j) {
         j["pre_tokenizer"]["pretokenizers"][1] = {{"type", "Metaspace"}};
       },
       "pre_tokenizer.pretokenizers[1].type 'Metaspace' is not supported"},
      {[](json& j) {
         j["pre_tokenizer"] = {{"type", "Whitespace"}};
       },
       "pre_tokenizer.type 'Whitespace' is not supported"},
      {[](json& j) { j["pre_tokenizer"]["pretokenizers"][0]["behavior"] = "Sideways"; },
       "pre_tokenizer.pretokenizers[0].behavior 'Sideways' is not supported"},
      {[](json& j) {
         j["pre_tokenizer"]["pretokenizers"][0]["pattern"] = {{"Regex", "(unclosed"}};
       },
       "pre_tokenizer.pretokenizers[0].pattern.Regex: the pattern does not compile"},
      {[](json& j) {
         auto bl = j["pre_tokenizer"]["pretokenizers"][3];
         j["pre_tokenizer"]["pretokenizers"] = json::array({bl, j["pre_tokenizer"]["pretokenizers"][0]});
       },
       "pre_tokenizer.pretokenizers[0]: ByteLevel is supported only as the last pre-tokenizer"},
      {[](json& j) { j["model"]["type"] = "WordPiece"; }, "model.type 'WordPiece' is not supported"},
      {[](json& j) { j["model"]["byte_fallback"] = true; }, "model.byte_fallback 'true' is not supported"},
      {[](json& j) { j["model"]["dropout"] = 0.1; }, "model.dropout '0.1' is not supported"},
      {[](json& j) { j["model"]["continuing_subword_prefix"] = "##"; },
       "model.continuing_subword_prefix '\"##\"' is not supported"},
      {[](json& j) { j["model"]["end_of_word_suffix"] = "</w>"; }, "model.end_of_word_suffix"},
      {[](json& j) {
         j["normalizer"] = {{"type", "NFC"}};
       },
       "normalizer.type 'NFC' is not supported"},
      {[](json& j) {
         j["normalizer"] = {{"type", "Sequence"}, {"normalizers", {{{"type", "Lowercase"}}}}};
       },
       "normalizer.normalizers[0].type 'Lowercase' is not supported"},
      {[](json& j) {
         j["post_processor"] = {{"type", "RobertaProcessing"}};
       },
       "post_processor.type 'RobertaProcessing' is not supported"},
      {[](json& j) {
         j["decoder"] = {{"type", "Metaspace"}};
       },
       "decoder.type 'Metaspace' is not supported"},
      {[](json& j) { j["decoder"] = nullptr; }, "decoder.type 'null' is not supported"},
      {[](json& j) { j["model"]["merges"][0] = "nospace"; }, "model.merges[0] 'nospace' is not 'a b'"},
      {[](json& j) {
         j["model"]["merges"][0] = json::array({"Ġ", "zzzz"});
       },
       "model.merges[0] 'Ġ zzzz': a part is not in"},
      {[](json& j) {
         j["truncation"] = {{"max_length", 8}};
       },
       "truncation"},
  };
  for (const Case& c : cases) {
    json j = base;
    c.edit(j);
    auto t = Tokenizer::FromJson(j.dump(), "");
    ASSERT_FALSE(t.ok()) << c.message;
    EXPECT_EQ(t.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(t.status().message().find(c.message), std::string::npos) << t.status() << "\nwanted: " << c.message;
  }
  EXPECT_FALSE(Tokenizer::FromJson("{not json", "").ok());
  EXPECT_FALSE(Tokenizer::FromJson(base.dump(), "[1,2").ok());
}

TEST(Tokenizer, MergesAsStringsEqualMergesAsPairs) {
  json j = json::parse(ReadAll(Fixture("bpe6k/tokenizer.json")));
  auto pairs = Tokenizer::FromJson(j.dump(), "");
  ASSERT_TRUE(pairs.ok()) << pairs.status();
  for (json& m : j["model"]["merges"]) m = m[0].get<std::string>() + " " + m[1].get<std::string>();
  auto strings = Tokenizer::FromJson(j.dump(), "");
  ASSERT_TRUE(strings.ok()) << strings.status();
  for (const json& l : ReadLines(Fixture("bpe6k_encode.jsonl"))) {
    const std::string bytes = Unhex(l["hex"].get<std::string>());
    ASSERT_EQ((*strings)->Encode(bytes, false), (*pairs)->Encode(bytes, false));
  }
}

TEST(Tokenizer, TemplateProcessingAndConfigFlags) {
  const std::string tj = ReadAll(ConfigPath("models/tiny-tokenizer/tokenizer.json"));
  json j = json::parse(tj);
  j["post_processor"] = json::parse(R"({"type": "TemplateProcessing",
      "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                 {"SpecialToken": {"id": "</s>", "type_id": 0}}],
      "pair": [], "special_tokens": {"<s>": {"id": "<s>", "ids": [0], "tokens": ["<s>"]},
                                     "</s>": {"id": "</s>", "ids": [1], "tokens": ["</s>"]}}})");
  auto t = Tokenizer::FromJson(j.dump(), "");
  ASSERT_TRUE(t.ok()) << t.status();
  const auto plain = (*t)->Encode("abc", false);
  auto with = (*t)->Encode("abc", true);
  ASSERT_EQ(with.size(), plain.size() + 2);
  EXPECT_EQ(with.front(), 0);
  EXPECT_EQ(with.back(), 1);
  // tokenizer_config.json's flags replace the template (transformers).
  auto u = Tokenizer::FromJson(j.dump(), R"({"add_bos_token": false, "add_eos_token": true,
      "bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>"})");
  ASSERT_TRUE(u.ok()) << u.status();
  with = (*u)->Encode("abc", true);
  ASSERT_EQ(with.size(), plain.size() + 1);
  EXPECT_EQ(with.back(), 1);
  auto bad = Tokenizer::FromJson(tj, R"({"add_bos_token": true, "bos_token": "<nope>"})");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("bos_token '<nope>' is not in the vocabulary"), std::string::npos);
  // Named chat templates: the one named default.
  auto n = Tokenizer::FromJson(tj, R"({"chat_template": [{"name": "tool_use", "template": "T"},
                                                         {"name": "default", "template": "D"}]})");
  ASSERT_TRUE(n.ok());
  EXPECT_EQ((*n)->chat_template(), "D");
}

TEST(Tokenizer, ConcurrentEncodeGivesIdenticalIds) {
  auto t = LoadOrDie(Fixture("bpe6k"));
  ASSERT_NE(t, nullptr);
  const auto lines = ReadLines(Fixture("bpe6k_encode.jsonl"));
  std::vector<std::string> texts;
  std::vector<std::vector<int32_t>> want;
  for (const json& l : lines) {
    texts.push_back(Unhex(l["hex"].get<std::string>()));
    want.push_back(Ids(l["ids_special"]));
  }
  std::vector<int> mismatches(4, 0);
  std::vector<std::thread> threads;
  for (int k = 0; k < 4; ++k) {
    threads.emplace_back([&, k] {
      for (int round = 0; round < 3; ++round)
        for (size_t i = 0; i < texts.size(); ++i) {
          const size_t idx = (i * (k + 1) + round * 7) % texts.size();
          if (t->Encode(texts[idx], true) != want[idx]) ++mismatches[k];
        }
    });
  }
  for (auto& th : threads) th.join();
  for (int k = 0; k < 4; ++k) EXPECT_EQ(mismatches[k], 0) << "thread " << k;
}

// Bytes the program has allocated and not freed, over all malloc arenas
// (glibc); 0 under a sanitizer's allocator.
int64_t HeapInUse() {
  const struct mallinfo2 mi = mallinfo2();
  return int64_t(mi.uordblks + mi.hblkhd);
}

// The word cache is the tokenizer's, not each thread's: 16 live threads that
// have each encoded 20,000 words of their own hold at most its cap (16 MiB)
// between them, where a cache per thread held more than 3 MiB each.
TEST(Tokenizer, WordCacheMemoryDoesNotGrowWithThreads) {
  if (HeapInUse() == 0) GTEST_SKIP() << "mallinfo2 does not see this allocator";
  auto t = LoadOrDie(Fixture("bpe6k"));
  ASSERT_NE(t, nullptr);
  constexpr int kThreads = 16;
  std::vector<std::string> texts(kThreads);
  std::mt19937 rng(21);
  for (std::string& text : texts)
    for (int w = 0; w < 20000; ++w) {
      text += ' ';
      for (int n = 3 + int(rng() % 8); n > 0; --n) text += char('a' + rng() % 26);
    }
  const int64_t before = HeapInUse();
  std::latch encoded(kThreads), measured(1);
  std::vector<std::thread> threads;
  for (int k = 0; k < kThreads; ++k)
    threads.emplace_back([&, k] {
      EXPECT_FALSE(t->Encode(texts[k], false).empty());
      encoded.count_down();
      measured.wait();  // alive, with what it keeps per thread, until measured
    });
  encoded.wait();
  const int64_t grown = HeapInUse() - before;
  measured.count_down();
  for (std::thread& th : threads) th.join();
  EXPECT_LT(grown, int64_t{20} << 20) << "heap grown by " << grown << " bytes with " << kThreads << " threads";
}

// After a huge input, the thread that encoded it keeps no large scratch: the
// symbols of a piece of a million letters, the runs of a Split over a million
// characters, the prefixed copy of a whole text, the segments around 70,000
// added tokens. (Each kept megabytes.)
TEST(Tokenizer, HugeInputLeavesNoLargeScratch) {
  if (HeapInUse() == 0) GTEST_SKIP() << "mallinfo2 does not see this allocator";
  const json base = json::parse(ReadAll(ConfigPath("models/tiny-tokenizer/tokenizer.json")));
  const json byte_level = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}};
  const json contiguous = {
      {"type", "Sequence"},
      {"pretokenizers",
       {{{"type", "Split"}, {"pattern", {{"Regex", "\\s+|[0-9]"}}}, {"behavior", "Contiguous"}, {"invert", false}},
        byte_level}}};
  const json prefix = {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"use_regex", true}};
  const struct {
    const char* what;
    json pre_tokenizer;  // null: the tiny tokenizer's own
    std::string unit;
  } cases[] = {{"one long piece", json(), "a"},
               {"Split runs", contiguous, "a1"},
               {"prefix space", prefix, "ab "},
               {"added tokens", json(), "<｜end▁of▁sentence｜>x"}};
  for (const auto& c : cases) {
    json j = base;
    if (!c.pre_tokenizer.is_null()) j["pre_tokenizer"] = c.pre_tokenizer;
    auto t = Tokenizer::FromJson(j.dump(), "");
    ASSERT_TRUE(t.ok()) << t.status() << " " << c.what;
    std::string huge;
    while (huge.size() < (size_t{1} << 20)) huge += c.unit;
    // The word cache and the regex state for these pieces are made here.
    for (int i = 0; i < 3; ++i) (*t)->Encode(huge.substr(0, 4096), true);
    const int64_t before = HeapInUse();
    EXPECT_GT((*t)->Encode(huge, true).size(), 1000u) << c.what;
    const int64_t kept = HeapInUse() - before;
    EXPECT_LT(kept, int64_t{256} << 10) << c.what << ": " << kept << " bytes kept after the call";
  }
}

// Without normalizer or stripping added tokens, a byte-level BPE gives any
// bytes back (as repaired UTF-8); long runs take the heap merge and the
// uncached path.
TEST(Tokenizer, RandomBytesAndLongRunsRoundTrip) {
  auto t = LoadOrDie(TinyYaml());
  ASSERT_NE(t, nullptr);
  std::mt19937 rng(5);
  for (int i = 0; i < 3000; ++i) {
    std::string s(rng() % 40, '\0');
    for (char& c : s) c = char(rng() % 4 == 0 ? rng() % 256 : 0x20 + rng() % 0x60);
    ASSERT_EQ(Hex(t->Decode(t->Encode(s, false), false)), Hex(utf8::Lossy(s))) << Hex(s);
  }
  for (const std::string unit : {" ", "a", "\xE4\xB8\xAD", "7", "\xF0\x9F\x98\x80", "ab ", "\r\n", "!?"}) {
    std::string s;
    while (s.size() < (1u << 20)) s += unit;
    ASSERT_EQ(t->Decode(t->Encode(s, true), true), s) << Hex(unit);
  }
}

// ---- StopMatcher against the definition: the text before the earliest
// occurrence of any stop string in the whole text.

std::pair<std::string, bool> StopReference(const std::string& text, const std::vector<std::string>& stops) {
  size_t best = std::string::npos;
  for (const std::string& s : stops)
    if (!s.empty()) best = std::min(best, text.find(s));
  if (best == std::string::npos) return {text, false};
  return {text.substr(0, best), true};
}

TEST(StopMatcher, MatchesReferenceOverRandomSplits) {
  std::mt19937 rng(11);
  const std::string alphabet = "abc \n";
  auto random_string = [&](size_t max_len) {
    std::string s(rng() % (max_len + 1), ' ');
    for (char& c : s) c = alphabet[rng() % alphabet.size()];
    return s;
  };
  for (int iter = 0; iter < 20000; ++iter) {
    std::vector<std::string> stops(1 + rng() % 3);
    for (auto& s : stops) s = random_string(4);
    const std::string text = random_string(30);
    const auto [want_text, want_stopped] = StopReference(text, stops);
    StopMatcher m(stops);
    std::string got;
    bool stopped = false;
    size_t pos = 0;
    while (pos < text.size() && !stopped) {
      const size_t len = std::min<size_t>(text.size() - pos, rng() % 5);
      auto r = m.Add(std::string_view(text).substr(pos, len));
      pos += len;
      got += r.text;
      stopped = r.stopped;
    }
    if (!stopped) {
      got += m.Finish();
      stopped = m.stopped();
    }
    ASSERT_EQ(got, want_text) << "text '" << text << "' stops[0] '" << stops[0] << "'";
    ASSERT_EQ(stopped, want_stopped) << "text '" << text << "'";
  }
}

TEST(StopMatcher, HoldsBackOnlyWhatMayStartAStop) {
  StopMatcher m({"</end>", ""});
  auto r = m.Add("hello </e");
  EXPECT_EQ(r.text, "hello ");
  EXPECT_FALSE(r.stopped);
  r = m.Add("x> more");
  EXPECT_EQ(r.text, "</ex> more");
  r = m.Add(" done</end> never");
  EXPECT_EQ(r.text, " done");
  EXPECT_TRUE(r.stopped);
  EXPECT_TRUE(m.stopped());
  EXPECT_EQ(m.Add("more").text, "");
  EXPECT_EQ(m.Finish(), "");
  StopMatcher none({});
  EXPECT_EQ(none.Add("abc").text, "abc");
  EXPECT_EQ(none.Finish(), "");
}

// A longer stop string that starts earlier wins over a shorter complete one.
TEST(StopMatcher, EarliestStartWins) {
  StopMatcher m({"abcd", "bc"});
  auto r = m.Add("xabc");
  EXPECT_EQ(r.text, "x");
  EXPECT_FALSE(r.stopped);
  r = m.Add("d");
  EXPECT_EQ(r.text, "");
  EXPECT_TRUE(r.stopped);
  StopMatcher n({"abcd", "bc"});
  EXPECT_EQ(n.Add("xabc").text, "x");
  EXPECT_EQ(n.Add("e").text, "a");
  EXPECT_TRUE(n.stopped());
}

// ---- mlarun tokenize.

TEST(TokenizeCli, EncodesAndDecodesLineByLine) {
  auto t = LoadOrDie(TinyYaml());
  ASSERT_NE(t, nullptr);
  std::istringstream in("\"hello world\"\nnot json\n\"\\u4e2d\\u6587\"\n");
  std::ostringstream out, err;
  EXPECT_EQ(RunTokenize({.model = TinyYaml()}, in, out, err), 1);
  std::istringstream lines(out.str());
  std::string l1, l2, l3;
  std::getline(lines, l1);
  std::getline(lines, l2);
  std::getline(lines, l3);
  EXPECT_EQ(json::parse(l1).get<std::vector<int32_t>>(), t->Encode("hello world", true));
  EXPECT_NE(l2.find("line 2"), std::string::npos) << l2;
  EXPECT_TRUE(json::parse(l2).contains("error"));
  EXPECT_EQ(json::parse(l3).get<std::vector<int32_t>>(), t->Encode("中文", true));

  std::istringstream din(json(t->Encode("hello world", true)).dump() + "\n[1, \"x\"]\n");
  std::ostringstream dout;
  EXPECT_EQ(RunTokenize({.model = TinyYaml(), .decode = true, .skip_special_tokens = true}, din, dout, err), 1);
  std::istringstream dlines(dout.str());
  std::getline(dlines, l1);
  std::getline(dlines, l2);
  EXPECT_EQ(json::parse(l1).get<std::string>(), "hello world");
  EXPECT_NE(l2.find("line 2"), std::string::npos);

  std::istringstream ok("\"a\"\n");
  std::ostringstream okout;
  EXPECT_EQ(RunTokenize({.model = TinyYaml(), .add_special_tokens = false}, ok, okout, err), 0);
  EXPECT_EQ(okout.str(), json(t->Encode("a", false)).dump() + "\n");

  std::istringstream none;
  std::ostringstream err2;
  EXPECT_EQ(RunTokenize({.model = "/nonexistent"}, none, okout, err2), 2);
  EXPECT_NE(err2.str().find("/nonexistent: no such file or directory"), std::string::npos) << err2.str();
}

TEST(TokenizeCli, Bench) {
  const std::string path = ::testing::TempDir() + "/tokenize_bench.txt";
  {
    std::ofstream f(path, std::ios::binary);
    for (int i = 0; i < 200; ++i) f << "Line " << i << ": the quick brown fox, 中文 and 😀.\n";
  }
  for (const std::string& mode : {std::string("whole"), std::string("lines")}) {
    std::ostringstream out, err;
    ASSERT_EQ(
        RunTokenizeBench({.model = TinyYaml(), .text_file = path, .mode = mode, .runs = 3, .json = true}, out, err), 0)
        << err.str();
    const json r = json::parse(out.str());
    EXPECT_EQ(r["bytes"].get<size_t>(), ReadAll(path).size());
    EXPECT_GT(r["tokens"].get<size_t>(), 0u);
    EXPECT_GT(r["tokens_per_s"].get<double>(), 0);
    EXPECT_EQ(r["runs_s"].size(), 3u);
  }
  // Two threads: twice the bytes and tokens of one.
  std::ostringstream one, two, err;
  ASSERT_EQ(RunTokenizeBench({.model = TinyYaml(), .text_file = path, .runs = 1, .json = true}, one, err), 0);
  ASSERT_EQ(RunTokenizeBench({.model = TinyYaml(), .text_file = path, .runs = 1, .threads = 2, .json = true}, two, err),
            0);
  const json r1 = json::parse(one.str()), r2 = json::parse(two.str());
  EXPECT_EQ(r2["threads"].get<int>(), 2);
  EXPECT_EQ(r2["bytes"].get<size_t>(), 2 * r1["bytes"].get<size_t>());
  EXPECT_EQ(r2["tokens"].get<size_t>(), 2 * r1["tokens"].get<size_t>());

  std::ostringstream out;
  EXPECT_EQ(RunTokenizeBench({.model = TinyYaml(), .text_file = path + ".missing"}, out, err), 2);
  std::ostringstream bad_out, bad_err;
  EXPECT_EQ(RunTokenizeBench({.model = TinyYaml(), .text_file = path, .threads = 0}, bad_out, bad_err), 2);
  EXPECT_NE(bad_err.str().find("threads"), std::string::npos) << bad_err.str();
}

// ---- Unicode classes as tokenizers' tables have them (Unicode 16.0) ----
// tests/text/fixtures/unicode_classes.jsonl (make_unicode_fixture.py):
// characters that Unicode 15.0 to 16.0 assigned or moved (U+1C89, U+2429,
// U+1171E among them) and others, as tokenizers' regex engine matches them.

TEST(UnicodeClasses, EachClassMatchesWhatTokenizersMatches) {
  const auto lines = ReadLines(Fixture("unicode_classes.jsonl"));
  ASSERT_GT(lines.size(), 10u);
  std::vector<std::string> chars;
  for (const json& cp : lines[0]["codepoints"]) {
    chars.emplace_back();
    utf8::Append(cp.get<char32_t>(), &chars.back());
  }
  int patterns = 0;
  for (const json& l : lines) {
    if (!l.contains("matches")) continue;
    const std::string pattern = l["pattern"];
    auto re = Regex::Compile(pattern, false, "test");
    ASSERT_TRUE(re.ok()) << pattern << ": " << re.status().ToString();
    const std::string want = l["matches"];
    ASSERT_EQ(want.size(), chars.size());
    for (size_t i = 0; i < chars.size(); ++i) {
      bool whole = false;
      (*re)->ForEachMatch(chars[i], [&](size_t a, size_t b) { whole = whole || (a == 0 && b == chars[i].size()); });
      EXPECT_EQ(whole, want[i] == '1') << pattern << " U+" << std::hex << lines[0]["codepoints"][i].get<uint32_t>();
    }
    ++patterns;
  }
  EXPECT_GE(patterns, 17);
}

TEST(UnicodeClasses, PreTokenizerSplitsAsTokenizers) {
  int cases = 0;
  for (const json& l : ReadLines(Fixture("unicode_classes.jsonl"))) {
    if (!l.contains("pieces")) continue;
    auto re = Regex::Compile(l["pattern"].get<std::string>(), false, "test");
    ASSERT_TRUE(re.ok()) << re.status().ToString();
    const std::string text = Unhex(l["hex"]);
    // Split(isolated): the matches and the gaps between them, in order.
    std::vector<std::string> pieces;
    size_t at = 0;
    (*re)->ForEachMatch(text, [&](size_t a, size_t b) {
      if (a > at) pieces.push_back(text.substr(at, a - at));
      pieces.push_back(text.substr(a, b - a));
      at = b;
    });
    if (at < text.size()) pieces.push_back(text.substr(at));
    EXPECT_EQ(pieces, l["pieces"].get<std::vector<std::string>>()) << l["pattern"] << " hex " << l["hex"];
    ++cases;
  }
  EXPECT_GE(cases, 100);
}

}  // namespace
}  // namespace mlarun::text
