// attention/cuda/lse_merge.h on the host: online softmax over key tiles and
// merges of partial results against a float64 softmax over the union.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "attention/cuda/lse_merge.h"

namespace mlarun {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// float64 softmax of scores (masked = -inf) applied to values [n, d].
void Reference(const std::vector<float>& x, const std::vector<float>& v, int d, std::vector<double>* o, double* lse) {
  double m = -INFINITY;
  for (float s : x) m = std::max(m, static_cast<double>(s));
  o->assign(static_cast<size_t>(d), 0.0);
  if (m == -INFINITY) {
    *lse = -INFINITY;
    return;
  }
  double sum = 0;
  for (size_t k = 0; k < x.size(); ++k) {
    if (x[k] == kNegInf) continue;
    const double w = std::exp(static_cast<double>(x[k]) - m);
    sum += w;
    for (int c = 0; c < d; ++c) (*o)[c] += w * v[k * d + c];
  }
  for (double& e : *o) e /= sum;
  *lse = m + std::log(sum);
}

// Keys [b, e) as the kernels do it: online softmax over tiles of `tile`
// keys, then normalized (o, lse).
void Partial(const std::vector<float>& x, const std::vector<float>& v, int d, size_t b, size_t e, size_t tile,
             std::vector<float>* o, float* lse) {
  float m = kNegInf, l = 0.f;
  std::vector<float> acc(static_cast<size_t>(d), 0.f);
  for (size_t kb = b; kb < e; kb += tile) {
    const size_t ke = std::min(e, kb + tile);
    float tmax = kNegInf;
    for (size_t k = kb; k < ke; ++k) tmax = std::max(tmax, x[k]);
    const float m_new = std::max(m, tmax);
    const float alpha = SoftmaxRescale(m, m_new);
    float sum = 0.f;
    for (float& a : acc) a *= alpha;
    for (size_t k = kb; k < ke; ++k) {
      const float p = SoftmaxProb(x[k], m_new);
      sum += p;
      for (int c = 0; c < d; ++c) acc[c] += p * v[k * d + c];
    }
    l = l * alpha + sum;
    m = m_new;
  }
  const float inv = SoftmaxInvSum(l);
  o->resize(static_cast<size_t>(d));
  for (int c = 0; c < d; ++c) (*o)[c] = acc[c] * inv;
  *lse = SoftmaxLse(m, l);
}

void ExpectClose(const std::vector<float>& o, float lse, const std::vector<double>& ref, double ref_lse) {
  if (ref_lse == -INFINITY) {
    EXPECT_EQ(lse, kNegInf);
    for (float e : o) EXPECT_EQ(e, 0.f);
    return;
  }
  EXPECT_NEAR(lse, ref_lse, 1e-5 * std::max(1.0, std::fabs(ref_lse)));
  for (size_t c = 0; c < o.size(); ++c) EXPECT_NEAR(o[c], ref[c], 2e-5) << c;
}

TEST(MlaLseMerge, SplitsMergeToTheSoftmaxOfTheUnion) {
  std::mt19937_64 rng(5);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (int round = 0; round < 200; ++round) {
    const size_t n = 1 + rng() % 700;
    const int d = 1 + static_cast<int>(rng() % 17);
    const int mode = static_cast<int>(rng() % 4);  // 0 dense, 1 some masked, 2 masked runs, 3 all masked
    std::vector<float> x(n), v(n * static_cast<size_t>(d));
    for (size_t k = 0; k < n; ++k) {
      x[k] = nd(rng) * (round % 3 == 0 ? 30.f : 3.f);  // large spreads stress the rescaling
      if (mode == 1 && rng() % 3 == 0) x[k] = kNegInf;
      if (mode == 2 && (k / 64) % 2 == 1) x[k] = kNegInf;  // whole tiles (splits) empty
      if (mode == 3) x[k] = kNegInf;
    }
    for (float& e : v) e = nd(rng);
    std::vector<double> ref;
    double ref_lse;
    Reference(x, v, d, &ref, &ref_lse);

    // Random split points (some splits empty of keys altogether).
    const size_t splits = 1 + rng() % 9;
    std::vector<size_t> cuts{0, n};
    for (size_t s = 1; s < splits; ++s) cuts.push_back(rng() % (n + 1));
    std::sort(cuts.begin(), cuts.end());
    const size_t tile = std::vector<size_t>{1, 32, 64}[rng() % 3];
    std::vector<std::vector<float>> parts;
    std::vector<float> lses;
    for (size_t s = 0; s + 1 < cuts.size(); ++s) {
      std::vector<float> o;
      float lse;
      Partial(x, v, d, cuts[s], cuts[s + 1], tile, &o, &lse);
      parts.push_back(o);
      lses.push_back(lse);
    }
    SCOPED_TRACE(testing::Message() << "round " << round << " n=" << n << " mode=" << mode);

    // The combine kernel's way: total lse, then weights.
    const float total = LseOfParts(lses.data(), static_cast<int64_t>(lses.size()), 1);
    std::vector<float> merged(static_cast<size_t>(d), 0.f);
    for (size_t s = 0; s < parts.size(); ++s) {
      const float w = LseWeight(lses[s], total);
      for (int c = 0; c < d; ++c) merged[c] = LseMix(merged[c], 1.f, parts[s][c], w);
    }
    ExpectClose(merged, total, ref, ref_lse);

    // The chunk merge's way: a running (acc, lse) from empty, two at a time.
    std::vector<float> acc(static_cast<size_t>(d), 0.f);
    float acc_lse = kNegInf;
    for (size_t s = 0; s < parts.size(); ++s) LseMergeRow(acc.data(), &acc_lse, parts[s].data(), lses[s], d);
    ExpectClose(acc, acc_lse, ref, ref_lse);
    if (HasFailure()) return;
  }
}

TEST(MlaLseMerge, EmptyOperandsAreNeverRead) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  float wa, wp;
  // Empty part: acc kept, even if the part's buffer holds NaN.
  EXPECT_EQ(LseMergeWeights(1.5f, kNegInf, &wa, &wp), 1.5f);
  EXPECT_EQ(LseMix(2.f, wa, nan, wp), 2.f);
  // Empty acc (never written: NaN) takes the part.
  EXPECT_EQ(LseMergeWeights(kNegInf, 0.25f, &wa, &wp), 0.25f);
  EXPECT_EQ(LseMix(nan, wa, 3.f, wp), 3.f);
  // Both empty: still empty.
  EXPECT_EQ(LseMergeWeights(kNegInf, kNegInf, &wa, &wp), kNegInf);
  EXPECT_EQ(LseWeight(kNegInf, kNegInf), 0.f);
  EXPECT_EQ(LseWeight(0.f, kNegInf), 0.f);
  EXPECT_EQ(LseOfParts(nullptr, 0, 1), kNegInf);
  const float all_empty[3] = {kNegInf, kNegInf, kNegInf};
  EXPECT_EQ(LseOfParts(all_empty, 3, 1), kNegInf);
  // Online softmax before any visible key.
  EXPECT_EQ(SoftmaxRescale(kNegInf, kNegInf), 1.f);
  EXPECT_EQ(SoftmaxProb(kNegInf, kNegInf), 0.f);
  EXPECT_EQ(SoftmaxRescale(kNegInf, 3.f), 0.f);
  EXPECT_EQ(SoftmaxLse(kNegInf, 0.f), kNegInf);
  EXPECT_EQ(SoftmaxInvSum(0.f), 0.f);
}

TEST(MlaLseMerge, LseAddIsStableForLargeGaps) {
  EXPECT_FLOAT_EQ(LseAdd(1000.f, 1000.f), 1000.f + std::log(2.f));
  EXPECT_FLOAT_EQ(LseAdd(-1000.f, 0.f), 0.f);
  EXPECT_EQ(LseAdd(kNegInf, 7.f), 7.f);
  EXPECT_EQ(LseAdd(7.f, kNegInf), 7.f);
  const float lses[2] = {88.f, 88.f};  // exp(88) is near float's limit; the max shift keeps it finite
  EXPECT_NEAR(LseOfParts(lses, 2, 1), 88.f + std::log(2.f), 1e-4);
}

}  // namespace
}  // namespace mlarun
