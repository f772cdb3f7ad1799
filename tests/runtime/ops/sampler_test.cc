#include "runtime/ops/sampler.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <set>
#include <span>
#include <string>
#include <vector>

namespace mlarun {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr float kFloatInf = std::numeric_limits<float>::infinity();
constexpr float kFloatNaN = std::numeric_limits<float>::quiet_NaN();
// Statistical checks allow 5 binomial standard errors: with fixed seeds the
// outcome is deterministic, and a correct sampler sits well inside it.
constexpr double kSigmas = 5.0;

// Reference log-softmax in double with libm's exp, written independently of
// the sampler's vectorized exp and block sums.
std::vector<double> LogSoftmax(const std::vector<float>& logits) {
  double max_logit = -kInf;
  for (float x : logits) max_logit = std::max(max_logit, static_cast<double>(x));
  double sum = 0.0;
  for (float x : logits) sum += std::exp(static_cast<double>(x) - max_logit);
  std::vector<double> out;
  for (float x : logits) out.push_back(static_cast<double>(x) - max_logit - std::log(sum));
  return out;
}

// softmax(logits / temperature), renormalized over `kept` (all when empty).
// No max subtraction: the test logits / temperature stay far from overflow.
std::vector<double> TemperedProbs(const std::vector<float>& logits, double temperature,
                                  const std::set<int64_t>& kept = {}) {
  std::vector<double> w(logits.size(), 0.0);
  double sum = 0.0;
  for (size_t i = 0; i < logits.size(); ++i) {
    if (!kept.empty() && !kept.count(static_cast<int64_t>(i))) continue;
    w[i] = std::exp(static_cast<double>(logits[i]) / temperature);
    sum += w[i];
  }
  for (double& x : w) x /= sum;
  return w;
}

std::vector<float> LogitsOfProbs(const std::vector<double>& probs) {
  std::vector<float> out;
  for (double p : probs) out.push_back(static_cast<float>(std::log(p)));
  return out;
}

std::vector<int64_t> Histogram(const SamplingParams& params, const std::vector<float>& logits, int64_t draws) {
  Sampler sampler(params);
  std::vector<int64_t> counts(logits.size(), 0);
  for (int64_t i = 0; i < draws; ++i) {
    const SampledToken t = sampler.Sample(logits);
    EXPECT_GE(t.token, 0);
    EXPECT_LT(t.token, static_cast<int64_t>(logits.size()));
    if (t.token >= 0 && t.token < static_cast<int64_t>(logits.size())) ++counts[t.token];
  }
  return counts;
}

// Each token's frequency within kSigmas binomial standard errors of its
// expected probability; tokens with probability 0 must never appear.
void ExpectDistribution(const std::vector<int64_t>& counts, const std::vector<double>& expected, int64_t draws) {
  ASSERT_EQ(counts.size(), expected.size());
  for (size_t i = 0; i < counts.size(); ++i) {
    const double p = expected[i];
    if (p == 0.0) {
      EXPECT_EQ(counts[i], 0) << "token " << i << " is outside the kept set";
      continue;
    }
    const double freq = static_cast<double>(counts[i]) / static_cast<double>(draws);
    const double se = std::sqrt(p * (1.0 - p) / static_cast<double>(draws));
    EXPECT_NEAR(freq, p, kSigmas * se) << "token " << i;
  }
}

SamplingParams Params(double temperature, int64_t top_k = 0, double top_p = 1.0, uint64_t seed = 42) {
  SamplingParams p;
  p.temperature = temperature;
  p.top_k = top_k;
  p.top_p = top_p;
  p.seed = seed;
  return p;
}

const std::vector<float> kSixLogits = {1.0f, 2.0f, 0.5f, -1.0f, 3.0f, 0.0f};

TEST(SamplerRng, PublishedVectors) {
  // splitmix64 from state 0 and xoshiro256** from state {1, 2, 3, 4}: the
  // published outputs of the reference implementations.
  uint64_t sm = 0;
  const uint64_t sm_expected[] = {0xE220A8397B1DCDAFull, 0x6E789E6AA1B965F4ull, 0x06C45D188009454Full,
                                  0xF88BB8A8724C81ECull};
  for (uint64_t e : sm_expected) EXPECT_EQ(internal::SplitMix64Next(sm), e);
  uint64_t s[4] = {1, 2, 3, 4};
  const uint64_t xo_expected[] = {11520ull,
                                  0ull,
                                  1509978240ull,
                                  1215971899390074240ull,
                                  1216172134540287360ull,
                                  607988272756665600ull,
                                  16172922978634559625ull,
                                  8476171486693032832ull,
                                  10595114339597558777ull,
                                  2904607092377533576ull};
  for (uint64_t e : xo_expected) EXPECT_EQ(internal::Xoshiro256StarStarNext(s), e);
}

TEST(SamplerRng, DrawsFollowTheDocumentedStream) {
  // The sampler's k-th u is the top 53 bits of the k-th xoshiro output, state
  // seeded by four splitmix64 outputs of the seed. With n equal logits the
  // inverse CDF in id order picks the first i with n*u < i+1.
  for (uint64_t seed : {0ull, 7ull, 0xDEADBEEFull}) {
    uint64_t sm = seed;
    uint64_t s[4];
    for (uint64_t& w : s) w = internal::SplitMix64Next(sm);
    Sampler sampler(Params(1.0, 0, 1.0, seed));
    const std::vector<float> flat(3, 0.25f);
    for (int k = 0; k < 200; ++k) {
      const double u = static_cast<double>(internal::Xoshiro256StarStarNext(s) >> 11) * 0x1.0p-53;
      const double target = u * 3.0;
      const int64_t expected = target < 1.0 ? 0 : (target < 2.0 ? 1 : 2);
      ASSERT_EQ(sampler.Sample(flat).token, expected) << "seed " << seed << " draw " << k;
    }
  }
}

TEST(Sampler, GreedyPicksArgmaxLowestIdOnTies) {
  const std::vector<float> logits = {0.1f, 3.0f, -2.0f, 3.0f, 1.0f};
  const std::vector<double> ref = LogSoftmax(logits);
  for (double t : {0.0, 1e-6}) {
    Sampler sampler(Params(t, 0, 1.0, 9));
    for (int i = 0; i < 20; ++i) {
      const SampledToken s = sampler.Sample(logits);
      EXPECT_EQ(s.token, 1) << "temperature " << t;
      EXPECT_NEAR(s.logprob, ref[1], 1e-12);
    }
  }
  // top-k and top-p do not change greedy.
  Sampler with_filters(Params(0.0, 3, 0.5));
  EXPECT_EQ(with_filters.Sample(logits).token, 1);
  // An argmax at the last index is found too.
  Sampler last(Params(0.0));
  const std::vector<float> rising = {-1.0f, 0.0f, 1.0f, 2.0f};
  const SampledToken s = last.Sample(rising);
  EXPECT_EQ(s.token, 3);
  EXPECT_NEAR(s.logprob, LogSoftmax(rising)[3], 1e-12);
}

TEST(Sampler, SameSeedSameTokensDifferentSeedDifferentTokens) {
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<std::vector<float>> rows(1000, std::vector<float>(50));
  for (auto& row : rows)
    for (float& x : row) x = normal(rng);
  for (const SamplingParams& base : {Params(1.0), Params(0.8, 10), Params(1.3, 0, 0.9), Params(0.7, 20, 0.8)}) {
    SamplingParams p1 = base, p2 = base, p3 = base;
    p1.seed = p2.seed = 1234;
    p3.seed = 1235;
    Sampler a(p1), b(p2), c(p3);
    int64_t differing = 0;
    for (const auto& row : rows) {
      const SampledToken ta = a.Sample(row), tb = b.Sample(row), tc = c.Sample(row);
      ASSERT_EQ(ta.token, tb.token);
      ASSERT_EQ(ta.logprob, tb.logprob);
      differing += ta.token != tc.token;
    }
    // Over 50 tokens of spread-out mass, independent streams disagree on most rows.
    EXPECT_GT(differing, 300) << "top_k " << base.top_k << " top_p " << base.top_p;
  }
}

TEST(Sampler, EveryCallConsumesOneDraw) {
  // Rows whose outcome is forced (one finite logit, all -inf, empty) still
  // advance the stream, so later draws line up with a sampler that sampled
  // normally in their place.
  std::vector<float> forced(6, -kFloatInf);
  forced[2] = 0.0f;
  const std::vector<float> all_inf(6, -kFloatInf);
  const std::vector<float> empty;
  Sampler a(Params(1.0, 0, 1.0, 77)), b(Params(1.0, 0, 1.0, 77));
  EXPECT_EQ(a.Sample(forced).token, 2);
  b.Sample(kSixLogits);
  a.Sample(all_inf);
  b.Sample(kSixLogits);
  a.Sample(empty);
  b.Sample(kSixLogits);
  int64_t differing_from_shifted = 0;
  Sampler shifted(Params(1.0, 0, 1.0, 77));  // two draws behind a and b
  shifted.Sample(kSixLogits);
  for (int i = 0; i < 500; ++i) {
    const int64_t ta = a.Sample(kSixLogits).token;
    ASSERT_EQ(ta, b.Sample(kSixLogits).token) << "draw " << i;
    differing_from_shifted += ta != shifted.Sample(kSixLogits).token;
  }
  // Guards the check above: misaligned streams do disagree.
  EXPECT_GT(differing_from_shifted, 100);
}

TEST(Sampler, TemperatureMatchesSoftmax) {
  constexpr int64_t kDraws = 200000;
  for (double t : {1.0, 0.5, 2.0}) {
    SCOPED_TRACE("temperature " + std::to_string(t));
    ExpectDistribution(Histogram(Params(t), kSixLogits, kDraws), TemperedProbs(kSixLogits, t), kDraws);
  }
}

TEST(Sampler, TopKKeepsTopTokensRenormalized) {
  constexpr int64_t kDraws = 200000;
  // Top 2 of kSixLogits: ids 4 (3.0) and 1 (2.0).
  for (double t : {1.0, 0.5}) {
    SCOPED_TRACE("temperature " + std::to_string(t));
    ExpectDistribution(Histogram(Params(t, 2), kSixLogits, kDraws), TemperedProbs(kSixLogits, t, {4, 1}), kDraws);
  }
  // top_k >= vocab and -1 are off.
  ExpectDistribution(Histogram(Params(1.0, 6), kSixLogits, kDraws), TemperedProbs(kSixLogits, 1.0), kDraws);
  ExpectDistribution(Histogram(Params(1.0, -1), kSixLogits, kDraws), TemperedProbs(kSixLogits, 1.0), kDraws);
}

TEST(Sampler, TopKTiesAtBoundaryKeepLowerIds) {
  const std::vector<float> logits = {1.0f, 2.0f, 2.0f, 2.0f, 0.0f};
  constexpr int64_t kDraws = 20000;
  ExpectDistribution(Histogram(Params(1.0, 2), logits, kDraws), {0.0, 0.5, 0.5, 0.0, 0.0}, kDraws);
}

TEST(Sampler, TopPKeepsSmallestPrefix) {
  constexpr int64_t kDraws = 200000;
  // Probabilities 0.5, 0.3, 0.15, 0.05 placed out of id order: top_p 0.7
  // keeps the two most likely (ids 1 and 3), renormalized to 0.625 / 0.375.
  const std::vector<float> logits = LogitsOfProbs({0.15, 0.5, 0.05, 0.3});
  ExpectDistribution(Histogram(Params(1.0, 0, 0.7), logits, kDraws), {0.0, 0.625, 0.0, 0.375}, kDraws);
  // Temperature applies first: at T = 2 the probabilities flatten to about
  // 0.379, 0.294, 0.208, 0.120, so 0.7 needs the third token as well.
  ExpectDistribution(Histogram(Params(2.0, 0, 0.7), logits, kDraws), TemperedProbs(logits, 2.0, {1, 3, 0}), kDraws);
  // A tiny top_p keeps only the most likely token.
  ExpectDistribution(Histogram(Params(1.0, 0, 1e-9), logits, 1000), {0.0, 1.0, 0.0, 0.0}, 1000);
}

TEST(Sampler, TopPTiesKeepLowerIds) {
  // Four equal tokens: 0.5 is reached exactly after two, the lowest ids.
  const std::vector<float> logits(4, 1.0f);
  constexpr int64_t kDraws = 20000;
  ExpectDistribution(Histogram(Params(1.0, 0, 0.5), logits, kDraws), {0.5, 0.5, 0.0, 0.0}, kDraws);
}

TEST(Sampler, TopKThenTopPRenormalizesOverTopK) {
  constexpr int64_t kDraws = 200000;
  // Over the top 3 of kSixLogits (ids 4, 1, 0) the renormalized masses are
  // about 0.665, 0.245, 0.090, so top_p 0.9 keeps {4, 1} (cumulative 0.910).
  // Over the whole vocabulary the first two only reach 0.827 and top_p alone
  // would also keep id 0: the check catches normalizing over the wrong set.
  ExpectDistribution(Histogram(Params(1.0, 3, 0.9), kSixLogits, kDraws), TemperedProbs(kSixLogits, 1.0, {4, 1}),
                     kDraws);
  ExpectDistribution(Histogram(Params(1.0, 0, 0.9), kSixLogits, kDraws), TemperedProbs(kSixLogits, 1.0, {4, 1, 0}),
                     kDraws);
}

TEST(Sampler, LogprobIsFromUnmodifiedDistribution) {
  const std::vector<double> ref = LogSoftmax(kSixLogits);
  for (const SamplingParams& p :
       {Params(0.0), Params(1.0), Params(0.5), Params(2.0, 2), Params(1.0, 0, 0.7), Params(0.3, 3, 0.9)}) {
    Sampler sampler(p);
    for (int i = 0; i < 200; ++i) {
      const SampledToken s = sampler.Sample(kSixLogits);
      ASSERT_GE(s.token, 0);
      ASSERT_LT(s.token, 6);
      EXPECT_NEAR(s.logprob, ref[s.token], 1e-12)
          << "temperature " << p.temperature << " top_k " << p.top_k << " top_p " << p.top_p;
    }
  }
}

TEST(Sampler, NonFiniteLogits) {
  // NaN counts as -inf: never sampled, and it does not poison the logprob.
  const std::vector<float> with_nan = {0.0f, kFloatNaN, 1.0f, -kFloatInf};
  const std::vector<double> ref = LogSoftmax({0.0f, -kFloatInf, 1.0f, -kFloatInf});
  for (const SamplingParams& p : {Params(0.0), Params(1.0), Params(1.0, 2), Params(1.0, 0, 0.99)}) {
    Sampler sampler(p);
    for (int i = 0; i < 500; ++i) {
      const SampledToken s = sampler.Sample(with_nan);
      ASSERT_TRUE(s.token == 0 || s.token == 2) << s.token;
      EXPECT_NEAR(s.logprob, ref[s.token], 1e-12);
    }
  }
  // A NaN first entry is not the argmax.
  EXPECT_EQ(Sampler(Params(0.0)).Sample(std::vector<float>{kFloatNaN, -5.0f}).token, 1);
  // All -inf (or NaN): token 0, logprob -inf.
  for (const SamplingParams& p : {Params(0.0), Params(1.0), Params(1.0, 1, 0.5)}) {
    const SampledToken s = Sampler(p).Sample(std::vector<float>{-kFloatInf, kFloatNaN, -kFloatInf});
    EXPECT_EQ(s.token, 0);
    EXPECT_EQ(s.logprob, -kInf);
  }
  // +inf tokens share all the mass equally.
  const std::vector<float> two_inf = {0.0f, kFloatInf, 3.0f, kFloatInf};
  const SampledToken g = Sampler(Params(0.0)).Sample(two_inf);
  EXPECT_EQ(g.token, 1);
  EXPECT_NEAR(g.logprob, -std::log(2.0), 1e-12);
  constexpr int64_t kDraws = 20000;
  ExpectDistribution(Histogram(Params(1.0), two_inf, kDraws), {0.0, 0.5, 0.0, 0.5}, kDraws);
  ExpectDistribution(Histogram(Params(0.5, 0, 0.9), two_inf, kDraws), {0.0, 0.5, 0.0, 0.5}, kDraws);
}

// The `n` most likely tokens by the documented order (larger logit first,
// then lower id; NaN as -inf, -inf never listed), by a full sort.
std::vector<int64_t> TopIds(const std::vector<float>& logits, int64_t n) {
  std::vector<int64_t> ids;
  for (int64_t i = 0; i < static_cast<int64_t>(logits.size()); ++i)
    if (logits[i] > -kFloatInf) ids.push_back(i);  // false for NaN too
  std::stable_sort(ids.begin(), ids.end(), [&](int64_t a, int64_t b) { return logits[a] > logits[b]; });
  ids.resize(std::min<size_t>(ids.size(), static_cast<size_t>(n)));
  return ids;
}

void ExpectTop(const SampledToken& s, const std::vector<float>& logits, int64_t n, const std::string& what) {
  const std::vector<double> ref = LogSoftmax(logits);
  const std::vector<int64_t> want = TopIds(logits, n);
  ASSERT_EQ(s.num_top, static_cast<int32_t>(want.size())) << what;
  for (size_t j = 0; j < want.size(); ++j) {
    EXPECT_EQ(s.top[j].token, want[j]) << what << ", entry " << j;
    EXPECT_NEAR(s.top[j].logprob, ref[static_cast<size_t>(want[j])], 1e-9) << what << ", entry " << j;
  }
}

TEST(Sampler, TopLogprobsAreTheMostLikelyTokensOfTheUnmodifiedDistribution) {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  for (int64_t vocab : {1, 5, 37, 1000, 129280}) {
    std::vector<float> logits(static_cast<size_t>(vocab));
    for (float& x : logits) x = normal(rng);
    if (vocab >= 1000) {
      // Ties across the list's boundary and inside it: lower ids first.
      for (int64_t i = 0; i < 8; ++i) logits[static_cast<size_t>(vocab - 1 - 7 * i)] = 9.5f;
      logits[3] = 9.5f;
    }
    for (int64_t n : {1, 2, 5, 20}) {
      for (const SamplingParams& base : {Params(0.0), Params(1.0), Params(0.7, 40, 0.9), Params(1.3, 0, 0.5)}) {
        SamplingParams p = base;
        p.logprobs = n;
        SamplingParams plain = base;  // the same draws without the list
        Sampler with(p), without(plain);
        for (int draw = 0; draw < 3; ++draw) {
          const SampledToken s = with.Sample(logits);
          const std::string what = "vocab " + std::to_string(vocab) + ", logprobs " + std::to_string(n) +
                                   ", temperature " + std::to_string(p.temperature);
          ExpectTop(s, logits, n, what);
          const SampledToken t = without.Sample(logits);
          EXPECT_EQ(t.num_top, 0) << what;
          EXPECT_EQ(s.token, t.token) << what << ": asking for the list changed the draw";
          EXPECT_EQ(s.logprob, t.logprob) << what;
        }
      }
    }
  }
}

TEST(Sampler, TopLogprobsSkipTokensWithoutProbability) {
  // NaN and -inf have no probability: fewer entries than asked; +inf tokens
  // share the mass and come first, lower id first.
  const std::vector<float> logits = {0.5f, kFloatNaN, -kFloatInf, kFloatInf, 2.0f, -kFloatInf, kFloatInf};
  SamplingParams p = Params(0.0);
  p.logprobs = 6;
  const SampledToken s = Sampler(p).Sample(logits);
  ASSERT_EQ(s.num_top, 4);
  const int64_t want[] = {3, 6, 4, 0};
  for (int j = 0; j < 4; ++j) EXPECT_EQ(s.top[static_cast<size_t>(j)].token, want[j]) << j;
  EXPECT_NEAR(s.top[0].logprob, -std::log(2.0), 1e-12);
  EXPECT_NEAR(s.top[1].logprob, -std::log(2.0), 1e-12);
  // Finite logits beside +inf (read as the largest float): no mass to speak of.
  EXPECT_LT(s.top[2].logprob, -1e38);
  // A row with no distribution lists nothing.
  const SampledToken none = Sampler(p).Sample(std::vector<float>{-kFloatInf, kFloatNaN});
  EXPECT_EQ(none.num_top, 0);
}

// Tokens kept by top-p over softmax(logits / t), by the documented rule.
std::set<int64_t> TopPSet(const std::vector<float>& logits, double t, double top_p) {
  const std::vector<double> probs = TemperedProbs(logits, t);
  std::vector<int64_t> ids(logits.size());
  std::iota(ids.begin(), ids.end(), 0);
  std::sort(ids.begin(), ids.end(),
            [&](int64_t a, int64_t b) { return probs[a] > probs[b] || (probs[a] == probs[b] && a < b); });
  std::set<int64_t> kept;
  double cum = 0.0;
  for (int64_t id : ids) {
    kept.insert(id);
    cum += probs[id];
    if (cum >= top_p) break;
  }
  return kept;
}

TEST(Sampler, TopPWithManyKeptTokens) {
  // Slowly decaying logits on shuffled ids: top_p 0.8 keeps well over a
  // thousand tokens, so the sorted window has to grow several times.
  constexpr int64_t kVocab = 4000;
  std::vector<int64_t> perm(kVocab);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), std::mt19937(5));
  std::vector<float> logits(kVocab);
  std::vector<int64_t> rank_of(kVocab);
  for (int64_t rank = 0; rank < kVocab; ++rank) {
    logits[perm[rank]] = -0.0005f * static_cast<float>(rank);
    rank_of[perm[rank]] = rank;
  }
  const std::set<int64_t> kept = TopPSet(logits, 1.0, 0.8);
  ASSERT_GT(kept.size(), 1100u);
  ASSERT_LT(kept.size(), static_cast<size_t>(kVocab));
  // Mass in the better half of the kept ranks, renormalized over the kept set.
  const std::vector<double> probs = TemperedProbs(logits, 1.0, kept);
  const int64_t half = static_cast<int64_t>(kept.size()) / 2;
  double better_half = 0.0;
  for (int64_t rank = 0; rank < half; ++rank) better_half += probs[perm[rank]];
  constexpr int64_t kDraws = 20000;
  Sampler sampler(Params(1.0, 0, 0.8, 11));
  int64_t in_better_half = 0;
  std::set<int64_t> seen;
  for (int64_t i = 0; i < kDraws; ++i) {
    const int64_t tok = sampler.Sample(logits).token;
    ASSERT_TRUE(kept.count(tok)) << "token " << tok << " outside the top-p set";
    seen.insert(tok);
    in_better_half += rank_of[tok] < half;
  }
  const double se = std::sqrt(better_half * (1.0 - better_half) / kDraws);
  EXPECT_NEAR(static_cast<double>(in_better_half) / kDraws, better_half, kSigmas * se);
  // The kept tokens are almost equally likely: nearly all of them show up.
  EXPECT_GT(seen.size(), kept.size() * 99 / 100);
}

