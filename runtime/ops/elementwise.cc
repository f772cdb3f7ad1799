#include "runtime/ops/elementwise.h"

#include "runtime/ops/backend.h"

namespace mlarun {

Status AddRun(const AddParams& p) {
  if (p.n < 0) return InvalidArgumentError("add: n is negative (", p.n, ")");
  if (p.n == 0) return Status::Ok();
  if (p.x == nullptr || p.y == nullptr) return InvalidArgumentError("add: x and y must be set");
  switch (p.backend) {
    case Backend::kCpu:
      return cpu::Add(p);
    case Backend::kCuda:
      return cuda::Add(p);
  }
  return NoBackend("add", p.backend);
}

Status CopyRowsRun(const CopyRowsParams& p) {
  if (p.rows < 0 || p.cols < 0)
    return InvalidArgumentError("copy_rows: rows (", p.rows, ") and cols (", p.cols, ") must be >= 0");
  if (p.rows == 0 || p.cols == 0) return Status::Ok();
  if (p.x == nullptr || p.y == nullptr) return InvalidArgumentError("copy_rows: x and y must be set");
  if (p.ldx < p.cols || p.ldy < p.cols)
    return InvalidArgumentError("copy_rows: ldx (", p.ldx, ") and ldy (", p.ldy, ") must be >= cols (", p.cols, ")");
  switch (p.backend) {
    case Backend::kCpu:
      return cpu::CopyRows(p);
    case Backend::kCuda:
      return cuda::CopyRows(p);
  }
  return NoBackend("copy_rows", p.backend);
}

}  // namespace mlarun
