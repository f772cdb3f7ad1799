#include "runtime/ops/sampler.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>

#include "base/hash.h"

// Every token costs a few passes over the vocabulary (129k on DeepSeek-V3),
// so those loops must vectorize:
// - They select with ?: on float compares, which GCC will not if-convert
//   under its default -ftrapping-math. Nothing here reads FP exception flags.
// - fp-contract=off keeps a*b+c from becoming an FMA in some builds or clones
//   and not others: every variant performs the same correctly rounded IEEE
//   operations in the same order, so a seed gives the same tokens everywhere.
// The pragma covers the whole file so that inlining never mixes option sets.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-trapping-math", "fp-contract=off")
#endif

// exp(x) for x <= 0 (including -inf), within 1 ulp like libm (fdlibm's
// e_exp.c reduction and rational approximation), branch-free so that the
// weight loops vectorize: SamplerExpNonPositive, which the device sampler
// uses too. Included after the pragma so that it is compiled with this
// file's options and inlined into its loops.
#include "runtime/ops/sampling_math.h"  // NOLINT(build/include_order)

// The hot loops also get AVX2 and AVX-512 clones, chosen once at load time
// (the default build targets baseline x86-64, where they run several times
// slower; figures: docs/cpu-kernels.md, 'Kernel choices').
// -DMLARUN_SAMPLER_CLONES= turns that off.
#if !defined(MLARUN_SAMPLER_CLONES)
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define MLARUN_SAMPLER_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define MLARUN_SAMPLER_CLONES
#endif
#endif

