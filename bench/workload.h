// The serving benchmarks' shared parts (`mlarun bench serve`, and its --http
// form in http_bench.h): the requests they send and the arithmetic of their
// reports, exposed for tests.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace mlarun {
namespace serve_bench {

// The p-th percentile (p in [0, 100]) by the nearest-rank method: the smallest
// value with at least p% of the values at or below it. NaN when empty.
double Percentile(std::vector<double> values, double p);

// Load imbalance of one GetStats sample: max / mean of the groups' queued
// tokens. NaN when there are no groups or none has queued tokens (an idle
// sample says nothing about balance; callers skip it).
double LoadImbalance(std::span<const int64_t> queued_tokens);

// One request of a benchmark's load: its prompt ids, seed and max_tokens.
struct BenchRequest {
  std::vector<int32_t> prompt;
  uint64_t seed = 0;
  int64_t max_tokens = 16;
};
// `n` independent prompts of prompt_min..prompt_max random ids in [2,
// vocab_size) (no shared prefixes), request i seeded seed * 1000003 + i.
// Deterministic in `seed`.
std::vector<BenchRequest> RandomRequests(int64_t n, int64_t max_tokens, int64_t vocab_size, uint64_t seed,
                                         int64_t prompt_min = 16, int64_t prompt_max = 256);

// Arrival times in [0, duration_s) of a Poisson process of `rate_per_s`
// arrivals per second (independent exponential gaps), ascending. Empty when
// either is not positive. Deterministic in `seed`.
std::vector<double> PoissonArrivals(double rate_per_s, double duration_s, uint64_t seed);

// Group balance of one GetStats sample: mean / max of the groups' requests
// in flight, 1 when all run as many, 1/groups when one runs them all. NaN
// when none has any (an idle sample says nothing about balance; callers
// skip it).
double GroupBalance(std::span<const int64_t> in_flight);

// A skewed open-loop workload (`mlarun bench rebalance`): Poisson arrivals
// at rate_per_s over duration_s; each request long (long_tokens) with
// probability long_fraction, else short (short_tokens); prompts of
// prompt_min..prompt_max random ids in [2, vocab_size) as RandomRequests
// makes them. Deterministic in `seed`.
struct SkewedSpec {
  double rate_per_s = 16;
  double duration_s = 20;
  double long_fraction = 0.1;
  int64_t short_tokens = 32, long_tokens = 1024;
  int64_t vocab_size = 512;
  int64_t prompt_min = 16, prompt_max = 256;
  uint64_t seed = 1;
};
struct TimedRequest {
  double arrival_s = 0;  // from the start of the run
  BenchRequest request;
};
std::vector<TimedRequest> MakeSkewedWorkload(const SkewedSpec& spec);

// A prompt-length mix (`mlarun bench disagg`): Poisson arrivals at
// rate_per_s over duration_s; each prompt short (short_min..short_max
// random ids in [2, vocab_size)) with probability short_fraction, else long
// (long_min..long_max); max_tokens uniform in output_min..output_max;
// request i seeded seed * 1000003 + i. Deterministic in `seed`.
struct PromptMixSpec {
  double rate_per_s = 8;
  double duration_s = 20;
  double short_fraction = 0.3;
  int64_t short_min = 64, short_max = 256;
  int64_t long_min = 1024, long_max = 4096;
  int64_t output_min = 64, output_max = 256;
  int64_t vocab_size = 512;
  uint64_t seed = 1;
};
std::vector<TimedRequest> MakePromptMixWorkload(const PromptMixSpec& spec);

// Mean of the finite values (the skipped samples are NaN). NaN when none.
double MeanOfFinite(std::span<const double> values);

// What one Finished message says about the prefix cache.
struct PrefixCounts {
  int64_t prompt_tokens = 0;
  int64_t prefix_hit_tokens = 0;
};
// Sum of prefix_hit_tokens / sum of prompt_tokens. NaN when there are no
// prompt tokens.
double PrefixHitRate(std::span<const PrefixCounts> finished);

// The shared-prefix workload: `prefixes` random "system prompts" of
// `prefix_tokens` tokens each; request i is prompt prefix_of[i] followed by
// a unique random suffix of suffix_min..suffix_max tokens; the requests come
// in random order (each prefix used requests / prefixes times, +-1). Token
// ids are in [2, vocab_size). Deterministic in `seed`.
struct SharedPrefixSpec {
  int prefixes = 8;
  int64_t prefix_tokens = 256;  // 4 blocks of 64
  int64_t requests = 512;
  int64_t suffix_min = 8, suffix_max = 56;
  int64_t vocab_size = 512;
  uint64_t seed = 1;
};
struct SharedPrefixWorkload {
  std::vector<std::vector<int32_t>> prompts;  // in arrival order
  std::vector<int> prefix_of;                 // which system prompt each one starts with
};
SharedPrefixWorkload MakeSharedPrefixWorkload(const SharedPrefixSpec& spec);

}  // namespace serve_bench
}  // namespace mlarun
