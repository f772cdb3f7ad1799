#include "runtime/ops/sampling.h"

#include "runtime/ops/backend.h"

namespace mlarun {

Status SampleRun(const SampleParams& p) {
  if (p.rows < 0 || p.vocab < 0)
    return InvalidArgumentError("sample: rows (", p.rows, ") and vocab (", p.vocab, ") must be >= 0");
  if (p.rows == 0) return Status::Ok();
  if (p.ld < p.vocab) return InvalidArgumentError("sample: ld (", p.ld, ") < vocab (", p.vocab, ")");
  if ((p.vocab > 0 && p.logits == nullptr) || p.samplers == nullptr || p.out == nullptr)
    return InvalidArgumentError("sample: logits, samplers and out must be set");
  for (int64_t r = 0; r < p.rows; ++r)
    if (p.samplers[r] == nullptr) return InvalidArgumentError("sample: samplers[", r, "] is null");
  switch (p.backend) {
    case Backend::kCpu: return cpu::Sample(p);
    case Backend::kCuda: return cuda::Sample(p);
  }
  return NoBackend("sample", p.backend);
}

}  // namespace mlarun
