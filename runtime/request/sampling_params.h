// A request's sampling parameters and their check: part of the serving
// front end's types (runtime/request/), which the coordinator, the client
// and the worker share without linking the engine, the model or the cache.
// How they are applied: runtime/ops/sampler.h.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "base/status.h"

namespace mlarun {

// The most alternatives a request may ask to see per generated token
// (SamplingParams::logprobs), as vLLM's default max_logprobs and OpenAI's
// top_logprobs bound.
inline constexpr int64_t kMaxTopLogprobs = 20;
// Bounds of the penalties and biases, as OpenAI's and vLLM's.
inline constexpr double kMaxPresencePenalty = 2.0;  // |presence_penalty|, |frequency_penalty|
inline constexpr double kMaxLogitBias = 100.0;      // |logit_bias value|
// The most token sequences of bad_words: each costs every step of the
// request a comparison.
inline constexpr size_t kMaxBadWords = 1024;

// A token and its logprob (natural log, unmodified distribution): an entry
// of the most likely tokens a request asks for.
struct TokenLogprob {
  int64_t token = 0;
  double logprob = 0.0;
  friend bool operator==(const TokenLogprob&, const TokenLogprob&) = default;
};

// A token with its logprob, and the most likely tokens of its position
// (SamplingParams::logprobs for a generated token, ::prompt_logprobs for a
// prompt token), best first.
struct LogprobEntry {
  TokenLogprob token;
  std::vector<TokenLogprob> top;
};

// A constraint on what may be generated: each step's token mask comes from
// a grammar (xgrammar on the group's leader, runtime/grammar). The kinds are
// those of vLLM's structured outputs; `spec` holds the JSON Schema text, the
// regular expression or the EBNF grammar, `choices` the alternatives.
struct StructuredOutput {
  enum class Kind { kNone, kJsonObject, kJsonSchema, kRegex, kChoice, kGrammar };
  Kind kind = Kind::kNone;
  std::string spec;
  std::vector<std::string> choices;
  // JSON kinds: whitespace between tokens as the model likes (vLLM's
  // default), or none at all (vLLM's disable_any_whitespace).
  bool any_whitespace = true;
  // Token ids after which the grammar holds (vLLM's reasoning end marker,
  // e.g. `</think>`): until the generated tokens end with them the output is
  // free; empty: the grammar holds from the first token.
  std::vector<int64_t> start_after;

  bool active() const { return kind != Kind::kNone; }
  friend bool operator==(const StructuredOutput&, const StructuredOutput&) = default;
};

struct SamplingParams {
  double temperature = 0.0;  // 0: greedy
  int64_t top_k = 0;         // <= 0: off
  double top_p = 1.0;        // (0, 1]
  uint64_t seed = 0;         // per request; same seed and logits, same tokens
  int64_t max_tokens = 16;   // > 0; also the wire's default (serving/proto/proto_sampling.h)
  std::vector<int64_t> stop_token_ids;
  bool ignore_eos = false;
  // The most likely tokens to report beside each generated token, with their
  // logprobs under the unmodified distribution: [0, kMaxTopLogprobs].
  int64_t logprobs = 0;
  // >= 0: also each prompt token's logprob given the tokens before it (all
  // but the first), with that position's this many most likely tokens
  // (vLLM's prompt_logprobs): [-1, kMaxTopLogprobs], -1: off. Such a
  // request computes its whole prompt (no prefix is reused from the cache).
  int64_t prompt_logprobs = -1;
  // Penalties and biases, as vLLM applies them to the logits before
  // temperature, top-k and top-p (runtime/ops/sampler.h): presence and
  // frequency penalties over the generated tokens, the repetition penalty
  // over the prompt's and the generated tokens (1: off), a bias per token id,
  // and min_tokens: the stop ids and the model's EOS ids are masked until
  // that many tokens were generated.
  double presence_penalty = 0.0;         // [-2, 2]
  double frequency_penalty = 0.0;        // [-2, 2]
  double repetition_penalty = 1.0;       // > 0
  std::map<int64_t, double> logit_bias;  // token id -> bias in [-100, 100]
  int64_t min_tokens = 0;                // [0, max_tokens]
  StructuredOutput structured;
  // vLLM's bad_words, as token-id sequences (the HTTP API encodes the words,
  // text::EncodeBadWords): the last token of a sequence gets -inf when the
  // tokens generated last are the ones before it; a one-token sequence is
  // never generated. Each non-empty, ids in [0, vocab_size).
  std::vector<std::vector<int64_t>> bad_words;

  friend bool operator==(const SamplingParams&, const SamplingParams&) = default;
};

// Rejects negative or absurd values with a message naming the field:
// temperature < 0 or > 100 or not finite, top_p outside (0, 1], top_k < -1
// (-1 and 0 both mean off, as vLLM accepts -1), max_tokens < 1 or >
// max_tokens_limit, stop ids outside [0, vocab_size), logprobs outside
// [0, kMaxTopLogprobs], prompt_logprobs outside [-1, kMaxTopLogprobs],
// presence or frequency penalty outside [-2, 2], a repetition penalty not
// > 0, logit_bias ids outside [0, vocab_size) or biases outside [-100, 100],
// min_tokens outside [0, max_tokens] (all not finite too), more than
// kMaxBadWords bad_words, an empty one or one with an id outside
// [0, vocab_size). Every message starts
// with the field's name ("top_p must be ..."), so a caller can prefix its
// path ("sampling."). A caller without a limit passes INT64_MAX. The one
// place of these ranges: the coordinator and the workers check every request
// with it (ValidateRequest), the HTTP API what its requests' fields map to.
Status ValidateSamplingParams(const SamplingParams& p, int64_t vocab_size, int64_t max_tokens_limit);

}  // namespace mlarun