TEST(Sampler, LargeVocabSmoke) {
  constexpr int64_t kVocab = 129280;  // DeepSeek-V3
  std::mt19937 rng(2024);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  std::vector<float> logits(kVocab);
  for (float& x : logits) x = normal(rng);
  const std::vector<double> ref = LogSoftmax(logits);
  const int64_t argmax = std::max_element(logits.begin(), logits.end()) - logits.begin();

  Sampler plain(Params(1.0, 0, 1.0, 1));
  for (int i = 0; i < 20; ++i) {
    const SampledToken s = plain.Sample(logits);
    ASSERT_GE(s.token, 0);
    ASSERT_LT(s.token, kVocab);
    EXPECT_NEAR(s.logprob, ref[s.token], 1e-9);
  }
  Sampler greedy(Params(0.0));
  const SampledToken g = greedy.Sample(logits);
  EXPECT_EQ(g.token, argmax);
  EXPECT_NEAR(g.logprob, ref[argmax], 1e-9);
  Sampler top1(Params(0.7, 1, 1.0, 2));
  for (int i = 0; i < 20; ++i) EXPECT_EQ(top1.Sample(logits).token, argmax);

  // top_k 50: only the 50 largest logits.
  std::vector<float> sorted = logits;
  std::nth_element(sorted.begin(), sorted.begin() + 49, sorted.end(), std::greater<float>());
  const float fiftieth = sorted[49];
  Sampler top50(Params(1.0, 50, 1.0, 3));
  for (int i = 0; i < 200; ++i) {
    const SampledToken s = top50.Sample(logits);
    ASSERT_GE(logits[s.token], fiftieth);
    EXPECT_NEAR(s.logprob, ref[s.token], 1e-9);
  }
  // top_p 0.9 alone, and after top_k 5000.
  const std::set<int64_t> nucleus = TopPSet(logits, 1.0, 0.9);
  Sampler top_p(Params(1.0, 0, 0.9, 4));
  for (int i = 0; i < 200; ++i) ASSERT_TRUE(nucleus.count(top_p.Sample(logits).token));
  Sampler both(Params(1.0, 5000, 0.9, 5));
  for (int i = 0; i < 200; ++i) {
    const int64_t tok = both.Sample(logits).token;
    ASSERT_TRUE(nucleus.count(tok));
  }

  // Model-like logits: a broad low tail and a few strong tokens, so the
  // nucleus is small next to the vocabulary.
  std::normal_distribution<float> tail(-2.0f, 3.0f);
  std::vector<float> peaked(kVocab);
  for (float& x : peaked) x = tail(rng);
  for (int j = 0; j < 20; ++j) peaked[(j * 7919) % kVocab] = 18.0f - 0.7f * static_cast<float>(j);
  const std::vector<double> peaked_ref = LogSoftmax(peaked);
  for (double t : {0.6, 1.0}) {
    const std::set<int64_t> kept = TopPSet(peaked, t, 0.95);
    ASSERT_LT(kept.size(), 100u);
    Sampler sampler(Params(t, 0, 0.95, 6));
    for (int i = 0; i < 300; ++i) {
      const SampledToken s = sampler.Sample(peaked);
      ASSERT_TRUE(kept.count(s.token)) << "temperature " << t << " token " << s.token;
      EXPECT_NEAR(s.logprob, peaked_ref[s.token], 1e-9);
    }
  }
}

