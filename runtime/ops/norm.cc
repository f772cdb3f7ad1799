#include "runtime/ops/norm.h"

#include <cmath>

#include "runtime/ops/backend.h"

namespace mlarun {

Status RmsNormRun(const RmsNormParams& p) {
  if (p.rows < 0 || p.n <= 0)
    return InvalidArgumentError("rms_norm: rows (", p.rows, ") must be >= 0 and n (", p.n, ") positive");
  if (!std::isfinite(p.eps) || p.eps < 0)
    return InvalidArgumentError("rms_norm: eps must be finite and >= 0, got ", p.eps);
  if (p.rows == 0) return Status::Ok();
  if (p.x == nullptr || p.y == nullptr || p.weight == nullptr)
    return InvalidArgumentError("rms_norm: x, y and weight must be set");
  if (p.ldx < p.n || p.ldy < p.n)
    return InvalidArgumentError("rms_norm: ldx (", p.ldx, ") and ldy (", p.ldy, ") must be >= n (", p.n, ")");
  if (p.x == p.y && p.ldx != p.ldy)
    return InvalidArgumentError("rms_norm: in place (y == x) needs ldy == ldx, got ", p.ldy, " and ", p.ldx);
  switch (p.backend) {
    case Backend::kCpu:
      return cpu::RmsNorm(p);
    case Backend::kCuda:
      return cuda::RmsNorm(p);
  }
  return NoBackend("rms_norm", p.backend);
}

}  // namespace mlarun
