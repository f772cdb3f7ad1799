#include "kv/latent_cache.h"

#include <algorithm>

namespace mlarun {
StatusOr<std::unique_ptr<LatentCache>> LatentCache::Create(const LatentCacheConfig& c) {
  MLARUN_RETURN_IF_ERROR(ValidateLatentCacheConfig(c));
  return std::unique_ptr<LatentCache>(new LatentCache(c, c.num_blocks()));
}

LatentCache::LatentCache(const LatentCacheConfig& config, int64_t num_blocks)
    : config_(config), num_blocks_(num_blocks), blocks_(static_cast<size_t>(num_blocks)) {
  // Taken from the back: block 0 first, so a fresh cache hands out ascending ids.
  free_.reserve(static_cast<size_t>(num_blocks));
  for (int64_t b = num_blocks - 1; b >= 0; --b) free_.push_back(static_cast<int32_t>(b));
}

LatentCacheStats LatentCache::stats() const {
  LatentCacheStats s;
  s.bytes_per_token = config_.bytes_per_token();
  s.block_bytes = config_.block_bytes();
  s.blocks_total = num_blocks_;
  s.blocks_free = static_cast<int64_t>(free_.size());
  s.blocks_cached = static_cast<int64_t>(evictable_.size());
  s.blocks_used = num_blocks_ - s.blocks_free - s.blocks_cached;
  s.bytes_capacity = s.blocks_total * s.block_bytes;
  s.bytes_used = s.blocks_used * s.block_bytes;
  s.prefix_hit_tokens = prefix_hit_tokens_;
  s.evictions = evictions_;
  s.blocks_retired = blocks_retired_;
  return s;
}

LatentCache::Sequence* LatentCache::Find(SeqId id) {
  auto it = seqs_.find(id);
  return it == seqs_.end() ? nullptr : &it->second;
}
const LatentCache::Sequence* LatentCache::Find(SeqId id) const {
  auto it = seqs_.find(id);
  return it == seqs_.end() ? nullptr : &it->second;
}

int64_t LatentCache::BlocksFor(int64_t tokens) const { return (tokens + config_.block_size - 1) / config_.block_size; }

Status LatentCache::AddSequence(SeqId id, uint64_t salt) {
  auto [it, added] = seqs_.try_emplace(id);
  if (!added) return InvalidArgumentError("latent cache: sequence ", id, " already exists");
  it->second.seed = PrefixChainSeed(salt);
  return Status::Ok();
}

int32_t LatentCache::Lookup(uint64_t parent, std::span<const int32_t> tokens, uint64_t* hash) const {
  *hash = PrefixChainHash(parent, tokens);
  auto it = index_.find(*hash);
  if (it == index_.end()) return -1;
  const BlockMeta& m = blocks_[static_cast<size_t>(it->second)];
  // Exact check: a hash collision must never hand out another prompt's rows.
  if (m.parent_hash != parent || !std::equal(m.tokens.begin(), m.tokens.end(), tokens.begin(), tokens.end())) return -1;
  return it->second;
}

int64_t LatentCache::MatchPrefix(std::span<const int32_t> tokens, uint64_t salt) const {
  const int64_t bs = config_.block_size;
  uint64_t parent = PrefixChainSeed(salt), h = 0;
  int64_t n = 0;
  while (config_.enable_prefix_caching && n + bs <= static_cast<int64_t>(tokens.size())) {
    if (Lookup(parent, tokens.subspan(static_cast<size_t>(n), static_cast<size_t>(bs)), &h) < 0) break;
    parent = h;
    n += bs;
  }
  return n;
}

StatusOr<int64_t> LatentCache::AttachPrefix(SeqId id, std::span<const int32_t> tokens, int64_t max_tokens) {
  Sequence* s = Find(id);
  if (s == nullptr) return NotFoundError("latent cache: unknown sequence ", id);
  if (!s->tokens.empty())
    return FailedPreconditionError("latent cache: AttachPrefix on sequence ", id, " which already has ",
                                   s->tokens.size(), " tokens");
  const int64_t bs = config_.block_size;
  const int64_t limit = std::min<int64_t>(max_tokens, static_cast<int64_t>(tokens.size()));
  uint64_t parent = s->seed, h = 0;
  int64_t n = 0;
  while (config_.enable_prefix_caching && n + bs <= limit) {
    auto block_tokens = tokens.subspan(static_cast<size_t>(n), static_cast<size_t>(bs));
    const int32_t b = Lookup(parent, block_tokens, &h);
    if (b < 0) break;
    BlockMeta& m = blocks_[static_cast<size_t>(b)];
    if (m.ref_count++ == 0) evictable_.erase(m.lru_pos);
    s->blocks.push_back(b);
    s->tokens.insert(s->tokens.end(), block_tokens.begin(), block_tokens.end());
    s->chain.push_back(h);
    parent = h;
    n += bs;
  }
  prefix_hit_tokens_ += n;
  return n;
}

StatusOr<int64_t> LatentCache::BlocksNeeded(SeqId id, int64_t n_tokens) const {
  const Sequence* s = Find(id);
  if (s == nullptr) return NotFoundError("latent cache: unknown sequence ", id);
  if (n_tokens < 0) return InvalidArgumentError("latent cache: negative token count ", n_tokens);
  return BlocksFor(static_cast<int64_t>(s->tokens.size()) + n_tokens) - static_cast<int64_t>(s->blocks.size());
}

int32_t LatentCache::TakeBlock() {
  int32_t b;
  if (!free_.empty()) {
    b = free_.back();
    free_.pop_back();
  } else {
    b = evictable_.front();
    evictable_.pop_front();
    BlockMeta& m = blocks_[static_cast<size_t>(b)];
    auto it = index_.find(m.hash);
    if (it != index_.end() && it->second == b) index_.erase(it);
    m.published = false;
    m.tokens.clear();
    ++evictions_;
  }
  blocks_[static_cast<size_t>(b)].ref_count = 1;
  return b;
}

Status LatentCache::Append(SeqId id, std::span<const int32_t> tokens) {
  Sequence* s = Find(id);
  if (s == nullptr) return NotFoundError("latent cache: unknown sequence ", id);
  const int64_t need =
      BlocksFor(static_cast<int64_t>(s->tokens.size() + tokens.size())) - static_cast<int64_t>(s->blocks.size());
  const int64_t have = static_cast<int64_t>(free_.size() + evictable_.size());
  if (need > have)
    return ResourceExhaustedError("latent cache: sequence ", id, " needs ", need, " more blocks for ", tokens.size(),
                                  " tokens, ", have, " of ", num_blocks_, " are allocatable");
  for (int64_t i = 0; i < need; ++i) s->blocks.push_back(TakeBlock());
  s->tokens.insert(s->tokens.end(), tokens.begin(), tokens.end());
  return Status::Ok();
}

Status LatentCache::Commit(SeqId id) {
  Sequence* s = Find(id);
  if (s == nullptr) return NotFoundError("latent cache: unknown sequence ", id);
  const int64_t bs = config_.block_size;
  const int64_t total = static_cast<int64_t>(s->tokens.size());
  if (config_.enable_prefix_caching) {
    // Extend the sequence's hash chain over the blocks that are now full and
    // written, and publish each unless another sequence published it first.
    for (int64_t j = static_cast<int64_t>(s->chain.size()); (j + 1) * bs <= total; ++j) {
      auto block_tokens =
          std::span<const int32_t>(s->tokens).subspan(static_cast<size_t>(j * bs), static_cast<size_t>(bs));
      const uint64_t parent = j == 0 ? s->seed : s->chain.back();
      const uint64_t h = PrefixChainHash(parent, block_tokens);
      s->chain.push_back(h);
      BlockMeta& m = blocks_[static_cast<size_t>(s->blocks[static_cast<size_t>(j)])];
      if (m.published || index_.count(h)) continue;
      m.published = true;
      m.hash = h;
      m.parent_hash = parent;
      m.tokens.assign(block_tokens.begin(), block_tokens.end());
      index_[h] = s->blocks[static_cast<size_t>(j)];
    }
  }
  return Status::Ok();
}

void LatentCache::DropRef(int32_t b) {
  BlockMeta& m = blocks_[static_cast<size_t>(b)];
  if (--m.ref_count > 0) return;
  if (m.published) {
    m.lru_pos = evictable_.insert(evictable_.end(), b);
  } else {
    free_.push_back(b);
  }
}

Status LatentCache::Release(SeqId id) {
  auto it = seqs_.find(id);
  if (it == seqs_.end()) return NotFoundError("latent cache: unknown sequence ", id);
  // Tail blocks first, so the LRU evicts a prompt's tail before its head.
  for (auto b = it->second.blocks.rbegin(); b != it->second.blocks.rend(); ++b) DropRef(*b);
  seqs_.erase(it);
  return Status::Ok();
}

Status LatentCache::Retire(SeqId id) {
  const Sequence* s = Find(id);
  if (s == nullptr) return NotFoundError("latent cache: unknown sequence ", id);
  const int64_t blocks = static_cast<int64_t>(s->blocks.size());
  MLARUN_RETURN_IF_ERROR(Release(id));
  blocks_retired_ += blocks;
  return Status::Ok();
}

std::span<const int32_t> LatentCache::BlockTable(SeqId id) const {
  const Sequence* s = Find(id);
  return s ? std::span<const int32_t>(s->blocks) : std::span<const int32_t>();
}

int64_t LatentCache::NumTokens(SeqId id) const {
  const Sequence* s = Find(id);
  return s ? static_cast<int64_t>(s->tokens.size()) : -1;
}

Status LatentCache::CheckWritable(SeqId id, int64_t pos, int64_t n) const {
  const Sequence* s = Find(id);
  if (s == nullptr) return NotFoundError("latent cache: unknown sequence ", id);
  if (pos < 0 || n < 0 || pos + n > static_cast<int64_t>(s->tokens.size()))
    return OutOfRangeError("latent cache: rows [", pos, ", ", pos + n, ") of sequence ", id, " which has ",
                           s->tokens.size(), " appended tokens");
  const int64_t bs = config_.block_size;
  for (int64_t j = pos / bs; n > 0 && j * bs < pos + n; ++j) {
    const int32_t b = s->blocks[static_cast<size_t>(j)];
    const BlockMeta& m = blocks_[static_cast<size_t>(b)];
    if (m.ref_count > 1 || m.published)
      return FailedPreconditionError("latent cache: row ", std::max(pos, j * bs), " of sequence ", id,
                                     " lies in block ", b, " which is shared or published; its rows are immutable");
  }
  return Status::Ok();
}

}  // namespace mlarun
