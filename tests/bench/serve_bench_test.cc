// `mlarun bench serve`: the report's arithmetic on hand-made inputs, the
// shared-prefix and skewed workloads, and the quick mode end to end in
// process (a real coordinator on 127.0.0.1:0 and simulated groups); `mlarun
// bench rebalance`'s option checks (its run: rebalance_bench_test.sh).
#include "bench/serve_bench.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "bench/disagg_bench.h"
#include "bench/rebalance_bench.h"
#include "serving/coordinator/coordinator.h"
#include "tests/serving/sim_worker_thread.h"

namespace mlarun {
namespace {

using serve_bench::LoadImbalance;
using serve_bench::MeanOfFinite;
using serve_bench::Percentile;
using serve_bench::PrefixCounts;
using serve_bench::PrefixHitRate;

TEST(ServeBenchArithmetic, PercentileIsNearestRank) {
  std::vector<double> v;
  for (int i = 100; i >= 1; --i) v.push_back(i);  // unsorted on purpose
  EXPECT_EQ(Percentile(v, 50), 50);
  EXPECT_EQ(Percentile(v, 99), 99);
  EXPECT_EQ(Percentile(v, 100), 100);
  EXPECT_EQ(Percentile(v, 0), 1);
  // Nearest rank on few values: the smallest value with at least p% at or below it.
  EXPECT_EQ(Percentile({3, 1, 2}, 50), 2);
  EXPECT_EQ(Percentile({3, 1, 2}, 99), 3);
  EXPECT_EQ(Percentile({7}, 99), 7);
  EXPECT_TRUE(std::isnan(Percentile({}, 50)));
}

TEST(ServeBenchArithmetic, ImbalanceIsMaxOverMean) {
  const std::vector<int64_t> even = {10, 10, 10, 10}, one_hot = {40, 0, 0, 0}, skew = {30, 10}, idle = {0, 0, 0};
  EXPECT_DOUBLE_EQ(LoadImbalance(even), 1.0);
  EXPECT_DOUBLE_EQ(LoadImbalance(one_hot), 4.0);  // all load on one of four groups
  EXPECT_DOUBLE_EQ(LoadImbalance(skew), 1.5);
  EXPECT_TRUE(std::isnan(LoadImbalance(idle)));  // nothing queued: skipped, not "perfectly balanced"
  EXPECT_TRUE(std::isnan(LoadImbalance({})));
  const std::vector<double> samples = {1.0, NAN, 3.0};
  EXPECT_DOUBLE_EQ(MeanOfFinite(samples), 2.0);
  EXPECT_TRUE(std::isnan(MeanOfFinite(std::vector<double>{NAN})));
}

TEST(ServeBenchArithmetic, HitRateIsSumOverSum) {
  // Sums, not a mean of per-request rates: a long prompt weighs more.
  const std::vector<PrefixCounts> f = {{.prompt_tokens = 300, .prefix_hit_tokens = 256},
                                       {.prompt_tokens = 100, .prefix_hit_tokens = 0}};
  EXPECT_DOUBLE_EQ(PrefixHitRate(f), 256.0 / 400.0);
  EXPECT_DOUBLE_EQ(PrefixHitRate(std::vector<PrefixCounts>{{.prompt_tokens = 64, .prefix_hit_tokens = 64}}), 1.0);
  EXPECT_TRUE(std::isnan(PrefixHitRate({})));
}

TEST(ServeBenchWorkload, SharedPrefixes) {
  const serve_bench::SharedPrefixSpec spec{.prefixes = 8,
                                           .prefix_tokens = 256,
                                           .requests = 100,
                                           .suffix_min = 8,
                                           .suffix_max = 56,
                                           .vocab_size = 512,
                                           .seed = 3};
  const auto w = serve_bench::MakeSharedPrefixWorkload(spec);
  ASSERT_EQ(w.prompts.size(), 100u);
  ASSERT_EQ(w.prefix_of.size(), 100u);
  std::map<int, std::vector<int32_t>> prefix;
  std::map<int, int> uses;
  std::set<std::vector<int32_t>> suffixes;
  for (size_t i = 0; i < w.prompts.size(); ++i) {
    const auto& p = w.prompts[i];
    ASSERT_GE(p.size(), 256u + 8);
    ASSERT_LE(p.size(), 256u + 56);
    for (int32_t t : p) ASSERT_TRUE(t >= 2 && t < 512) << t;
    const std::vector<int32_t> head(p.begin(), p.begin() + 256);
    auto [it, fresh] = prefix.emplace(w.prefix_of[i], head);
    EXPECT_EQ(it->second, head) << "request " << i << " does not start with system prompt " << w.prefix_of[i];
    ++uses[w.prefix_of[i]];
    suffixes.insert(std::vector<int32_t>(p.begin() + 256, p.end()));
  }
  EXPECT_EQ(prefix.size(), 8u);
  for (const auto& [a, pa] : prefix)
    for (const auto& [b, pb] : prefix)
      if (a != b) {
        EXPECT_NE(pa, pb);
      }
  for (const auto& [p, n] : uses) EXPECT_TRUE(n == 12 || n == 13) << p << ": " << n;
  EXPECT_EQ(suffixes.size(), 100u);  // every suffix unique
  // Random arrival order, not 0,1,2,...,7,0,1,...
  bool cyclic = true;
  for (size_t i = 0; i < w.prefix_of.size(); ++i) cyclic = cyclic && w.prefix_of[i] == static_cast<int>(i % 8);
  EXPECT_FALSE(cyclic);
  // Deterministic in the seed.
  EXPECT_EQ(serve_bench::MakeSharedPrefixWorkload(spec).prompts, w.prompts);
}

TEST(ServeBenchArithmetic, BalanceIsMeanOverMax) {
  const std::vector<int64_t> even = {5, 5, 5, 5}, one_hot = {8, 0, 0, 0}, skew = {6, 2}, idle = {0, 0};
  EXPECT_DOUBLE_EQ(serve_bench::GroupBalance(even), 1.0);
  EXPECT_DOUBLE_EQ(serve_bench::GroupBalance(one_hot), 0.25);  // one of four groups runs everything
  EXPECT_DOUBLE_EQ(serve_bench::GroupBalance(skew), 4.0 / 6.0);
  EXPECT_TRUE(std::isnan(serve_bench::GroupBalance(idle)));  // nothing in flight: skipped
  EXPECT_TRUE(std::isnan(serve_bench::GroupBalance({})));
}

TEST(ServeBenchWorkload, PoissonArrivals) {
  const std::vector<double> t = serve_bench::PoissonArrivals(50, 100, 7);
  // About rate x duration arrivals (5000, standard deviation ~71).
  EXPECT_GT(t.size(), 4600u);
  EXPECT_LT(t.size(), 5400u);
  ASSERT_FALSE(t.empty());
  EXPECT_GE(t.front(), 0);
  EXPECT_LT(t.back(), 100);
  EXPECT_TRUE(std::is_sorted(t.begin(), t.end()));
  // Exponential gaps: mean 1 / rate, and about e^-1 of them longer than it.
  double sum = 0;
  int64_t longer = 0;
  for (size_t i = 1; i < t.size(); ++i) {
    sum += t[i] - t[i - 1];
    longer += t[i] - t[i - 1] > 1.0 / 50;
  }
  const double n = static_cast<double>(t.size() - 1);
  EXPECT_NEAR(sum / n, 1.0 / 50, 0.002);
  EXPECT_NEAR(static_cast<double>(longer) / n, std::exp(-1.0), 0.03);
  // Deterministic in the seed, and the seed matters.
  EXPECT_EQ(serve_bench::PoissonArrivals(50, 100, 7), t);
  EXPECT_NE(serve_bench::PoissonArrivals(50, 100, 8), t);
  EXPECT_TRUE(serve_bench::PoissonArrivals(0, 100, 7).empty());
  EXPECT_TRUE(serve_bench::PoissonArrivals(50, 0, 7).empty());
}

TEST(ServeBenchWorkload, SkewedMix) {
  const serve_bench::SkewedSpec spec{.rate_per_s = 40,
                                     .duration_s = 50,
                                     .long_fraction = 0.1,
                                     .short_tokens = 32,
                                     .long_tokens = 1024,
                                     .vocab_size = 512,
                                     .prompt_min = 16,
                                     .prompt_max = 256,
                                     .seed = 3};
  const auto w = serve_bench::MakeSkewedWorkload(spec);
  ASSERT_GT(w.size(), 1800u);
  EXPECT_EQ(w.size(), serve_bench::PoissonArrivals(40, 50, 3).size());
  int64_t longs = 0;
  std::set<uint64_t> seeds;
  for (size_t i = 0; i < w.size(); ++i) {
    const auto& r = w[i].request;
    ASSERT_TRUE(r.max_tokens == 32 || r.max_tokens == 1024) << r.max_tokens;
    longs += r.max_tokens == 1024;
    ASSERT_GE(r.prompt.size(), 16u);
    ASSERT_LE(r.prompt.size(), 256u);
    for (int32_t t : r.prompt) ASSERT_TRUE(t >= 2 && t < 512) << t;
    if (i > 0) {
      EXPECT_GE(w[i].arrival_s, w[i - 1].arrival_s);
    }
    seeds.insert(r.seed);
  }
  EXPECT_EQ(seeds.size(), w.size());  // every request its own seed
  EXPECT_NEAR(static_cast<double>(longs) / static_cast<double>(w.size()), 0.1, 0.025);
  // Deterministic in the seed: the same arrivals, prompts and lengths.
  const auto again = serve_bench::MakeSkewedWorkload(spec);
  ASSERT_EQ(again.size(), w.size());
  for (size_t i = 0; i < w.size(); ++i) {
    EXPECT_EQ(again[i].arrival_s, w[i].arrival_s);
    EXPECT_EQ(again[i].request.prompt, w[i].request.prompt);
    EXPECT_EQ(again[i].request.seed, w[i].request.seed);
    EXPECT_EQ(again[i].request.max_tokens, w[i].request.max_tokens);
  }
  // All short or all long at the ends of the range.
  serve_bench::SkewedSpec none = spec, all = spec;
  none.long_fraction = 0, all.long_fraction = 1;
  for (const auto& r : serve_bench::MakeSkewedWorkload(none)) ASSERT_EQ(r.request.max_tokens, 32);
  for (const auto& r : serve_bench::MakeSkewedWorkload(all)) ASSERT_EQ(r.request.max_tokens, 1024);
}

TEST(ServeBenchWorkload, PromptMix) {
  const serve_bench::PromptMixSpec spec{.rate_per_s = 40,
                                        .duration_s = 50,
                                        .short_fraction = 0.3,
                                        .short_min = 64,
                                        .short_max = 256,
                                        .long_min = 1024,
                                        .long_max = 4096,
                                        .output_min = 64,
                                        .output_max = 256,
                                        .vocab_size = 512,
                                        .seed = 5};
  const auto w = serve_bench::MakePromptMixWorkload(spec);
  ASSERT_GT(w.size(), 1800u);
  EXPECT_EQ(w.size(), serve_bench::PoissonArrivals(40, 50, 5).size());
  int64_t shorts = 0;
  std::set<uint64_t> seeds;
  std::set<int64_t> outputs;
  for (size_t i = 0; i < w.size(); ++i) {
    const auto& r = w[i].request;
    const int64_t len = static_cast<int64_t>(r.prompt.size());
    ASSERT_TRUE((len >= 64 && len <= 256) || (len >= 1024 && len <= 4096)) << len;
    shorts += len <= 256;
    ASSERT_GE(r.max_tokens, 64);
    ASSERT_LE(r.max_tokens, 256);
    outputs.insert(r.max_tokens);
    for (int32_t t : r.prompt) ASSERT_TRUE(t >= 2 && t < 512) << t;
    if (i > 0) EXPECT_GE(w[i].arrival_s, w[i - 1].arrival_s);
    seeds.insert(r.seed);
  }
  EXPECT_EQ(seeds.size(), w.size());
  EXPECT_GT(outputs.size(), 150u);  // spread over the range
  EXPECT_NEAR(static_cast<double>(shorts) / static_cast<double>(w.size()), 0.3, 0.03);
  // Deterministic in the seed.
  const auto again = serve_bench::MakePromptMixWorkload(spec);
  ASSERT_EQ(again.size(), w.size());
  for (size_t i = 0; i < w.size(); ++i) {
    EXPECT_EQ(again[i].arrival_s, w[i].arrival_s);
    EXPECT_EQ(again[i].request.prompt, w[i].request.prompt);
    EXPECT_EQ(again[i].request.max_tokens, w[i].request.max_tokens);
  }
  // Every prompt short with short_fraction 1, the same arrivals.
  serve_bench::PromptMixSpec all_short = spec;
  all_short.short_fraction = 1;
  const auto s = serve_bench::MakePromptMixWorkload(all_short);
  ASSERT_EQ(s.size(), w.size());
  for (size_t i = 0; i < s.size(); ++i) {
    EXPECT_EQ(s[i].arrival_s, w[i].arrival_s);
    ASSERT_LE(s[i].request.prompt.size(), 256u);
  }
}

TEST(ServeBench, RejectsBadOptions) {
  std::ostringstream out, table;
  ServeBenchOptions o{.quick = true};
  o.policies = {"fastest"};
  EXPECT_EQ(RunServeBench(o, out, table).code(), StatusCode::kInvalidArgument);
  o.policies = {};
  o.groups = {0};
  EXPECT_EQ(RunServeBench(o, out, table).code(), StatusCode::kInvalidArgument);
}

// Bad options of `mlarun bench rebalance` are refused, naming the option,
// before anything starts.
TEST(RebalanceBench, RejectsBadOptions) {
  // `bad` spoils the default options; the refusal must name `option`.
  auto refused = [](const std::function<void(RebalanceBenchOptions&)>& bad, const std::string& option) {
    RebalanceBenchOptions o;
    bad(o);
    std::ostringstream out, table;
    const Status st = RunRebalanceBench(o, out, table);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << option << ": " << st;
    EXPECT_NE(st.message().find(option), std::string::npos) << st;
    EXPECT_TRUE(out.str().empty());
  };
  refused([](auto& o) { o.groups = {0}; }, "--groups");
  refused([](auto& o) { o.rounds = 0; }, "--rounds");
  refused([](auto& o) { o.duration_s = -1; }, "--duration-s");
  refused([](auto& o) { o.rate = 0; }, "--rate");
  refused([](auto& o) { o.rate = std::nan(""); }, "--rate");
  refused([](auto& o) { o.long_fraction = 1.5; }, "--long-fraction");
  refused([](auto& o) { o.short_tokens = 0; }, "--short-tokens");
  refused([](auto& o) { o.long_tokens = 100000; }, "--long-tokens");
  refused([](auto& o) { o.tokens_per_s = -1; }, "--tokens-per-s");
  refused([](auto& o) { o.step_ms = HUGE_VAL; }, "--step-ms");
  refused(
      [](auto& o) {
        o.tokens_per_s = 0;
        o.step_ms = 0;
      },
      "--step-ms");
  refused([](auto& o) { o.threshold = 0; }, "--threshold");
  refused([](auto& o) { o.policy = "fastest"; }, "--policy");
}

// Bad options of `mlarun bench disagg` are refused, naming the option,
// before anything starts.
TEST(DisaggBench, RejectsBadOptions) {
  auto refused = [](const std::function<void(DisaggBenchOptions&)>& bad, const std::string& option) {
    DisaggBenchOptions o;
    bad(o);
    std::ostringstream out, table;
    const Status st = RunDisaggBench(o, out, table);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << option << ": " << st;
    EXPECT_NE(st.message().find(option), std::string::npos) << st;
    EXPECT_TRUE(out.str().empty());
  };
  refused([](auto& o) { o.groups = 1; }, "--groups");
  refused([](auto& o) { o.rounds = 0; }, "--rounds");
  refused([](auto& o) { o.duration_s = 0; }, "--duration-s");
  refused([](auto& o) { o.rate = std::nan(""); }, "--rate");
  refused([](auto& o) { o.prefill_tokens_per_s = -1; }, "--prefill-tokens-per-s");
  refused([](auto& o) { o.max_batched_tokens = 0; }, "--max-batched-tokens");
  refused([](auto& o) { o.tokens_per_s = HUGE_VAL; }, "--tokens-per-s");
  refused([](auto& o) { o.step_ms = -1; }, "--step-ms");
  refused(
      [](auto& o) {
        o.tokens_per_s = 0;
        o.step_ms = 0;
      },
      "--step-ms");
  refused([](auto& o) { o.transfer_gbps = std::nan(""); }, "--transfer-gbps");
  refused([](auto& o) { o.short_fraction = -0.1; }, "--short-fraction");
  refused([](auto& o) { o.long_prompt_min = 0; }, "--long-prompt-min");
  refused([](auto& o) { o.long_prompt_max = 100000; }, "--long-prompt-max");
  refused([](auto& o) { o.short_prompt_min = 300; }, "--short-prompt-min");
  refused([](auto& o) { o.output_max = 8; }, "--output-max");
  refused(
      [](auto& o) {
        o.long_prompt_max = 32768;
        o.output_max = 256;
      },
      "--output-max");
}

TEST(ServeBench, QuickRunInProcess) {
  ServeBenchOptions o;
  o.quick = true;
  o.json = true;
  o.groups = {2, 5};
  o.clients = 4;
  o.requests = 16;
  o.max_tokens = 4;
  std::ostringstream out, table;
  const Status st = RunServeBench(o, out, table);
  ASSERT_TRUE(st.ok()) << st << "\n" << table.str();
  const auto doc = nlohmann::json::parse(out.str());
  for (const char* key : {"machine", "date", "target", "config", "load", "overhead", "prefix", "all_verified"})
    EXPECT_TRUE(doc.contains(key)) << key;
  EXPECT_EQ(doc["machine"]["network"], "loopback (127.0.0.1)");
  EXPECT_TRUE(doc["all_verified"].get<bool>());

  // One row per (groups, policy); every request completed once, verified.
  ASSERT_EQ(doc["load"].size(), 6u);
  std::set<std::pair<int, std::string>> rows;
  for (const auto& row : doc["load"]) {
    rows.insert({row["groups"].get<int>(), row["policy"].get<std::string>()});
    const int64_t n = row["requests"].get<int64_t>();
    EXPECT_GE(n, 16);
    EXPECT_GE(row["clients"].get<int>(), 4 * row["groups"].get<int>());  // at least 4 clients per group
    EXPECT_EQ(row["completed"].get<int64_t>(), n) << row.dump();
    EXPECT_EQ(row["failed"].get<int64_t>(), 0);
    EXPECT_EQ(row["coordinator"]["received"].get<int64_t>(), n);
    EXPECT_EQ(row["coordinator"]["completed"].get<int64_t>(), n);
    EXPECT_TRUE(row["verified"].get<bool>());
    EXPECT_GT(row["requests_per_s"].get<double>(), 0);
    EXPECT_NEAR(row["tokens_per_s"].get<double>(), 4 * row["requests_per_s"].get<double>(), 1e-6);
    EXPECT_GT(row["ttft_ms"]["p50"].get<double>(), 0);
    EXPECT_LE(row["ttft_ms"]["p50"].get<double>(), row["ttft_ms"]["p99"].get<double>());
    EXPECT_LE(row["itl_ms"]["p50"].get<double>(), row["itl_ms"]["p99"].get<double>());
    if (!row["imbalance"]["mean"].is_null()) {
      EXPECT_GE(row["imbalance"]["mean"].get<double>(), 1.0);
    }
  }
  EXPECT_EQ(rows.size(), 6u);

  const auto& ov = doc["overhead"];
  EXPECT_TRUE(ov["verified"].get<bool>());
  EXPECT_EQ(ov["failed"].get<int64_t>(), 0);
  EXPECT_GT(ov["direct_ms"]["p50"].get<double>(), 0);
  EXPECT_GT(ov["through_coordinator_ms"]["p50"].get<double>(), 0);
  EXPECT_DOUBLE_EQ(ov["coordinator_overhead_ms"]["p50"].get<double>(),
                   ov["through_coordinator_ms"]["p50"].get<double>() - ov["direct_ms"]["p50"].get<double>());

  ASSERT_EQ(doc["prefix"]["rows"].size(), 3u);
  std::map<std::string, double> hit_rate;
  for (const auto& row : doc["prefix"]["rows"]) {
    hit_rate[row["policy"].get<std::string>()] = row["hit_rate"].get<double>();
    EXPECT_TRUE(row["verified"].get<bool>()) << row.dump();
    EXPECT_EQ(row["completed"].get<int64_t>(), doc["prefix"]["requests"].get<int64_t>());
    const double rate = row["hit_rate"].get<double>();
    EXPECT_DOUBLE_EQ(rate, row["prefix_hit_tokens"].get<double>() / row["prompt_tokens"].get<double>());
    EXPECT_GT(rate, 0);
    EXPECT_LT(rate, 1);
  }
  // Keeping each system prompt on one group is what the policy is for.
  EXPECT_GT(hit_rate["prefix_affinity"], hit_rate["round_robin"]);
}

// --coordinator with a deployment whose client API needs a token: with the
// token every request is served and verified; without it the benchmark
// stops at its first GetStats, naming the refusal.
TEST(ServeBench, DrivesADeploymentThatNeedsAToken) {
  constexpr char kToken[] = "bench-token-0123456789abcdef";
  auto coord = Coordinator::Start(
      {.listen = "127.0.0.1:0", .auth_tokens = AuthTokens(std::vector<Principal>{{.token = kToken, .name = "bench"}})});
  ASSERT_TRUE(coord.ok()) << coord.status();
  SimWorkerOptions so;
  so.coordinator = (*coord)->address();
  so.groups = 2;
  so.tokens_per_s = 0;
  SimWorkerThread sim(so);
  ServeBenchOptions o;
  o.quick = true;
  o.json = true;
  o.coordinator = (*coord)->address();
  o.clients = 4;
  o.requests = 16;
  o.max_tokens = 4;
  {
    std::ostringstream out, table;
    const Status st = RunServeBench(o, out, table);
    EXPECT_EQ(st.code(), StatusCode::kUnavailable) << st;
    EXPECT_NE(st.message().find("UNAUTHENTICATED"), std::string::npos) << st;
  }
  o.security.token = kToken;
  std::ostringstream out, table;
  const Status st = RunServeBench(o, out, table);
  ASSERT_TRUE(st.ok()) << st << "\n" << table.str() << sim.log();
  const auto doc = nlohmann::json::parse(out.str());
  EXPECT_EQ(doc["target"]["kind"], "external");
  ASSERT_FALSE(doc["load"].empty());
  for (const auto& row : doc["load"]) {
    EXPECT_EQ(row["failed"].get<int64_t>(), 0) << row.dump();
    EXPECT_EQ(row["completed"].get<int64_t>(), row["requests"].get<int64_t>()) << row.dump();
  }
}

}  // namespace
}  // namespace mlarun