TEST(Sampler, FewKeptTokensMatchTheDensePath) {
  // Padding the vocabulary with -inf tokens after the real ones changes
  // nothing about the distribution or the id order, but a top-k/top-p kept
  // set that is small next to the vocabulary is drawn from a sorted list
  // instead of the dense weights: both must pick the same tokens.
  std::vector<float> padded = kSixLogits;
  padded.resize(1000, -kFloatInf);
  const std::vector<double> ref = LogSoftmax(kSixLogits);
  for (const SamplingParams& p :
       {Params(1.0, 2), Params(0.5, 3, 0.9), Params(1.0, 0, 0.7), Params(2.0, 0, 0.95), Params(1.3, 5, 0.99)}) {
    Sampler dense(p), sparse(p);
    std::set<int64_t> seen;
    for (int i = 0; i < 2000; ++i) {
      const SampledToken a = dense.Sample(kSixLogits), b = sparse.Sample(padded);
      ASSERT_EQ(a.token, b.token) << "draw " << i << " top_k " << p.top_k << " top_p " << p.top_p;
      EXPECT_NEAR(b.logprob, ref[b.token], 1e-12);
      seen.insert(a.token);
    }
    EXPECT_GE(seen.size(), 2u);  // the comparison covered real draws
  }
}

TEST(Sampler, TopKTiesInLargeVocabKeepLowerIds) {
  // Heavily tied logits: the threshold prefilter and the selection must keep
  // exactly the top k by (logit, then lower id), for small and large k.
  constexpr int64_t kVocab = 129280;
  std::mt19937 rng(8);
  std::uniform_int_distribution<int> level(0, 40);
  std::vector<float> logits(kVocab);
  for (float& x : logits) x = 0.25f * static_cast<float>(level(rng));
  std::vector<int64_t> ranked(kVocab);
  std::iota(ranked.begin(), ranked.end(), 0);
  std::stable_sort(ranked.begin(), ranked.end(), [&](int64_t a, int64_t b) { return logits[a] > logits[b]; });
  for (int64_t k : {int64_t{1}, int64_t{7}, int64_t{100}, int64_t{5000}, int64_t{60000}}) {
    const std::set<int64_t> expected(ranked.begin(), ranked.begin() + k);
    Sampler sampler(Params(1.0, k, 1.0, static_cast<uint64_t>(k)));
    std::set<int64_t> seen;
    for (int i = 0; i < 300; ++i) {
      const int64_t tok = sampler.Sample(logits).token;
      ASSERT_TRUE(expected.count(tok)) << "k " << k << " token " << tok;
      seen.insert(tok);
    }
    // Near-uniform draws over the kept set (300 draws over 100 tokens leave
    // about 5 unseen): a set missing ids would show up here.
    EXPECT_GE(seen.size(), std::min<size_t>(static_cast<size_t>(k), 80u)) << "k " << k;
  }
}

