// Rows of a table by id on the GPU (embedding.h).
//
// CheckIdsKernel: every id against [0, num_rows); the first bad one (lowest
// index) lands in one 64-bit word as (index << 32 | id), so a single atomicMin
// keeps both and one 8-byte copy brings them back. Only when every id is
// valid does GatherRowsKernel run (one block per id, threads over the width),
// so a bad id writes nothing, as on the CPU.
#include <cuda_bf16.h>

#include "base/cuda/convert.cuh"
#include "runtime/ops/backend.h"
#include "runtime/ops/cuda/common.cuh"

namespace mlarun::cuda {
namespace {

constexpr unsigned long long kNoBadId = ~0ull;

__global__ void CheckIdsKernel(const int32_t* __restrict__ ids, int64_t n, int64_t num_rows,
                               unsigned long long* first_bad) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int32_t id = ids[i];
    if (id < 0 || id >= num_rows)
      atomicMin(first_bad, (static_cast<unsigned long long>(i) << 32) | static_cast<uint32_t>(id));
  }
}

using cuda_convert::ToFloat;

template <typename T>
__global__ void GatherRowsKernel(const T* __restrict__ table, int64_t ld, const int32_t* __restrict__ ids,
                                 int64_t width, float* __restrict__ out, int64_t ld_out) {
  const int64_t i = blockIdx.x;
  const T* row = table + static_cast<int64_t>(ids[i]) * ld;
  float* dst = out + i * ld_out;
  for (int64_t c = threadIdx.x; c < width; c += blockDim.x) dst[c] = ToFloat(row[c]);
}

}  // namespace

Status Embedding(const EmbeddingParams& p) {
  if (p.n == 0) return Status::Ok();
  // The packed word holds the index in 32 bits; one block per row.
  MLARUN_RETURN_IF_ERROR(CheckInt("embedding", "n", p.n));
  thread_local DeviceScratch scratch;
  MLARUN_ASSIGN_OR_RETURN(void* word, scratch.Get(sizeof(unsigned long long), "embedding: the id check"));
  auto* first_bad = static_cast<unsigned long long*>(word);
  MLARUN_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(first_bad, 0xff, sizeof(unsigned long long), 0));
  constexpr int kThreads = 256;
  CheckIdsKernel<<<GridFor(p.n, kThreads), kThreads>>>(p.ids, p.n, p.num_rows, first_bad);
  MLARUN_CUDA_RETURN_IF_LAUNCH_FAILED("CheckIdsKernel");
  unsigned long long bad = kNoBadId;
  MLARUN_CUDA_RETURN_IF_ERROR(cudaMemcpy(&bad, first_bad, sizeof bad, cudaMemcpyDeviceToHost));
  if (bad != kNoBadId)
    return InvalidArgumentError("embedding: ids[", static_cast<int64_t>(bad >> 32),
                                "] = ", static_cast<int32_t>(static_cast<uint32_t>(bad & 0xffffffffull)),
                                " outside [0, ", p.num_rows, ")");
  const unsigned blocks = static_cast<unsigned>(p.n);
  if (p.dtype == DType::kBF16) {
    GatherRowsKernel<<<blocks, kThreads>>>(static_cast<const __nv_bfloat16*>(p.table), p.ld, p.ids, p.width, p.out,
                                           p.ld_out);
  } else {
    GatherRowsKernel<<<blocks, kThreads>>>(static_cast<const float*>(p.table), p.ld, p.ids, p.width, p.out, p.ld_out);
  }
  MLARUN_CUDA_RETURN_IF_LAUNCH_FAILED("GatherRowsKernel");
  return Status::Ok();
}

}  // namespace mlarun::cuda
