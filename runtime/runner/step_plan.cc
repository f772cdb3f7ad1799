#include "runtime/runner/step_plan.h"

#include <cstring>
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

namespace {

// A string as [byte length, its bytes packed 8 to a word, the last one
// zero-padded].
void PutString(const std::string& s, std::vector<int64_t>& out) {
  out.push_back(static_cast<int64_t>(s.size()));
  const size_t at = out.size();
  out.resize(at + (s.size() + 7) / 8, 0);
  if (!s.empty()) std::memcpy(&out[at], s.data(), s.size());
}

}  // namespace

// [has_work, cache use (5), n_seqs, per seq: id, start_pos, n_tokens,
// tokens..., n_blocks, blocks...; n_imports, per import: id, n_descriptors,
// per descriptor: n_bytes, words...; n_src, src..., n_dst, dst...]
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
  out.push_back(static_cast<int64_t>(imports.size()));
  for (const Import& m : imports) {
    out.insert(out.end(), {m.id, static_cast<int64_t>(m.descriptors.size())});
    for (const std::string& d : m.descriptors) PutString(d, out);
    out.push_back(static_cast<int64_t>(m.src.size()));
    out.insert(out.end(), m.src.begin(), m.src.end());
    out.push_back(static_cast<int64_t>(m.dst.size()));
    out.insert(out.end(), m.dst.begin(), m.dst.end());
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
  // A string: its byte length, then as many words as its bytes fill.
  auto take_string = [&](std::string& out) {
    int64_t n = 0;
    if (!take(&n) || n < 0 || static_cast<uint64_t>(n) > 8 * (d.size() - i)) return false;
    out.resize(static_cast<size_t>(n));
    if (n > 0) std::memcpy(out.data(), &d[i], static_cast<size_t>(n));
    i += static_cast<size_t>((n + 7) / 8);
    return true;
  };
  int64_t n_imports = 0;
  if (!take(&n_imports) || n_imports < 0) return InvalidArgumentError("step plan: truncated import count");
  for (int64_t k = 0; k < n_imports; ++k) {
    Import m;
    int64_t n_desc = 0;
    bool ok = take(&m.id) && take(&n_desc) && n_desc >= 0 && static_cast<uint64_t>(n_desc) <= d.size() - i;
    for (int64_t j = 0; ok && j < n_desc; ++j) ok = take_string(m.descriptors.emplace_back());
    if (!ok || !take_ints(m.src) || !take_ints(m.dst))
      return InvalidArgumentError("step plan: import ", k, " is truncated or holds a value outside int32");
    if (m.src.size() != m.dst.size())
      return InvalidArgumentError("step plan: import ", k, " has ", m.src.size(), " source blocks and ", m.dst.size(),
                                  " destination blocks");
    p.imports.push_back(std::move(m));
  }
  if (i != d.size()) return InvalidArgumentError("step plan: ", d.size() - i, " trailing values");
  return p;
}

}  // namespace mlarun
