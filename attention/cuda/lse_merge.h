// Log-sum-exp arithmetic shared by the CUDA attention kernels and their host
// tests: the online softmax of one query row over successive key tiles, and
// the merge of normalized partial results over disjoint key ranges (the
// split decode's combine, the expanded path's context chunks).
//
// Conventions (the CPU backend's, attention/cpu/attend_tile.h):
//  * scores are already scaled by softmax_scale; a masked key is -inf;
//  * a partial result is (o, lse): o normalized (sum of its weights 1) and
//    lse = log(sum over its keys of exp(score));
//  * a row that saw no key has lse = -inf and o = 0. Merging it changes
//    nothing, and a merge of nothing but such rows is again lse = -inf, o = 0.
// A weight of 0 excludes its operand completely (LseMix never multiplies
// it), so a buffer that was never written cannot leak a NaN into a result.
//
// Plain header: the functions are MLARUN_HD, host-tested in
// tests/attention/mla_lse_merge_test.cc.
#pragma once

#include <math.h>

#include <cstdint>

#include "base/host_device.h"

namespace mlarun {

inline constexpr float kLseNegInf = -INFINITY;

// ---- Online softmax of one row (m: running max, l: running sum) ----------

// Factor that rescales what was accumulated under max m_old when the max
// becomes m_new >= m_old: exp(m_old - m_new). 1 while nothing was seen (both
// -inf), 0 when only m_old is -inf.
MLARUN_HD inline float SoftmaxRescale(float m_old, float m_new) {
  if (m_new == kLseNegInf) return 1.f;
  return expf(m_old - m_new);  // m_old = -inf gives 0
}

// Weight of a score x under the running max m (m >= x): exp(x - m); 0 for a
// masked key (x = -inf), also when nothing is visible yet (m = -inf).
MLARUN_HD inline float SoftmaxProb(float x, float m) {
  if (x == kLseNegInf) return 0.f;
  return expf(x - m);
}

// The row's log-sum-exp from its final state: m + log(l); -inf when the row
// saw no key (l = 0).
MLARUN_HD inline float SoftmaxLse(float m, float l) { return l > 0.f ? m + logf(l) : kLseNegInf; }

// The normalizer of the accumulated sum: 1 / l, or 0 for a row that saw no
// key (its accumulator is then 0, and stays 0).
MLARUN_HD inline float SoftmaxInvSum(float l) { return l > 0.f ? 1.f / l : 0.f; }

// ---- Merging normalized partial results ---------------------------------

// log(e^a + e^b), exact for -inf operands.
MLARUN_HD inline float LseAdd(float a, float b) {
  if (a == kLseNegInf) return b;
  if (b == kLseNegInf) return a;
  const float m = fmaxf(a, b);
  return m + log1pf(expf(-fabsf(a - b)));
}

// The log-sum-exp over n partials lse[0], lse[stride], ...: max first, so no
// term overflows. -inf when every partial is empty (or n == 0).
MLARUN_HD inline float LseOfParts(const float* lse, int64_t n, int64_t stride) {
  float m = kLseNegInf;
  for (int64_t i = 0; i < n; ++i) m = fmaxf(m, lse[i * stride]);
  if (m == kLseNegInf) return kLseNegInf;
  float sum = 0.f;
  for (int64_t i = 0; i < n; ++i) {
    const float x = lse[i * stride];
    if (x != kLseNegInf) sum += expf(x - m);
  }
  return m + logf(sum);
}

// Weight of a partial with log-sum-exp `part` in a merge whose total is
// `total`: exp(part - total); 0 for an empty partial.
MLARUN_HD inline float LseWeight(float part, float total) {
  if (part == kLseNegInf || total == kLseNegInf) return 0.f;
  return expf(part - total);
}

// wa * a + wb * b, where a zero weight drops its operand unread (0 * NaN
// would be NaN).
MLARUN_HD inline float LseMix(float a, float wa, float b, float wb) {
  float r = 0.f;
  if (wa != 0.f) r = wa * a;
  if (wb != 0.f) r = fmaf(wb, b, r);
  return r;
}

// Weights of the two-way merge acc <- merge(acc, part) (the CPU's MergeLse):
// returns the merged lse. An empty part keeps acc as it is (weights 1, 0);
// an empty acc takes part (0, 1); both empty stay empty (1, 0).
MLARUN_HD inline float LseMergeWeights(float acc_lse, float part_lse, float* w_acc, float* w_part) {
  if (part_lse == kLseNegInf) {
    *w_acc = 1.f;
    *w_part = 0.f;
    return acc_lse;
  }
  if (acc_lse == kLseNegInf) {
    *w_acc = 0.f;
    *w_part = 1.f;
    return part_lse;
  }
  const float lse = LseAdd(acc_lse, part_lse);
  *w_acc = expf(acc_lse - lse);
  *w_part = expf(part_lse - lse);
  return lse;
}

// One row of d values: acc <- merge(acc, part); acc_lse updated.
MLARUN_HD inline void LseMergeRow(float* acc, float* acc_lse, const float* part, float part_lse, int64_t d) {
  float wa, wp;
  const float lse = LseMergeWeights(*acc_lse, part_lse, &wa, &wp);
  if (wa == 1.f && wp == 0.f) return;
  for (int64_t i = 0; i < d; ++i) acc[i] = LseMix(acc[i], wa, part[i], wp);
  *acc_lse = lse;
}

}  // namespace mlarun
