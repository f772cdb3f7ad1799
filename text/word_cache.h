// The BPE word cache: a piece's raw bytes -> its token ids, one per Bpe,
// shared by every thread that encodes with it and bounded in bytes.
//
// Layout: up to 64 shards chosen by the piece's hash. A shard is one block
// of 64-bit words allocated on its first insert: an open-addressing table of
// slots (a tag of the hash, the key's length, the number of ids, the entry's
// offset), then an arena of entries (the key's bytes, the ids two to a
// word). Entries are written once and never changed; a shard that is full
// (half its slots, or its arena) is emptied whole and starts over.
//
// Lookups take no lock and write nothing shared: a shard's sequence number
// is odd while it is being emptied and moves on after; a lookup that sees it
// change (or odd) treats the piece as a miss. Inserts take the shard's mutex.
// Every word is a std::atomic, so a lookup racing an emptying is defined
// behaviour (relaxed loads; plain moves on x86).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

namespace mlarun::text {

class WordCache {
 public:
  static constexpr size_t kMaxWordBytes = 256;  // longer pieces are not cached
  static constexpr size_t kDefaultCapBytes = size_t{16} << 20;

  // At most `cap_bytes` allocated, in total, whatever the number of threads;
  // 0 (or a cap too small for one shard) caches nothing.
  explicit WordCache(size_t cap_bytes = kDefaultCapBytes);
  ~WordCache();
  WordCache(const WordCache&) = delete;
  WordCache& operator=(const WordCache&) = delete;

  // 64-bit hash of a piece.
  static uint64_t Hash(std::string_view s);

  // Appends the cached ids of `key` (hash: Hash(key)) to `ids` and returns
  // true; false, with `ids` unchanged, when it is not cached.
  bool Find(std::string_view key, uint64_t hash, std::vector<int32_t>* ids) const;
  // Remembers `ids` for `key`. A key over kMaxWordBytes, or an entry larger
  // than a shard's arena, is not kept.
  void Insert(std::string_view key, uint64_t hash, std::span<const int32_t> ids);

  // What the shards allocated so far hold (never above the cap).
  size_t bytes() const;
  // Shards emptied to make room, since construction.
  uint64_t evictions() const { return evictions_.load(std::memory_order_relaxed); }

 private:
  struct Shard;
  using Word = std::atomic<uint64_t>;
  // Bits of the hash apart from the slot's index and tag.
  size_t ShardOf(uint64_t hash) const { return (hash >> 24) & (num_shards_ - 1); }
  // Whether `key` is in a shard's words; with `ids`, its ids appended.
  bool Probe(const Word* w, std::string_view key, uint64_t hash, std::vector<int32_t>* ids) const;
  void Empty(Shard& sh);

  size_t num_shards_ = 0;   // 0: caches nothing
  size_t slots_ = 0;        // per shard, a power of two
  size_t arena_words_ = 0;  // per shard
  std::unique_ptr<Shard[]> shards_;
  std::atomic<uint64_t> evictions_{0};
};

}  // namespace mlarun::text
