// The MoE gate's arithmetic and selection rule (moe_gate.h), shared by the
// CPU gate (runtime/ops/cpu/moe_gate.cc) and the CUDA one
// (runtime/ops/cuda/moe_gate.cu), so that both compute the same scores bit
// for bit and therefore choose the same experts, also where two choice scores
// are a rounding error apart.
#pragma once

#include <cmath>
#include <cstdint>

#include "base/host_device.h"

namespace mlarun {

// e^x rounded to fp32 from a double exponential. libm's and CUDA's double exp
// are within an ulp of the exact value, so their fp32 roundings agree except
// where the exact value lies within ~2^-29 of an fp32 rounding boundary; the
// fp32 exponentials (glibc's and CUDA's expf) differ by up to 2 ulp, enough
// to reorder near-tied experts.
MLARUN_HD inline float GateExp(float x) { return static_cast<float>(exp(static_cast<double>(x))); }

// V3's score: the sigmoid of a router logit.
MLARUN_HD inline float GateSigmoid(float logit) { return 1.f / (1.f + GateExp(-logit)); }

// The key the choice order compares: NaN counts as -inf, so that the order is
// total (every rank below is distinct and each output slot is written once).
MLARUN_HD inline float GateKey(float v) { return v != v ? -INFINITY : v; }

// True when (va, a) is chosen before (vb, b): the larger value, then the
// lower index.
MLARUN_HD inline bool GateBefore(float va, int64_t a, float vb, int64_t b) {
  va = GateKey(va);
  vb = GateKey(vb);
  return va > vb || (va == vb && a < b);
}

// How many of v[0, n) are chosen before v[i]: its position in the order
// (distinct for distinct i), so i is among the top k iff the rank is < k.
MLARUN_HD inline int64_t GateRank(const float* v, int64_t n, int64_t i) {
  int64_t rank = 0;
  const float vi = v[i];
  for (int64_t j = 0; j < n; ++j) rank += GateBefore(v[j], j, vi, i) ? 1 : 0;
  return rank;
}

// A group's score over its `per_group` choice scores s: the sum of its two
// best (V3 noaux_tc; the best alone when the group has one expert), summed
// best first from 0 as the CPU always did, or its best (V2
// group_limited_greedy). REQUIRES: per_group >= 1.
MLARUN_HD inline float GateGroupScore(const float* s, int64_t per_group, bool sum_of_two_best) {
  int64_t best = 0;
  for (int64_t i = 1; i < per_group; ++i)
    if (GateBefore(s[i], i, s[best], best)) best = i;
  if (!sum_of_two_best) return s[best];
  float sum = 0.f + s[best];
  if (per_group == 1) return sum;
  int64_t second = best == 0 ? 1 : 0;
  for (int64_t i = 0; i < per_group; ++i)
    if (i != best && GateBefore(s[i], i, s[second], second)) second = i;
  return sum + s[second];
}

}  // namespace mlarun
