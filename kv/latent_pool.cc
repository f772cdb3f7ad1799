#include "kv/latent_pool.h"

#include <cstdlib>

#include "kv/latent_write.h"

namespace mlarun {

Status ValidateLatentCacheConfig(const LatentCacheConfig& c) {
  if (c.num_layers <= 0) return InvalidArgumentError("latent cache: num_layers must be positive, got ", c.num_layers);
  if (c.kv_lora_rank <= 0) return InvalidArgumentError("latent cache: kv_lora_rank must be positive, got ", c.kv_lora_rank);
  if (c.rope_dim < 0) return InvalidArgumentError("latent cache: rope_dim must be >= 0, got ", c.rope_dim);
  if (c.block_size <= 0) return InvalidArgumentError("latent cache: block_size must be positive, got ", c.block_size);
  if (c.dtype != DType::kBF16 && c.dtype != DType::kF32)
    return InvalidArgumentError("latent cache: dtype must be bf16 or f32, got ", DTypeName(c.dtype));
  if (c.num_blocks() < 1)
    return InvalidArgumentError("latent cache: budget_bytes ", c.budget_bytes, " is smaller than one block (",
                                c.block_bytes(), " bytes = block_size ", c.block_size, " x ", c.bytes_per_token(),
                                " bytes per token)");
  if (c.num_blocks() > INT32_MAX) return InvalidArgumentError("latent cache: more than 2^31 blocks");
  return Status::Ok();
}

StatusOr<std::unique_ptr<LatentPool>> LatentPool::Create(const LatentCacheConfig& c, DeviceMemory& memory) {
  MLARUN_RETURN_IF_ERROR(ValidateLatentCacheConfig(c));
  const size_t bytes = static_cast<size_t>(c.num_blocks() * c.block_bytes());
  MLARUN_ASSIGN_OR_RETURN(DeviceBuffer buffer, DeviceBuffer::Allocate(memory, bytes, "the latent cache"));
  // Zero-filling touches every page: committed now, not under load.
  if (c.commit_memory) MLARUN_RETURN_IF_ERROR(memory.Zero(buffer.data(), bytes));
  return std::unique_ptr<LatentPool>(new LatentPool(c, c.num_blocks(), std::move(buffer)));
}

LatentPool::LatentPool(const LatentCacheConfig& config, int64_t num_blocks, DeviceBuffer buffer)
    : config_(config),
      num_blocks_(num_blocks),
      layer_stride_(num_blocks * config.block_size * (config.kv_lora_rank + config.rope_dim)),
      buffer_(std::move(buffer)),
      memory_(buffer_.data()) {}

LatentPool::~LatentPool() = default;

void* LatentPool::LayerData(int64_t layer) const {
  return static_cast<std::byte*>(memory_) + layer * layer_stride_ * static_cast<int64_t>(DTypeSize(config_.dtype));
}

PagedRowsView LatentPool::Layer(int64_t layer) const {
  PagedRowsView v;
  v.data = LayerData(layer);
  v.dtype = config_.dtype;
  v.num_blocks = num_blocks_;
  v.block_size = config_.block_size;
  v.row_width = row_width();
  v.stride_token = row_width();
  v.stride_block = config_.block_size * row_width();
  return v;
}

Status LatentPool::WriteRows(int64_t layer, std::span<const int32_t> table, int64_t pos, int64_t n, const float* kv_c,
                             int64_t kv_c_stride, const float* k_pe, int64_t k_pe_stride) {
  if (!buffer_.memory()->host_accessible())
    return FailedPreconditionError("latent cache: WriteRows writes host rows; a pool on ",
                                   BackendName(buffer_.memory()->backend()),
                                   " is written by the step's cache write op (kv/latent_write.h)");
  if (layer < 0 || layer >= config_.num_layers)
    return OutOfRangeError("latent cache: layer ", layer, " outside [0, ", config_.num_layers, ")");
  const int64_t bs = config_.block_size;
  if (pos < 0 || n < 0 || pos + n > static_cast<int64_t>(table.size()) * bs)
    return OutOfRangeError("latent cache: rows [", pos, ", ", pos + n, ") outside the ", table.size(),
                           " blocks of the block table");
  for (int64_t b = pos / bs; b * bs < pos + n; ++b)
    if (table[static_cast<size_t>(b)] < 0 || table[static_cast<size_t>(b)] >= num_blocks_)
      return OutOfRangeError("latent cache: block id ", table[static_cast<size_t>(b)], " outside [0, ", num_blocks_, ")");
  const PagedRowsView v = Layer(layer);
  LatentWriteParams w{.cache = LayerData(layer), .dtype = v.dtype, .block_size = bs, .num_blocks = num_blocks_,
                      .stride_block = v.stride_block, .stride_token = v.stride_token, .d_latent = config_.kv_lora_rank,
                      .d_rope = config_.rope_dim, .n = 1, .kv_c_stride = kv_c_stride, .k_pe_stride = k_pe_stride};
  for (int64_t t = 0; t < n; ++t) {  // one row at a time: no slot list to allocate
    const int64_t p = pos + t;
    const int64_t slot = table[static_cast<size_t>(p / bs)] * bs + p % bs;
    w.slots = &slot;
    w.kv_c = kv_c + t * kv_c_stride;
    w.k_pe = k_pe + t * k_pe_stride;
    MLARUN_RETURN_IF_ERROR(LatentWriteRun(w));
  }
  return Status::Ok();
}

}  // namespace mlarun
