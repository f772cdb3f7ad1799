// RMSNorm on the GPU (norm.h).
//
// RmsNormKernel: one block per row. The threads' fp32 sums of squares are
// reduced over the block (so the summation order differs from the CPU's
// vectorized one: results agree to fp32 rounding), then each thread scales
// the elements it read. In place (y == x) is safe: the reduction's barrier
// separates every read of the sum pass from the writes, and in the second
// pass each element is read and written by the same thread.
#include "runtime/ops/backend.h"
#include "runtime/ops/cuda/common.cuh"

namespace mlarun::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void RmsNormKernel(const float* x, int64_t ldx, float* y, int64_t ldy, int64_t n,
                              const float* __restrict__ weight, float eps) {
  const float* xr = x + static_cast<int64_t>(blockIdx.x) * ldx;
  float* yr = y + static_cast<int64_t>(blockIdx.x) * ldy;
  float sum = 0.f;
  for (int64_t i = threadIdx.x; i < n; i += kThreads) sum += xr[i] * xr[i];
  sum = BlockReduce(sum, SumOp{}, 0.f);
  // As the CPU: 1 / sqrt(mean + eps), both correctly rounded (nvcc's default
  // -prec-div and -prec-sqrt).
  const float inv = 1.f / sqrtf(sum / static_cast<float>(n) + eps);
  for (int64_t i = threadIdx.x; i < n; i += kThreads) yr[i] = weight[i] * (xr[i] * inv);
}

}  // namespace

Status RmsNorm(const RmsNormParams& p) {
  if (p.rows == 0) return Status::Ok();
  MLARUN_RETURN_IF_ERROR(CheckInt("rms_norm", "rows", p.rows));
  RmsNormKernel<<<static_cast<unsigned>(p.rows), kThreads>>>(p.x, p.ldx, p.y, p.ldy, p.n, p.weight,
                                                             static_cast<float>(p.eps));
  MLARUN_CUDA_RETURN_IF_LAUNCH_FAILED("RmsNormKernel");
  return Status::Ok();
}

}  // namespace mlarun::cuda
