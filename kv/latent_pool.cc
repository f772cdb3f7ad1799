#include "kv/latent_pool.h"

#include <algorithm>
#include <cstdlib>
#include <vector>

#include "kv/latent_write.h"

namespace mlarun {

Status ValidateLatentCacheConfig(const LatentCacheConfig& c) {
  if (c.num_layers <= 0) return InvalidArgumentError("latent cache: num_layers must be positive, got ", c.num_layers);
  if (c.kv_lora_rank <= 0)
    return InvalidArgumentError("latent cache: kv_lora_rank must be positive, got ", c.kv_lora_rank);
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
  if (layer < 0 || layer >= config_.num_layers)
    return OutOfRangeError("latent cache: layer ", layer, " outside [0, ", config_.num_layers, ")");
  const int64_t bs = config_.block_size;
  if (pos < 0 || n < 0 || pos + n > static_cast<int64_t>(table.size()) * bs)
    return OutOfRangeError("latent cache: rows [", pos, ", ", pos + n, ") outside the ", table.size(),
                           " blocks of the block table");
  for (int64_t b = pos / bs; b * bs < pos + n; ++b)
    if (table[static_cast<size_t>(b)] < 0 || table[static_cast<size_t>(b)] >= num_blocks_)
      return OutOfRangeError("latent cache: block id ", table[static_cast<size_t>(b)], " outside [0, ", num_blocks_,
                             ")");
  const PagedRowsView v = Layer(layer);
  const int64_t L = config_.kv_lora_rank, R = config_.rope_dim;
  DeviceMemory& memory = *buffer_.memory();
  LatentWriteParams w{.cache = LayerData(layer),
                      .dtype = v.dtype,
                      .block_size = bs,
                      .num_blocks = num_blocks_,
                      .stride_block = v.stride_block,
                      .stride_token = v.stride_token,
                      .d_latent = L,
                      .d_rope = R,
                      .n = 1,
                      .kv_c_stride = kv_c_stride,
                      .k_pe_stride = k_pe_stride,
                      .backend = memory.backend()};
  if (memory.host_accessible()) {
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
  // A device pool: the rows and their slots go over once, then the device's
  // cache write (for benchmarks and tests filling a context; a model step
  // writes its rows with the op directly).
  if (n == 0) return Status::Ok();
  std::vector<float> rows(static_cast<size_t>(n * (L + R)));
  std::vector<int64_t> slots(static_cast<size_t>(n));
  for (int64_t t = 0; t < n; ++t) {
    const int64_t p = pos + t;
    slots[static_cast<size_t>(t)] = table[static_cast<size_t>(p / bs)] * bs + p % bs;
    std::copy_n(kv_c + t * kv_c_stride, L, rows.begin() + t * (L + R));
    std::copy_n(k_pe + t * k_pe_stride, R, rows.begin() + t * (L + R) + L);
  }
  MLARUN_ASSIGN_OR_RETURN(DeviceBuffer d_rows,
                          DeviceBuffer::Allocate(memory, rows.size() * sizeof(float), "latent rows"));
  MLARUN_ASSIGN_OR_RETURN(DeviceBuffer d_slots,
                          DeviceBuffer::Allocate(memory, slots.size() * sizeof(int64_t), "slots"));
  MLARUN_RETURN_IF_ERROR(memory.CopyIn(d_rows.data(), rows.data(), rows.size() * sizeof(float)));
  MLARUN_RETURN_IF_ERROR(memory.CopyIn(d_slots.data(), slots.data(), slots.size() * sizeof(int64_t)));
  w.n = n;
  w.slots = static_cast<const int64_t*>(d_slots.data());
  w.kv_c = static_cast<const float*>(d_rows.data());
  w.k_pe = w.kv_c + L;
  w.kv_c_stride = w.k_pe_stride = L + R;
  MLARUN_RETURN_IF_ERROR(LatentWriteRun(w));
  // The write is queued; the staging buffers are freed when this returns, so
  // wait for it: a copy out is synchronous and ordered after the kernel.
  float sink = 0;
  return memory.CopyOut(&sink, d_rows.data(), sizeof(float));
}

}  // namespace mlarun
