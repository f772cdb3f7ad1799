// Turning one row of logits into the next token.
//
// Semantics follow vLLM: first a constraint's mask (structured output:
// tokens it does not allow get -inf), then the request's penalties and biases
// (SamplingParams; vLLM's order): while fewer than min_tokens were generated
// the stop and EOS ids get -inf; so does the last token of a bad_words
// sequence whose other tokens were just generated; logit_bias is added;
// tokens seen in the prompt or the output get the repetition penalty r (a
// positive logit is divided by r, any other multiplied); each generated
// token's logit loses frequency_penalty * its count + presence_penalty.
// Then temperature 0 is greedy on those logits (argmax, lowest id on
// ties); otherwise logits / temperature, then top-k (k <= 0 or >= vocab:
// off), then top-p (1: off) over the remaining tokens sorted by probability
// (keep the smallest prefix whose mass reaches p; always at least one
// token), then a draw from the renormalized distribution. The reported
// log-probability is that of the chosen token under the unmodified model
// distribution (log_softmax of the raw logits, before penalties and
// biases), as vLLM's default logprobs (logprobs_mode raw_logprobs); so are
// those of the most likely tokens a request asks for
// (SamplingParams::logprobs).
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <span>
#include <unordered_map>
#include <utility>
#include <vector>

#include "base/status.h"
#include "runtime/request/sampling_params.h"

namespace mlarun {

struct SampledToken {
  int64_t token = 0;
  double logprob = 0.0;  // natural log, unmodified distribution
  // SamplingParams::logprobs > 0: the most likely tokens of the unmodified
  // distribution, best first (lower id first on ties), top[0, num_top).
  // Tokens of logprob -inf are never listed, so num_top is less than asked
  // when fewer tokens have a finite logit.
  int32_t num_top = 0;
  std::array<TokenLogprob, kMaxTopLogprobs> top{};
  std::span<const TokenLogprob> top_logprobs() const { return {top.data(), static_cast<size_t>(num_top)}; }
};

// Temperatures below this are greedy, as in vLLM (its _SAMPLING_EPS): the
// tempered distribution is the argmax to double precision anyway.
inline constexpr double kMinSamplingTemperature = 1e-5;

// What the penalties need besides the parameters: the request's own tokens.
struct SamplerHistory {
  std::span<const int32_t> prompt;         // the repetition penalty's
  std::span<const int64_t> eos_token_ids;  // masked with the stop ids under min_tokens
  std::span<const int32_t> output;         // tokens generated before this sampler existed
  // Random draws the request's stream already made (one per token it
  // generated elsewhere, a resumed request's): the sampler starts that far
  // into its stream, so its next draw is the one the request's first
  // sampler would have made next. `output` alone does not advance it.
  int64_t draws = 0;
};

// A constraint on the tokens a request may draw next (structured output:
// runtime/grammar implements it over a grammar). Sample asks it which
// tokens are allowed before anything else touches the row, and tells it
// the token drawn.
class TokenConstraint {
 public:
  virtual ~TokenConstraint() = default;
  // Sets bit (t % 32) of words[t / 32] for each token t that may come next
  // and clears every other bit; words.size() == (vocab + 31) / 32.
  virtual void FillAllowed(std::span<uint32_t> words) = 0;
  // The token drawn from the row FillAllowed masked last.
  virtual void Accept(int64_t token) = 0;
  // Nothing more may be generated: the grammar is complete and took its
  // stop token, or (a row without allowed tokens) a token it refused.
  virtual bool terminated() const = 0;
};

// Per-request sampler: holds the request's random stream (seeded from
// SamplingParams::seed), so the k-th draw of a request depends only on its seed,
// k and the logits, never on other requests in the batch. Not thread-safe;
// one per request.
//
// Random stream: xoshiro256** seeded with four splitmix64 outputs of the seed;
// u in [0, 1) is the top 53 bits of one 64-bit draw.
// Order: top-k and top-p rank tokens by probability descending, lower id first
// on ties (so exactly k survive a tie at the boundary, and top-p's prefix is
// well defined). The draw itself is an inverse CDF over the kept tokens in
// token id order, which needs no sort of the kept set (top-p alone can keep
// most of a 129k vocabulary). Top-p's prefix test (mass >= top_p) holds up to
// double rounding in the summation order.
// Non-finite logits: NaN counts as -inf; +inf counts as the largest finite
// float, so several +inf tokens share the mass equally. If every logit is -inf
// (or NaN) there is no distribution: the result is token 0 with logprob -inf.
// An empty row gives the same. Vocabularies must fit in int32.
class Sampler {
 public:
  // Each token Sample returns counts as generated (the request's output from
  // then on), on top of history.output.
  explicit Sampler(const SamplingParams& p, const SamplerHistory& history = {});
  // From now on tokens the constraint does not allow get -inf before the
  // penalties and biases, and each drawn token is accepted by it; with
  // SamplingParams::structured.start_after only from the token after the
  // generated tokens first end with that sequence (a reasoning end marker).
  // `output`: the history.output this sampler was built with (a resumed
  // request's); the constraint first accepts those of its tokens it would
  // have accepted as they were drawn, the ones after the marker (all of
  // them without one). Called before the first Sample.
  void SetConstraint(std::unique_ptr<TokenConstraint> constraint, std::span<const int32_t> output = {});
  const TokenConstraint* constraint() const { return constraint_.get(); }
  // logits: [vocab], fp32. Advances the random stream by one draw (also for
  // greedy, to keep streams aligned). Lists the most likely tokens when
  // wants_top(); the draw does not depend on it.
  SampledToken Sample(std::span<const float> logits);

