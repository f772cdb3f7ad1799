#include "text/bpe.h"

#include <algorithm>
#include <cstring>
#include <queue>

#include "text/scratch.h"
#include "text/utf8.h"

namespace mlarun::text {

const ByteMap& ByteMap::Get() {
  static const ByteMap map = [] {
    ByteMap m;
    std::fill(std::begin(m.byte_of), std::end(m.byte_of), int16_t{-1});
    int extra = 0;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      const char32_t cp = printable ? char32_t(b) : char32_t(256 + extra++);
      utf8::Append(cp, &m.chars[b]);
      m.byte_of[cp] = int16_t(b);
    }
    return m;
  }();
  return map;
}

std::string ByteLevelDecode(std::string_view token) {
  const ByteMap& map = ByteMap::Get();
  std::string out;
  out.reserve(token.size());
  if (!utf8::IsValid(token)) return std::string(token);
  size_t i = 0;
  while (i < token.size()) {
    const char32_t cp = utf8::Next(token, &i);
    if (cp >= 324 || map.byte_of[cp] < 0) return std::string(token);
    out.push_back(char(map.byte_of[cp]));
  }
  return out;
}

void ByteLevelEncode(std::string_view bytes, std::string* out) {
  const ByteMap& map = ByteMap::Get();
  for (unsigned char b : bytes) out->append(map.chars[b]);
}

Bpe::Bpe(size_t word_cache_bytes) : cache_(std::make_unique<WordCache>(word_cache_bytes)) {
  std::fill(std::begin(byte_id_), std::end(byte_id_), -1);
}

Bpe::~Bpe() = default;

void Bpe::InsertMerge(int32_t a, int32_t b, Merge m) {
  const uint64_t key = Key(a, b);
  size_t i = (key * 0x9E3779B97F4A7C15ull) >> shift_;
  while (merge_table_[i].key != kEmpty) {
    if (merge_table_[i].key == key) return;  // a repeated merge keeps its first rank
    i = (i + 1) & mask_;
  }
  merge_table_[i] = {key, m};
}

Status Bpe::Init(const std::vector<std::pair<std::string, int32_t>>& vocab,
                 const std::vector<std::pair<std::string, std::string>>& merges, bool ignore_merges,
                 const std::optional<std::string>& unk_token) {
  vocab_.clear();
  vocab_.reserve(vocab.size());
  for (const auto& [s, id] : vocab) vocab_.emplace(s, id);
  const ByteMap& map = ByteMap::Get();
  for (int b = 0; b < 256; ++b) {
    auto it = vocab_.find(map.chars[b]);
    byte_id_[b] = it == vocab_.end() ? -1 : it->second;
  }
  ignore_merges_ = ignore_merges;
  unk_id_ = -1;
  if (unk_token) {
    auto it = vocab_.find(*unk_token);
    if (it == vocab_.end()) return InvalidArgumentError("model.unk_token '", *unk_token, "' is not in model.vocab");
    unk_id_ = it->second;
  }
  size_t cap = 16;
  while (cap < merges.size() * 2) cap <<= 1;
  merge_table_.assign(cap, MergeSlot{kEmpty, {0, 0}});
  mask_ = cap - 1;
  shift_ = 64 - std::countr_zero(cap);
  for (size_t r = 0; r < merges.size(); ++r) {
    const auto& [a, b] = merges[r];
    auto ia = vocab_.find(a);
    auto ib = vocab_.find(b);
    auto ic = vocab_.find(a + b);
    if (ia == vocab_.end() || ib == vocab_.end())
      return InvalidArgumentError("model.merges[", r, "] '", a, " ", b, "': a part is not in model.vocab");
    if (ic == vocab_.end())
      return InvalidArgumentError("model.merges[", r, "] '", a, " ", b, "': the merged token is not in model.vocab");
    InsertMerge(ia->second, ib->second, Merge{int32_t(r), ic->second});
  }
  return Status::Ok();
}

std::optional<int32_t> Bpe::TokenToId(std::string_view token) const {
  auto it = vocab_.find(token);
  if (it == vocab_.end()) return std::nullopt;
  return it->second;
}

