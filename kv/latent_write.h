// Writing new tokens' rows into a paged latent cache on a device: the cache
// write of every attention layer (kv_c after kv_a_layernorm, k_pe after RoPE).
// Plain params struct; the CUDA launcher lives in kv/cuda/. The host cache
// (LatentCache::WriteRows) does the same on the CPU.
#pragma once

#include <cstdint>

#include "runtime/base/dtype.h"
#include "runtime/base/status.h"

namespace mlarun {

struct LatentWriteParams {
  // One layer of the cache (device memory): row of slot s at
  // cache + (s / block_size) * stride_block + (s % block_size) * stride_token elements.
  void* cache = nullptr;
  DType dtype = DType::kBF16;  // bf16 or f32
  int64_t block_size = 0;
  int64_t stride_block = 0;
  int64_t stride_token = 0;
  int64_t d_latent = 0;  // L
  int64_t d_rope = 0;    // R
  // n rows to write (device memory): token t goes to slot slots[t];
  // slots[t] < 0 skips the token (padding).
  int64_t n = 0;
  const int64_t* slots = nullptr;
  const float* kv_c = nullptr;  // [n, L], row stride kv_c_stride
  int64_t kv_c_stride = 0;
  const float* k_pe = nullptr;  // [n, R], row stride k_pe_stride
  int64_t k_pe_stride = 0;
  void* stream = nullptr;  // cudaStream_t; nullptr: the default stream
};

// Launches the write (asynchronous on `stream`). UNIMPLEMENTED in builds
// without CUDA; INVALID_ARGUMENT for bad params.
Status LaunchWriteLatentRows(const LatentWriteParams& p);

}  // namespace mlarun
