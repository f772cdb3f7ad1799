// A BlockImporter for tests: it copies blocks from another pool of the same
// shape in this process, as the worker's transfer plane fetches them from
// another DP group's pools. And a poison for the pools that import: rows
// nobody wrote are NaN, so a block imported to the wrong place, or not at
// all, shows in the tokens.
#pragma once

#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "runtime/runner/model_runner.h"

namespace mlarun {

class PoolCopyImporter : public BlockImporter {
 public:
  // `from`: the old group's pool (outlives the importer).
  explicit PoolCopyImporter(const LatentPool* from) : from_(from) {}

  // Every layer's rows of block import.src[i] of `from` into block
  // import.dst[i] of `pool`. With `fail` set: copies the first block only,
  // then fails (a fetch that broke half-way).
  Status Import(const StepPlan::Import& import, int rank_in_group, LatentPool& pool) override {
    calls.push_back(import);
    ranks.push_back(rank_in_group);
    const LatentCacheConfig &c = pool.config(), &f = from_->config();
    if (c.block_size != f.block_size || c.dtype != f.dtype || c.num_layers != f.num_layers ||
        pool.row_width() != from_->row_width())
      return InvalidArgumentError("test importer: the pools differ in shape");
    const size_t bytes = static_cast<size_t>(c.block_size * pool.row_width()) * DTypeSize(c.dtype);
    for (size_t i = 0; i < import.src.size(); ++i) {
      if (fail && i == 1) break;
      if (import.src[i] < 0 || import.src[i] >= from_->num_blocks())
        return OutOfRangeError("test importer: source block ", import.src[i], " outside the old pool");
      for (int64_t l = 0; l < c.num_layers; ++l) {
        const auto* src = static_cast<const std::byte*>(from_->LayerData(l)) + import.src[i] * bytes;
        auto* dst = static_cast<std::byte*>(pool.LayerData(l)) + import.dst[i] * bytes;
        std::memcpy(dst, src, bytes);
      }
    }
    if (fail) return UnavailableError("test importer: the old group is gone");
    return Status::Ok();
  }

  bool fail = false;
  std::vector<StepPlan::Import> calls;  // every import asked for, in order
  std::vector<int> ranks;               // the rank_in_group of each call

 private:
  const LatentPool* from_;
};

// Every row of an f32 pool NaN.
inline void PoisonPool(const LatentPool& pool) {
  const LatentCacheConfig& c = pool.config();
  if (c.dtype != DType::kF32) return;
  const int64_t n = pool.num_blocks() * c.block_size * pool.row_width();
  for (int64_t l = 0; l < c.num_layers; ++l) {
    float* p = static_cast<float*>(pool.LayerData(l));
    for (int64_t i = 0; i < n; ++i) p[i] = std::numeric_limits<float>::quiet_NaN();
  }
}

}  // namespace mlarun
