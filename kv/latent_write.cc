#include "kv/latent_write.h"

#include "kv/latent_write_backend.h"

namespace mlarun {

Status LatentWriteCheck(const LatentWriteParams& p) {
  if (p.dtype != DType::kBF16 && p.dtype != DType::kF32)
    return InvalidArgumentError("latent write: dtype must be bf16 or f32, got ",
                                IsValidDType(p.dtype) ? DTypeName(p.dtype) : "(invalid)");
  if (p.n < 0) return InvalidArgumentError("latent write: n is negative (", p.n, ")");
  if (p.block_size <= 0 || p.d_latent <= 0 || p.d_rope < 0)
    return InvalidArgumentError("latent write: block_size (", p.block_size, ") and d_latent (", p.d_latent,
                                ") must be positive, d_rope (", p.d_rope, ") >= 0");
  if (p.stride_token < p.d_latent + p.d_rope || p.stride_block < p.block_size * p.stride_token)
    return InvalidArgumentError("latent write: strides (block ", p.stride_block, ", token ", p.stride_token,
                                ") overlap rows of d_latent + d_rope = ", p.d_latent + p.d_rope);
  if (p.n == 0) return Status::Ok();
  if (p.num_blocks <= 0) return InvalidArgumentError("latent write: num_blocks must be positive, got ", p.num_blocks);
  if (p.cache == nullptr || p.slots == nullptr || p.kv_c == nullptr || (p.d_rope > 0 && p.k_pe == nullptr))
    return InvalidArgumentError("latent write: cache, slots, kv_c and (with d_rope > 0) k_pe must be set");
  if (p.kv_c_stride < p.d_latent || (p.d_rope > 0 && p.k_pe_stride < p.d_rope))
    return InvalidArgumentError("latent write: kv_c_stride (", p.kv_c_stride, ") must be >= d_latent and k_pe_stride (",
                                p.k_pe_stride, ") >= d_rope");
  return Status::Ok();
}

Status LatentWriteRun(const LatentWriteParams& p) {
  switch (p.backend) {
    case Backend::kCpu:
      MLARUN_RETURN_IF_ERROR(LatentWriteCheck(p));
      return p.n == 0 ? Status::Ok() : cpu::WriteLatentRows(p);
    case Backend::kCuda:
      return cuda::LaunchWriteLatentRows(p);
  }
  return InvalidArgumentError("latent write: unknown backend ", static_cast<int>(p.backend));
}

}  // namespace mlarun
