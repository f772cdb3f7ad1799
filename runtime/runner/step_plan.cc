#include "runtime/runner/step_plan.h"

#include <limits>

namespace mlarun {

int64_t StepPlan::num_tokens() const {
  int64_t n = 0;
  for (const Seq& s : seqs) n += static_cast<int64_t>(s.tokens.size());
  return n;
}

int64_t StepPlan::num_sampled() const {
  int64_t n = 0;
  for (const Seq& s : seqs) n += s.sampler != nullptr ? 1 : 0;
  return n;
}

// [has_work, cache use (5), n_seqs, per seq: id, start_pos, n_tokens, tokens..., n_blocks, blocks...]
std::vector<int64_t> StepPlan::Encode() const {
  std::vector<int64_t> out = {has_work ? 1 : 0,
                              cache.blocks_used,
                              cache.blocks_cached,
                              cache.blocks_retired,
                              cache.prefix_hit_tokens,
                              cache.evictions,
                              static_cast<int64_t>(seqs.size())};
  for (const Seq& s : seqs) {
    out.insert(out.end(), {s.id, s.start_pos, static_cast<int64_t>(s.tokens.size())});
    out.insert(out.end(), s.tokens.begin(), s.tokens.end());
    out.push_back(static_cast<int64_t>(s.block_table.size()));
    out.insert(out.end(), s.block_table.begin(), s.block_table.end());
  }
  return out;
}

StatusOr<StepPlan> StepPlan::Decode(std::span<const int64_t> d) {
  size_t i = 0;
  auto take = [&](int64_t* v) {
    if (i >= d.size()) return false;
    *v = d[i++];
    return true;
  };
  // n int32 values into `out`.
  auto take_ints = [&](std::vector<int32_t>& out) {
    int64_t n = 0;
    if (!take(&n) || n < 0 || static_cast<uint64_t>(n) > d.size() - i) return false;
    out.reserve(static_cast<size_t>(n));
    for (int64_t k = 0; k < n; ++k, ++i) {
      if (d[i] < std::numeric_limits<int32_t>::min() || d[i] > std::numeric_limits<int32_t>::max()) return false;
      out.push_back(static_cast<int32_t>(d[i]));
    }
    return true;
  };
  StepPlan p;
  int64_t has_work = 0, n_seqs = 0;
  if (!take(&has_work) || !take(&p.cache.blocks_used) || !take(&p.cache.blocks_cached) ||
      !take(&p.cache.blocks_retired) || !take(&p.cache.prefix_hit_tokens) || !take(&p.cache.evictions) ||
      !take(&n_seqs) || n_seqs < 0)
    return InvalidArgumentError("step plan: truncated header");
  p.has_work = has_work != 0;
  for (int64_t k = 0; k < n_seqs; ++k) {
    Seq s;
    if (!take(&s.id) || !take(&s.start_pos) || !take_ints(s.tokens) || !take_ints(s.block_table))
      return InvalidArgumentError("step plan: sequence ", k, " is truncated or holds a value outside int32");
    p.seqs.push_back(std::move(s));
  }
  if (i != d.size()) return InvalidArgumentError("step plan: ", d.size() - i, " trailing values");
  return p;
}

}  // namespace mlarun
