// Turning one row of logits into the next token.
//
// Semantics follow vLLM: temperature 0 is greedy (argmax, lowest id on ties);
// otherwise logits / temperature, then top-k (k <= 0 or >= vocab: off), then
// top-p (1: off) over the remaining tokens sorted by probability (keep the
// smallest prefix whose mass reaches p; always at least one token), then a
// draw from the renormalized distribution. The reported log-probability is
// that of the chosen token under the unmodified model distribution
// (log_softmax of the raw logits), as vLLM's default logprobs.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "runtime/base/status.h"

namespace mlarun {

struct SamplingParams {
  double temperature = 0.0;  // 0: greedy
  int64_t top_k = 0;         // <= 0: off
  double top_p = 1.0;        // (0, 1]
  uint64_t seed = 0;         // per request; same seed and logits, same tokens
  int64_t max_tokens = 16;   // > 0
  std::vector<int64_t> stop_token_ids;
  bool ignore_eos = false;

  friend bool operator==(const SamplingParams&, const SamplingParams&) = default;
};

// Rejects negative or absurd values with a message naming the field:
// temperature < 0 or > 100 or not finite, top_p outside (0, 1], max_tokens < 1
// or > max_tokens_limit, stop ids outside [0, vocab_size).
Status ValidateSamplingParams(const SamplingParams& p, int64_t vocab_size, int64_t max_tokens_limit);

struct SampledToken {
  int64_t token = 0;
  double logprob = 0.0;  // natural log, unmodified distribution
};

// Per-request sampler: holds the request's random stream (seeded from
// SamplingParams::seed), so the k-th draw of a request depends only on its seed,
// k and the logits, never on other requests in the batch. Not thread-safe;
// one per request.
class Sampler {
 public:
  explicit Sampler(const SamplingParams& p);
  // logits: [vocab], fp32. Advances the random stream by one draw (also for greedy, to keep streams aligned).
  SampledToken Sample(std::span<const float> logits);

 private:
  SamplingParams params_;
  uint64_t state_[4];  // xoshiro256** state
  std::vector<int32_t> order_;  // scratch
  std::vector<double> probs_;   // scratch
};

}  // namespace mlarun
