#include "bench/workload.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

namespace mlarun {
namespace serve_bench {

double Percentile(std::vector<double> values, double p) {
  if (values.empty()) return NAN;
  std::sort(values.begin(), values.end());
  const double n = static_cast<double>(values.size());
  // Multiplying first keeps whole ranks exact (0.99 * 100 is not 99 in binary).
  const double rank = std::ceil(std::clamp(p, 0.0, 100.0) * n / 100.0);  // 1-based
  const size_t i = static_cast<size_t>(std::clamp(rank, 1.0, n)) - 1;
  return values[i];
}

double LoadImbalance(std::span<const int64_t> queued_tokens) {
  if (queued_tokens.empty()) return NAN;
  int64_t max = 0;
  double sum = 0;
  for (int64_t q : queued_tokens) {
    max = std::max(max, q);
    sum += static_cast<double>(q);
  }
  if (sum <= 0) return NAN;
  return static_cast<double>(max) / (sum / static_cast<double>(queued_tokens.size()));
}

double MeanOfFinite(std::span<const double> values) {
  double sum = 0;
  int64_t n = 0;
  for (double v : values) {
    if (!std::isfinite(v)) continue;
    sum += v;
    ++n;
  }
  return n > 0 ? sum / static_cast<double>(n) : NAN;
}

double PrefixHitRate(std::span<const PrefixCounts> finished) {
  int64_t prompt = 0, hit = 0;
  for (const PrefixCounts& f : finished) {
    prompt += f.prompt_tokens;
    hit += f.prefix_hit_tokens;
  }
  return prompt > 0 ? static_cast<double>(hit) / static_cast<double>(prompt) : NAN;
}

SharedPrefixWorkload MakeSharedPrefixWorkload(const SharedPrefixSpec& spec) {
  std::mt19937_64 rng(spec.seed);
  std::uniform_int_distribution<int32_t> token(2, static_cast<int32_t>(std::max<int64_t>(spec.vocab_size, 3) - 1));
  std::uniform_int_distribution<int64_t> suffix_len(spec.suffix_min, std::max(spec.suffix_min, spec.suffix_max));
  std::vector<std::vector<int32_t>> system(static_cast<size_t>(std::max(spec.prefixes, 1)));
  for (auto& s : system) {
    s.resize(static_cast<size_t>(spec.prefix_tokens));
    for (int32_t& t : s) t = token(rng);
  }
  SharedPrefixWorkload w;
  for (int64_t i = 0; i < spec.requests; ++i)
    w.prefix_of.push_back(static_cast<int>(i % static_cast<int64_t>(system.size())));
  std::shuffle(w.prefix_of.begin(), w.prefix_of.end(), rng);  // random arrival order
  for (int p : w.prefix_of) {
    std::vector<int32_t> prompt = system[static_cast<size_t>(p)];
    const int64_t n = suffix_len(rng);
    for (int64_t j = 0; j < n; ++j) prompt.push_back(token(rng));
    w.prompts.push_back(std::move(prompt));
  }
  return w;
}

namespace {

// `len` random ids in [2, vocab_size).
std::vector<int32_t> RandomPrompt(std::mt19937_64& rng, int64_t len, int64_t vocab_size) {
  std::uniform_int_distribution<int32_t> token(2, static_cast<int32_t>(vocab_size - 1));
  std::vector<int32_t> prompt(static_cast<size_t>(len));
  for (int32_t& t : prompt) t = token(rng);
  return prompt;
}

uint64_t RequestSeed(uint64_t seed, size_t i) { return seed * 1000003 + static_cast<uint64_t>(i); }

}  // namespace

std::vector<BenchRequest> RandomRequests(int64_t n, int64_t max_tokens, int64_t vocab_size, uint64_t seed,
                                         int64_t prompt_min, int64_t prompt_max) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int64_t> len(prompt_min, prompt_max);
  std::vector<BenchRequest> out(static_cast<size_t>(n));
  for (size_t i = 0; i < out.size(); ++i) {
    BenchRequest& r = out[i];
    r.prompt = RandomPrompt(rng, len(rng), vocab_size);
    r.seed = RequestSeed(seed, i);
    r.max_tokens = max_tokens;
  }
  return out;
}

std::vector<double> PoissonArrivals(double rate_per_s, double duration_s, uint64_t seed) {
  std::vector<double> t;
  if (!(rate_per_s > 0) || !(duration_s > 0)) return t;
  std::mt19937_64 rng(seed);
  std::exponential_distribution<double> gap(rate_per_s);
  for (double now = gap(rng); now < duration_s; now += gap(rng)) t.push_back(now);
  return t;
}

double GroupBalance(std::span<const int64_t> in_flight) {
  int64_t max = 0;
  double sum = 0;
  for (int64_t n : in_flight) {
    max = std::max(max, n);
    sum += static_cast<double>(n);
  }
  if (max <= 0) return NAN;
  return sum / static_cast<double>(in_flight.size()) / static_cast<double>(max);
}

std::vector<TimedRequest> MakeSkewedWorkload(const SkewedSpec& spec) {
  const std::vector<double> arrivals = PoissonArrivals(spec.rate_per_s, spec.duration_s, spec.seed);
  std::vector<BenchRequest> requests = RandomRequests(static_cast<int64_t>(arrivals.size()), spec.short_tokens,
                                                      spec.vocab_size, spec.seed, spec.prompt_min, spec.prompt_max);
  // Its own stream, so the mix does not shift the prompts or the arrivals.
  std::mt19937_64 rng(spec.seed ^ 0x6c6f6e67ull);  // "long"
  std::bernoulli_distribution is_long(std::clamp(spec.long_fraction, 0.0, 1.0));
  std::vector<TimedRequest> out(arrivals.size());
  for (size_t i = 0; i < arrivals.size(); ++i) {
    out[i].arrival_s = arrivals[i];
    out[i].request = std::move(requests[i]);
    if (is_long(rng)) out[i].request.max_tokens = spec.long_tokens;
  }
  return out;
}

std::vector<TimedRequest> MakePromptMixWorkload(const PromptMixSpec& spec) {
  const std::vector<double> arrivals = PoissonArrivals(spec.rate_per_s, spec.duration_s, spec.seed);
  std::mt19937_64 rng(spec.seed ^ 0x6d6978ull);  // "mix": its own stream, apart from the arrivals'
  std::bernoulli_distribution is_short(std::clamp(spec.short_fraction, 0.0, 1.0));
  std::uniform_int_distribution<int64_t> short_len(spec.short_min, std::max(spec.short_min, spec.short_max));
  std::uniform_int_distribution<int64_t> long_len(spec.long_min, std::max(spec.long_min, spec.long_max));
  std::uniform_int_distribution<int64_t> output(spec.output_min, std::max(spec.output_min, spec.output_max));
  std::vector<TimedRequest> out(arrivals.size());
  for (size_t i = 0; i < arrivals.size(); ++i) {
    out[i].arrival_s = arrivals[i];
    BenchRequest& r = out[i].request;
    const int64_t len = is_short(rng) ? short_len(rng) : long_len(rng);
    r.prompt = RandomPrompt(rng, len, spec.vocab_size);
    r.seed = RequestSeed(spec.seed, i);
    r.max_tokens = output(rng);
  }
  return out;
}

}  // namespace serve_bench

}  // namespace mlarun
