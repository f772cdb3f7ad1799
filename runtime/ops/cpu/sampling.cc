#include "runtime/ops/backend.h"

namespace mlarun::cpu {

Status Sample(const SampleParams& p) {
  for (int64_t r = 0; r < p.rows; ++r)
    p.out[r] = p.samplers[r]->Sample(std::span<const float>(p.logits + r * p.ld, static_cast<size_t>(p.vocab)));
  return Status::Ok();
}

Status Score(const ScoreParams& p) {
  for (int64_t r = 0; r < p.rows; ++r)
    p.out[r] =
        ScoreToken(std::span<const float>(p.logits + r * p.ld, static_cast<size_t>(p.vocab)), p.tokens[r], p.top);
  return Status::Ok();
}

}  // namespace mlarun::cpu
