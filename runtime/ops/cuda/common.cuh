// What the CUDA ops share: a grow-only device scratch buffer, block
// reductions, launch-size checks. Only runtime/ops/cuda/*.cu include it.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "base/cuda/cuda_check.h"
#include "base/status.h"

namespace mlarun::cuda {

// Device memory an op keeps between calls (the bf16 copy of a product's
// activations, the sampler's reductions): it only grows, so steps after
// warm-up allocate nothing. One per op and host thread (thread_local at the
// use); it follows the current device, giving back its buffer when that
// changes. Growing frees the old buffer, and cudaFree waits for the device,
// so kernels still queued on it finish first.
class DeviceScratch {
 public:
  DeviceScratch() = default;
  DeviceScratch(const DeviceScratch&) = delete;
  DeviceScratch& operator=(const DeviceScratch&) = delete;
  // At exit the runtime may already be gone: nothing to report then.
  ~DeviceScratch() {
    if (data_ != nullptr) cudaFree(data_);
  }

  // At least `bytes` (256-byte aligned), contents undefined. `what` names the
  // use in the error when the memory cannot be had.
  StatusOr<void*> Get(size_t bytes, std::string_view what) {
    int device = 0;
    MLARUN_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
    if (device != device_ || bytes > bytes_) {
      if (data_ != nullptr) MLARUN_CUDA_RETURN_IF_ERROR(cudaFree(data_));
      data_ = nullptr;
      bytes_ = 0;
      device_ = device;
      // 1/8 headroom, so slowly growing batches do not reallocate every step.
      const size_t want = bytes + bytes / 8 < 256 ? 256 : bytes + bytes / 8;
      const cudaError_t err = cudaMalloc(&data_, want);
      if (err != cudaSuccess) {
        data_ = nullptr;
        // Only a plain allocation failure is this Status; anything else (a
        // sticky error from an earlier kernel) is reported as itself.
        if (err != cudaErrorMemoryAllocation) MLARUN_CUDA_RETURN_IF_ERROR(err);
        cudaGetLastError();  // clears the out-of-memory error, which is not sticky
        return ResourceExhaustedError(what, ": cannot allocate ", want, " bytes of device scratch",
                                      cuda_check::Where());
      }
      bytes_ = want;
    }
    return data_;
  }

 private:
  int device_ = -1;
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

// `v` as an int for an API that takes int (cuBLAS sizes, grid sizes), or
// INVALID_ARGUMENT naming it.
inline Status CheckInt(std::string_view op, std::string_view what, int64_t v) {
  if (v < 0 || v > 0x7fffffff) return InvalidArgumentError(op, ": ", what, " (", v, ") does not fit a 32-bit int");
  return Status::Ok();
}

// Blocks for grid-stride loops over n elements: enough to fill the GPU,
// never more than the elements need.
inline unsigned GridFor(int64_t n, int threads) {
  const int64_t blocks = (n + threads - 1) / threads;
  return static_cast<unsigned>(blocks < 4096 ? (blocks < 1 ? 1 : blocks) : 4096);
}

// The warp's reduction of v with `op` (a xor butterfly: every lane ends with
// the same bits, as each step combines the same two values on both lanes).
// REQUIRES: all 32 lanes active.
template <class T, class Op>
__device__ inline T WarpReduce(T v, Op op) {
  for (int offset = 16; offset > 0; offset >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// The block's reduction of v, returned to every thread. REQUIRES: blockDim.x
// a multiple of 32, at most 1024, and every thread of the block calls it (it
// synchronizes). May be called repeatedly: it waits for the previous call's
// readers before reusing its shared memory.
template <class T, class Op>
__device__ inline T BlockReduce(T v, Op op, T identity) {
  __shared__ T partial[32];
  const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
  v = WarpReduce(v, op);
  __syncthreads();
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  const unsigned warps = blockDim.x >> 5;
  return WarpReduce(lane < warps ? partial[lane] : identity, op);
}

struct SumOp {
  template <class T>
  __device__ T operator()(T a, T b) const {
    return a + b;
  }
};
struct MaxOp {
  __device__ float operator()(float a, float b) const { return fmaxf(a, b); }
};
struct MinOp {
  __device__ int64_t operator()(int64_t a, int64_t b) const { return a < b ? a : b; }
};

}  // namespace mlarun::cuda
