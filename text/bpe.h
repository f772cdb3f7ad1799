// The byte-level BPE model of the tokenizer (tokenizers' models::bpe::BPE
// with byte_fallback false, no dropout, no subword prefix or suffix): a
// vocabulary of byte-level strings ("Ġthe"), merges ranked by their order in
// tokenizer.json, and the encoding of one pre-tokenized piece.
//
// Merging: the piece's bytes become one symbol each (the vocabulary id of the
// byte's character in the byte map), then the adjacent pair of lowest rank,
// leftmost among equals, is merged until no pair has a rank (the result
// tokenizers' heap-based merge_word gives). Short words scan linearly; long
// ones use a heap.
//
// Thread-safe after Init: the word cache (text/word_cache.h, keyed by the
// piece's raw bytes) is this Bpe's own, shared by the threads that encode
// with it and bounded in bytes however many they are.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "base/status.h"
#include "text/word_cache.h"

namespace mlarun::text {

// GPT-2's byte map: each byte's stand-in character, and back.
struct ByteMap {
  // The UTF-8 of byte b's character.
  std::string chars[256];
  // Code point -> byte, -1 where the code point stands for no byte
  // (code points above 323 stand for none).
  int16_t byte_of[324];
  static const ByteMap& Get();
};

// What tokenizers' ByteLevel decoder makes of one token: its characters as
// bytes when every one is in the byte map, otherwise the token's own UTF-8.
std::string ByteLevelDecode(std::string_view token);
// The byte-level form of raw bytes ("the cat" -> "theĠcat").
void ByteLevelEncode(std::string_view bytes, std::string* out);

class Bpe {
 public:
  // `word_cache_bytes`: the word cache's cap (0: no cache).
  explicit Bpe(size_t word_cache_bytes = WordCache::kDefaultCapBytes);
  ~Bpe();
  // INVALID_ARGUMENT for a merge whose parts or result are not in `vocab`
  // (named by its index).
  Status Init(const std::vector<std::pair<std::string, int32_t>>& vocab,
              const std::vector<std::pair<std::string, std::string>>& merges, bool ignore_merges,
              const std::optional<std::string>& unk_token);

  std::optional<int32_t> TokenToId(std::string_view token) const;
  // Appends the ids of one piece (raw bytes, before the byte map).
  void EncodeWord(std::string_view piece, std::vector<int32_t>* ids) const;
  const WordCache& word_cache() const { return *cache_; }

 private:
  struct Merge {
    int32_t rank;
    int32_t id;
  };
  // Open addressing over (left id, right id); kEmpty marks a free slot.
  struct MergeSlot {
    uint64_t key;
    Merge merge;
  };
  static constexpr uint64_t kEmpty = ~uint64_t{0};
  static uint64_t Key(int32_t a, int32_t b) { return (uint64_t(uint32_t(a)) << 32) | uint32_t(b); }
  const Merge* FindMerge(int32_t a, int32_t b) const {
    const uint64_t key = Key(a, b);
    size_t i = (key * 0x9E3779B97F4A7C15ull) >> shift_;
    while (true) {
      const MergeSlot& s = merge_table_[i];
      if (s.key == key) return &s.merge;
      if (s.key == kEmpty) return nullptr;
      i = (i + 1) & mask_;
    }
  }
  void InsertMerge(int32_t a, int32_t b, Merge m);
  void MergeWord(std::string_view piece, std::vector<int32_t>* ids) const;

  struct StringHash {
    using is_transparent = void;
    size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
  };
  std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>> vocab_;
  int32_t byte_id_[256];  // byte -> id of its character, -1 when missing
  std::vector<MergeSlot> merge_table_;
  size_t mask_ = 0;
  int shift_ = 64;
  bool ignore_merges_ = false;
  int32_t unk_id_ = -1;
  std::unique_ptr<WordCache> cache_;
};

}  // namespace mlarun::text
