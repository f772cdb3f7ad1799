// A latent cache of one process with no scheduler: the block manager and the
// pool side by side, for benchmarks and tests that drive Model::Forward with
// sequences they lay out themselves. Serving goes through the scheduler
// (runtime/engine/) and the runner (runtime/runner/), which hold the two
// apart.
#pragma once

#include <memory>
#include <span>

#include "kv/latent_cache.h"
#include "kv/latent_pool.h"
#include "runtime/model/model.h"

namespace mlarun {

struct LocalLatentCache {
  std::unique_ptr<LatentCache> blocks;
  std::unique_ptr<LatentPool> pool;

  // The pool in `memory` (the model's, for a device runner).
  static StatusOr<LocalLatentCache> Create(const LatentCacheConfig& config, DeviceMemory& memory = HostMemory());
  // Appends `tokens` to sequence `id` (added if new) and returns the step's
  // view of them: their positions, the sequence's block table (valid until
  // `id` is appended to again or released), `logits`. `tokens` must outlive
  // the returned ForwardSeq.
  StatusOr<ForwardSeq> Append(SeqId id, std::span<const int32_t> tokens,
                              ForwardSeq::Logits logits = ForwardSeq::Logits::kLast);
};

}  // namespace mlarun
