// The latent cache's default block size, in tokens.
#pragma once

#include <cstdint>

namespace mlarun {

// Tokens per latent-cache block where no --block-size is given: the one
// default of the cache, the engine, the memory plan, the simulated worker and
// the benchmarks. FlashMLA's paged kernels take 64-token blocks, so the CPU
// and a GPU backend can share a cache layout.
inline constexpr int64_t kDefaultBlockSize = 64;

}  // namespace mlarun
