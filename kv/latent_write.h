// The cache write of every attention layer: new tokens' rows [kv_c | k_pe]
// (kv_c after kv_a_layernorm, k_pe after RoPE; fp32) scattered into one layer
// of a paged latent cache through a slot mapping, converted to the cache
// dtype. Params -> run; the implementations are kv/cpu/ (host memory) and
// kv/cuda/ (device memory).
#pragma once

#include <cstdint>

#include "base/backend.h"
#include "base/dtype.h"
#include "base/status.h"

namespace mlarun {

struct LatentWriteParams {
  // One layer of the cache (the backend's memory): row of slot s at
  // cache + (s / block_size) * stride_block + (s % block_size) * stride_token elements.
  void* cache = nullptr;
  DType dtype = DType::kBF16;  // bf16 or f32
  int64_t block_size = 0;
  int64_t num_blocks = 0;  // the layer's blocks: slots lie in [0, num_blocks * block_size)
  int64_t stride_block = 0;
  int64_t stride_token = 0;
  int64_t d_latent = 0;  // L
  int64_t d_rope = 0;    // R
  // n rows to write: token t goes to slot slots[t]; slots[t] < 0 skips the
  // token (padding). Slot s is block s / block_size of the layer, row
  // s % block_size in it.
  int64_t n = 0;
  const int64_t* slots = nullptr;
  const float* kv_c = nullptr;  // [n, L], row stride kv_c_stride
  int64_t kv_c_stride = 0;
  const float* k_pe = nullptr;  // [n, R], row stride k_pe_stride; may be nullptr when R == 0
  int64_t k_pe_stride = 0;
  void* stream = nullptr;  // CUDA: the cudaStream_t (nullptr: the default stream); CPU: unused
  Backend backend = Backend::kCpu;
};

// Shapes, dtype, strides and pointers, naming the first bad field. Reads no
// memory behind the pointers.
Status LatentWriteCheck(const LatentWriteParams& p);

// Checks, then writes. CPU: blocks until done; a slot at or beyond
// num_blocks * block_size is OUT_OF_RANGE naming it, and nothing is written.
// CUDA: asynchronous on `stream` (slots are device memory and are not
// checked); UNIMPLEMENTED in builds without CUDA.
Status LatentWriteRun(const LatentWriteParams& p);

}  // namespace mlarun