namespace mlarun {

namespace internal {

uint64_t SplitMix64Next(uint64_t& state) { return Mix64(state += kGoldenGamma); }

uint64_t Xoshiro256StarStarNext(uint64_t (&state)[4]) {
  const uint64_t result = std::rotl(state[1] * 5, 7) * 9;
  const uint64_t t = state[1] << 17;
  state[2] ^= state[0];
  state[3] ^= state[1];
  state[1] ^= state[2];
  state[0] ^= state[3];
  state[2] ^= t;
  state[3] = std::rotl(state[3], 45);
  return result;
}

}  // namespace internal

namespace {

constexpr double kNegInf = -std::numeric_limits<double>::infinity();
constexpr float kNegInfF = -std::numeric_limits<float>::infinity();
// The top-p search sorts a range outright once it is this small.
constexpr int64_t kTopPSortBelow = 64;
// Weights are summed per block so the draw can skip whole blocks instead of
// walking a serial running sum over the vocabulary.
constexpr int64_t kBlock = 256;
// At most vocab / kSparseKeptRatio kept tokens are drawn from directly (sorted
// by id); more, and zeroing the rest of the dense weights is cheaper.
constexpr int64_t kSparseKeptRatio = 16;

// NaN would break every comparison below (and the strict weak order the
// selections need), so it counts as -inf. +inf would make the logsumexp
// inf - inf = NaN; clamping it to the largest float keeps the arithmetic
// finite and gives all +inf tokens equal shares. `d != d` rather than
// std::isnan, and no std::min: header functions are compiled without the
// options above, are not inlined into these loops, and stop vectorization.
inline double CleanLogit(float x) {
  const double d = x;
  return d != d ? kNegInf : (d > FLT_MAX ? FLT_MAX : d);
}
inline float CleanKey(float x) { return x != x ? kNegInfF : x; }

// memcpy rather than std::bit_cast, for the same reason.
inline int64_t BitsOf(double x) {
  int64_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  return bits;
}
inline double DoubleOf(uint64_t bits) {
  double x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}

// Float bits as an int32 that orders like the float: -inf < ... < -0 < +0 <
// ... < +inf. NaNs land outside: positive ones above +inf, negative ones
// below -inf. Integer max reductions vectorize; float ones need -ffast-math.
inline int32_t OrderedBits(float x) {
  int32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  return bits ^ ((bits >> 31) & 0x7fffffff);
}
// The same with -0 read as +0 (x + 0 does that), so that keys equal as
// floats are equal here too.
inline int32_t OrderedKey(float x) { return OrderedBits(x + 0.0f); }
constexpr int32_t kPosInfKey = 0x7f800000;  // +inf: positive floats keep their bits
inline float FromOrderedBits(int32_t ordered) {
  const int32_t bits = ordered ^ ((ordered >> 31) & 0x7fffffff);
  float x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}

inline int32_t MaxKey(const float* logits, int64_t n) {
  int32_t m = std::numeric_limits<int32_t>::min();
  for (int64_t i = 0; i < n; ++i) {
    const int32_t b = OrderedKey(logits[i]);
    m = b > m ? b : m;
  }
  return m;
}

MLARUN_SAMPLER_CLONES int32_t RowMaxKey(const float* logits, int64_t n) { return MaxKey(logits, n); }

// out[b] = max OrderedKey over logits[b * block, (b + 1) * block).
MLARUN_SAMPLER_CLONES void BlockMaxKeys(const float* logits, int64_t n, int64_t block, int32_t* out) {
  for (int64_t start = 0, b = 0; start < n; start += block, ++b)
    out[b] = MaxKey(logits + start, std::min(block, n - start));
}

struct MaxLogit {
  double value;           // CleanLogit of the max; -inf when there is no finite-or-+inf logit
  int64_t index;          // lowest index holding it
  bool has_positive_nan;  // such NaNs sort above +inf in OrderedKey
};

MaxLogit FindMax(std::span<const float> logits) {
  const int64_t n = static_cast<int64_t>(logits.size());
  const int32_t ordered = RowMaxKey(logits.data(), n);
  const bool has_positive_nan = ordered > kPosInfKey;
  float max_key;
  if (has_positive_nan) {
    // A positive NaN is in the row (it sorts above +inf): rare, so a scalar
    // scan that skips NaNs (x > m is false for them) is good enough.
    max_key = kNegInfF;
    for (float x : logits) max_key = x > max_key ? x : max_key;
  } else {
    max_key = FromOrderedBits(ordered);  // a negative NaN if the row is all NaN
  }
  if (!(max_key > kNegInfF)) return {kNegInf, 0, has_positive_nan};
  // Lowest index on ties; float == also ties -0 with +0.
  int64_t index = 0;
  while (logits[index] != max_key) ++index;
  return {CleanLogit(max_key), index, has_positive_nan};
}

// out[i] = exp((logit_i - max_logit) * scale), scale > 0.
MLARUN_SAMPLER_CLONES void FillWeights(const float* logits, int64_t n, double max_logit, double scale, double* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = SamplerExpNonPositive((CleanLogit(logits[i]) - max_logit) * scale);
}

// Zeroes the weights of tokens ordered after `worst` (see Sampler::SelectKept).
MLARUN_SAMPLER_CLONES void DropAfter(const float* logits, int64_t n, float worst_key, int64_t worst_id,
                                     double* weights) {
  for (int64_t i = 0; i < n; ++i) {
    const float key = CleanKey(logits[i]);
    const bool kept = key > worst_key || (key == worst_key && i <= worst_id);
    weights[i] = kept ? weights[i] : 0.0;
  }
}

// Per-block sums (four accumulators each: one running sum is bound by add
// latency) and the total over blocks, in a fixed order.
MLARUN_SAMPLER_CLONES double BlockSums(const double* weights, int64_t n, double* block_sums) {
  double total = 0.0;
  for (int64_t start = 0, b = 0; start < n; start += kBlock, ++b) {
    const int64_t end = std::min(n, start + kBlock);
    double acc[4] = {0.0, 0.0, 0.0, 0.0};
    int64_t i = start;
    for (; i + 4 <= end; i += 4) {
      acc[0] += weights[i];
      acc[1] += weights[i + 1];
      acc[2] += weights[i + 2];
      acc[3] += weights[i + 3];
    }
    for (; i < end; ++i) acc[0] += weights[i];
    block_sums[b] = (acc[0] + acc[1]) + (acc[2] + acc[3]);
    total += block_sums[b];
  }
  return total;
}

// Inverse CDF in id order: the first token whose running mass exceeds target,
// found block by block. The running sums are rounded differently from the
// block sums, so a target can fall just past a block's or the row's end; it
// then takes the last token with weight there.
int64_t InverseCdf(const double* weights, int64_t n, const double* block_sums, double target) {
  double cum = 0.0;
  for (int64_t start = 0, b = 0; start < n; start += kBlock, ++b) {
    if (!(target < cum + block_sums[b])) {
      cum += block_sums[b];
      continue;
    }
    const int64_t end = std::min(n, start + kBlock);
    int64_t last_positive = -1;
    for (int64_t i = start; i < end; ++i) {
      if (weights[i] > 0.0) {
        cum += weights[i];
        if (target < cum) return i;
        last_positive = i;
      }
    }
    if (last_positive >= 0) return last_positive;
  }
  int64_t i = n - 1;
  while (i > 0 && !(weights[i] > 0.0)) --i;
  return i;
}

// The `count` best tokens of the row into out.top, best first: larger key,
// then lower id (a tie with the worst kept token never displaces it, as ids
// only grow), each with its logprob under the unmodified distribution.
// Tokens of logit -inf (or NaN) have no probability and are not listed.
void FillTop(std::span<const float> logits, int64_t count, double max_logit, double log_normalizer, SampledToken& out) {
  struct Best {
    float key;
    int32_t id;
  };
  std::array<Best, kMaxTopLogprobs> best;
  const int64_t want = std::min<int64_t>(count, kMaxTopLogprobs);
  int64_t n = 0;
  for (int64_t i = 0; i < static_cast<int64_t>(logits.size()); ++i) {
    const float key = CleanKey(logits[i]);
    if (!(key > kNegInfF)) continue;
    if (n == want && !(key > best[static_cast<size_t>(n - 1)].key)) continue;
    int64_t j = n < want ? n++ : n - 1;  // the slot it enters from: a new one, or the worst's
    for (; j > 0 && key > best[static_cast<size_t>(j - 1)].key; --j)
      best[static_cast<size_t>(j)] = best[static_cast<size_t>(j - 1)];
    best[static_cast<size_t>(j)] = {key, static_cast<int32_t>(i)};
  }
  out.num_top = static_cast<int32_t>(n);
  for (int64_t j = 0; j < n; ++j) {
    const int32_t id = best[static_cast<size_t>(j)].id;
    out.top[static_cast<size_t>(j)] = {id, (CleanLogit(logits[id]) - max_logit) - log_normalizer};
  }
}

// The untempered weights of the row, relative to its max logit's (which
// weighs exactly 1, so the sum is >= 1), into `weights`, with their block
// sums; returns the sum, whose log is the log normalizer of the row's
// log_softmax.
double RawWeights(std::span<const float> logits, double max_logit, std::vector<double>& weights,
                  std::vector<double>& block_sums) {
  const int64_t vocab = static_cast<int64_t>(logits.size());
  weights.resize(static_cast<size_t>(vocab));
  block_sums.resize(static_cast<size_t>((vocab + kBlock - 1) / kBlock));
  FillWeights(logits.data(), vocab, max_logit, 1.0, weights.data());
  return BlockSums(weights.data(), vocab, block_sums.data());
}

// The greedy result from the argmax and the row's weight sum: the argmax
// weighs exactly 1, so its logprob is minus the log normalizer.
SampledToken GreedyToken(int64_t argmax, double weight_sum) {
  if (argmax < 0) return {0, kNegInf};
  return {argmax, 0.0 - std::log(weight_sum)};
}

}  // namespace

struct Sampler::Scratch {
  std::vector<Candidate> candidates;
  std::vector<double> probs;        // weight by token id
  std::vector<double> block_sums;   // sums of probs per block of ids
  std::vector<int32_t> block_keys;  // top-k's per-block maxima
  std::vector<float> processed;     // the row with penalties and biases applied
  std::vector<uint32_t> allowed;    // a constraint's mask, a bit per token id
};

Sampler::Scratch& Sampler::ThreadScratch() {
  thread_local Scratch scratch;
  return scratch;
}

Sampler::Sampler(const SamplingParams& p, const SamplerHistory& history) : params_(p) {
  // splitmix64 turns any seed (0 included) into a well-mixed, never all-zero
  // xoshiro state, as the xoshiro authors recommend.
  uint64_t seed_state = p.seed;
  for (uint64_t& word : state_) word = internal::SplitMix64Next(seed_state);
  for (int64_t i = 0; i < history.draws; ++i) internal::Xoshiro256StarStarNext(state_);
  const bool repetition = p.repetition_penalty != 1.0;
  counts_output_ = repetition || p.presence_penalty != 0.0 || p.frequency_penalty != 0.0;
  penalized_ = counts_output_ || !p.logit_bias.empty();
  for (const auto& [id, bias] : p.logit_bias)
    if (bias != 0.0) bias_.emplace_back(static_cast<int32_t>(id), bias);
  if (repetition) {
    prompt_ids_.assign(history.prompt.begin(), history.prompt.end());
    std::sort(prompt_ids_.begin(), prompt_ids_.end());
    prompt_ids_.erase(std::unique(prompt_ids_.begin(), prompt_ids_.end()), prompt_ids_.end());
  }
  if (p.min_tokens > 0) {
    min_tokens_ids_ = p.stop_token_ids;
    min_tokens_ids_.insert(min_tokens_ids_.end(), history.eos_token_ids.begin(), history.eos_token_ids.end());
  }
  for (const std::vector<int64_t>& word : p.bad_words) output_kept_ = std::max(output_kept_, word.size() - 1);
  constraint_started_ = p.structured.start_after.empty();
  for (int32_t token : history.output) {
    if (!constraint_started_) ++constraint_from_;
    Record(token);
  }
}

void Sampler::SetConstraint(std::unique_ptr<TokenConstraint> constraint, std::span<const int32_t> output) {
  constraint_ = std::move(constraint);
  for (size_t i = constraint_from_; i < output.size() && constraint_ != nullptr; ++i) constraint_->Accept(output[i]);
}

namespace {

// Whether `seq` ends with the non-empty `tail`.
bool EndsWith(std::span<const int64_t> seq, std::span<const int64_t> tail) {
  return seq.size() >= tail.size() && std::equal(tail.begin(), tail.end(), seq.end() - std::ssize(tail));
}

}  // namespace

void Sampler::Record(int64_t token) {
  ++generated_;
  if (output_kept_ > 0) {
    if (output_.size() == output_kept_) output_.erase(output_.begin());
    output_.push_back(token);
  }
  if (counts_output_) ++output_counts_[static_cast<int32_t>(token)];
  if (constraint_started_) {
    if (constraint_ != nullptr) constraint_->Accept(token);
    return;
  }
  // Before the marker the output is free; the marker itself is not the
  // grammar's either.
  const std::vector<int64_t>& marker = params_.structured.start_after;
  if (recent_.size() == marker.size()) recent_.erase(recent_.begin());
  recent_.push_back(token);
  constraint_started_ = EndsWith(recent_, marker);
  if (constraint_started_) recent_.clear();
}

namespace {

// Whether the bitmask `words` allows no token outside `ids`.
bool OnlyTheseAllowed(std::span<const uint32_t> words, std::span<const int64_t> ids) {
  std::vector<uint32_t> rest(words.begin(), words.end());
  for (int64_t id : ids)
    if (id >= 0 && static_cast<size_t>(id >> 5) < rest.size()) rest[static_cast<size_t>(id >> 5)] &= ~(1u << (id & 31));
  return std::all_of(rest.begin(), rest.end(), [](uint32_t w) { return w == 0; });
}

}  // namespace

void Sampler::MaskBadWords(std::span<float> row) const {
  const int64_t vocab = static_cast<int64_t>(row.size());
  for (const std::vector<int64_t>& word : params_.bad_words) {
    if (word.empty()) continue;  // refused by ValidateSamplingParams
    const size_t before = word.size() - 1;
    if (before > output_.size()) continue;
    if (!std::equal(word.begin(), word.end() - 1, output_.end() - static_cast<std::ptrdiff_t>(before))) continue;
    if (word.back() >= 0 && word.back() < vocab) row[static_cast<size_t>(word.back())] = kNegInfF;
  }
}

std::span<const float> Sampler::ProcessedLogits(std::span<const float> logits) {
  std::vector<float>& row = ThreadScratch().processed;
  row.assign(logits.begin(), logits.end());
  const int64_t vocab = static_cast<int64_t>(row.size());
  auto in_vocab = [vocab](int64_t id) { return id >= 0 && id < vocab; };
  // A complete grammar allows only the stop ids; min_tokens then yields to
  // it, or nothing could be drawn.
  bool grammar_only_stops = false;
  if (constraint_ != nullptr && constraint_started_) {
    std::vector<uint32_t>& allowed = ThreadScratch().allowed;
    allowed.assign(static_cast<size_t>((vocab + 31) / 32), 0);
    constraint_->FillAllowed(allowed);
    for (int64_t id = 0; id < vocab; ++id)
      if (!((allowed[static_cast<size_t>(id >> 5)] >> (id & 31)) & 1u)) row[static_cast<size_t>(id)] = kNegInfF;
    if (generated_ < params_.min_tokens) grammar_only_stops = OnlyTheseAllowed(allowed, min_tokens_ids_);
  }
  if (generated_ < params_.min_tokens && !grammar_only_stops) {
    for (int64_t id : min_tokens_ids_)
      if (in_vocab(id)) row[static_cast<size_t>(id)] = kNegInfF;
  }
  MaskBadWords(row);
  for (const auto& [id, bias] : bias_)
    if (in_vocab(id)) row[static_cast<size_t>(id)] = static_cast<float>(row[static_cast<size_t>(id)] + bias);
  const double r = params_.repetition_penalty;
  auto repeat = [&](int32_t id) {
    const double x = row[static_cast<size_t>(id)];
    row[static_cast<size_t>(id)] = static_cast<float>(x > 0.0 ? x / r : x * r);
  };
  if (r != 1.0) {
    for (int32_t id : prompt_ids_)
      if (in_vocab(id)) repeat(id);
    for (const auto& [id, count] : output_counts_)
      if (in_vocab(id) && !std::binary_search(prompt_ids_.begin(), prompt_ids_.end(), id)) repeat(id);
  }
  if (params_.frequency_penalty != 0.0 || params_.presence_penalty != 0.0) {
    for (const auto& [id, count] : output_counts_) {
      if (!in_vocab(id)) continue;
      const double x = row[static_cast<size_t>(id)];
      row[static_cast<size_t>(id)] =
          static_cast<float>(x - (params_.frequency_penalty * count + params_.presence_penalty));
    }
  }
  return row;
}

SampledToken Sampler::Sample(std::span<const float> logits) {
  // Draw first and unconditionally: the stream position must depend only on
  // how many tokens this request has sampled, whatever path is taken below.
  const uint64_t bits = internal::Xoshiro256StarStarNext(state_);
  const double u = static_cast<double>(bits >> 11) * 0x1.0p-53;  // [0, 1)
  if (!modifies_logits()) {
    const SampledToken t = SampleRow(logits, u, wants_top());
    Record(t.token);
    return t;
  }
  // Drawn from the processed row; reported under the raw one.
  SampledToken t = SampleRow(ProcessedLogits(logits), u, /*top=*/false);
  Record(t.token);
  if (logits.empty()) return t;
  t.logprob = kNegInf;
  const MaxLogit max = FindMax(logits);
  if (max.value == kNegInf) return t;
  Scratch& s = ThreadScratch();
  const double log_normalizer = std::log(RawWeights(logits, max.value, s.probs, s.block_sums));
  t.logprob = (CleanLogit(logits[t.token]) - max.value) - log_normalizer;
  if (wants_top()) FillTop(logits, params_.logprobs, max.value, log_normalizer, t);
  return t;
}

SampledToken Sampler::SampleRow(std::span<const float> logits, double u, bool top) {
  if (logits.empty()) return {0, kNegInf};
  const MaxLogit max = FindMax(logits);
  if (max.value == kNegInf) return {0, kNegInf};  // no distribution at all
  Scratch& s = ThreadScratch();

  // The reported logprob uses the unmodified distribution whatever the
  // sampling parameters. Weights are relative to the max token's, which is
  // exactly 1, so every sum below is >= 1.
  const double raw_sum = RawWeights(logits, max.value, s.probs, s.block_sums);
  const double log_normalizer = std::log(raw_sum);

  SampledToken drawn = Draw(logits, max.value, max.index, max.has_positive_nan, raw_sum, log_normalizer, u, s);
  if (top) FillTop(logits, params_.logprobs, max.value, log_normalizer, drawn);
  return drawn;
}

SampledToken Sampler::Draw(std::span<const float> logits, double max_logit, int64_t max_index, bool has_positive_nan,
                           double raw_sum, double log_normalizer, double u, Scratch& s) {
  const int64_t vocab = static_cast<int64_t>(logits.size());
  auto result = [&](int64_t token) {
    return SampledToken{token, (CleanLogit(logits[token]) - max_logit) - log_normalizer};
  };
  const double temperature = params_.temperature;
  if (greedy()) return GreedyToken(max_index, raw_sum);
  const double inv_temperature = 1.0 / temperature;

  // Tempered weights of every token, except under top-k, which only needs
  // (and SelectKept computes) those of its k candidates.
  const bool top_k_on = params_.top_k > 0 && params_.top_k < vocab;
  const bool top_p_on = params_.top_p < 1.0;
  double scaled_sum = raw_sum;
  if (!top_k_on && temperature != 1.0) {
    FillWeights(logits.data(), vocab, max_logit, inv_temperature, s.probs.data());
    scaled_sum = BlockSums(s.probs.data(), vocab, s.block_sums.data());
  }
  if (!top_k_on && !top_p_on) return result(InverseCdf(s.probs.data(), vocab, s.block_sums.data(), u * scaled_sum));

  const int64_t kept = SelectKept(logits, max_logit, has_positive_nan, inv_temperature, scaled_sum, s);
  if (kept * kSparseKeptRatio <= vocab) {
    // Few kept tokens: put them in id order and walk them directly.
    auto first = s.candidates.begin();
    std::sort(first, first + kept, [](const Candidate& a, const Candidate& b) { return a.id < b.id; });
    double kept_sum = 0.0;
    for (int64_t j = 0; j < kept; ++j) kept_sum += s.probs[s.candidates[j].id];
    const double target = u * kept_sum;
    double cum = 0.0;
    int64_t last_positive = s.candidates[0].id;
    for (int64_t j = 0; j < kept; ++j) {
      const int32_t id = s.candidates[j].id;
      if (s.probs[id] > 0.0) {
        cum += s.probs[id];
        if (target < cum) return result(id);
        last_positive = id;
      }
    }
    return result(last_positive);
  }
  // Many: zero the rest and draw as without filters (same order, same result
  // up to rounding in the sums).
  const Candidate worst = s.candidates[kept - 1];
  DropAfter(logits.data(), vocab, worst.key, worst.id, s.probs.data());
  scaled_sum = BlockSums(s.probs.data(), vocab, s.block_sums.data());
  return result(InverseCdf(s.probs.data(), vocab, s.block_sums.data(), u * scaled_sum));
}

SampledToken ScoreToken(std::span<const float> logits, int64_t token, int64_t top) {
  SampledToken out{token, kNoProbabilityLogprob};
  const MaxLogit max = FindMax(logits);
  if (max.value == kNegInf) return out;
  Sampler::Scratch& s = Sampler::ThreadScratch();
  const double log_normalizer = std::log(RawWeights(logits, max.value, s.probs, s.block_sums));
  const double logprob = (CleanLogit(logits[token]) - max.value) - log_normalizer;
  if (logprob > kNegInf) out.logprob = logprob;
  if (top > 0) FillTop(logits, top, max.value, log_normalizer, out);
  return out;
}

SampledToken Sampler::SampleGreedyFrom(int64_t argmax, double weight_sum) {
  internal::Xoshiro256StarStarNext(state_);  // the draw Sample makes for every row
  const SampledToken t = GreedyToken(argmax, weight_sum);
  Record(t.token);
  return t;
}

int64_t Sampler::SelectKept(std::span<const float> logits, double max_logit, bool has_positive_nan,
                            double inv_temperature, double scaled_sum, Scratch& s) {
  const int64_t vocab = static_cast<int64_t>(logits.size());
  // Larger logit first, then lower id: a strict total order, so the kept set
  // is exact even with ties at a boundary. Logit order is probability order
  // at any temperature.
  auto before = [](const Candidate& a, const Candidate& b) { return a.key > b.key || (a.key == b.key && a.id < b.id); };
  auto weight = [&](const Candidate& c) { return s.probs[c.id]; };
  const bool top_k_on = params_.top_k > 0 && params_.top_k < vocab;

  // Stage 1: s.candidates[0, n) is the top-k set with its worst member last,
  // or (top-k off) every token that can be in the top-p set.
  int64_t n = 0;
  if (top_k_on) {
    n = params_.top_k;
    // Only tokens at or above a threshold go to the selection: the n-th
    // largest of at least n block maxima. Those n maxima are n tokens at or
    // above it, so the top n are among them; with about 4n blocks few others
    // reach it, and the selection runs on a few times n tokens, not 129k.
    // (A positive NaN would pose as a block maximum: then all tokens go.)
    int64_t count = 0;
    s.candidates.resize(static_cast<size_t>(vocab));
    if (!has_positive_nan) {
      const int64_t block = std::clamp<int64_t>(vocab / (4 * n), 1, kBlock);
      s.block_keys.resize(static_cast<size_t>((vocab + block - 1) / block));
      BlockMaxKeys(logits.data(), vocab, block, s.block_keys.data());
      std::nth_element(s.block_keys.begin(), s.block_keys.begin() + (n - 1), s.block_keys.end(), std::greater<>());
      const int32_t threshold = s.block_keys[n - 1];
      for (int64_t start = 0; start < vocab; start += block) {
        const int64_t end = std::min(vocab, start + block);
        if (RowMaxKey(logits.data() + start, end - start) < threshold) continue;  // most blocks
        for (int64_t i = start; i < end; ++i) {
          if (OrderedKey(logits[i]) >= threshold)
            s.candidates[count++] = {CleanKey(logits[i]), static_cast<int32_t>(i)};
        }
      }
    } else {
      for (int64_t i = 0; i < vocab; ++i) s.candidates[count++] = {CleanKey(logits[i]), static_cast<int32_t>(i)};
    }
    // The n best, worst of them last.
    std::nth_element(s.candidates.begin(), s.candidates.begin() + (n - 1), s.candidates.begin() + count, before);
    s.candidates.resize(static_cast<size_t>(n));
    // s.probs still holds untempered weights; only the candidates need theirs.
    if (inv_temperature != 1.0) {
      for (int64_t j = 0; j < n; ++j) {
        const int32_t id = s.candidates[j].id;
        s.probs[id] = SamplerExpNonPositive((CleanLogit(logits[id]) - max_logit) * inv_temperature);
      }
    }
    if (!(params_.top_p < 1.0)) return n;
  } else {
    // Tokens lighter than min_weight can never be in the top-p set: together
    // they weigh less than vocab * min_weight <= (1 - top_p) * total, so the
    // tokens above them already reach top_p. Real model outputs put nearly
    // all of a large vocabulary below it, so the search below stays small.
    // (Half the bound, so rounding cannot matter.)
    const double min_weight = 0.5 * (1.0 - params_.top_p) * scaled_sum / static_cast<double>(vocab);
    s.candidates.resize(static_cast<size_t>(vocab));
    for (int64_t i = 0; i < vocab; ++i) {
      if (s.probs[i] >= min_weight) s.candidates[n++] = {CleanKey(logits[i]), static_cast<int32_t>(i)};
    }
    s.candidates.resize(static_cast<size_t>(n));  // n >= 1: the max token weighs 1 > min_weight
  }

  // Stage 2, top-p: the smallest best-first prefix of s.candidates[0, n)
  // whose mass reaches top_p of the renormalized total (over the top-k set,
  // or over the whole vocabulary). Instead of sorting (the prefix can be most
  // of the vocabulary) this is a quickselect on mass: partition around the
  // median, keep whichever side holds the crossing point.
  // Invariant: s.candidates[0, lo) are the best lo, with mass `above` short of
  // `needed`; the crossing lies in [lo, hi).
  double total = scaled_sum;
  if (top_k_on) {
    total = 0.0;
    for (int64_t j = 0; j < n; ++j) total += weight(s.candidates[j]);
  }
  const double needed = params_.top_p * total;
  auto first = s.candidates.begin();
  int64_t lo = 0;
  int64_t hi = n;
  double above = 0.0;
  while (hi - lo > kTopPSortBelow) {
    const int64_t mid = lo + (hi - lo) / 2;
    std::nth_element(first + lo, first + mid, first + hi, before);
    double left = 0.0;
    for (int64_t j = lo; j < mid; ++j) left += weight(s.candidates[j]);
    if (above + left >= needed) {
      hi = mid;
    } else {
      above += left;
      lo = mid;
    }
  }
  std::sort(first + lo, first + hi, before);
  for (int64_t j = lo; j < hi; ++j) {
    above += weight(s.candidates[j]);
    if (above >= needed) return j + 1;
  }
  // Only rounding gets here (the partition sums said the crossing is before
  // hi): keep all of [lo, hi).
  return hi;
}

}  // namespace mlarun
