// The greedy sampler's reduction over a logit row, as Sampler::Sample
// (runtime/ops/sampler.cc) computes it, for backends that reduce the row
// where it lies (runtime/ops/cuda/sampling.cu) and hand the result to
// Sampler::SampleGreedyFrom:
//  * the argmax: the largest logit with NaN skipped, the lowest id holding it
//    (fp32 ==, so -0 ties +0); none when no logit exceeds -inf;
//  * the weight sum: sum over the row of exp(CleanLogit(l) - CleanLogit(max)),
//    in blocks of kSamplerWeightBlock ids with four accumulators each, the
//    blocks added in id order; every operation the same correctly rounded
//    IEEE double one as the sampler's, so the sums are equal bit for bit and
//    so are the logprobs (the host takes the log).
// sampler_greedy tests in tests/runtime/ops/ops_cuda_test.cc hold these to
// Sampler::Sample on the host.
#pragma once

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "base/host_device.h"

namespace mlarun {

// sampler.cc's kBlock: the weights are summed in blocks of this many ids.
inline constexpr int64_t kSamplerWeightBlock = 256;

namespace sampler_math {

// Double arithmetic that nvcc may not contract into FMAs (the sampler's own
// file is built with fp-contract=off).
MLARUN_HD inline double Add(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dadd_rn(a, b);
#else
  return a + b;
#endif
}
MLARUN_HD inline double Sub(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dsub_rn(a, b);
#else
  return a - b;
#endif
}
MLARUN_HD inline double Mul(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dmul_rn(a, b);
#else
  return a * b;
#endif
}
MLARUN_HD inline double Div(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __ddiv_rn(a, b);
#else
  return a / b;
#endif
}
MLARUN_HD inline int64_t BitsOf(double x) {
#if defined(__CUDA_ARCH__)
  return __double_as_longlong(x);
#else
  int64_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  return bits;
#endif
}
MLARUN_HD inline double DoubleOf(uint64_t bits) {
#if defined(__CUDA_ARCH__)
  return __longlong_as_double(static_cast<long long>(bits));
#else
  double x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
#endif
}

}  // namespace sampler_math

// NaN as -inf, +inf as the largest float (sampler.cc's CleanLogit).
MLARUN_HD inline double SamplerCleanLogit(float x) {
  const double d = x;
  return d != d ? -INFINITY : (d > FLT_MAX ? static_cast<double>(FLT_MAX) : d);
}

// exp(x) for x <= 0, the sampler's (runtime/ops/sampler.cc includes this
// header under its own compile options).
MLARUN_HD inline double SamplerExpNonPositive(double x) {
  using namespace sampler_math;
  constexpr double kMinArg = -708.0;
  constexpr double kInvLn2 = 1.44269504088896338700e+00;
  constexpr double kLn2Hi = 6.93147180369123816490e-01;
  constexpr double kLn2Lo = 1.90821492927058770002e-10;
  constexpr double kP1 = 1.66666666666666019037e-01;
  constexpr double kP2 = -2.77777777770155933842e-03;
  constexpr double kP3 = 6.61375632143793436117e-05;
  constexpr double kP4 = -1.65339022054652515390e-06;
  constexpr double kP5 = 4.13813679705723846039e-08;
  constexpr double kShifter = 0x1.8p52;
  const bool tiny = !(x >= kMinArg);
  const double xc = tiny ? kMinArg : x;
  const double kd = Add(Mul(xc, kInvLn2), kShifter);
  const double k = Sub(kd, kShifter);
  const double hi = Sub(xc, Mul(k, kLn2Hi));
  const double lo = Mul(k, kLn2Lo);
  const double r = Sub(hi, lo);
  const double t = Mul(r, r);
  const double poly = Add(kP1, Mul(t, Add(kP2, Mul(t, Add(kP3, Mul(t, Add(kP4, Mul(t, kP5))))))));
  const double c = Sub(r, Mul(t, poly));
  const double y = Sub(1.0, Sub(Sub(lo, Div(Mul(r, c), Sub(2.0, c))), hi));
  const int64_t ki = BitsOf(kd) - BitsOf(kShifter);
  const double two_to_k = DoubleOf(static_cast<uint64_t>(ki + 1023) << 52);
  return tiny ? 0.0 : Mul(y, two_to_k);
}

// The weight sum of logits[start, end), one block of the row (sampler.cc's
// BlockSums: four accumulators over consecutive ids, the tail into the
// first). `max_logit` is SamplerCleanLogit of the row's max.
MLARUN_HD inline double SamplerBlockWeightSum(const float* logits, int64_t start, int64_t end, double max_logit) {
  using namespace sampler_math;
  double acc0 = 0.0, acc1 = 0.0, acc2 = 0.0, acc3 = 0.0;
  int64_t i = start;
  for (; i + 4 <= end; i += 4) {
    acc0 = Add(acc0, SamplerExpNonPositive(Sub(SamplerCleanLogit(logits[i]), max_logit)));
    acc1 = Add(acc1, SamplerExpNonPositive(Sub(SamplerCleanLogit(logits[i + 1]), max_logit)));
    acc2 = Add(acc2, SamplerExpNonPositive(Sub(SamplerCleanLogit(logits[i + 2]), max_logit)));
    acc3 = Add(acc3, SamplerExpNonPositive(Sub(SamplerCleanLogit(logits[i + 3]), max_logit)));
  }
  for (; i < end; ++i) acc0 = Add(acc0, SamplerExpNonPositive(Sub(SamplerCleanLogit(logits[i]), max_logit)));
  return Add(Add(acc0, acc1), Add(acc2, acc3));
}

// The whole reduction of logits[0, n) in one thread: the argmax (-1: none)
// and the weight sum (0 when there is no argmax). The CUDA kernel computes
// the same in parallel; this is its host reference.
struct GreedyReduction {
  int64_t argmax = -1;
  double weight_sum = 0.0;
};
MLARUN_HD inline GreedyReduction SamplerGreedyReduce(const float* logits, int64_t n) {
  float max_key = -INFINITY;
  for (int64_t i = 0; i < n; ++i) max_key = logits[i] > max_key ? logits[i] : max_key;  // NaN never wins
  GreedyReduction r;
  if (!(max_key > -INFINITY)) return r;
  r.argmax = 0;
  while (logits[r.argmax] != max_key) ++r.argmax;
  const double max_logit = SamplerCleanLogit(max_key);
  for (int64_t start = 0; start < n; start += kSamplerWeightBlock) {
    const int64_t end = start + kSamplerWeightBlock < n ? start + kSamplerWeightBlock : n;
    r.weight_sum = sampler_math::Add(r.weight_sum, SamplerBlockWeightSum(logits, start, end, max_logit));
  }
  return r;
}

}  // namespace mlarun