TEST(Sampler, SignedZerosTie) {
  // -0 and +0 are the same logit: the lower id wins ties either way round.
  for (const std::vector<float>& logits : {std::vector<float>{-0.0f, 0.0f, -1.0f}, std::vector<float>{0.0f, -0.0f}}) {
    EXPECT_EQ(Sampler(Params(0.0)).Sample(logits).token, 0);
    Sampler top1(Params(1.0, 1, 1.0, 3));
    for (int i = 0; i < 20; ++i) EXPECT_EQ(top1.Sample(logits).token, 0);
  }
}

TEST(Sampler, NaNsInLargeVocab) {
  // Positive and negative NaNs (the sign bit matters to the bit tricks used
  // for the max and the top-k threshold) are never kept or sampled.
  constexpr int64_t kVocab = 129280;
  std::mt19937 rng(12);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  std::vector<float> clean(kVocab);
  for (float& x : clean) x = normal(rng);
  for (bool negative_only : {false, true}) {
    std::vector<float> logits = clean;
    std::vector<float> as_inf = clean;
    for (int64_t i = 5; i < kVocab; i += 1291) {
      logits[i] = (negative_only || i % 2 == 1) ? -kFloatNaN : kFloatNaN;
      as_inf[i] = -kFloatInf;
    }
    ASSERT_TRUE(std::signbit(-kFloatNaN));
    const std::vector<double> ref_inf = LogSoftmax(as_inf);
    std::vector<int64_t> ranked(kVocab);
    std::iota(ranked.begin(), ranked.end(), 0);
    std::stable_sort(ranked.begin(), ranked.end(), [&](int64_t a, int64_t b) { return as_inf[a] > as_inf[b]; });
    const int64_t argmax = ranked[0];
    EXPECT_EQ(Sampler(Params(0.0)).Sample(logits).token, argmax);
    const std::set<int64_t> top50(ranked.begin(), ranked.begin() + 50);
    for (const SamplingParams& p : {Params(1.0, 50), Params(0.8, 50, 0.9), Params(1.0, 0, 0.5), Params(1.0)}) {
      Sampler sampler(p);
      for (int i = 0; i < 50; ++i) {
        const SampledToken s = sampler.Sample(logits);
        ASSERT_FALSE(std::isnan(logits[s.token])) << s.token;
        if (p.top_k == 50) {
          ASSERT_TRUE(top50.count(s.token)) << s.token;
        }
        EXPECT_NEAR(s.logprob, ref_inf[s.token], 1e-9);
      }
    }
  }
}

TEST(ValidateSamplingParams, AcceptsSaneValues) {
  SamplingParams p = Params(0.7, 50, 0.9);
  p.max_tokens = 4096;
  p.stop_token_ids = {0, 1, 999};
  EXPECT_TRUE(ValidateSamplingParams(p, 1000, 4096).ok());
  EXPECT_TRUE(ValidateSamplingParams(SamplingParams{}, 1000, 4096).ok());
  p.temperature = 100.0;
  p.top_p = 1.0;
  p.top_k = -1;
  p.max_tokens = 1;
  EXPECT_TRUE(ValidateSamplingParams(p, 1000, 4096).ok());
}

void ExpectRejected(const SamplingParams& p, const std::string& field, const std::string& value) {
  const Status st = ValidateSamplingParams(p, 1000, 4096);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find(field), std::string::npos) << st;
  EXPECT_NE(st.message().find(value), std::string::npos) << st;
}

TEST(ValidateSamplingParams, RejectsEachBadField) {
  const SamplingParams good = Params(0.7, 50, 0.9);
  SamplingParams p = good;
  p.temperature = -1.0;
  ExpectRejected(p, "temperature", "-1");
  p.temperature = std::numeric_limits<double>::quiet_NaN();
  ExpectRejected(p, "temperature", "nan");
  p.temperature = kInf;
  ExpectRejected(p, "temperature", "inf");
  p.temperature = 1000.0;
  ExpectRejected(p, "temperature", "1000");

  p = good;
  p.top_p = 0.0;
  ExpectRejected(p, "top_p", "got 0");
  p.top_p = 1.5;
  ExpectRejected(p, "top_p", "1.5");
  p.top_p = std::numeric_limits<double>::quiet_NaN();
  ExpectRejected(p, "top_p", "nan");

  p = good;
  p.top_k = -2;
  ExpectRejected(p, "top_k", "-2");

  p = good;
  p.max_tokens = 0;
  ExpectRejected(p, "max_tokens", "got 0");
  p.max_tokens = 4097;
  ExpectRejected(p, "max_tokens", "4097");

  p = good;
  p.logprobs = -1;
  ExpectRejected(p, "logprobs", "-1");
  p.logprobs = kMaxTopLogprobs + 1;
  ExpectRejected(p, "logprobs", "21");
  p = good;
  p.prompt_logprobs = -2;
  ExpectRejected(p, "prompt_logprobs", "-2");
  p.prompt_logprobs = kMaxTopLogprobs + 1;
  ExpectRejected(p, "prompt_logprobs", "21");

  p = good;
  p.stop_token_ids = {5, 1000};
  ExpectRejected(p, "stop_token_ids", "1000");
  p.stop_token_ids = {-3};
  ExpectRejected(p, "stop_token_ids", "-3");
}