void Bpe::EncodeWord(std::string_view piece, std::vector<int32_t>* ids) const {
  if (piece.empty()) return;
  if (piece.size() == 1 && !ignore_merges_) {
    const int32_t id = byte_id_[static_cast<unsigned char>(piece[0])];
    if (id >= 0) {
      ids->push_back(id);
    } else if (unk_id_ >= 0) {
      ids->push_back(unk_id_);
    }
    return;
  }
  if (piece.size() > WordCache::kMaxWordBytes) {
    MergeWord(piece, ids);
    return;
  }
  const uint64_t hash = WordCache::Hash(piece);
  if (cache_->Find(piece, hash, ids)) return;
  const size_t before = ids->size();
  MergeWord(piece, ids);
  cache_->Insert(piece, hash, std::span<const int32_t>(ids->data() + before, ids->size() - before));
}

void Bpe::MergeWord(std::string_view piece, std::vector<int32_t>* ids) const {
  if (ignore_merges_) {
    thread_local std::string mapped;
    ReleaseIfLargeOnExit release_mapped(mapped);
    mapped.clear();
    ByteLevelEncode(piece, &mapped);
    if (auto it = vocab_.find(mapped); it != vocab_.end()) {
      ids->push_back(it->second);
      return;
    }
  }
  // Symbols in a doubly linked list over the piece's bytes.
  struct Sym {
    int32_t id;
    int32_t prev;
    int32_t next;
  };
  thread_local std::vector<Sym> syms;
  ReleaseIfLargeOnExit release_syms(syms);
  syms.clear();
  for (unsigned char b : piece) {
    int32_t id = byte_id_[b];
    if (id < 0) {
      if (unk_id_ < 0) continue;  // tokenizers drops a character it has no id for
      id = unk_id_;
    }
    const int32_t n = int32_t(syms.size());
    syms.push_back({id, n - 1, n + 1});
  }
  if (syms.empty()) return;
  syms.back().next = -1;
  const int32_t n = int32_t(syms.size());

  if (n <= 24) {
    // Linear: find the lowest-ranked pair, leftmost among equals, merge it.
    while (true) {
      int32_t best_rank = INT32_MAX, best_pos = -1, best_id = 0;
      for (int32_t i = 0; i != -1 && syms[i].next != -1; i = syms[i].next) {
        const Merge* m = FindMerge(syms[i].id, syms[syms[i].next].id);
        if (m != nullptr && m->rank < best_rank) {
          best_rank = m->rank;
          best_pos = i;
          best_id = m->id;
        }
      }
      if (best_pos < 0) break;
      const int32_t right = syms[best_pos].next;
      syms[best_pos].id = best_id;
      syms[best_pos].next = syms[right].next;
      if (syms[right].next != -1) syms[syms[right].next].prev = best_pos;
      syms[right].id = -1;
    }
  } else {
    struct Cand {
      int32_t rank, pos, left, right, id;
      bool operator>(const Cand& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
    };
    thread_local std::vector<Cand> heap;
    ReleaseIfLargeOnExit release_heap(heap);
    heap.clear();
    auto push = [&](int32_t pos) {
      const int32_t nx = syms[pos].next;
      if (nx == -1) return;
      const Merge* m = FindMerge(syms[pos].id, syms[nx].id);
      if (m == nullptr) return;
      heap.push_back({m->rank, pos, syms[pos].id, syms[nx].id, m->id});
      std::push_heap(heap.begin(), heap.end(), std::greater<>());
    };
    for (int32_t i = 0; i < n - 1; ++i) push(i);
    while (!heap.empty()) {
      std::pop_heap(heap.begin(), heap.end(), std::greater<>());
      const Cand c = heap.back();
      heap.pop_back();
      Sym& s = syms[c.pos];
      if (s.id != c.left || s.next == -1 || syms[s.next].id != c.right) continue;  // stale
      const int32_t right = s.next;
      s.id = c.id;
      s.next = syms[right].next;
      if (s.next != -1) syms[s.next].prev = c.pos;
      syms[right].id = -1;
      if (s.prev != -1) push(s.prev);
      push(c.pos);
    }
  }
  for (int32_t i = 0; i != -1; i = syms[i].next) ids->push_back(syms[i].id);
}

}  // namespace mlarun::text
