#include "serving/coordinator/router.h"

#include <algorithm>

namespace mlarun {

std::string_view RoutingPolicyName(RoutingPolicy p) {
  switch (p) {
    case RoutingPolicy::kRoundRobin:
      return "round_robin";
    case RoutingPolicy::kLeastLoaded:
      return "least_loaded";
    case RoutingPolicy::kPrefixAffinity:
      return "prefix_affinity";
  }
  return "unknown";
}

StatusOr<RoutingPolicy> ParseRoutingPolicy(std::string_view name) {
  for (RoutingPolicy p : {RoutingPolicy::kRoundRobin, RoutingPolicy::kLeastLoaded, RoutingPolicy::kPrefixAffinity}) {
    if (name == RoutingPolicyName(p)) return p;
  }
  return InvalidArgumentError("policy: unknown routing policy '", name,
                              "' (round_robin, least_loaded, prefix_affinity)");
}

namespace coord {
namespace {

// True if a is less loaded than b (the least_loaded order).
bool LessLoaded(const Candidate& a, const Candidate& b) {
  if (a.queued_tokens != b.queued_tokens) return a.queued_tokens < b.queued_tokens;
  if (a.free_blocks != b.free_blocks) return a.free_blocks > b.free_blocks;
  return a.index < b.index;
}

}  // namespace

int64_t PrefixIndex::LeadingMatch(std::span<const uint64_t> chain) const {
  int64_t n = 0;
  for (uint64_t h : chain) {
    if (!last_use_.contains(h)) break;
    ++n;
  }
  return n;
}

void PrefixIndex::Insert(std::span<const uint64_t> chain) {
  if (capacity_ <= 0) return;
  ++tick_;
  for (uint64_t h : chain) last_use_[h] = tick_;
  if (static_cast<int64_t>(last_use_.size()) > capacity_ + capacity_ / 8) Evict();
}

void PrefixIndex::Evict() {
  // Keep the `capacity_` most recently used hashes. Ties on the cut tick (one
  // prompt's blocks share a tick) are dropped together, which may leave a few
  // fewer than capacity_: harmless for an estimate.
  std::vector<uint64_t> ticks;
  ticks.reserve(last_use_.size());
  for (const auto& [h, t] : last_use_) ticks.push_back(t);
  const size_t drop = ticks.size() - static_cast<size_t>(capacity_);
  std::nth_element(ticks.begin(), ticks.begin() + static_cast<std::ptrdiff_t>(drop - 1), ticks.end());
  const uint64_t cut = ticks[drop - 1];
  std::erase_if(last_use_, [cut](const auto& kv) { return kv.second <= cut; });
}

size_t Router::LeastLoaded(std::span<const Candidate> candidates) {
  size_t best = 0;
  for (size_t i = 1; i < candidates.size(); ++i) {
    if (LessLoaded(candidates[i], candidates[best])) best = i;
  }
  return best;
}

size_t Router::Pick(std::span<const Candidate> candidates) {
  switch (policy_) {
    case RoutingPolicy::kRoundRobin: {
      // The next index after the last pick, wrapping: groups that come and go
      // keep their table index, so the rotation stays fair across changes.
      size_t pick = 0;
      for (size_t i = 0; i < candidates.size(); ++i) {
        if (candidates[i].index > last_index_) {
          pick = i;
          break;
        }
      }
      last_index_ = candidates[pick].index;
      return pick;
    }
    case RoutingPolicy::kLeastLoaded:
      return LeastLoaded(candidates);
    case RoutingPolicy::kPrefixAffinity: {
      const size_t least = LeastLoaded(candidates);
      size_t best = least;
      int64_t best_blocks = candidates[least].prefix_blocks;
      for (size_t i = 0; i < candidates.size(); ++i) {
        const Candidate& c = candidates[i];
        if (c.prefix_blocks > best_blocks || (c.prefix_blocks == best_blocks && LessLoaded(c, candidates[best]))) {
          best = i;
          best_blocks = c.prefix_blocks;
        }
      }
      if (best_blocks == 0) return least;
      // Affinity loses only when the imbalance is large in absolute AND in
      // relative terms: a small absolute gap is not worth a cache miss, and a
      // large gap between two busy groups may still be a small ratio.
      const double q_best = static_cast<double>(candidates[best].queued_tokens);
      const double q_least = static_cast<double>(candidates[least].queued_tokens);
      if (q_best - q_least > static_cast<double>(balance_abs_tokens_) && q_best > balance_rel_ * q_least) return least;
      return best;
    }
  }
  return 0;
}

}  // namespace coord
}  // namespace mlarun
