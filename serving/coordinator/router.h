// Routing decisions of the coordinator, without gRPC: the per-group
// approximate prefix index (of the block hashes PrefixBlockHashes in
// kv/prefix_hash.h computes, the chain a worker's cache publishes), and the
// policy that picks one DP group among the eligible ones (coordinator.h
// documents the policies).
//
// Internal to serving/coordinator. Nothing here is thread-safe: the
// dispatcher calls it with its mutex held.
#pragma once

#include <cstdint>
#include <span>
#include <unordered_map>
#include <vector>

#include "serving/coordinator/coordinator.h"

namespace mlarun::coord {

// An approximate, bounded set of the block hashes routed to one DP group: what
// its latent cache probably holds. Approximate because the coordinator does not
// see the group's evictions; it forgets the least recently routed hashes
// instead once `capacity` is exceeded.
//
// Memory: about 40 B per hash (an unordered_map node and bucket), so the
// default 100,000 hashes per group cost ~4 MB. Eviction is amortized O(1): when
// the set grows past capacity by 1/8 it drops the oldest eighth at once (an
// nth_element over the last-use ticks), so the set holds between capacity and
// 9/8 capacity hashes at its largest.
class PrefixIndex {
 public:
  explicit PrefixIndex(int64_t capacity) : capacity_(capacity) {}

  // Number of leading hashes of `chain` present in the set. No side effects.
  int64_t LeadingMatch(std::span<const uint64_t> chain) const;
  // Inserts (or refreshes) every hash of `chain`.
  void Insert(std::span<const uint64_t> chain);
  void Clear() { last_use_.clear(); }
  int64_t size() const { return static_cast<int64_t>(last_use_.size()); }

 private:
  void Evict();

  const int64_t capacity_;
  uint64_t tick_ = 0;
  std::unordered_map<uint64_t, uint64_t> last_use_;  // hash -> tick of its last insert
};

// One eligible DP group as the router sees it.
struct Candidate {
  int index = 0;              // position in the coordinator's group table (stable)
  int64_t queued_tokens = 0;  // prompt + max_tokens of its requests routed and not done
  int64_t free_blocks = 0;    // last reported
  int64_t prefix_blocks = 0;  // leading prompt blocks in its PrefixIndex (prefix_affinity)
};

class Router {
 public:
  Router(RoutingPolicy policy, int64_t balance_abs_tokens, double balance_rel)
      : policy_(policy), balance_abs_tokens_(balance_abs_tokens), balance_rel_(balance_rel) {}

  RoutingPolicy policy() const { return policy_; }

  // Picks one of `candidates` (REQUIRES: non-empty, ordered by index) and
  // returns its position there. Round robin advances its cursor.
  size_t Pick(std::span<const Candidate> candidates);

  // Least loaded: fewest queued tokens, then most free blocks, then lowest index.
  static size_t LeastLoaded(std::span<const Candidate> candidates);

 private:
  const RoutingPolicy policy_;
  const int64_t balance_abs_tokens_;
  const double balance_rel_;
  int last_index_ = -1;  // round robin: the index picked last
};

}  // namespace mlarun::coord
