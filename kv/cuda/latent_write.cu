// WriteLatentRowsKernel: scatters n new rows [kv_c | k_pe] (fp32) into a paged
// latent cache through a slot mapping, converting to the cache dtype.
// One block per token, threads striding over the L + R columns; rows are
// independent, so there is no synchronisation. Use: the per-layer cache write
// (kv/latent_write.h) on the CUDA backend.
#include <cuda_bf16.h>

#include "base/cuda/convert.cuh"
#include "base/cuda/cuda_check.h"
#include "kv/latent_write_backend.h"

namespace mlarun {
namespace {

using cuda_convert::FromFloat;

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

namespace cuda {

Status LaunchWriteLatentRows(const LatentWriteParams& p) {
  MLARUN_RETURN_IF_ERROR(LatentWriteCheck(p));
  if (p.n == 0) return Status::Ok();
  if (p.n > 0x7fffffff) return InvalidArgumentError("latent write: n (", p.n, ") is too many rows for one launch");
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

}  // namespace cuda
}  // namespace mlarun