TEST(ValidateSamplingParams, PenaltiesAndBiases) {
  SamplingParams p;
  p.max_tokens = 8;
  p.presence_penalty = -2.0;
  p.frequency_penalty = 2.0;
  p.repetition_penalty = 0.01;
  p.logit_bias = {{0, -100.0}, {999, 100.0}};
  p.min_tokens = 8;
  EXPECT_TRUE(ValidateSamplingParams(p, 1000, 4096).ok());
  const SamplingParams good = p;
  p.presence_penalty = 2.5;
  ExpectRejected(p, "presence_penalty", "2.5");
  p = good;
  p.frequency_penalty = std::nan("");
  ExpectRejected(p, "frequency_penalty", "nan");
  p = good;
  p.repetition_penalty = 0.0;
  ExpectRejected(p, "repetition_penalty", "got 0");
  p.repetition_penalty = std::numeric_limits<double>::infinity();
  ExpectRejected(p, "repetition_penalty", "inf");
  p = good;
  p.logit_bias[1000] = 1.0;
  ExpectRejected(p, "logit_bias", "1000");
  p = good;
  p.logit_bias[-1] = 1.0;
  ExpectRejected(p, "logit_bias", "-1");
  p = good;
  p.logit_bias[5] = 100.5;
  ExpectRejected(p, "logit_bias", "100.5");
  p = good;
  p.min_tokens = 9;
  ExpectRejected(p, "min_tokens", "9");
  p.min_tokens = -1;
  ExpectRejected(p, "min_tokens", "-1");
}

// ---- Penalties and biases ----------------------------------------------------

// A request's history for the penalties: prompt and output ids drawn from a
// small range, so that ids repeat within and across them.
struct History {
  std::vector<int32_t> prompt, output;
  std::vector<int64_t> eos;
};

History RandomHistory(std::mt19937_64& rng, int64_t vocab) {
  std::uniform_int_distribution<int32_t> id(0, static_cast<int32_t>(std::min<int64_t>(vocab, 40) - 1));
  History h;
  for (int i = 0; i < 30; ++i) h.prompt.push_back(id(rng));
  for (int i = 0; i < 20; ++i) h.output.push_back(id(rng));
  return h;
}

std::vector<float> RandomLogits(std::mt19937_64& rng, int64_t vocab) {
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::vector<float> logits(static_cast<size_t>(vocab));
  for (float& x : logits) x = normal(rng);
  return logits;
}

// The published definitions (vLLM's sampler), in float64: min_tokens masks
// the stop and EOS ids, logit_bias is added, the repetition penalty divides
// a positive logit of a token seen in prompt or output and multiplies any
// other, and each generated token loses frequency * count + presence.
std::vector<double> ReferencePenalized(const std::vector<float>& logits, const SamplingParams& p, const History& h) {
  const size_t vocab = logits.size();
  std::vector<double> out(logits.begin(), logits.end());
  std::vector<int64_t> count(vocab, 0);
  std::vector<bool> seen(vocab, false);
  for (int32_t t : h.prompt) seen[static_cast<size_t>(t)] = true;
  for (int32_t t : h.output) seen[static_cast<size_t>(t)] = true, ++count[static_cast<size_t>(t)];
  if (static_cast<int64_t>(h.output.size()) < p.min_tokens) {
    for (int64_t t : p.stop_token_ids) out[static_cast<size_t>(t)] = -kInf;
    for (int64_t t : h.eos) out[static_cast<size_t>(t)] = -kInf;
  }
  for (const auto& [t, bias] : p.logit_bias) out[static_cast<size_t>(t)] += bias;
  for (size_t i = 0; i < vocab; ++i) {
    if (seen[i]) out[i] = out[i] > 0 ? out[i] / p.repetition_penalty : out[i] * p.repetition_penalty;
    out[i] -= p.frequency_penalty * static_cast<double>(count[i]) + p.presence_penalty * (count[i] > 0 ? 1.0 : 0.0);
  }
  return out;
}

std::vector<SamplingParams> PenaltyKinds(std::mt19937_64& rng, int64_t vocab) {
  std::uniform_real_distribution<double> unit(-1.0, 1.0);
  std::uniform_int_distribution<int64_t> id(0, vocab - 1);
  std::vector<SamplingParams> kinds(7, Params(0.0));
  kinds[0].presence_penalty = 2.0 * unit(rng);
  kinds[1].frequency_penalty = 2.0 * unit(rng);
  kinds[2].repetition_penalty = 1.0 + 1.5 * std::fabs(unit(rng));
  kinds[3].repetition_penalty = 0.3 + 0.5 * std::fabs(unit(rng));  // < 1: rewards repeats
  for (int i = 0; i < 10; ++i) kinds[4].logit_bias[id(rng)] = 20.0 * unit(rng);
  kinds[5].min_tokens = 25;
  kinds[5].stop_token_ids = {id(rng), id(rng)};
  kinds[6] = kinds[4];  // all at once
  kinds[6].presence_penalty = 2.0 * unit(rng);
  kinds[6].frequency_penalty = 2.0 * unit(rng);
  kinds[6].repetition_penalty = 1.0 + 1.5 * std::fabs(unit(rng));
  kinds[6].min_tokens = 25;
  kinds[6].stop_token_ids = {id(rng)};
  return kinds;
}

// The lowest id of the largest value, or -1 when the runner-up is too close
// for float rounding to decide.
int64_t ClearArgmax(const std::vector<double>& x) {
  const int64_t best = std::max_element(x.begin(), x.end()) - x.begin();
  for (size_t i = 0; i < x.size(); ++i)
    if (static_cast<int64_t>(i) != best && x[i] > x[static_cast<size_t>(best)] - 1e-3) return -1;
  return best;
}

TEST(SamplerPenalties, ProcessedLogitsAndGreedyTokenMatchReference) {
  std::mt19937_64 rng(20260601);
  for (int64_t vocab : {50, 3000}) {
    for (int trial = 0; trial < 20; ++trial) {
      History h = RandomHistory(rng, vocab);
      h.eos = {static_cast<int64_t>(rng() % static_cast<uint64_t>(vocab))};
      if (trial % 2 == 1) h.output.resize(static_cast<size_t>(trial));  // some below min_tokens, some not
      const std::vector<float> logits = RandomLogits(rng, vocab);
      const std::vector<double> raw = LogSoftmax(logits);
      int kind = 0;
      for (const SamplingParams& p : PenaltyKinds(rng, vocab)) {
        SCOPED_TRACE("vocab " + std::to_string(vocab) + " trial " + std::to_string(trial) + " kind " +
                     std::to_string(kind++));
        const std::vector<double> want = ReferencePenalized(logits, p, h);
        Sampler sampler(p, {.prompt = h.prompt, .eos_token_ids = h.eos, .output = h.output});
        EXPECT_TRUE(sampler.modifies_logits());
        const std::span<const float> got = sampler.ProcessedLogits(logits);
        ASSERT_EQ(got.size(), logits.size());
        for (size_t i = 0; i < got.size(); ++i) {
          if (want[i] == -kInf) {
            EXPECT_EQ(got[i], -kFloatInf) << "token " << i;
          } else {
            EXPECT_NEAR(got[i], want[i], 1e-5 * (1.0 + std::fabs(want[i]))) << "token " << i;
          }
        }
        const SampledToken t = sampler.Sample(logits);
        if (const int64_t best = ClearArgmax(want); best >= 0) {
          EXPECT_EQ(t.token, best);
        }
        // Reported under the unmodified distribution, as vLLM's raw logprobs.
        EXPECT_NEAR(t.logprob, raw[static_cast<size_t>(t.token)], 1e-9);
      }
    }
  }
}

