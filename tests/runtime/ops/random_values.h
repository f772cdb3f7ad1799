// Random test inputs for the op tests: values in +-[0.1, 1), never zero, so
// a missing term always shows; weights whose row padding is NaN.
#pragma once

#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "base/dtype.h"
#include "gemm/convert.h"
#include "runtime/ops/linear.h"

namespace mlarun::testing_values {

class Random {
 public:
  explicit Random(uint32_t seed) : rng_(seed) {}
  float Next() {
    const float v = std::uniform_real_distribution<float>(0.1f, 1.f)(rng_);
    return std::bernoulli_distribution(0.5)(rng_) ? v : -v;
  }
  std::vector<float> Vector(size_t n) {
    std::vector<float> v(n);
    for (float& x : v) x = Next();
    return v;
  }
  int Int(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng_); }
  float Normal(float scale) { return std::normal_distribution<float>(0.f, scale)(rng_); }
  std::mt19937& rng() { return rng_; }

 private:
  std::mt19937 rng_;
};

// A [out, in] weight with row stride in + pad; the padding columns are NaN,
// so a product that reads past `in` shows it.
inline Linear RandomLinear(Random& r, int64_t out, int64_t in, DType dt, int64_t pad = 3) {
  Linear w = Linear::Owned(out, in + pad, dt);
  std::vector<float> row(static_cast<size_t>(in + pad));
  for (int64_t o = 0; o < out; ++o) {
    for (int64_t i = 0; i < in + pad; ++i)
      row[static_cast<size_t>(i)] = i < in ? r.Next() : std::numeric_limits<float>::quiet_NaN();
    StoreFromF32(row.data(), w.mutable_data() + o * (in + pad) * static_cast<int64_t>(DTypeSize(dt)), dt, in + pad);
  }
  w.in = in;  // the padding stays behind ld
  return w;
}

}  // namespace mlarun::testing_values
