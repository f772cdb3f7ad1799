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

// One JSON object: "prompt_ids" (required) and the sampling fields
// "max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids",
// "ignore_eos"; `defaults` fill absent fields. Errors name the field.
StatusOr<GenerationRequest> ParseRequestLine(const std::string& line, const SamplingParams& defaults);

}  // namespace mlarun
