// The memory of the paged latent cache: one [kv_c | k_pe] row of width L + R
// per token per layer, in fixed-size blocks, addressed by block id. Which
// blocks hold which sequence is not its business: the scheduler's block
// manager (LatentCache) decides, and every step's plan carries each
// sequence's block table, so a rank that never schedules (an attn-TP member)
// needs only this.
//
// Layout (one allocation): [layer][block][token in block][L + R], so the rows
// of one block of one layer are contiguous and a layer is a strided view
// (Layer). bf16 (default) or f32.
//
// Not thread-safe for writes: one step at a time writes it.
#pragma once

#include <cstdint>
#include <memory>
#include <span>

#include "base/block_size.h"
#include "base/device_memory.h"
#include "base/dtype.h"
#include "base/status.h"
#include "base/tensor_view.h"

namespace mlarun {

struct LatentCacheConfig {
  int64_t num_layers = 1;
  int64_t kv_lora_rank = 512;              // L: width of kv_c
  int64_t rope_dim = 64;                   // R: width of k_pe
  int64_t block_size = kDefaultBlockSize;  // tokens per block
  DType dtype = DType::kBF16;              // bf16 or f32
  // Capacity: as many whole blocks as fit in this many bytes.
  int64_t budget_bytes = int64_t{1} << 30;
  // Publish full blocks for reuse by later sequences with the same prefix
  // (the block manager's; the pool ignores it).
  bool enable_prefix_caching = true;
  // Touch every page of the pool at creation, so the memory is committed up
  // front (a server should fail at start-up, not under load, when the host
  // cannot back its cache) and shows in the process's resident size.
  bool commit_memory = false;

  // num_layers x (L + R) x dtype size.
  int64_t bytes_per_token() const {
    return num_layers * (kv_lora_rank + rope_dim) * static_cast<int64_t>(DTypeSize(dtype));
  }
  int64_t block_bytes() const { return bytes_per_token() * block_size; }
  // The capacity rule: the whole blocks of `block_bytes` in `budget_bytes`
  // (0 when the budget is below one block, or negative).
  static int64_t BlocksIn(int64_t budget_bytes, int64_t block_bytes) {
    return block_bytes > 0 && budget_bytes >= block_bytes ? budget_bytes / block_bytes : 0;
  }
  int64_t num_blocks() const { return BlocksIn(budget_bytes, block_bytes()); }

  friend bool operator==(const LatentCacheConfig&, const LatentCacheConfig&) = default;
};

// The fields' checks, naming the bad one (e.g. a budget smaller than one
// block). The pool and the block manager both start with it.
Status ValidateLatentCacheConfig(const LatentCacheConfig& c);

class LatentPool {
 public:
  // Allocates config.num_blocks() blocks in `memory` (the runner's device;
  // the host's by default).
  static StatusOr<std::unique_ptr<LatentPool>> Create(const LatentCacheConfig& config,
                                                      DeviceMemory& memory = HostMemory());

  ~LatentPool();
  LatentPool(const LatentPool&) = delete;
  LatentPool& operator=(const LatentPool&) = delete;

  const LatentCacheConfig& config() const { return config_; }
  int64_t num_blocks() const { return num_blocks_; }
  int64_t row_width() const { return config_.kv_lora_rank + config_.rope_dim; }
  int64_t bytes() const { return num_blocks_ * config_.block_bytes(); }

  // One layer as a paged view (rows of width L + R). The pointer is writable:
  // tests and the model's cache writer may fill rows through it.
  PagedRowsView Layer(int64_t layer) const;
  void* LayerData(int64_t layer) const;

  // Writes the rows of positions [pos, pos + n) of the sequence whose blocks
  // are `block_table` (position p lives in block block_table[p / block_size])
  // in `layer`, converting from fp32: row t = [kv_c[t * kv_c_stride .. + L) |
  // k_pe[t * k_pe_stride .. + R)]; kv_c and k_pe are host memory, also for a
  // pool on a device (the rows are copied there first). The table must cover the positions with
  // block ids of this pool (OUT_OF_RANGE otherwise, nothing written). The
  // caller (the scheduler, through the plan) guarantees that no other
  // sequence reads those blocks' rows as its own. The cache write op
  // (kv/latent_write.h) on this pool's memory, for callers with a block
  // table rather than a step's slot mapping; the model's step calls the op.
  Status WriteRows(int64_t layer, std::span<const int32_t> block_table, int64_t pos, int64_t n, const float* kv_c,
                   int64_t kv_c_stride, const float* k_pe, int64_t k_pe_stride);

 private:
  LatentPool(const LatentCacheConfig& config, int64_t num_blocks, DeviceBuffer buffer);

  const LatentCacheConfig config_;
  const int64_t num_blocks_;
  const int64_t layer_stride_;  // elements
  DeviceBuffer buffer_;
  void* const memory_;
};

}  // namespace mlarun
