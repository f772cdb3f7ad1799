// `mlarun bench rebalance` (rebalance_bench.h says what is measured).
//
// Threads: the load is open_loop.h's (client threads and a GetStats
// sampler); the coordinator runs on gRPC's callback threads and the
// simulated groups on RunSimWorker's.
#include "bench/rebalance_bench.h"

#include <chrono>
#include <cmath>
#include <nlohmann/json.hpp>
#include <ostream>

#include "bench/open_loop.h"
#include "bench/sim_target.h"
#include "bench/timing.h"
#include "bench/workload.h"

namespace mlarun {

namespace {

using Json = nlohmann::json;
using serve_bench::InProcessTarget;
using serve_bench::TimedRequest;

constexpr int64_t kPromptMin = 16, kPromptMax = 256;
// The simulated groups' limit on prompt + max_tokens (SimWorkerOptions'
// default max_position_embeddings), so the longest request is this less the
// longest prompt.
constexpr int64_t kMaxTokens = 4096 - kPromptMax;
// Cache blocks per simulated group: enough that no request ever waits for
// blocks (each reserves its prompt and max_tokens rows at admission), so
// what is measured is the steps' pacing alone.
constexpr int64_t kCacheBlocks = 16384;
constexpr auto kSamplePeriod = std::chrono::milliseconds(25);

// ---- Options ------------------------------------------------------------------

struct Resolved {
  std::vector<int> groups;
  int rounds = 0;
  double duration_s = 0, rate = 0;
  int64_t short_tokens = 0, long_tokens = 0;
  RoutingPolicy policy = RoutingPolicy::kLeastLoaded;
};

StatusOr<Resolved> Resolve(const RebalanceBenchOptions& o) {
  Resolved r;
  r.groups = !o.groups.empty() ? o.groups : std::vector<int>{2, 4};
  for (int g : r.groups)
    if (g < 1 || g > 256) return InvalidArgumentError("--groups: each must be in [1, 256], got ", g);
  r.rounds = o.rounds.value_or(o.quick ? 1 : 3);
  if (r.rounds < 1 || r.rounds > 100) return InvalidArgumentError("--rounds must be in [1, 100], got ", r.rounds);
  r.duration_s = o.duration_s.value_or(o.quick ? 2 : 20);
  if (!(r.duration_s > 0) || r.duration_s > 3600)
    return InvalidArgumentError("--duration-s must be in (0, 3600], got ", r.duration_s);
  r.rate = o.rate.value_or(8);
  if (!(r.rate > 0) || r.rate > 10000) return InvalidArgumentError("--rate must be in (0, 10000], got ", r.rate);
  if (!(o.long_fraction >= 0 && o.long_fraction <= 1))
    return InvalidArgumentError("--long-fraction must be in [0, 1], got ", o.long_fraction);
  r.short_tokens = o.short_tokens.value_or(o.quick ? 16 : 32);
  r.long_tokens = o.long_tokens.value_or(o.quick ? 128 : 1024);
  if (r.short_tokens < 1 || r.short_tokens > kMaxTokens)
    return InvalidArgumentError("--short-tokens must be in [1, ", kMaxTokens, "], got ", r.short_tokens);
  if (r.long_tokens < 1 || r.long_tokens > kMaxTokens)
    return InvalidArgumentError("--long-tokens must be in [1, ", kMaxTokens, "], got ", r.long_tokens);
  if (!(o.tokens_per_s >= 0) || !std::isfinite(o.tokens_per_s))
    return InvalidArgumentError("--tokens-per-s must be a finite number >= 0, got ", o.tokens_per_s);
  if (!(o.step_ms >= 0) || !std::isfinite(o.step_ms))
    return InvalidArgumentError("--step-ms must be a finite number >= 0, got ", o.step_ms);
  if (o.tokens_per_s == 0 && o.step_ms == 0)
    return InvalidArgumentError(
        "--tokens-per-s and --step-ms are both 0: the groups would run as fast as this machine allows, and the "
        "benchmark would measure the machine");
  if (o.threshold < 1) return InvalidArgumentError("--threshold must be >= 1, got ", o.threshold);
  auto policy = ParseRoutingPolicy(o.policy);
  if (!policy.ok())
    return InvalidArgumentError("--policy must be round_robin, least_loaded or prefix_affinity, got '", o.policy, "'");
  r.policy = *policy;
  return r;
}

// ---- One run ----------------------------------------------------------------------

// What one run (a group count, rebalancing off or on, a round) measured.
struct RunResult : serve_bench::LoadFigures {
  int groups = 0, round = 0;
  bool rebalance = false;
  double balance = NAN, moves = 0;
  int64_t balance_samples = 0;
};

double SampleBalance(const v1::GetStatsResponse& s) {
  std::vector<int64_t> in_flight;
  for (const v1::GroupStats& g : s.groups())
    if (g.connected()) in_flight.push_back(g.requests_in_flight());
  return serve_bench::GroupBalance(in_flight);
}

// One run on a fresh coordinator and fresh simulated groups.
StatusOr<RunResult> RunOnce(const RebalanceBenchOptions& o, const Resolved& r, int groups, bool rebalance, int round,
                            const std::vector<TimedRequest>& work) {
  CoordinatorOptions co;
  co.policy = r.policy;
  co.rebalance_threshold = rebalance ? o.threshold : 0;
  SimWorkerOptions sim = serve_bench::SimOptions(groups, o.tokens_per_s, kCacheBlocks);
  sim.worker_id = "rebalance-bench";
  sim.step_ms = o.step_ms;
  MLARUN_ASSIGN_OR_RETURN(auto target, InProcessTarget::Start(co, sim));
  // The groups' balance, one per sample with a request in flight.
  std::vector<double> balance;
  auto load = serve_bench::DriveOpenLoop(
      target->address(), work,
      [&](const v1::GetStatsResponse& s) {
        const double b = SampleBalance(s);
        if (std::isfinite(b)) balance.push_back(b);
      },
      kSamplePeriod);
  target->Stop();
  if (!load.ok()) return load.status();
  RunResult run;
  static_cast<serve_bench::LoadFigures&>(run) = serve_bench::SummarizeLoad(*load);
  run.groups = groups;
  run.round = round;
  run.rebalance = rebalance;
  run.balance = serve_bench::MeanOfFinite(balance);
  run.balance_samples = static_cast<int64_t>(balance.size());
  const v1::CoordinatorStats &c0 = load->before.coordinator(), &c1 = load->after.coordinator();
  run.moves = static_cast<double>(c1.rebalance_moves() - c0.rebalance_moves());
  return run;
}

// ---- The report -------------------------------------------------------------------

// The figures summarized over rounds: median, spread and (where `ratio`)
// the same-round ratio on / off.
struct Metric {
  serve_bench::PairMetric m;
  double RunResult::*field;
};
// Those without a ratio come last (the ratio row leaves them out).
const Metric kMetrics[] = {
    {{"decode_tokens_per_s", "decode tok/s", 0, true}, &RunResult::decode_tokens_per_s},
    {{"itl_p50_ms", "ITL p50 ms", 2, true}, &RunResult::itl_p50_ms},
    {{"itl_p99_ms", "ITL p99 ms", 2, true}, &RunResult::itl_p99_ms},
    {{"ttft_p50_ms", "TTFT p50 ms", 2, true}, &RunResult::ttft_p50_ms},
    {{"ttft_p99_ms", "TTFT p99 ms", 2, true}, &RunResult::ttft_p99_ms},
    {{"balance", "balance", 3, true}, &RunResult::balance},
    {{"rebalance_moves", "moves", 0, false}, &RunResult::moves},
};

serve_bench::PairTable Table(int rounds) {
  serve_bench::PairTable t{
      .case_header = "groups", .side_key = "rebalance", .sides = {"off", "on"}, .ratio = "on/off", .rounds = rounds};
  for (const Metric& m : kMetrics) t.metrics.push_back(m.m);
  return t;
}

Json RunJson(const RunResult& r) {
  Json j = {{"groups", r.groups},
            {"rebalance", r.rebalance ? "on" : "off"},
            {"round", r.round},
            {"balance_samples", r.balance_samples}};
  serve_bench::AddFiguresJson(r, j);
  for (const Metric& m : kMetrics) j[m.m.key] = OrNull(r.*m.field);
  j["rebalance_moves"] = static_cast<int64_t>(r.moves);
  return j;
}

// The rows of one group count (both modes, then the ratio) into the table
// and the document.
void Report(const std::vector<RunResult>& runs, int groups, int rounds, std::ostream& t, Json& doc) {
  std::vector<serve_bench::PairRun> pair;
  for (const RunResult& r : runs) {
    if (r.groups != groups) continue;
    serve_bench::PairRun p{
        .round = r.round, .side = r.rebalance ? 1 : 0, .requests = r.requests, .verified = r.verified};
    for (const Metric& m : kMetrics) p.values.push_back(r.*m.field);
    pair.push_back(std::move(p));
  }
  serve_bench::ReportPair(Table(rounds), std::to_string(groups), {{"groups", groups}}, pair, t, doc);
}

// The document's leading fields and the table's first lines.
void Describe(const RebalanceBenchOptions& o, const Resolved& r, std::ostream& t, Json& doc) {
  const CoordinatorOptions defaults;
  doc["benchmark"] = "rebalance";
  doc["date"] = Today();
  doc["machine"] = serve_bench::LoopbackMachineJson();
  doc["config"] = {{"groups", r.groups},
                   {"rounds", r.rounds},
                   {"duration_s", r.duration_s},
                   {"rate_per_group", r.rate},
                   {"long_fraction", o.long_fraction},
                   {"short_tokens", r.short_tokens},
                   {"long_tokens", r.long_tokens},
                   {"prompt_tokens", {{"min", kPromptMin}, {"max", kPromptMax}}},
                   {"tokens_per_s", o.tokens_per_s},
                   {"step_ms", o.step_ms},
                   {"policy", std::string(RoutingPolicyName(r.policy))},
                   {"threshold", o.threshold},
                   {"rebalance_period_s", defaults.rebalance_period_s},
                   {"rebalance_cooldown_s", defaults.rebalance_cooldown_s},
                   {"seed", o.seed},
                   {"quick", o.quick},
                   {"vocab_size", serve_bench::kSimVocabSize},
                   {"sample_period_ms", kSamplePeriod.count()}};
  t << "mlarun bench rebalance: " << serve_bench::LoopbackMachineLine() << "\n";
  t << "coordinator: policy " << RoutingPolicyName(r.policy) << "; rebalancing on = threshold " << o.threshold
    << " requests in flight, at most one move every " << defaults.rebalance_period_s << " s, cooldown "
    << defaults.rebalance_cooldown_s << " s\n";
  t << "groups: a step of n tokens takes " << o.step_ms << " ms + n / " << o.tokens_per_s << " tokens/s\n";
  t << "workload: Poisson arrivals at " << r.rate << " requests/s per group for " << r.duration_s << " s; "
    << Fmt(100 * o.long_fraction, 0) << "% long (" << r.long_tokens << " tokens), the rest short (" << r.short_tokens
    << " tokens); prompts " << kPromptMin << "-" << kPromptMax << " random ids; seed " << o.seed
    << "; the same requests with rebalancing off and on; " << r.rounds << " round(s), off then on in each\n";
}

}  // namespace

Status RunRebalanceBench(const RebalanceBenchOptions& o, std::ostream& out, std::ostream& t) {
  MLARUN_ASSIGN_OR_RETURN(const Resolved r, Resolve(o));
  Json doc;
  Describe(o, r, t, doc);
  std::vector<RunResult> runs;
  bool all_verified = true;
  for (int groups : r.groups) {
    const std::vector<TimedRequest> work = serve_bench::MakeSkewedWorkload({.rate_per_s = r.rate * groups,
                                                                            .duration_s = r.duration_s,
                                                                            .long_fraction = o.long_fraction,
                                                                            .short_tokens = r.short_tokens,
                                                                            .long_tokens = r.long_tokens,
                                                                            .vocab_size = serve_bench::kSimVocabSize,
                                                                            .prompt_min = kPromptMin,
                                                                            .prompt_max = kPromptMax,
                                                                            .seed = o.seed});
    if (work.empty())
      return InvalidArgumentError("no request arrives within --duration-s ", r.duration_s, " at --rate ", r.rate,
                                  " per group; raise either");
    for (int round = 1; round <= r.rounds; ++round) {
      for (bool on : {false, true}) {
        MLARUN_ASSIGN_OR_RETURN(const RunResult run, RunOnce(o, r, groups, on, round, work));
        t << "  round " << round << ", " << groups << " groups, rebalancing " << (on ? "on: " : "off:") << " "
          << run.requests << " requests, " << Fmt(run.decode_tokens_per_s, 0) << " tok/s, ITL p99 "
          << Fmt(run.itl_p99_ms, 2) << " ms, balance " << Fmt(run.balance, 3) << ", " << run.moves
          << " moves; verified: " << (run.verified ? "yes" : "NO: " + run.first_error) << "\n";
        all_verified = all_verified && run.verified;
        runs.push_back(run);
      }
    }
  }
  t << "\nmedians over rounds" << (r.rounds > 1 ? " (min..max)" : "")
    << "; on/off: the same round's ratio; balance = mean / max of the groups' requests in flight\n";
  serve_bench::PrintPairHeader(Table(r.rounds), t);
  doc["rows"] = Json::array();
  doc["ratios"] = Json::array();
  for (int groups : r.groups) Report(runs, groups, r.rounds, t, doc);
  doc["runs"] = Json::array();
  for (const RunResult& run : runs) doc["runs"].push_back(RunJson(run));
  doc["all_verified"] = all_verified;
  if (o.json) out << doc.dump(2) << std::endl;
  if (!all_verified) return InternalError("some requests failed verification (see the runs above)");
  return Status::Ok();
}

}  // namespace mlarun
