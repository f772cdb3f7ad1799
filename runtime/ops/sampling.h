// The next token of each logit row, by that row's sampler
// (runtime/ops/sampler.h: the request's parameters and random stream).
#pragma once

#include <cstdint>

#include "base/backend.h"
#include "base/status.h"
#include "runtime/ops/sampler.h"

namespace mlarun {

struct SampleParams {
  const float* logits = nullptr;  // [rows, vocab], row stride ld
  int64_t rows = 0;
  int64_t vocab = 0;
  int64_t ld = 0;
  Sampler* const* samplers = nullptr;  // [rows]: row r's sampler; each advances its stream by one draw
  SampledToken* out = nullptr;         // [rows]
  Backend backend = Backend::kCpu;
};
Status SampleRun(const SampleParams& p);

// The logprob of a given token in each logit row, and the row's `top` most
// likely tokens (ScoreToken): a prompt's tokens given those before them.
struct ScoreParams {
  const float* logits = nullptr;  // [rows, vocab], row stride ld
  int64_t rows = 0;
  int64_t vocab = 0;
  int64_t ld = 0;
  const int32_t* tokens = nullptr;  // [rows], host: row r's token, in [0, vocab)
  int64_t top = 0;                  // [0, kMaxTopLogprobs]
  SampledToken* out = nullptr;      // [rows], host
  Backend backend = Backend::kCpu;
};
Status ScoreRun(const ScoreParams& p);

}  // namespace mlarun
