#include "runtime/request/sampling_params.h"

#include <cmath>
#include <cstddef>

namespace mlarun {
namespace {

constexpr double kMaxTemperature = 100.0;

}  // namespace

Status ValidateSamplingParams(const SamplingParams& p, int64_t vocab_size, int64_t max_tokens_limit) {
  if (!std::isfinite(p.temperature) || p.temperature < 0.0 || p.temperature > kMaxTemperature) {
    return InvalidArgumentError("temperature must be finite and in [0, ", kMaxTemperature, "], got ", p.temperature);
  }
  // Written so that NaN fails too.
  if (!(p.top_p > 0.0 && p.top_p <= 1.0)) {
    return InvalidArgumentError("top_p must be in (0, 1], got ", p.top_p);
  }
  if (p.top_k < -1) {
    return InvalidArgumentError("top_k must be >= -1 (-1 or 0: off), got ", p.top_k);
  }
  // Lower and upper bounds apart, so a caller without a limit (the
  // coordinator before any group registered) passes INT64_MAX and its
  // messages never print it.
  if (p.max_tokens < 1) return InvalidArgumentError("max_tokens must be >= 1, got ", p.max_tokens);
  if (p.max_tokens > max_tokens_limit) {
    return InvalidArgumentError("max_tokens must be in [1, ", max_tokens_limit, "], got ", p.max_tokens);
  }
  if (p.logprobs < 0 || p.logprobs > kMaxTopLogprobs) {
    return InvalidArgumentError("logprobs must be in [0, ", kMaxTopLogprobs, "] (alternatives per token), got ",
                                p.logprobs);
  }
  if (p.prompt_logprobs < -1 || p.prompt_logprobs > kMaxTopLogprobs) {
    return InvalidArgumentError("prompt_logprobs must be in [-1, ", kMaxTopLogprobs, "] (-1: off), got ",
                                p.prompt_logprobs);
  }
  for (size_t i = 0; i < p.stop_token_ids.size(); ++i) {
    const int64_t id = p.stop_token_ids[i];
    if (id < 0) return InvalidArgumentError("stop_token_ids[", i, "] must be >= 0, got ", id);
    if (id >= vocab_size) {
      return InvalidArgumentError("stop_token_ids[", i, "] must be in [0, ", vocab_size, "), got ", id);
    }
  }
  return Status::Ok();
}

}  // namespace mlarun
