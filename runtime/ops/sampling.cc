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
    case Backend::kCpu:
      return cpu::Sample(p);
    case Backend::kCuda:
      return cuda::Sample(p);
  }
  return NoBackend("sample", p.backend);
}

Status ScoreRun(const ScoreParams& p) {
  if (p.rows < 0 || p.vocab < 1)
    return InvalidArgumentError("score: rows (", p.rows, ") must be >= 0 and vocab (", p.vocab, ") >= 1");
  if (p.rows == 0) return Status::Ok();
  if (p.ld < p.vocab) return InvalidArgumentError("score: ld (", p.ld, ") < vocab (", p.vocab, ")");
  if (p.logits == nullptr || p.tokens == nullptr || p.out == nullptr)
    return InvalidArgumentError("score: logits, tokens and out must be set");
  if (p.top < 0 || p.top > kMaxTopLogprobs)
    return InvalidArgumentError("score: top (", p.top, ") must be in [0, ", kMaxTopLogprobs, "]");
  for (int64_t r = 0; r < p.rows; ++r)
    if (p.tokens[r] < 0 || p.tokens[r] >= p.vocab)
      return InvalidArgumentError("score: tokens[", r, "] = ", p.tokens[r], " outside [0, ", p.vocab, ")");
  switch (p.backend) {
    case Backend::kCpu:
      return cpu::Score(p);
    case Backend::kCuda:
      return cuda::Score(p);
  }
  return NoBackend("score", p.backend);
}

}  // namespace mlarun