  // True when Sample takes the argmax: temperature below
  // kMinSamplingTemperature (NaN too).
  bool greedy() const { return !(params_.temperature >= kMinSamplingTemperature); }
  // True when Sample also lists the most likely tokens (SamplingParams::
  // logprobs > 0): a device then hands Sample the whole row instead of its
  // greedy reduction.
  bool wants_top() const { return params_.logprobs > 0; }
  // True when the next Sample changes the logits before it draws
  // (penalties, biases, a constraint, bad words, or min_tokens not reached
  // yet): a device then hands Sample the whole row. False costs Sample
  // nothing.
  bool modifies_logits() const {
    return penalized_ || constraint_ != nullptr || generated_ < params_.min_tokens || !params_.bad_words.empty();
  }
  // The row Sample draws from (the penalties and biases applied to logits),
  // in the thread's scratch, valid until the next call on this thread.
  std::span<const float> ProcessedLogits(std::span<const float> logits);
  // What Sample returns for a greedy row reduced where its logits lie (a
  // device; runtime/ops/sampling_math.h is that reduction): `argmax` the
  // lowest id of the largest logit (NaN skipped), -1 when the row has no
  // distribution (empty, or every logit -inf or NaN); `weight_sum` the sum
  // of exp(logit - max) over the row in Sample's order. Advances the random
  // stream by one draw, as Sample does. REQUIRES: greedy(),
  // !modifies_logits().
  SampledToken SampleGreedyFrom(int64_t argmax, double weight_sum);

 private:
  struct Candidate {
    float key;  // the logit, NaN as -inf
    int32_t id;
  };
  // Sample's working memory (a weight per token id, the candidates, block
  // sums): one per thread, shared by every sampler that thread runs, not one
  // per request. A request holds its parameters and random stream; the scratch
  // (about 2 MB for a 129k vocabulary) exists once per thread, and a new request's first token
  // allocates nothing once the thread has sampled a row of that size.
  struct Scratch;
  static Scratch& ThreadScratch();
  friend SampledToken ScoreToken(std::span<const float> logits, int64_t token, int64_t top);

  // Sample after the random draw u: the token from `logits`, its logprob
  // and (top) the most likely tokens from `logits` too.
  SampledToken SampleRow(std::span<const float> logits, double u, bool top);
  // Counts a returned token as generated.
  void Record(int64_t token);
  // bad_words: -inf for the last token of each sequence whose other tokens
  // are the last ones generated.
  void MaskBadWords(std::span<float> row) const;
  // The token Sample draws from a row with a distribution (max_logit finite),
  // given the row's untempered weights in s.probs (their sum raw_sum) and the
  // uniform u of this draw.
  SampledToken Draw(std::span<const float> logits, double max_logit, int64_t max_index, bool has_positive_nan,
                    double raw_sum, double log_normalizer, double u, Scratch& s);
  // Top-k / top-p: leaves the kept set in s.candidates[0, m), its worst
  // member last (kept tokens are exactly those ordered no later than it),
  // with the tempered weight of each in s.probs[id]; returns m.
  int64_t SelectKept(std::span<const float> logits, double max_logit, bool has_positive_nan, double inv_temperature,
                     double scaled_sum, Scratch& s);

  SamplingParams params_;
  uint64_t state_[4];  // xoshiro256** state
  // The penalties' state: whether any penalty or bias is set, the tokens
  // generated, the prompt's distinct ids (repetition penalty only) sorted,
  // each generated id's count (any penalty), the ids min_tokens masks.
  bool penalized_ = false;
  bool counts_output_ = false;
  int64_t generated_ = 0;
  std::vector<int32_t> prompt_ids_;
  std::unordered_map<int32_t, int32_t> output_counts_;
  std::vector<int64_t> min_tokens_ids_;
  std::vector<std::pair<int32_t, double>> bias_;
  std::unique_ptr<TokenConstraint> constraint_;
  // Whether the constraint holds yet (structured.start_after seen, or
  // empty), and until then the last tokens generated, to spot it.
  bool constraint_started_ = true;
  std::vector<int64_t> recent_;
  // history.output[constraint_from_, ) came after the marker: the tokens of
  // it the constraint holds for.
  size_t constraint_from_ = 0;
  // The last tokens generated, as many as the longest bad word's prefix
  // (none without bad_words): all MaskBadWords compares.
  std::vector<int64_t> output_;
  size_t output_kept_ = 0;
};

// The logprob of `token` under the distribution of one row of logits (as
// Sample reports the drawn token's), and the row's `top` most likely tokens
// (as Sample lists them): a prompt token's logprob given the tokens before
// it. A token of no probability (logit -inf or NaN, or a row without a
// distribution) gets kNoProbabilityLogprob, as vLLM reports it, so that
// every logprob is a finite number. REQUIRES: 0 <= token < logits.size(),
// 0 <= top <= kMaxTopLogprobs.
inline constexpr double kNoProbabilityLogprob = -9999.0;
SampledToken ScoreToken(std::span<const float> logits, int64_t token, int64_t top);

namespace internal {
// Exposed for the published test vectors; Sampler uses them.
// splitmix64: advances `state` and returns the next output.
uint64_t SplitMix64Next(uint64_t& state);
// xoshiro256** (Blackman and Vigna): advances `state` and returns the next output.
uint64_t Xoshiro256StarStarNext(uint64_t (&state)[4]);
}  // namespace internal

}  // namespace mlarun
