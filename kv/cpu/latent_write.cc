#include <cstddef>

#include "gemm/convert.h"
#include "kv/latent_write_backend.h"

namespace mlarun::cpu {

Status WriteLatentRows(const LatentWriteParams& p) {
  const int64_t slots_end = p.num_blocks * p.block_size;
  for (int64_t t = 0; t < p.n; ++t)  // all slots first: a bad one writes nothing
    if (p.slots[t] >= slots_end)
      return OutOfRangeError("latent write: slots[", t, "] = ", p.slots[t], " is in block ", p.slots[t] / p.block_size,
                             ", outside the layer's ", p.num_blocks, " blocks");
  const size_t es = DTypeSize(p.dtype);
  for (int64_t t = 0; t < p.n; ++t) {
    const int64_t s = p.slots[t];
    if (s < 0) continue;
    std::byte* row =
        static_cast<std::byte*>(p.cache) +
        ((s / p.block_size) * p.stride_block + (s % p.block_size) * p.stride_token) * static_cast<int64_t>(es);
    StoreFromF32(p.kv_c + t * p.kv_c_stride, row, p.dtype, p.d_latent);
    if (p.d_rope > 0)
      StoreFromF32(p.k_pe + t * p.k_pe_stride, row + p.d_latent * static_cast<int64_t>(es), p.dtype, p.d_rope);
  }
  return Status::Ok();
}

}  // namespace mlarun::cpu
