#include "attention/cuda/split_plan.h"

#include <algorithm>
#include <limits>

#include "attention/mla_params.h"

namespace mlarun {

Status CheckSplitPlanInput(const SplitPlanConfig& c, const SplitSeq* seqs, int64_t n) {
  if (c.h_q <= 0 || c.rows_per_block <= 0 || c.page_rows <= 0 || c.num_sms <= 0 || c.blocks_per_sm <= 0 ||
      c.min_split_keys <= 0 || c.max_splits <= 0)
    return InvalidArgumentError("split plan: every size must be positive (h_q ", c.h_q, ", rows_per_block ",
                                c.rows_per_block, ", page_rows ", c.page_rows, ", num_sms ", c.num_sms,
                                ", blocks_per_sm ", c.blocks_per_sm, ", min_split_keys ", c.min_split_keys,
                                ", max_splits ", c.max_splits, ")");
  if (n < 0 || (n > 0 && seqs == nullptr)) return InvalidArgumentError("split plan: no sequences given");
  for (int64_t i = 0; i < n; ++i) {
    const SplitSeq& s = seqs[i];
    if (s.q_len < 1 || s.seq_len < s.q_len)
      return InvalidArgumentError("split plan: sequence ", i, " has q_len ", s.q_len, " and seq_len ", s.seq_len,
                                  " (need 1 <= q_len <= seq_len)");
    if (s.q_len * c.h_q > std::numeric_limits<int32_t>::max())
      return InvalidArgumentError("split plan: sequence ", i, " has ", s.q_len * c.h_q,
                                  " query rows, more than int32 indexes");
  }
  return Status::Ok();
}

void PlanSplits(const SplitPlanConfig& c, const SplitSeq* seqs, int64_t n, SplitPlan* plan) {
  plan->num_splits.assign(static_cast<size_t>(n), 1);
  plan->partial_offset.assign(static_cast<size_t>(n), -1);
  plan->items.clear();
  plan->partial_rows = 0;

  auto tiles_of = [&](const SplitSeq& s) { return (s.q_len * c.h_q + c.rows_per_block - 1) / c.rows_per_block; };
  int64_t base = 0;
  double total_keys = 0;  // keys summed over tiles; double: b * h_q * s_kv can pass 2^53 only in theory
  for (int64_t i = 0; i < n; ++i) {
    const int64_t t = tiles_of(seqs[i]);
    base += t;
    total_keys += static_cast<double>(t) * static_cast<double>(seqs[i].seq_len);
  }
  const int64_t slots = c.num_sms * c.blocks_per_sm;
  const int64_t target = base < slots ? 2 * slots : base;
  const int64_t min_keys = (c.min_split_keys + c.page_rows - 1) / c.page_rows * c.page_rows;
  int64_t k = target > 0 ? static_cast<int64_t>(total_keys / static_cast<double>(target)) + 1 : min_keys;
  k = std::max(min_keys, (k + c.page_rows - 1) / c.page_rows * c.page_rows);
  plan->split_keys = k;
  plan->base_tiles = base;
  plan->target_blocks = target;

  for (int64_t i = 0; i < n; ++i) {
    const SplitSeq& s = seqs[i];
    const int64_t pages = (s.seq_len + c.page_rows - 1) / c.page_rows;
    const int64_t splits = std::clamp<int64_t>((s.seq_len + k - 1) / k, 1, std::min(c.max_splits, pages));
    const int64_t rows_total = s.q_len * c.h_q;
    plan->num_splits[static_cast<size_t>(i)] = static_cast<int32_t>(splits);
    if (splits > 1) {
      plan->partial_offset[static_cast<size_t>(i)] = plan->partial_rows;
      plan->partial_rows += splits * rows_total;
    }
    const int64_t prefix = s.seq_len - s.q_len;
    for (int64_t row0 = 0; row0 < rows_total; row0 += c.rows_per_block) {
      const int64_t rows = std::min(c.rows_per_block, rows_total - row0);
      const int64_t visible = CausalVisibleKeys(prefix, (row0 + rows - 1) / c.h_q);
      for (int64_t sp = 0; sp < splits; ++sp) {
        const KeyRange r = SplitKeyRange(s.seq_len, c.page_rows, sp, splits);
        SplitWorkItem it;
        it.seq = static_cast<int32_t>(i);
        it.split = static_cast<int32_t>(sp);
        it.row0 = static_cast<int32_t>(row0);
        it.rows = static_cast<int32_t>(rows);
        it.key_begin = r.begin;
        it.key_end = std::min(r.end, visible);
        it.partial_row = splits > 1 ? plan->partial_offset[static_cast<size_t>(i)] + sp * rows_total + row0 : -1;
        plan->items.push_back(it);
      }
    }
  }
}

}  // namespace mlarun
