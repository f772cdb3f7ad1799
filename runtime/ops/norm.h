// RMSNorm over rows of fp32, as HF computes it (fp32 mean of squares):
// y[r][i] = weight[i] * (x[r][i] / sqrt(mean_i(x[r][i]^2) + eps)) for i < n.
#pragma once

#include <cstdint>

#include "base/backend.h"
#include "base/status.h"

namespace mlarun {

struct RmsNormParams {
  const float* x = nullptr;  // [rows, n], row stride ldx (ldx >= n: the first n of wider rows)
  int64_t ldx = 0;
  float* y = nullptr;  // [rows, n], row stride ldy; y == x (with ldy == ldx) normalizes in place
  int64_t ldy = 0;
  int64_t rows = 0;
  int64_t n = 0;
  const float* weight = nullptr;  // [n]
  double eps = 1e-6;
  Backend backend = Backend::kCpu;
};
Status RmsNormRun(const RmsNormParams& p);

}  // namespace mlarun
