// RoPE in place on the GPU (rope.h).
//
// RopeKernel: one block per token. Its threads first compute the token's
// cos/sin table into shared memory as RopeCosSin does (the angle an fp32
// product, its cos and sin in double, times attention_factor in fp32); then
// each warp takes one head at a time: it copies the head's dim floats into its
// own shared slice (kInterleavedToHalf writes other pairs' inputs, so the
// whole slice is read first, as the CPU copies it), and its lanes rotate the
// pairs with RopePairOf / RopeRotate (runtime/ops/rope_math.h), the same
// pairing and rounding as the CPU.
// Shared memory: (dim + warps * dim) floats.
#include "runtime/ops/backend.h"
#include "runtime/ops/cuda/common.cuh"
#include "runtime/ops/rope_math.h"

namespace mlarun::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

__global__ void RopeKernel(float* x, int64_t n_heads, int64_t stride_token, int64_t stride_head,
                           const int32_t* __restrict__ positions, int64_t dim, RopeLayout layout,
                           const float* __restrict__ inv_freq, float attention_factor) {
  extern __shared__ float smem[];
  const int64_t half = dim / 2;
  float* cos_t = smem;
  float* sin_t = smem + half;
  const int64_t t = blockIdx.x;
  const float position = static_cast<float>(static_cast<int64_t>(positions[t]));
  for (int64_t j = threadIdx.x; j < half; j += kThreads) {
    const float angle = position * inv_freq[j];
    cos_t[j] = static_cast<float>(cos(static_cast<double>(angle))) * attention_factor;
    sin_t[j] = static_cast<float>(sin(static_cast<double>(angle))) * attention_factor;
  }
  __syncthreads();
  const int64_t warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  float* tmp = smem + dim + warp * dim;
  for (int64_t h = warp; h < n_heads; h += kWarps) {
    float* v = x + t * stride_token + h * stride_head;
    for (int64_t i = lane; i < dim; i += 32) tmp[i] = v[i];
    __syncwarp();
    for (int64_t j = lane; j < half; j += 32) {
      const RopePair q = RopePairOf(layout, j, half);
      RopeRotate(tmp[q.in_a], tmp[q.in_b], cos_t[j], sin_t[j], v[q.out_a], v[q.out_b]);
    }
    __syncwarp();  // every lane's reads of tmp before the next head overwrites it
  }
}

}  // namespace

Status ApplyRope(const RopeParams& p) {
  if (p.n_tokens == 0 || p.n_heads == 0) return Status::Ok();
  MLARUN_RETURN_IF_ERROR(CheckInt("rope", "n_tokens", p.n_tokens));
  const size_t smem = static_cast<size_t>(p.dim) * (1 + kWarps) * sizeof(float);
  if (smem > 48 * 1024)
    return InvalidArgumentError("rope: dim ", p.dim, " needs ", smem, " bytes of shared memory on cuda (at most ",
                                48 * 1024, ")");
  RopeKernel<<<static_cast<unsigned>(p.n_tokens), kThreads, smem>>>(
      p.x, p.n_heads, p.stride_token, p.stride_head, p.positions, p.dim, p.layout, p.inv_freq, p.attention_factor);
  MLARUN_CUDA_RETURN_IF_LAUNCH_FAILED("RopeKernel");
  return Status::Ok();
}

}  // namespace mlarun::cuda
