// A generation request and its JSON-lines form, shared by `mlarun generate
// --prompts` and `mlarun submit --prompts`.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "runtime/base/status.h"
#include "runtime/engine/sampler.h"

namespace mlarun {

struct GenerationRequest {
  std::vector<int32_t> prompt;
  SamplingParams sampling;
};

// What a request must fit: the model's vocabulary and context length, and
// the latent cache it will live in.
struct RequestLimits {
  int64_t vocab_size = 0;
  int64_t max_position_embeddings = 0;
  int64_t block_size = 0;          // tokens per cache block, > 0
  int64_t cache_blocks_total = 0;  // blocks of the whole cache
};

// The checks every server of requests makes before taking one (Engine::Add,
// the simulated worker), INVALID_ARGUMENT naming the field: a non-empty prompt
// of ids in [0, vocab_size), ValidateSamplingParams (max_tokens at most
// max_position_embeddings), prompt + max_tokens within
// max_position_embeddings, and the cache blocks of prompt + max_tokens within
// the whole cache.
Status ValidateGenerationRequest(const GenerationRequest& request, const RequestLimits& limits);

// One JSON object: "prompt_ids" (required) and the sampling fields
// "max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids",
// "ignore_eos"; `defaults` fill absent fields. Errors name the field.
StatusOr<GenerationRequest> ParseRequestLine(const std::string& line, const SamplingParams& defaults);

}  // namespace mlarun
