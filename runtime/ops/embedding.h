// Rows of a table by id, converted to fp32: the token embeddings (rows of the
// [vocab, H] table in the weight dtype), and the hidden rows a step asks
// logits for (rows of its fp32 activations).
#pragma once

#include <cstdint>

#include "base/backend.h"
#include "base/dtype.h"
#include "base/status.h"

namespace mlarun {

// out[i] = table[ids[i]] for i < n. An id outside [0, num_rows) is an
// INVALID_ARGUMENT naming ids[i], and nothing is written.
struct EmbeddingParams {
  const void* table = nullptr;  // [num_rows, width] in dtype (f32 or bf16), row stride ld elements
  DType dtype = DType::kF32;
  int64_t num_rows = 0;
  int64_t width = 0;
  int64_t ld = 0;
  const int32_t* ids = nullptr;  // [n]
  int64_t n = 0;
  float* out = nullptr;  // [n, width], row stride ld_out
  int64_t ld_out = 0;
  Backend backend = Backend::kCpu;
};
Status EmbeddingRun(const EmbeddingParams& p);

}  // namespace mlarun
