// Random test inputs for the op tests: values in +-[0.1, 1), never zero, so
// a missing term always shows.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

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

}  // namespace mlarun::testing_values
