#include "gemm/convert.h"
#include "runtime/ops/backend.h"

namespace mlarun::cpu {

Status Embedding(const EmbeddingParams& p) {
  for (int64_t i = 0; i < p.n; ++i)  // all ids first: a bad one writes nothing
    if (p.ids[i] < 0 || p.ids[i] >= p.num_rows)
      return InvalidArgumentError("embedding: ids[", i, "] = ", p.ids[i], " outside [0, ", p.num_rows, ")");
  const int64_t row_bytes = p.ld * static_cast<int64_t>(DTypeSize(p.dtype));
  for (int64_t i = 0; i < p.n; ++i)
    LoadToF32(static_cast<const std::byte*>(p.table) + p.ids[i] * row_bytes, p.dtype, p.out + i * p.ld_out, p.width);
  return Status::Ok();
}

}  // namespace mlarun::cpu
