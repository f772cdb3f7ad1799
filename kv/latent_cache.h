// The block manager of the paged latent cache: which blocks of the pool
// (kv/latent_pool.h, where the rows live) hold which sequence's tokens, and
// reuse of finished prefixes between sequences. It holds no rows itself: it
// is host-only bookkeeping over block ids, run by a DP group's scheduler; the
// block tables it hands out travel in each step's plan to every rank of the
// group, whose pools are written and read through them.
//
// Prefix reuse: every full block that a sequence has committed is published
// under a hash chain over the token ids of all blocks up to and including it.
// A later sequence whose prompt starts with the same full blocks attaches them
// (reference-counted) instead of recomputing them, if it has the same salt: a
// sequence's salt (AddSequence) seeds its chain (PrefixChainSeed), so
// sequences of different salts (tenants) never share a block. Released blocks
// that hold a published prefix stay cached and are evicted least-recently-used
// first when free blocks run out.
//
// Running out of blocks is an ordinary event: Append returns RESOURCE_EXHAUSTED
// and changes nothing, so a scheduler can queue or preempt.
//
// Not thread-safe: one owner (a DP group's scheduler) drives it.
#pragma once

#include <cstdint>
#include <list>
#include <memory>
#include <span>
#include <unordered_map>
#include <vector>

#include "base/block_size.h"
#include "base/dtype.h"
#include "base/status.h"
#include "kv/latent_pool.h"
#include "kv/prefix_hash.h"

namespace mlarun {

struct LatentCacheStats {
  int64_t bytes_per_token = 0;  // num_layers * (L + R) * dtype size
  int64_t block_bytes = 0;      // block_size * bytes_per_token
  int64_t blocks_total = 0;
  int64_t blocks_used = 0;        // referenced by at least one sequence
  int64_t blocks_cached = 0;      // unreferenced, holding a reusable prefix (evictable)
  int64_t blocks_free = 0;        // unreferenced and empty
  int64_t bytes_capacity = 0;     // blocks_total * block_bytes
  int64_t bytes_used = 0;         // blocks_used * block_bytes
  int64_t prefix_hit_tokens = 0;  // tokens attached from cached prefixes, cumulative
  int64_t evictions = 0;          // cached blocks reclaimed, cumulative
  // Blocks in the block tables of retired sequences (Retire: done, not
  // preempted or abandoned), summed as they retire: each sequence's
  // footprint, ceil(tokens / block_size), cumulative. A request set's total
  // is predictable from its lengths alone.
  int64_t blocks_retired = 0;

  int64_t blocks_allocatable() const { return blocks_free + blocks_cached; }
};

using SeqId = int64_t;

// PrefixBlockHashes (kv/prefix_hash.h): the chain full blocks are published under.

class LatentCache {
 public:
  // config.num_blocks() blocks, all free. Errors name the bad field (e.g. a
  // budget smaller than one block). Allocates no rows (LatentPool does).
  static StatusOr<std::unique_ptr<LatentCache>> Create(const LatentCacheConfig& config);

  LatentCache(const LatentCache&) = delete;
  LatentCache& operator=(const LatentCache&) = delete;

  const LatentCacheConfig& config() const { return config_; }
  int64_t row_width() const { return config_.kv_lora_rank + config_.rope_dim; }
  LatentCacheStats stats() const;

  // ---- Sequences ---------------------------------------------------------
  // Registers an empty sequence whose blocks are published, and prefixes
  // attached, under prefix-cache salt `salt` (0: unsalted).
  // INVALID_ARGUMENT if the id is in use.
  Status AddSequence(SeqId id, uint64_t salt = 0);
  bool HasSequence(SeqId id) const { return seqs_.count(id) != 0; }

  // Tokens of `tokens` that a new sequence of salt `salt` could reuse: the
  // longest run of leading full blocks present in the cache under that salt.
  // A multiple of block_size. No side effects.
  int64_t MatchPrefix(std::span<const int32_t> tokens, uint64_t salt = 0) const;

