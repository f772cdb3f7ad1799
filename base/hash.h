// Small integer hashing shared by the cache's prefix chain, the random
// weights of YAML models, the sampler's seeding and the simulated worker.
#pragma once

#include <cstdint>

namespace mlarun {

// 2^64 / golden ratio: splitmix64's increment.
inline constexpr uint64_t kGoldenGamma = 0x9e3779b97f4a7c15ull;

// splitmix64's finalizer: a bijective mix of all 64 bits.
inline uint64_t Mix64(uint64_t x) {
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

}  // namespace mlarun
