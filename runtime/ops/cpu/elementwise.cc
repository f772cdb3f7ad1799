#include <cstring>

#include "runtime/ops/backend.h"

namespace mlarun::cpu {

Status Add(const AddParams& p) {
  float* __restrict y = p.y;
  const float* __restrict x = p.x;
  for (int64_t i = 0; i < p.n; ++i) y[i] += x[i];
  return Status::Ok();
}

Status CopyRows(const CopyRowsParams& p) {
  for (int64_t r = 0; r < p.rows; ++r)
    std::memcpy(p.y + r * p.ldy, p.x + r * p.ldx, static_cast<size_t>(p.cols) * sizeof(float));
  return Status::Ok();
}

}  // namespace mlarun::cpu
