// The BPE word cache: ids with the cache off, cold, warm, after evictions
// and under concurrent threads, all against a plain merge loop written here
// over the bpe6k fixture; and the cap on its bytes.
#include "text/word_cache.h"

#include <gtest/gtest.h>

#include <climits>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <thread>

#include "text/bpe.h"

namespace mlarun::text {
namespace {

using nlohmann::json;

// The fixture's model, and an independent byte-level BPE over it: symbols as
// strings, the lowest-ranked adjacent pair (leftmost among equals) merged
// until none has a rank.
struct Model {
  std::vector<std::pair<std::string, int32_t>> vocab;
  std::vector<std::pair<std::string, std::string>> merges;
  std::map<std::string, int32_t> id_of;
  std::map<std::pair<std::string, std::string>, int32_t> rank;
  std::string byte_char[256];
  std::map<std::string, unsigned char> byte_of_char;

  static const Model& Get() {
    static const Model m = Load();
    return m;
  }

  static Model Load() {
    Model m;
    std::ifstream f(std::string(MLARUN_FIXTURES_DIR) + "/bpe6k/tokenizer.json");
    std::stringstream ss;
    ss << f.rdbuf();
    const json j = json::parse(ss.str())["model"];
    for (const auto& [s, id] : j["vocab"].items()) {
      m.vocab.emplace_back(s, id.get<int32_t>());
      m.id_of[s] = id.get<int32_t>();
    }
    for (const json& mg : j["merges"]) {
      std::pair<std::string, std::string> p;
      if (mg.is_string()) {
        const std::string s = mg.get<std::string>();
        p = {s.substr(0, s.find(' ')), s.substr(s.find(' ') + 1)};
      } else {
        p = {mg[0].get<std::string>(), mg[1].get<std::string>()};
      }
      m.rank.emplace(p, int32_t(m.merges.size()));
      m.merges.push_back(p);
    }
    // GPT-2's byte map: printable Latin-1 bytes stand for themselves, the
    // rest for U+0100 onwards in byte order.
    int extra = 0;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      const unsigned cp = printable ? unsigned(b) : 256u + unsigned(extra++);
      std::string& s = m.byte_char[b];
      if (cp < 0x80) {
        s = std::string(1, char(cp));
      } else {
        s = {char(0xC0 | (cp >> 6)), char(0x80 | (cp & 0x3F))};
      }
      m.byte_of_char[s] = (unsigned char)b;
    }
    return m;
  }

  std::vector<int32_t> Reference(std::string_view piece) const {
    std::vector<std::string> syms;
    for (unsigned char b : piece)
      if (id_of.count(byte_char[b])) syms.push_back(byte_char[b]);
    while (syms.size() > 1) {
      int32_t best = INT32_MAX;
      size_t at = 0;
      for (size_t i = 0; i + 1 < syms.size(); ++i) {
        auto it = rank.find({syms[i], syms[i + 1]});
        if (it != rank.end() && it->second < best) {
          best = it->second;
          at = i;
        }
      }
      if (best == INT32_MAX) break;
      syms[at] += syms[at + 1];
      syms.erase(syms.begin() + at + 1);
    }
    std::vector<int32_t> ids;
    for (const std::string& s : syms) ids.push_back(id_of.at(s));
    return ids;
  }