  // For a sequence that has no tokens yet: attaches the cached blocks of the
  // longest reusable prefix of `tokens`, at most `max_tokens` tokens (pass
  // tokens.size() - 1 to keep at least one token to compute). Returns the
  // number of tokens attached; their rows are already in the cache.
  StatusOr<int64_t> AttachPrefix(SeqId id, std::span<const int32_t> tokens, int64_t max_tokens);

  // Free blocks that appending `n_tokens` to `id` would take.
  StatusOr<int64_t> BlocksNeeded(SeqId id, int64_t n_tokens) const;

  // Reserves slots for `tokens` after the sequence's current tokens and records
  // their ids (for prefix hashing). All or nothing: RESOURCE_EXHAUSTED, with no
  // change, when the allocatable blocks do not suffice.
  Status Append(SeqId id, std::span<const int32_t> tokens);

  // Declares the rows of every appended token written. Full blocks become
  // reusable by later sequences.
  Status Commit(SeqId id);

  // Ends the sequence. Blocks nobody else references return to the pool;
  // those holding a published prefix stay cached until evicted.
  Status Release(SeqId id);
  // Release of a sequence that is done (all its tokens generated): the same,
  // and its block count adds to blocks_retired. A preempted or cancelled
  // sequence is Released, not retired.
  Status Retire(SeqId id);

  // Block ids of the sequence, in token order. Empty span for unknown ids.
  std::span<const int32_t> BlockTable(SeqId id) const;
  // Tokens appended so far (attached prefix included); -1 for unknown ids.
  int64_t NumTokens(SeqId id) const;

  // OK when positions [pos, pos + n) of `id` may be written: appended, and in
  // blocks no other sequence shares and none published (such rows are
  // immutable). A scheduler checks what it plans; FAILED_PRECONDITION or
  // OUT_OF_RANGE name the row otherwise.
  Status CheckWritable(SeqId id, int64_t pos, int64_t n) const;

 private:
  struct BlockMeta {
    int32_t ref_count = 0;
    bool published = false;
    uint64_t hash = 0;                     // valid when published
    uint64_t parent_hash = 0;              // hash of the previous block (PrefixChainSeed(salt) for the first)
    std::vector<int32_t> tokens;           // the block's token ids, for exact match on lookup
    std::list<int32_t>::iterator lru_pos;  // valid while in evictable_
  };
  struct Sequence {
    std::vector<int32_t> blocks;
    std::vector<int32_t> tokens;
    std::vector<uint64_t> chain;       // chain hash of each full, committed block
    uint64_t seed = kPrefixChainSeed;  // parent of its first block: PrefixChainSeed(salt)
  };

  LatentCache(const LatentCacheConfig& config, int64_t num_blocks);
  Sequence* Find(SeqId id);
  const Sequence* Find(SeqId id) const;
  // Cached block holding `tokens` whose parent hash is `parent`, or -1.
  int32_t Lookup(uint64_t parent, std::span<const int32_t> tokens, uint64_t* hash) const;
  int32_t TakeBlock();  // REQUIRES: an allocatable block exists
  void DropRef(int32_t block);
  int64_t BlocksFor(int64_t tokens) const;

  // Constant after construction.
  const LatentCacheConfig config_;
  const int64_t num_blocks_;

  std::vector<BlockMeta> blocks_;
  std::vector<int32_t> free_;                    // empty blocks; back() is taken first
  std::list<int32_t> evictable_;                 // cached, unreferenced; front() is evicted first
  std::unordered_map<uint64_t, int32_t> index_;  // chain hash -> published block
  std::unordered_map<SeqId, Sequence> seqs_;
  int64_t prefix_hit_tokens_ = 0;
  int64_t evictions_ = 0;
  int64_t blocks_retired_ = 0;
};

}  // namespace mlarun
