// The small element-wise steps of the forward pass: the residual add and
// strided row copies (k_pe out of the kv_a projection's rows).
#pragma once

#include <cstdint>

#include "base/backend.h"
#include "base/status.h"

namespace mlarun {

// y[i] += x[i] for i < n.
struct AddParams {
  float* y = nullptr;        // [n]
  const float* x = nullptr;  // [n]; must not overlap y
  int64_t n = 0;
  Backend backend = Backend::kCpu;
};
Status AddRun(const AddParams& p);

// y[r][j] = x[r][j] for r < rows, j < cols.
struct CopyRowsParams {
  const float* x = nullptr;  // [rows, cols], row stride ldx
  int64_t ldx = 0;
  float* y = nullptr;  // [rows, cols], row stride ldy; must not overlap x
  int64_t ldy = 0;
  int64_t rows = 0;
  int64_t cols = 0;
  Backend backend = Backend::kCpu;
};
Status CopyRowsRun(const CopyRowsParams& p);

}  // namespace mlarun
