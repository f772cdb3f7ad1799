#include "text/word_cache.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <mutex>

namespace mlarun::text {
namespace {

constexpr size_t kMaxShards = 64;
constexpr size_t kMinShardBytes = size_t{16} << 10;

// A slot: the entry's offset in the arena + 1 (0: free), the key's length,
// the number of ids, and high bits of the hash. A lookup compares the tag and
// the length before it reads the entry (the key's words, then the ids).
constexpr uint64_t kOffsetMask = (uint64_t{1} << 24) - 1;
constexpr int kKeyLenShift = 24;  // 9 bits
constexpr int kCountShift = 33;   // 9 bits
constexpr int kTagShift = 42;     // 22 bits
constexpr size_t kMaxIds = 0x1FF;
constexpr uint64_t kTagAndKeyLen = ~uint64_t{0} << kTagShift | uint64_t{0x1FF} << kKeyLenShift;
uint64_t Tag(uint64_t hash) { return hash >> kTagShift << kTagShift; }
static_assert(WordCache::kMaxWordBytes <= 0x1FF);

size_t KeyWords(size_t key_len) { return (key_len + 7) / 8; }
size_t IdWords(size_t n) { return (n + 1) / 2; }

// Bytes [8 * i, 8 * i + 8) of `key`, zero-padded past its end.
uint64_t KeyWord(std::string_view key, size_t i) {
  const char* p = key.data() + 8 * i;
  const size_t left = key.size() - 8 * i;
  uint64_t w = 0;
  if (left >= 8) {
    std::memcpy(&w, p, 8);
  } else {
    for (size_t b = 0; b < left; ++b) w |= uint64_t(static_cast<unsigned char>(p[b])) << (8 * b);
  }
  return w;
}

}  // namespace

struct alignas(64) WordCache::Shard {
  // Read by every lookup; written only when the shard is allocated or emptied.
  std::atomic<uint32_t> seq{0};  // odd while the shard is being emptied
  std::atomic<Word*> words{nullptr};
  // Inserts only.
  alignas(64) std::mutex mu;
  std::unique_ptr<Word[]> storage;
  size_t entries = 0;     // occupied slots
  size_t arena_used = 0;  // words
};

WordCache::WordCache(size_t cap_bytes) {
  size_t shards = std::bit_floor(std::max<size_t>(1, std::min(kMaxShards, cap_bytes / kMinShardBytes)));
  const size_t shard_words = cap_bytes / shards / sizeof(Word);
  // A quarter of a shard for its slots (at most half of them used), the rest
  // for the entries: 6 words per entry, where most take 2 or 3.
  const size_t slots = shard_words >= 16 ? std::bit_floor(shard_words / 4) : 0;
  if (slots < 4) return;  // too small to cache anything
  num_shards_ = shards;
  slots_ = slots;
  arena_words_ = std::min<size_t>(shard_words - slots, kOffsetMask - 1);
  shards_ = std::make_unique<Shard[]>(shards);
}

WordCache::~WordCache() = default;

uint64_t WordCache::Hash(std::string_view s) {
  uint64_t h = 0x9E3779B97F4A7C15ull ^ (s.size() * 0xC2B2AE3D27D4EB4Full);
  size_t i = 0;
  for (; i + 8 <= s.size(); i += 8) {
    uint64_t w;
    std::memcpy(&w, s.data() + i, 8);
    h = (h ^ w) * 0xBF58476D1CE4E5B9ull;
    h ^= h >> 29;
  }
  uint64_t w = 0;
  std::memcpy(&w, s.data() + i, s.size() - i);
  h = (h ^ w) * 0x94D049BB133111EBull;
  h ^= h >> 32;
  return h;
}

bool WordCache::Probe(const Word* w, std::string_view key, uint64_t hash, std::vector<int32_t>* ids) const {
  const uint64_t want = Tag(hash) | uint64_t(key.size()) << kKeyLenShift;
  const size_t mask = slots_ - 1;
  const size_t key_words = KeyWords(key.size());
  // Bounded: a lookup racing an emptying may see any mix of slots.
  for (size_t i = hash & mask, probes = 0; probes < slots_; i = (i + 1) & mask, ++probes) {
    const uint64_t slot = w[i].load(std::memory_order_acquire);
    if (slot == 0) return false;
    if ((slot & kTagAndKeyLen) != want) continue;
    const size_t at = slots_ + (slot & kOffsetMask) - 1;
    const size_t n = (slot >> kCountShift) & kMaxIds;
    // Only a read torn by an emptying can point past the end; its sequence
    // check fails anyway.
    if (at + key_words + IdWords(n) > slots_ + arena_words_) continue;
    bool equal = true;
    for (size_t k = 0; k < key_words && equal; ++k)
      equal = w[at + k].load(std::memory_order_relaxed) == KeyWord(key, k);
    if (!equal) continue;
    if (ids != nullptr) {
      const Word* src = w + at + key_words;
      const size_t before = ids->size();
      ids->resize(before + n);
      int32_t* out = ids->data() + before;
      for (size_t k = 0; k < n; k += 2) {
        const uint64_t pair = src[k / 2].load(std::memory_order_relaxed);
        out[k] = int32_t(uint32_t(pair));
        if (k + 1 < n) out[k + 1] = int32_t(uint32_t(pair >> 32));
      }
    }
    return true;
  }
  return false;
}

bool WordCache::Find(std::string_view key, uint64_t hash, std::vector<int32_t>* ids) const {
  if (num_shards_ == 0) return false;
  const Shard& sh = shards_[ShardOf(hash)];
  const uint32_t seq = sh.seq.load(std::memory_order_acquire);
  if (seq & 1) return false;
  const Word* w = sh.words.load(std::memory_order_acquire);
  if (w == nullptr) return false;
  const size_t before = ids->size();
  if (!Probe(w, key, hash, ids)) return false;
  // What was read is good only if no emptying began meanwhile (one that did
  // wrote after its odd sequence number, so this load sees that or later).
  std::atomic_thread_fence(std::memory_order_acquire);
  if (sh.seq.load(std::memory_order_relaxed) != seq) {
    ids->resize(before);
    return false;
  }
  return true;
}

void WordCache::Empty(Shard& sh) {
  const uint32_t seq = sh.seq.load(std::memory_order_relaxed);
  sh.seq.store(seq + 1, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
  Word* w = sh.storage.get();
  for (size_t i = 0; i < slots_; ++i) w[i].store(0, std::memory_order_relaxed);
  sh.entries = 0;
  sh.arena_used = 0;
  sh.seq.store(seq + 2, std::memory_order_release);
  evictions_.fetch_add(1, std::memory_order_relaxed);
}

void WordCache::Insert(std::string_view key, uint64_t hash, std::span<const int32_t> ids) {
  if (num_shards_ == 0 || key.size() > kMaxWordBytes || ids.size() > kMaxIds) return;
  const size_t key_words = KeyWords(key.size());
  const size_t need = key_words + IdWords(ids.size());
  if (need > arena_words_) return;
  Shard& sh = shards_[ShardOf(hash)];
  std::lock_guard<std::mutex> lock(sh.mu);
  if (sh.storage == nullptr) {
    sh.storage = std::make_unique<Word[]>(slots_ + arena_words_);  // zeroed: every slot free
    sh.words.store(sh.storage.get(), std::memory_order_release);
  } else if (Probe(sh.storage.get(), key, hash, nullptr)) {
    return;  // another thread put it there first
  }
  if (sh.entries >= slots_ / 2 || sh.arena_used + need > arena_words_) Empty(sh);
  Word* w = sh.storage.get();
  const size_t at = slots_ + sh.arena_used;
  for (size_t k = 0; k < key_words; ++k) w[at + k].store(KeyWord(key, k), std::memory_order_relaxed);
  for (size_t k = 0; k < ids.size(); k += 2) {
    const uint64_t hi = k + 1 < ids.size() ? uint64_t(uint32_t(ids[k + 1])) << 32 : 0;
    w[at + key_words + k / 2].store(uint64_t(uint32_t(ids[k])) | hi, std::memory_order_relaxed);
  }
  sh.arena_used += need;
  ++sh.entries;
  const size_t mask = slots_ - 1;
  size_t i = hash & mask;
  while (w[i].load(std::memory_order_relaxed) != 0) i = (i + 1) & mask;
  // Publishes the entry: a lookup that loads this slot sees the words above.
  const uint64_t slot =
      Tag(hash) | uint64_t(key.size()) << kKeyLenShift | uint64_t(ids.size()) << kCountShift | (at - slots_ + 1);
  w[i].store(slot, std::memory_order_release);
}

size_t WordCache::bytes() const {
  size_t allocated = 0;
  for (size_t s = 0; s < num_shards_; ++s)
    if (shards_[s].words.load(std::memory_order_relaxed) != nullptr) ++allocated;
  return allocated * (slots_ + arena_words_) * sizeof(Word);
}

}  // namespace mlarun::text
