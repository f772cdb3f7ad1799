#include "runtime/ops/embedding.h"

#include "runtime/ops/backend.h"

namespace mlarun {

Status EmbeddingRun(const EmbeddingParams& p) {
  if (p.n < 0 || p.num_rows < 0 || p.width <= 0)
    return InvalidArgumentError("embedding: n (", p.n, ") and num_rows (", p.num_rows, ") must be >= 0, width (",
                                p.width, ") positive");
  if (p.dtype != DType::kF32 && p.dtype != DType::kBF16)
    return InvalidArgumentError("embedding: dtype ", IsValidDType(p.dtype) ? DTypeName(p.dtype) : "(invalid)",
                                " is not supported (f32 or bf16)");
  if (p.ld < p.width) return InvalidArgumentError("embedding: ld (", p.ld, ") < width (", p.width, ")");
  if (p.n == 0) return Status::Ok();
  if (p.table == nullptr || p.ids == nullptr || p.out == nullptr)
    return InvalidArgumentError("embedding: table, ids and out must be set");
  if (p.ld_out < p.width) return InvalidArgumentError("embedding: ld_out (", p.ld_out, ") < width (", p.width, ")");
  switch (p.backend) {
    case Backend::kCpu:
      return cpu::Embedding(p);
    case Backend::kCuda:
      return cuda::Embedding(p);
  }
  return NoBackend("embedding", p.backend);
}

}  // namespace mlarun