// Each token a sampler draws counts as output for the next: greedy decoding
// step by step against the reference over the growing history.
TEST(SamplerPenalties, DrawnTokensJoinTheHistory) {
  std::mt19937_64 rng(7);
  const int64_t vocab = 12;
  SamplingParams p = Params(0.0);
  p.presence_penalty = 0.7;
  p.frequency_penalty = 0.4;
  p.repetition_penalty = 1.3;
  p.min_tokens = 5;
  p.stop_token_ids = {2};
  History h{.prompt = {1, 1, 4, 9}, .output = {}, .eos = {3}};
  Sampler sampler(p, {.prompt = h.prompt, .eos_token_ids = h.eos});
  // Tokens 2 and 3 lead every row until min_tokens: masked, then free.
  for (int step = 0; step < 40; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    std::vector<float> logits = RandomLogits(rng, vocab);
    logits[2] += 4.0f;
    logits[3] += 4.0f;
    const int64_t want = ClearArgmax(ReferencePenalized(logits, p, h));
    const SampledToken t = sampler.Sample(logits);
    if (want >= 0) {
      EXPECT_EQ(t.token, want);
    }
    if (step < 5) {
      EXPECT_TRUE(t.token != 2 && t.token != 3) << t.token;
    }
    h.output.push_back(static_cast<int32_t>(t.token));
  }
}

// A sampler resumed with the n tokens another one drew (history.output) and
// the n draws they took behind it draws what that one draws next: plain and
// filtered sampling, and penalties, min_tokens and bad words over the same
// history.
TEST(SamplerPenalties, AResumedSamplerDrawsWhatTheOriginalDrawsNext) {
  std::mt19937_64 rng(5);
  const int64_t vocab = 40;  // small: drawn tokens repeat, so the penalties bite
  std::vector<std::vector<float>> rows;
  for (int i = 0; i < 20; ++i) rows.push_back(RandomLogits(rng, vocab));
  SamplingParams penalized = Params(0.8, 0, 0.9, 7);
  penalized.presence_penalty = 0.5;
  penalized.frequency_penalty = 0.3;
  penalized.repetition_penalty = 1.2;
  penalized.min_tokens = 6;
  penalized.stop_token_ids = {4};
  penalized.bad_words = {{3, 5}, {9}};
  const std::vector<int32_t> prompt = {1, 5, 9, 5};
  const std::vector<int64_t> eos = {2};
  for (const SamplingParams& p :
       {Params(1.0, 0, 1.0, 7), Params(0.8, 0, 0.9, 7), Params(0.7, 20, 0.95, 11), penalized}) {
    SCOPED_TRACE("temperature " + std::to_string(p.temperature) + " top_p " + std::to_string(p.top_p));
    Sampler original(p, {.prompt = prompt, .eos_token_ids = eos});
    std::vector<SampledToken> drawn;
    for (const auto& row : rows) drawn.push_back(original.Sample(row));
    for (const size_t n : {size_t{1}, size_t{5}, size_t{11}}) {
      std::vector<int32_t> output;
      for (size_t i = 0; i < n; ++i) output.push_back(static_cast<int32_t>(drawn[i].token));
      Sampler resumed(p, {.prompt = prompt, .eos_token_ids = eos, .output = output, .draws = static_cast<int64_t>(n)});
      Sampler unskipped(p, {.prompt = prompt, .eos_token_ids = eos, .output = output});
      int64_t differing = 0;
      for (size_t i = n; i < rows.size(); ++i) {
        const SampledToken t = resumed.Sample(rows[i]);
        ASSERT_EQ(t.token, drawn[i].token) << "n " << n << " row " << i;
        ASSERT_EQ(t.logprob, drawn[i].logprob) << "n " << n << " row " << i;
        differing += unskipped.Sample(rows[i]).token != drawn[i].token;
      }
      // Guards the check above: a stream that does not skip the draws goes astray.
      EXPECT_GT(differing, 0) << "n " << n;
    }
  }
}

// Tempered draws from the penalized logits: each draw from a fresh sampler
// (its own seed) over the same history, against softmax(reference / T).
TEST(SamplerPenalties, SampledDistributionMatchesReference) {
  std::mt19937_64 rng(99);
  const int64_t vocab = 10, draws = 20000;
  const History h{.prompt = {0, 1, 1, 2, 7}, .output = {1, 3, 3, 3, 8}, .eos = {}};
  SamplingParams p = Params(0.8, 0, 1.0);
  p.presence_penalty = 0.5;
  p.frequency_penalty = 0.3;
  p.repetition_penalty = 1.5;
  p.logit_bias = {{4, 1.5}, {9, -2.0}};
  std::vector<float> logits = {1.0f, 2.0f, 0.5f, 1.5f, -0.5f, 0.0f, 0.3f, 1.2f, 0.8f, 1.1f};
  const std::vector<double> z = ReferencePenalized(logits, p, h);
  std::vector<double> want(static_cast<size_t>(vocab));
  double sum = 0.0;
  for (size_t i = 0; i < want.size(); ++i) sum += want[i] = std::exp(z[i] / p.temperature);
  for (double& x : want) x /= sum;
  std::vector<int64_t> counts(static_cast<size_t>(vocab), 0);
  for (int64_t i = 0; i < draws; ++i) {
    p.seed = static_cast<uint64_t>(i);
    Sampler sampler(p, {.prompt = h.prompt, .output = h.output});
    ++counts[static_cast<size_t>(sampler.Sample(logits).token)];
  }
  ExpectDistribution(counts, want, draws);
}

TEST(SamplerPenalties, MinTokensMasksEosUntilReached) {
  // EOS (5) and a stop id (7) lead by far; min_tokens 3 with one token
  // already generated: two more tokens without them, then EOS.
  std::vector<float> logits(16, 0.0f);
  for (size_t i = 0; i < logits.size(); ++i) logits[i] = 0.1f * static_cast<float>(i % 5);
  logits[5] = 9.0f;
  logits[7] = 8.0f;
  const std::vector<int64_t> eos = {5};
  const std::vector<int32_t> output = {0};
  for (double temperature : {0.0, 1.0}) {
    SamplingParams p = Params(temperature);
    p.min_tokens = 3;
    p.stop_token_ids = {7};
    Sampler sampler(p, {.eos_token_ids = eos, .output = output});
    for (int i = 0; i < 2; ++i) {
      EXPECT_TRUE(sampler.modifies_logits());
      const int64_t t = sampler.Sample(logits).token;
      EXPECT_NE(t, 5) << "draw " << i;
      EXPECT_NE(t, 7) << "draw " << i;
    }
    EXPECT_FALSE(sampler.modifies_logits()) << "min_tokens reached: the fast path again";
    if (temperature == 0.0) {
      EXPECT_EQ(sampler.Sample(logits).token, 5);
    }
  }
}

TEST(SamplerPenalties, LogitBiasOfHundredForcesAToken) {
  std::mt19937_64 rng(3);
  for (int trial = 0; trial < 20; ++trial) {
    const int64_t vocab = 500;
    const std::vector<float> logits = RandomLogits(rng, vocab);
    const int64_t forced = static_cast<int64_t>(rng() % vocab);
    const int64_t best = std::max_element(logits.begin(), logits.end()) - logits.begin();
    for (double temperature : {0.0, 1.0, 1.5}) {
      SamplingParams p = Params(temperature, 0, 1.0, static_cast<uint64_t>(trial));
      p.logit_bias = {{forced, 100.0}, {best == forced ? (forced + 1) % vocab : best, -100.0}};
      Sampler sampler(p);
      for (int i = 0; i < 20; ++i) {
        const SampledToken t = sampler.Sample(logits);
        EXPECT_EQ(t.token, forced);
        EXPECT_NEAR(t.logprob, LogSoftmax(logits)[static_cast<size_t>(forced)], 1e-9);
      }
    }
  }
}

TEST(SamplerPenalties, NoPenaltyIsTheFastPath) {
  SamplingParams p = Params(0.0);
  EXPECT_FALSE(Sampler(p).modifies_logits());
  p.logit_bias = {{3, 0.0}};
  EXPECT_TRUE(Sampler(p).modifies_logits());
  p.logit_bias.clear();
  p.repetition_penalty = 1.1;
  EXPECT_TRUE(Sampler(p).modifies_logits());
}

