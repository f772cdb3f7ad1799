// `mlarun bench serve`: the report's arithmetic on hand-made inputs, the
// shared-prefix workload, and the quick mode end to end in process (a real
// coordinator on 127.0.0.1:0 and simulated groups).
#include "bench/serve_bench.h"

#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

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

TEST(ServeBench, RejectsBadOptions) {
  std::ostringstream out, table;
  ServeBenchOptions o{.quick = true};
  o.policies = {"fastest"};
  EXPECT_EQ(RunServeBench(o, out, table).code(), StatusCode::kInvalidArgument);
  o.policies = {};
  o.groups = {0};
  EXPECT_EQ(RunServeBench(o, out, table).code(), StatusCode::kInvalidArgument);
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
