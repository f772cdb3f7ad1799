#include <omp.h>

#include <cmath>

#include "runtime/ops/backend.h"

namespace mlarun::cpu {

Status RmsNorm(const RmsNormParams& p) {
  const float* x = p.x;
  float* y = p.y;
  const float* weight = p.weight;
  const int64_t n = p.n;
  // Rows are independent: a prefill's rows are split over the threads, a
  // decode step's few are not worth a parallel region.
#pragma omp parallel for schedule(static) if (p.rows > 16 && !omp_in_parallel())
  for (int64_t r = 0; r < p.rows; ++r) {
    const float* xr = x + r * p.ldx;
    float* yr = y + r * p.ldy;
    float sum = 0.f;  // fp32 accumulation, as torch's mean over an fp32 tensor
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; ++i) sum += xr[i] * xr[i];
    const float inv = 1.f / std::sqrt(sum / static_cast<float>(n) + static_cast<float>(p.eps));
    for (int64_t i = 0; i < n; ++i) yr[i] = weight[i] * (xr[i] * inv);
  }
  return Status::Ok();
}

}  // namespace mlarun::cpu
