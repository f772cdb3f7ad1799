// WriteLatentRowsKernel: scatters n new rows [kv_c | k_pe] (fp32) into a paged
// latent cache through a slot mapping, converting to the cache dtype.
// One block per token, threads striding over the L + R columns; rows are
// independent, so there is no synchronisation. Use: the per-layer cache write.
#include <cuda_bf16.h>

#include "kv/latent_write.h"
#include "runtime/base/cuda/cuda_check.h"

namespace mlarun {
namespace {

template <typename T>
__device__ inline T FromFloat(float v);
template <>
__device__ inline float FromFloat<float>(float v) { return v; }
template <>
__device__ inline __nv_bfloat16 FromFloat<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

template <typename T>
__global__ void WriteLatentRowsKernel(LatentWriteParams p) {
  const int64_t t = blockIdx.x;
  const int64_t slot = p.slots[t];
  if (slot < 0) return;
  T* row = static_cast<T*>(p.cache) + (slot / p.block_size) * p.stride_block + (slot % p.block_size) * p.stride_token;
  for (int64_t c = threadIdx.x; c < p.d_latent + p.d_rope; c += blockDim.x) {
    const float v = c < p.d_latent ? p.kv_c[t * p.kv_c_stride + c] : p.k_pe[t * p.k_pe_stride + (c - p.d_latent)];
    row[c] = FromFloat<T>(v);
  }
}

}  // namespace

Status LaunchWriteLatentRows(const LatentWriteParams& p) {
  if (p.dtype != DType::kBF16 && p.dtype != DType::kF32)
    return InvalidArgumentError("latent write: dtype must be bf16 or f32, got ", DTypeName(p.dtype));
  if (p.n < 0 || p.block_size <= 0 || p.d_latent <= 0 || p.d_rope < 0 ||
      p.stride_token < p.d_latent + p.d_rope || p.stride_block < p.block_size * p.stride_token)
    return InvalidArgumentError("latent write: inconsistent sizes or strides");
  if (p.n == 0) return Status::Ok();
  if (p.cache == nullptr || p.slots == nullptr || p.kv_c == nullptr || (p.d_rope > 0 && p.k_pe == nullptr))
    return InvalidArgumentError("latent write: null pointer");
  if (p.n > 0x7fffffff) return InvalidArgumentError("latent write: too many rows in one launch");
  const dim3 grid(static_cast<unsigned>(p.n)), block(128);
  auto stream = static_cast<cudaStream_t>(p.stream);
  if (p.dtype == DType::kBF16) {
    WriteLatentRowsKernel<__nv_bfloat16><<<grid, block, 0, stream>>>(p);
  } else {
    WriteLatentRowsKernel<float><<<grid, block, 0, stream>>>(p);
  }
  MLARUN_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return Status::Ok();
}

}  // namespace mlarun