// A constraint allowing a fixed random set of tokens.
class FixedSet final : public TokenConstraint {
 public:
  explicit FixedSet(std::vector<int64_t> allowed) : allowed_(std::move(allowed)) {}
  void FillAllowed(std::span<uint32_t> words) override {
    std::fill(words.begin(), words.end(), 0u);
    for (int64_t t : allowed_) words[static_cast<size_t>(t / 32)] |= 1u << (t % 32);
  }
  void Accept(int64_t token) override { accepted.push_back(token); }
  bool terminated() const override { return false; }
  std::vector<int64_t> accepted;

 private:
  std::vector<int64_t> allowed_;
};

// The largest logits are on disallowed tokens: greedy, top-k 1 and plain
// sampling must still draw allowed ones only, and the constraint hears of
// every token drawn.
TEST(SamplerConstraint, DisallowedTokensNeverWinEvenWithTheLargestLogits) {
  std::mt19937 rng(7);
  const int64_t vocab = 1000;
  for (int trial = 0; trial < 30; ++trial) {
    std::set<int64_t> allowed_set;
    while (allowed_set.size() < 5) allowed_set.insert(std::uniform_int_distribution<int64_t>(0, vocab - 1)(rng));
    const std::vector<int64_t> allowed(allowed_set.begin(), allowed_set.end());
    std::vector<float> logits(static_cast<size_t>(vocab));
    std::normal_distribution<float> d(0.0f, 1.0f);
    for (int64_t i = 0; i < vocab; ++i) logits[static_cast<size_t>(i)] = allowed_set.count(i) ? d(rng) : 50.0f + d(rng);
    for (const SamplingParams& p :
         {SamplingParams{.temperature = 0.0}, SamplingParams{.temperature = 1.0, .top_k = 1, .seed = 3},
          SamplingParams{.temperature = 1.5, .seed = static_cast<uint64_t>(trial)},
          SamplingParams{.temperature = 1.0, .top_p = 0.5, .seed = 9, .presence_penalty = 1.0}}) {
      Sampler s(p);
      auto owned = std::make_unique<FixedSet>(allowed);
      FixedSet* c = owned.get();
      s.SetConstraint(std::move(owned));
      EXPECT_TRUE(s.modifies_logits());
      for (int k = 0; k < 4; ++k) {
        const SampledToken tok = s.Sample(logits);
        EXPECT_TRUE(allowed_set.count(tok.token)) << "token " << tok.token << " temperature " << p.temperature;
        ASSERT_EQ(c->accepted.size(), static_cast<size_t>(k + 1));
        EXPECT_EQ(c->accepted.back(), tok.token);
      }
    }
  }
}

// The mask comes before the penalties: a logit_bias cannot lift a token the
// constraint refuses, and the reported logprob stays the raw one.
TEST(SamplerConstraint, MaskComesBeforeBiasesAndLogprobsStayRaw) {
  std::vector<float> logits = {0.5f, 1.0f, -0.25f, 2.0f};
  SamplingParams p{.temperature = 0.0, .logit_bias = {{0, 100.0}}};
  Sampler s(p);
  s.SetConstraint(std::make_unique<FixedSet>(std::vector<int64_t>{1, 2}));
  const SampledToken t = s.Sample(logits);
  EXPECT_EQ(t.token, 1);
  double z = 0;
  for (float x : logits) z += std::exp(static_cast<double>(x));
  EXPECT_NEAR(t.logprob, 1.0 - std::log(z), 1e-6);
}

// A complete grammar allows only the stop ids; min_tokens, which would mask
// them, yields to it instead of leaving nothing to draw. Before that point
// min_tokens holds.
TEST(SamplerConstraint, ACompleteGrammarOutranksMinTokens) {
  std::mt19937 rng(11);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> logits(64);
  for (float& x : logits) x = d(rng);
  const std::vector<int64_t> eos = {5};
  SamplingParams p{.temperature = 1.0, .seed = 4, .min_tokens = 8};
  Sampler only_eos(p, SamplerHistory{.eos_token_ids = eos});
  only_eos.SetConstraint(std::make_unique<FixedSet>(std::vector<int64_t>{5}));
  EXPECT_EQ(only_eos.Sample(logits).token, 5);
  logits[5] = 40.0f;  // EOS most likely, but min_tokens masks it beside other choices
  Sampler eos_or_more(p, SamplerHistory{.eos_token_ids = eos});
  eos_or_more.SetConstraint(std::make_unique<FixedSet>(std::vector<int64_t>{5, 9, 17}));
  for (int k = 0; k < 5; ++k) EXPECT_NE(eos_or_more.Sample(logits).token, 5);
}

// Random logits whose largest entry is `top` (a disallowed token).
std::vector<float> LogitsPeakingAt(std::mt19937& rng, int64_t vocab, int64_t top) {
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> logits(static_cast<size_t>(vocab));
  for (float& x : logits) x = d(rng);
  logits[static_cast<size_t>(top)] = 30.0f + d(rng);
  return logits;
}

// structured.start_after: before the marker the constraint neither masks
// nor hears tokens (greedy draws the disallowed peak); from the token after
// it on, only allowed tokens come and the constraint hears exactly those.
TEST(SamplerConstraint, HoldsOnlyAfterTheStartMarker) {
  std::mt19937 rng(23);
  const int64_t vocab = 500;
  const std::vector<int64_t> allowed = {3, 41, 97, 260, 499};
  for (const std::vector<int64_t>& marker : {std::vector<int64_t>{77}, std::vector<int64_t>{12, 13, 14}}) {
    SamplingParams p{.temperature = 0.0};
    p.structured = {.kind = StructuredOutput::Kind::kRegex, .spec = "x", .start_after = marker};
    Sampler s(p);
    auto owned = std::make_unique<FixedSet>(allowed);
    FixedSet* c = owned.get();
    s.SetConstraint(std::move(owned));
    EXPECT_TRUE(s.modifies_logits());
    // Free tokens, then the marker one token per step (a multi-token marker
    // split across steps), with a false start of the marker first.
    std::vector<int64_t> forced = {200, 5, 300};
    if (marker.size() > 1) forced.insert(forced.end(), {12, 13, 250});
    forced.insert(forced.end(), marker.begin(), marker.end());
    for (const int64_t want : forced) {
      EXPECT_EQ(s.Sample(LogitsPeakingAt(rng, vocab, want)).token, want);
      EXPECT_TRUE(c->accepted.empty());
    }
    std::vector<int64_t> after;
    for (int k = 0; k < 6; ++k) {
      const int64_t peak = std::uniform_int_distribution<int64_t>(100, 200)(rng);  // never allowed
      const int64_t tok = s.Sample(LogitsPeakingAt(rng, vocab, peak)).token;
      EXPECT_TRUE(std::count(allowed.begin(), allowed.end(), tok)) << tok;
      after.push_back(tok);
    }
    EXPECT_EQ(c->accepted, after);
  }
}

// A marker that never comes leaves the constraint untouched: no mask, no
// tokens heard, even when the marker's parts appear out of order.
TEST(SamplerConstraint, AMarkerThatNeverComesLeavesTheConstraintAlone) {
  std::mt19937 rng(29);
  SamplingParams p{.temperature = 0.0};
  p.structured = {.kind = StructuredOutput::Kind::kJsonObject, .start_after = {8, 9}};
  Sampler s(p);
  auto owned = std::make_unique<FixedSet>(std::vector<int64_t>{1, 2});
  FixedSet* c = owned.get();
  s.SetConstraint(std::move(owned));
  for (const int64_t want : {9, 8, 8, 7, 9, 50, 8}) EXPECT_EQ(s.Sample(LogitsPeakingAt(rng, 64, want)).token, want);
  EXPECT_TRUE(c->accepted.empty());
}

