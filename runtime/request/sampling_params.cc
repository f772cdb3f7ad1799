#include "runtime/request/sampling_params.h"

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>

namespace mlarun {
namespace {

constexpr double kMaxTemperature = 100.0;

Status ValidateBadWords(const SamplingParams& p, int64_t vocab_size) {
  if (p.bad_words.size() > kMaxBadWords)
    return InvalidArgumentError("bad_words must hold at most ", kMaxBadWords, " token sequences, got ",
                                p.bad_words.size());
  for (size_t i = 0; i < p.bad_words.size(); ++i) {
    if (p.bad_words[i].empty()) return InvalidArgumentError("bad_words[", i, "] must not be empty");
    for (const int64_t id : p.bad_words[i]) {
      if (id < 0 || id >= vocab_size)
        return InvalidArgumentError("bad_words[", i, "] has token id ", id, " outside [0, ",
                                    vocab_size == INT64_MAX ? "the vocabulary size" : std::to_string(vocab_size), ")");
    }
  }
  return Status::Ok();
}

// The penalties, the biases and min_tokens (after max_tokens is checked).
Status ValidatePenalties(const SamplingParams& p, int64_t vocab_size) {
  // Written so that NaN fails too.
  if (!(std::fabs(p.presence_penalty) <= kMaxPresencePenalty)) {
    return InvalidArgumentError("presence_penalty must be in [-", kMaxPresencePenalty, ", ", kMaxPresencePenalty,
                                "], got ", p.presence_penalty);
  }
  if (!(std::fabs(p.frequency_penalty) <= kMaxPresencePenalty)) {
    return InvalidArgumentError("frequency_penalty must be in [-", kMaxPresencePenalty, ", ", kMaxPresencePenalty,
                                "], got ", p.frequency_penalty);
  }
  if (!(p.repetition_penalty > 0.0 && std::isfinite(p.repetition_penalty))) {
    return InvalidArgumentError("repetition_penalty must be finite and > 0 (1: off), got ", p.repetition_penalty);
  }
  for (const auto& [id, bias] : p.logit_bias) {
    if (id < 0 || id >= vocab_size) {
      return InvalidArgumentError("logit_bias has token id ", id, " outside [0, ",
                                  vocab_size == INT64_MAX ? "the vocabulary size" : std::to_string(vocab_size), ")");
    }
    if (!(std::fabs(bias) <= kMaxLogitBias)) {
      return InvalidArgumentError("logit_bias of token ", id, " must be in [-", kMaxLogitBias, ", ", kMaxLogitBias,
                                  "], got ", bias);
    }
  }
  if (p.min_tokens < 0 || p.min_tokens > p.max_tokens) {
    return InvalidArgumentError("min_tokens must be in [0, max_tokens = ", p.max_tokens, "], got ", p.min_tokens);
  }
  return ValidateBadWords(p, vocab_size);
}

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
  MLARUN_RETURN_IF_ERROR(ValidatePenalties(p, vocab_size));
  for (size_t i = 0; i < p.stop_token_ids.size(); ++i) {
    const int64_t id = p.stop_token_ids[i];
    if (id < 0) return InvalidArgumentError("stop_token_ids[", i, "] must be >= 0, got ", id);
    if (id >= vocab_size) {
      return InvalidArgumentError("stop_token_ids[", i, "] must be in [0, ", vocab_size, "), got ", id);
    }
  }
  for (size_t i = 0; i < p.structured.start_after.size(); ++i) {
    const int64_t id = p.structured.start_after[i];
    if (id < 0 || id >= vocab_size) {
      return InvalidArgumentError("structured start_after[", i, "] has token id ", id, " outside [0, ",
                                  vocab_size == INT64_MAX ? "the vocabulary size" : std::to_string(vocab_size), ")");
    }
  }
  return Status::Ok();
}

}  // namespace mlarun