  // The raw bytes of a vocabulary token ("Ġthe" -> " the"); "" for one
  // outside the byte map (the special tokens).
  std::string Bytes(const std::string& token) const {
    std::string out;
    for (size_t i = 0; i < token.size();) {
      const unsigned char lead = static_cast<unsigned char>(token[i]);
      const size_t len = lead < 0x80 ? 1 : lead < 0xE0 ? 2 : lead < 0xF0 ? 3 : 4;
      auto it = byte_of_char.find(token.substr(i, len));
      if (it == byte_of_char.end()) return "";
      out.push_back(char(it->second));
      i += len;
    }
    return out;
  }
};

// Pieces such as the pre-tokenizer makes: one to four vocabulary tokens, now
// and then random bytes among them; at most `max_bytes` long.
std::vector<std::string> RandomWords(size_t count, uint32_t seed, size_t max_bytes = 64) {
  const Model& m = Model::Get();
  std::mt19937 rng(seed);
  std::vector<std::string> words;
  while (words.size() < count) {
    std::string w;
    for (int k = 1 + int(rng() % 4); k > 0; --k) {
      if (rng() % 5 == 0) {
        for (int n = 1 + int(rng() % 3); n > 0; --n) w.push_back(char(rng() % 256));
      } else {
        w += m.Bytes(m.vocab[rng() % m.vocab.size()].first);
      }
    }
    if (w.size() >= 2 && w.size() <= max_bytes) words.push_back(w);
  }
  return words;
}

std::unique_ptr<Bpe> MakeBpe(size_t cache_bytes) {
  const Model& m = Model::Get();
  auto bpe = std::make_unique<Bpe>(cache_bytes);
  const Status s = bpe->Init(m.vocab, m.merges, false, std::nullopt);
  EXPECT_TRUE(s.ok()) << s;
  return bpe;
}

std::vector<int32_t> Encode(const Bpe& bpe, std::string_view word) {
  std::vector<int32_t> ids = {-7};  // EncodeWord appends: what was there stays
  bpe.EncodeWord(word, &ids);
  EXPECT_EQ(ids.front(), -7);
  return std::vector<int32_t>(ids.begin() + 1, ids.end());
}

TEST(WordCache, IdsEqualReferenceOffColdWarmAndAfterEvictions) {
  const Model& m = Model::Get();
  // 3000 distinct words, some of them longer than the cache keeps.
  std::vector<std::string> words = RandomWords(2900, 1);
  for (const std::string& w : RandomWords(100, 2, 600))
    if (w.size() > WordCache::kMaxWordBytes) words.push_back(w);
  std::vector<std::vector<int32_t>> want;
  for (const std::string& w : words) want.push_back(m.Reference(w));

  auto off = MakeBpe(0);
  auto full = MakeBpe(WordCache::kDefaultCapBytes);
  auto small = MakeBpe(32 << 10);  // a few hundred entries: evicts all along
  EXPECT_EQ(off->word_cache().bytes(), 0u);
  std::mt19937 rng(3);
  for (int pass = 0; pass < 3; ++pass) {  // cold, then warm twice
    for (size_t i = 0; i < words.size(); ++i) {
      const size_t k = pass == 0 ? i : rng() % words.size();
      ASSERT_EQ(Encode(*off, words[k]), want[k]) << "off, pass " << pass << ", word " << k;
      ASSERT_EQ(Encode(*full, words[k]), want[k]) << "default cap, pass " << pass << ", word " << k;
      ASSERT_EQ(Encode(*small, words[k]), want[k]) << "32 KiB cap, pass " << pass << ", word " << k;
    }
  }
  EXPECT_EQ(off->word_cache().bytes(), 0u);
  EXPECT_GT(small->word_cache().evictions(), 10u);
  EXPECT_EQ(full->word_cache().evictions(), 0u);
  // Warm: every cacheable word is there, with its ids.
  for (size_t k = 0; k < words.size(); ++k) {
    std::vector<int32_t> ids;
    const bool found = full->word_cache().Find(words[k], WordCache::Hash(words[k]), &ids);
    EXPECT_EQ(found, words[k].size() <= WordCache::kMaxWordBytes) << k;
    if (found) {
      EXPECT_EQ(ids, want[k]) << k;
    }
  }
}

// Threads on one Bpe, each in its own order, while a small cap empties shards
// under their lookups: the ids of one thread with no cache, every time.
TEST(WordCache, ConcurrentThreadsGiveTheIdsOfOneThread) {
  const std::vector<std::string> words = RandomWords(4000, 4);
  auto off = MakeBpe(0);
  std::vector<std::vector<int32_t>> want;
  for (const std::string& w : words) want.push_back(Encode(*off, w));
  for (size_t cap : {size_t{48} << 10, WordCache::kDefaultCapBytes}) {
    auto bpe = MakeBpe(cap);
    constexpr int kThreads = 4;
    std::vector<size_t> mismatches(kThreads, 0);
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t)
      threads.emplace_back([&, t] {
        std::mt19937 rng(100 + t);
        for (int i = 0; i < 40000; ++i) {
          const size_t k = rng() % words.size();
          std::vector<int32_t> ids;
          bpe->EncodeWord(words[k], &ids);
          if (ids != want[k]) ++mismatches[t];
        }
      });
    for (std::thread& th : threads) th.join();
    for (int t = 0; t < kThreads; ++t) EXPECT_EQ(mismatches[t], 0u) << "cap " << cap << ", thread " << t;
    if (cap < WordCache::kDefaultCapBytes) {
      EXPECT_GT(bpe->word_cache().evictions(), 10u);
    }
  }
}

// Many distinct words through caches of several caps: the bytes stay under
// the cap, a lookup gives the inserted ids or nothing, and what was inserted
// last is there.
TEST(WordCache, StaysUnderItsCap) {
  std::mt19937 rng(9);
  for (size_t cap : {size_t{20} << 10, size_t{256} << 10, size_t{4} << 20, WordCache::kDefaultCapBytes}) {
    WordCache cache(cap);
    std::vector<std::string> keys;
    std::vector<std::vector<int32_t>> values;
    for (int i = 0; i < 400000; ++i) {
      std::string key(1 + rng() % 40, '\0');
      for (char& c : key) c = char(rng());
      key += std::to_string(i);  // distinct
      std::vector<int32_t> ids(1 + rng() % 12);
      for (int32_t& id : ids) id = int32_t(rng());
      cache.Insert(key, WordCache::Hash(key), ids);
      keys.push_back(std::move(key));
      values.push_back(std::move(ids));
      ASSERT_LE(cache.bytes(), cap) << "cap " << cap << " after " << i + 1 << " words";
    }
    EXPECT_GT(cache.bytes(), cap / 2) << cap;
    EXPECT_GT(cache.evictions(), 0u) << cap;
    size_t found = 0;
    for (size_t i = 0; i < keys.size(); i += 7) {
      std::vector<int32_t> ids = {1};
      if (cache.Find(keys[i], WordCache::Hash(keys[i]), &ids)) {
        ++found;
        ASSERT_EQ(std::vector<int32_t>(ids.begin() + 1, ids.end()), values[i]) << "cap " << cap << ", word " << i;
      } else {
        ASSERT_EQ(ids, std::vector<int32_t>{1});
      }
    }
    EXPECT_GT(found, 0u) << cap;
    std::vector<int32_t> last;
    ASSERT_TRUE(cache.Find(keys.back(), WordCache::Hash(keys.back()), &last)) << cap;
    EXPECT_EQ(last, values.back());
  }
  WordCache none(0);
  none.Insert("ab", WordCache::Hash("ab"), std::vector<int32_t>{1, 2});
  std::vector<int32_t> ids;
  EXPECT_FALSE(none.Find("ab", WordCache::Hash("ab"), &ids));
  EXPECT_EQ(none.bytes(), 0u);
}

}  // namespace
}  // namespace mlarun::text