// A resumed sampler (the tokens another one drew as history.output, its
// draws skipped) given its constraint with those tokens has it hear the
// ones the original's heard, those after start_after's marker (all without
// a marker), then each token it draws: the same tokens as the original's,
// wherever the request was cut, before, inside or after the marker.
TEST(SamplerConstraint, AResumedConstraintHearsWhatTheOriginalHeard) {
  std::mt19937 rng(31);
  const int64_t vocab = 500;
  const std::vector<int64_t> allowed = {3, 41, 97, 260, 499};
  for (const std::vector<int64_t>& marker :
       {std::vector<int64_t>{}, std::vector<int64_t>{77}, std::vector<int64_t>{12, 13, 14}}) {
    SCOPED_TRACE("marker of " + std::to_string(marker.size()) + " tokens");
    SamplingParams p{.temperature = 0.0};
    p.structured = {.kind = StructuredOutput::Kind::kRegex, .spec = "x", .start_after = marker};
    // Free tokens with a false start of the marker, the marker one token a
    // step, then peaks the constraint refuses (never allowed).
    std::vector<int64_t> peaks = {200, 12, 13, 250, 5};
    peaks.insert(peaks.end(), marker.begin(), marker.end());
    for (int k = 0; k < 6; ++k) peaks.push_back(std::uniform_int_distribution<int64_t>(100, 200)(rng));
    std::vector<std::vector<float>> rows;
    for (const int64_t peak : peaks) rows.push_back(LogitsPeakingAt(rng, vocab, peak));
    Sampler original(p);
    auto owned = std::make_unique<FixedSet>(allowed);
    const FixedSet* heard = owned.get();
    original.SetConstraint(std::move(owned));
    std::vector<int32_t> drawn;
    std::vector<std::vector<int64_t>> heard_by;  // what the constraint heard after each draw
    for (const auto& row : rows) {
      drawn.push_back(static_cast<int32_t>(original.Sample(row).token));
      heard_by.push_back(heard->accepted);
    }
    ASSERT_FALSE(heard->accepted.empty());
    for (size_t n = 1; n < rows.size(); ++n) {
      const std::vector<int32_t> output(drawn.begin(), drawn.begin() + static_cast<std::ptrdiff_t>(n));
      Sampler resumed(p, {.output = output, .draws = static_cast<int64_t>(n)});
      auto resumed_owned = std::make_unique<FixedSet>(allowed);
      const FixedSet* c = resumed_owned.get();
      resumed.SetConstraint(std::move(resumed_owned), output);
      EXPECT_EQ(c->accepted, heard_by[n - 1]) << "cut after " << n;
      for (size_t i = n; i < rows.size(); ++i) ASSERT_EQ(resumed.Sample(rows[i]).token, drawn[i]) << n << ", " << i;
      EXPECT_EQ(c->accepted, heard->accepted) << "cut after " << n;
    }
  }
}

}  // namespace
}  // namespace mlarun

namespace mlarun {
namespace {

// vLLM's bad_words rule, in float64 on its own: a sequence's last token
// gets -inf when the tokens before it are the output's last ones (a
// one-token sequence always).
std::vector<double> ReferenceBadWords(std::vector<double> x, const std::vector<std::vector<int64_t>>& words,
                                      const std::vector<int32_t>& output) {
  for (const std::vector<int64_t>& w : words) {
    const size_t k = w.size() - 1;
    if (k > output.size()) continue;
    bool match = true;
    for (size_t i = 0; i < k; ++i) match = match && output[output.size() - k + i] == w[i];
    if (match) x[static_cast<size_t>(w.back())] = -kInf;
  }
  return x;
}

// Random bad words over a small id range: some end the output with their
// prefix (so they apply), some do not, some are one token long.
std::vector<std::vector<int64_t>> RandomBadWords(std::mt19937_64& rng, const History& h, int64_t vocab) {
  std::uniform_int_distribution<int64_t> id(0, std::min<int64_t>(vocab, 40) - 1);
  std::vector<std::vector<int64_t>> words;
  for (int i = 0; i < 8; ++i) {
    const size_t len = 1 + rng() % 4;
    std::vector<int64_t> w;
    if (i % 2 == 0 && len - 1 <= h.output.size()) {
      w.assign(h.output.end() - static_cast<std::ptrdiff_t>(len - 1), h.output.end());  // applies
    } else {
      for (size_t j = 0; j + 1 < len; ++j) w.push_back(id(rng));  // rarely applies
    }
    w.push_back(static_cast<int64_t>(rng() % static_cast<uint64_t>(vocab)));
    words.push_back(std::move(w));
  }
  return words;
}

TEST(SamplerBadWords, ProcessedLogitsMatchReference) {
  std::mt19937_64 rng(20261206);
  for (int64_t vocab : {50, 3000}) {
    for (int trial = 0; trial < 30; ++trial) {
      History h = RandomHistory(rng, vocab);
      h.output.resize(static_cast<size_t>(trial % 6));  // short outputs: words longer than them too
      const std::vector<float> logits = RandomLogits(rng, vocab);
      for (SamplingParams p : {Params(0.0), PenaltyKinds(rng, vocab)[6]}) {
        p.bad_words = RandomBadWords(rng, h, vocab);
        p.max_tokens = 100;  // min_tokens 25 of the penalty kinds
        const Status valid = ValidateSamplingParams(p, vocab, INT64_MAX);
        ASSERT_TRUE(valid.ok()) << valid;
        SCOPED_TRACE("vocab " + std::to_string(vocab) + " trial " + std::to_string(trial));
        const std::vector<double> want = ReferenceBadWords(ReferencePenalized(logits, p, h), p.bad_words, h.output);
        Sampler sampler(p, {.prompt = h.prompt, .eos_token_ids = h.eos, .output = h.output});
        EXPECT_TRUE(sampler.modifies_logits()) << "a device must hand the row to the host";
        const std::span<const float> got = sampler.ProcessedLogits(logits);
        ASSERT_EQ(got.size(), logits.size());
        for (size_t i = 0; i < got.size(); ++i) {
          if (want[i] == -kInf) {
            EXPECT_EQ(got[i], -kFloatInf) << "token " << i;
          } else {
            EXPECT_NEAR(got[i], want[i], 1e-5 * (1.0 + std::fabs(want[i]))) << "token " << i;
          }
        }
        const SampledToken t = sampler.Sample(logits);
        if (const int64_t best = ClearArgmax(want); best >= 0) EXPECT_EQ(t.token, best);
        EXPECT_NE(want[static_cast<size_t>(t.token)], -kInf) << "a banned token was drawn";
      }
    }
  }
}

// The tokens the sampler draws itself join the history the words are
// matched against: with [a, b] banned, after a the sampler never draws b,
// and after anything else it may.
TEST(SamplerBadWords, DrawnTokensCompleteAWord) {
  std::mt19937_64 rng(11);
  for (int trial = 0; trial < 20; ++trial) {
    const int64_t vocab = 64;
    std::vector<float> logits = RandomLogits(rng, vocab);
    const int64_t a = static_cast<int64_t>(rng() % vocab);
    int64_t b = static_cast<int64_t>(rng() % vocab);
    if (b == a) b = (a + 1) % vocab;
    logits[static_cast<size_t>(a)] = 30.0f;  // first a, then (a is still best) the word's b...
    logits[static_cast<size_t>(b)] = 29.0f;
    SamplingParams p = Params(0.0);
    p.bad_words = {{a, b}, {b, b}};
    Sampler sampler(p);
    EXPECT_EQ(sampler.Sample(logits).token, a);
    std::vector<float> b_first = logits;
    b_first[static_cast<size_t>(b)] = 40.0f;  // b leads by far, but follows a: banned
    const int64_t second = sampler.Sample(b_first).token;
    EXPECT_EQ(second, a) << "b right after a";
    const std::vector<float> b_again = b_first;
    // After a again, b stays banned; a one-token word never comes.
    SamplingParams one = Params(1.0, 0, 1.0, static_cast<uint64_t>(trial));
    one.bad_words = {{b}};
    Sampler single(one);
    for (int i = 0; i < 10; ++i) EXPECT_NE(single.Sample(b_again).token, b);
  }
}

TEST(SamplerBadWords, ValidateNamesTheBadSequence) {
  SamplingParams p = Params(0.0);
  p.bad_words = {{1, 2}, {}};
  Status st = ValidateSamplingParams(p, 100, INT64_MAX);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("bad_words[1] must not be empty"), std::string::npos) << st;
  p.bad_words = {{1, 2}, {3, 100}};
  st = ValidateSamplingParams(p, 100, INT64_MAX);
  EXPECT_NE(st.message().find("bad_words[1] has token id 100 outside [0, 100)"), std::string::npos) << st;
  p.bad_words = {{-1}};
  EXPECT_FALSE(ValidateSamplingParams(p, 100, INT64_MAX).ok());
  p.bad_words.assign(kMaxBadWords + 1, {1});
  st = ValidateSamplingParams(p, 100, INT64_MAX);
  EXPECT_NE(st.message().find("at most 1024"), std::string::npos) << st;
  p.bad_words.assign(kMaxBadWords, {1, 99});
  EXPECT_TRUE(ValidateSamplingParams(p, 100, INT64_MAX).ok());
}

}  // namespace
}  // namespace mlarun
