// `mlarun bench disagg` (disagg_bench.h says what is measured).
//
// Threads: the load is open_loop.h's (client threads); the coordinator runs
// on gRPC's callback threads and the simulated groups on RunSimWorker's (one
// per worker job).
#include "bench/disagg_bench.h"

#include <algorithm>
#include <chrono>
#include <climits>
#include <cmath>
#include <nlohmann/json.hpp>
#include <ostream>
#include <string>
#include <thread>
#include <vector>

#include "bench/open_loop.h"
#include "bench/sim_target.h"
#include "bench/timing.h"
#include "bench/workload.h"
#include "serving/client/grpc_util.h"

namespace mlarun {

namespace {

using Json = nlohmann::json;
using serve_bench::InProcessTarget;
using serve_bench::TimedRequest;

// The simulated groups' longest prompt + output (their
// max_position_embeddings).
constexpr int64_t kMaxContext = 32768;
// Requests a simulated group runs at once at most (its kMaxRunning).
constexpr int64_t kMaxRunning = 256;
// The groups report their ranks' counters (the block moves) every 200 ms:
// after a run, the report that counts its last fetches is waited for this long at most.
constexpr auto kSettle = std::chrono::seconds(2);

// ---- Options ------------------------------------------------------------------

struct Resolved {
  int rounds = 0;
  double duration_s = 0;
  int64_t long_min = 0, long_max = 0, output_min = 0, output_max = 0;
  int prefill_groups = 0, decode_groups = 0;
};

// INVALID_ARGUMENT unless lo <= hi, both in [1, kMaxContext].
Status CheckRange(const char* name, int64_t lo, int64_t hi) {
  if (lo < 1 || hi > kMaxContext || lo > hi)
    return InvalidArgumentError("--", name, "-min and --", name, "-max must satisfy 1 <= min <= max <= ", kMaxContext,
                                ", got ", lo, " and ", hi);
  return Status::Ok();
}

// INVALID_ARGUMENT naming `name` unless `v` is finite and >= 0.
Status CheckRate(const char* name, double v) {
  if (!(v >= 0) || !std::isfinite(v)) return InvalidArgumentError("--", name, " must be a finite number >= 0, got ", v);
  return Status::Ok();
}

StatusOr<Resolved> Resolve(const DisaggBenchOptions& o) {
  Resolved r;
  if (o.groups < 2 || o.groups > 256) return InvalidArgumentError("--groups must be in [2, 256], got ", o.groups);
  r.prefill_groups = o.groups / 2;
  r.decode_groups = o.groups - r.prefill_groups;
  r.rounds = o.rounds.value_or(o.quick ? 1 : 3);
  if (r.rounds < 1 || r.rounds > 100) return InvalidArgumentError("--rounds must be in [1, 100], got ", r.rounds);
  r.duration_s = o.duration_s.value_or(o.quick ? 1.5 : 20);
  if (!(r.duration_s > 0) || r.duration_s > 3600)
    return InvalidArgumentError("--duration-s must be in (0, 3600], got ", r.duration_s);
  if (!(o.rate > 0) || o.rate > 10000) return InvalidArgumentError("--rate must be in (0, 10000], got ", o.rate);
  MLARUN_RETURN_IF_ERROR(CheckRate("prefill-tokens-per-s", o.prefill_tokens_per_s));
  MLARUN_RETURN_IF_ERROR(CheckRate("tokens-per-s", o.tokens_per_s));
  MLARUN_RETURN_IF_ERROR(CheckRate("step-ms", o.step_ms));
  MLARUN_RETURN_IF_ERROR(CheckRate("transfer-gbps", o.transfer_gbps));
  if (o.tokens_per_s == 0 && o.step_ms == 0)
    return InvalidArgumentError(
        "--tokens-per-s and --step-ms are both 0: decode steps would run as fast as this machine allows, and the "
        "benchmark would measure the machine");
  if (o.max_batched_tokens < 1 || o.max_batched_tokens > INT32_MAX)
    return InvalidArgumentError("--max-batched-tokens must be in [1, 2^31), got ", o.max_batched_tokens);
  if (!(o.short_fraction >= 0 && o.short_fraction <= 1))
    return InvalidArgumentError("--short-fraction must be in [0, 1], got ", o.short_fraction);
  r.long_min = o.long_prompt_min.value_or(o.quick ? 512 : 1024);
  r.long_max = o.long_prompt_max.value_or(o.quick ? 1024 : 4096);
  r.output_min = o.output_min.value_or(o.quick ? 16 : 64);
  r.output_max = o.output_max.value_or(o.quick ? 32 : 256);
  MLARUN_RETURN_IF_ERROR(CheckRange("long-prompt", r.long_min, r.long_max));
  MLARUN_RETURN_IF_ERROR(CheckRange("short-prompt", o.short_prompt_min, o.short_prompt_max));
  MLARUN_RETURN_IF_ERROR(CheckRange("output", r.output_min, r.output_max));
  const int64_t longest = std::max(r.long_max, o.short_prompt_max) + r.output_max;
  if (longest > kMaxContext)
    return InvalidArgumentError("--long-prompt-max / --short-prompt-max + --output-max must be at most ", kMaxContext,
                                ", got ", longest);
  return r;
}

// ---- One run ------------------------------------------------------------------

// What one run (a workload, a layout, a round) measured.
struct RunResult : serve_bench::LoadFigures {
  std::string workload;
  int round = 0;
  bool disagg = false;
  double moves = 0, block_moves = 0;  // requests_migrated; the decode groups' fetches
  int64_t prefill_migrated_out = 0, decode_migrated_in = 0, transfer_bytes = 0;
};

// A simulated worker job of `groups` groups of one role.
SimWorkerOptions Job(const DisaggBenchOptions& o, const Resolved& r, const char* role, int groups) {
  // Enough cache blocks that no request waits for them (each reserves its
  // prompt and output rows at admission), so what is measured is the
  // steps' pacing and the moves.
  const int64_t longest = std::max(r.long_max, o.short_prompt_max) + r.output_max;
  SimWorkerOptions s = serve_bench::SimOptions(
      groups, o.tokens_per_s, kMaxRunning * ((longest + serve_bench::kSimBlockSize - 1) / serve_bench::kSimBlockSize));
  s.worker_id = internal::StrCat("disagg-bench-", role);
  s.role = role;
  s.step_ms = o.step_ms;
  s.prefill_tokens_per_s = o.prefill_tokens_per_s;
  s.max_batched_tokens = o.max_batched_tokens;
  s.transfer_gbps = o.transfer_gbps;
  s.max_position_embeddings = kMaxContext;
  return s;
}

// The decode groups' fetches and their bytes in `s`.
std::pair<int64_t, int64_t> Fetches(const v1::GetStatsResponse& s) {
  int64_t fetches = 0, bytes = 0;
  for (const v1::RankStats& rank : s.ranks()) {
    fetches += rank.transfer_fetches();
    bytes += rank.transfer_bytes();
  }
  return {fetches, bytes};
}

// GetStats once the groups' reports count a fetch for every move into a
// decode group (or after kSettle): the ranks' counters come every 200 ms,
// the coordinator's own at once.
StatusOr<v1::GetStatsResponse> SettledStats(const std::string& address, const DisaggBenchOptions& o) {
  auto stub = v1::Mlarun::NewStub(client_internal::MakeChannel(address));
  const auto end = std::chrono::steady_clock::now() + kSettle;
  while (true) {
    MLARUN_ASSIGN_OR_RETURN(v1::GetStatsResponse s, serve_bench::GetStats(*stub));
    int64_t moved_in = 0;
    for (const v1::GroupStats& g : s.groups()) moved_in += g.migrated_in();
    if (o.transfer_gbps == 0 || Fetches(s).first >= moved_in || std::chrono::steady_clock::now() > end) return s;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

// One run on a fresh coordinator and fresh simulated groups.
StatusOr<RunResult> RunOnce(const DisaggBenchOptions& o, const Resolved& r, const std::string& workload, bool disagg,
                            int round, const std::vector<TimedRequest>& work) {
  CoordinatorOptions co;
  co.policy = RoutingPolicy::kLeastLoaded;
  std::vector<SimWorkerOptions> jobs;
  if (disagg) {
    jobs.push_back(Job(o, r, "prefill", r.prefill_groups));
    jobs.push_back(Job(o, r, "decode", r.decode_groups));
  } else {
    jobs.push_back(Job(o, r, "mixed", o.groups));
  }
  MLARUN_ASSIGN_OR_RETURN(auto target, InProcessTarget::Start(co, std::move(jobs)));
  auto load = serve_bench::DriveOpenLoop(target->address(), work);
  StatusOr<v1::GetStatsResponse> settled = load.status();
  if (load.ok()) settled = SettledStats(target->address(), o);
  target->Stop();
  MLARUN_RETURN_IF_ERROR(settled.status());
  RunResult run;
  static_cast<serve_bench::LoadFigures&>(run) = serve_bench::SummarizeLoad(*load);
  run.workload = workload;
  run.round = round;
  run.disagg = disagg;
  run.moves = static_cast<double>(run.migrated);
  // Each run's groups are fresh: their counters count this run alone.
  for (const v1::GroupStats& g : settled->groups()) {
    if (g.role() == "prefill") run.prefill_migrated_out += g.migrated_out();
    if (g.role() == "decode") run.decode_migrated_in += g.migrated_in();
  }
  const auto [fetches, bytes] = Fetches(*settled);
  run.block_moves = static_cast<double>(fetches);
  run.transfer_bytes = bytes;
  return run;
}

// ---- The report ---------------------------------------------------------------

// The figures summarized over rounds: median, spread and (where `ratio`)
// the same-round ratio disagg / mixed.
struct Metric {
  serve_bench::PairMetric m;
  double RunResult::*field;
};
// Those without a ratio come last (the ratio row leaves them out).
const Metric kMetrics[] = {
    {{"ttft_p50_ms", "TTFT p50 ms", 1, true}, &RunResult::ttft_p50_ms},
    {{"ttft_p99_ms", "TTFT p99 ms", 1, true}, &RunResult::ttft_p99_ms},
    {{"itl_p50_ms", "ITL p50 ms", 2, true}, &RunResult::itl_p50_ms},
    {{"itl_p99_ms", "ITL p99 ms", 2, true}, &RunResult::itl_p99_ms},
    {{"decode_tokens_per_s", "decode tok/s", 0, true}, &RunResult::decode_tokens_per_s},
    {{"moves", "moves", 0, false}, &RunResult::moves},
    {{"block_moves", "block moves", 0, false}, &RunResult::block_moves},
};
constexpr const char* kWorkloads[] = {"prefill-heavy", "short"};

serve_bench::PairTable Table(int rounds) {
  serve_bench::PairTable t{.case_header = "workload",
                           .case_width = 13,  // the longest workload's name
                           .side_key = "layout",
                           .sides = {"mixed", "disagg"},
                           .ratio = "disagg/mixed",
                           .rounds = rounds};
  for (const Metric& m : kMetrics) t.metrics.push_back(m.m);
  return t;
}

Json RunJson(const RunResult& r) {
  Json j = {{"workload", r.workload},
            {"layout", r.disagg ? "disagg" : "mixed"},
            {"round", r.round},
            {"prefill_migrated_out", r.prefill_migrated_out},
            {"decode_migrated_in", r.decode_migrated_in},
            {"transfer_bytes", r.transfer_bytes}};
  serve_bench::AddFiguresJson(r, j);
  for (const Metric& m : kMetrics) j[m.m.key] = OrNull(r.*m.field);
  j["moves"] = r.migrated;
  j["block_moves"] = static_cast<int64_t>(r.block_moves);
  return j;
}

// The rows of one workload (both layouts, then the ratio) into the table
// and the document.
void Report(const std::vector<RunResult>& runs, const std::string& workload, int rounds, std::ostream& t, Json& doc) {
  std::vector<serve_bench::PairRun> pair;
  for (const RunResult& r : runs) {
    if (r.workload != workload) continue;
    serve_bench::PairRun p{.round = r.round, .side = r.disagg ? 1 : 0, .requests = r.requests, .verified = r.verified};
    for (const Metric& m : kMetrics) p.values.push_back(r.*m.field);
    pair.push_back(std::move(p));
  }
  serve_bench::ReportPair(Table(rounds), workload, {{"workload", workload}}, pair, t, doc);
}

serve_bench::PromptMixSpec Spec(const DisaggBenchOptions& o, const Resolved& r, const std::string& workload) {
  return {.rate_per_s = o.rate,
          .duration_s = r.duration_s,
          .short_fraction = workload == "short" ? 1.0 : o.short_fraction,
          .short_min = o.short_prompt_min,
          .short_max = o.short_prompt_max,
          .long_min = r.long_min,
          .long_max = r.long_max,
          .output_min = r.output_min,
          .output_max = r.output_max,
          .vocab_size = serve_bench::kSimVocabSize,
          .seed = o.seed};
}

// The document's leading fields and the table's first lines.
void Describe(const DisaggBenchOptions& o, const Resolved& r, std::ostream& t, Json& doc) {
  doc["benchmark"] = "disagg";
  doc["date"] = Today();
  doc["machine"] = serve_bench::LoopbackMachineJson();
  doc["config"] = {{"groups", o.groups},
                   {"prefill_groups", r.prefill_groups},
                   {"decode_groups", r.decode_groups},
                   {"rounds", r.rounds},
                   {"duration_s", r.duration_s},
                   {"rate", o.rate},
                   {"prefill_tokens_per_s", o.prefill_tokens_per_s},
                   {"max_batched_tokens", o.max_batched_tokens},
                   {"tokens_per_s", o.tokens_per_s},
                   {"step_ms", o.step_ms},
                   {"transfer_gbps", o.transfer_gbps},
                   {"short_fraction", o.short_fraction},
                   {"long_prompt_tokens", {{"min", r.long_min}, {"max", r.long_max}}},
                   {"short_prompt_tokens", {{"min", o.short_prompt_min}, {"max", o.short_prompt_max}}},
                   {"output_tokens", {{"min", r.output_min}, {"max", r.output_max}}},
                   {"policy", std::string(RoutingPolicyName(RoutingPolicy::kLeastLoaded))},
                   {"seed", o.seed},
                   {"quick", o.quick},
                   {"vocab_size", serve_bench::kSimVocabSize}};
  t << "mlarun bench disagg: " << serve_bench::LoopbackMachineLine() << "\n";
  t << "layouts: mixed = " << o.groups << " mixed groups; disagg = " << r.prefill_groups << " prefill + "
    << r.decode_groups
    << " decode groups (each request prefilled on a prefill group, then moved to a decode group with its blocks); "
       "routing least_loaded\n";
  t << "groups: a step takes " << o.step_ms << " ms + decode rows / " << o.tokens_per_s << " tokens/s + prompt rows / "
    << o.prefill_tokens_per_s << " tokens/s, at most " << o.max_batched_tokens
    << " prompt rows per step; a moved request's blocks take rows x 1 KiB / " << o.transfer_gbps
    << " Gbit/s in its decode group's next step\n";
  t << "workloads: Poisson arrivals at " << o.rate << " requests/s for " << r.duration_s << " s, outputs "
    << r.output_min << "-" << r.output_max << " tokens; prefill-heavy: " << Fmt(100 * (1 - o.short_fraction), 0)
    << "% prompts of " << r.long_min << "-" << r.long_max << " tokens, the rest " << o.short_prompt_min << "-"
    << o.short_prompt_max << "; short: every prompt " << o.short_prompt_min << "-" << o.short_prompt_max << "; seed "
    << o.seed << "; the same requests for both layouts; " << r.rounds << " round(s), mixed then disagg in each\n";
}

}  // namespace

Status RunDisaggBench(const DisaggBenchOptions& o, std::ostream& out, std::ostream& t) {
  MLARUN_ASSIGN_OR_RETURN(const Resolved r, Resolve(o));
  Json doc;
  Describe(o, r, t, doc);
  std::vector<RunResult> runs;
  bool all_verified = true;
  for (const std::string workload : kWorkloads) {
    const std::vector<TimedRequest> work = serve_bench::MakePromptMixWorkload(Spec(o, r, workload));
    if (work.empty())
      return InvalidArgumentError("no request arrives within --duration-s ", r.duration_s, " at --rate ", o.rate,
                                  "; raise either");
    for (int round = 1; round <= r.rounds; ++round) {
      for (bool disagg : {false, true}) {
        MLARUN_ASSIGN_OR_RETURN(const RunResult run, RunOnce(o, r, workload, disagg, round, work));
        t << "  round " << round << ", " << workload << ", " << (disagg ? "disagg: " : "mixed:  ") << run.requests
          << " requests, TTFT p99 " << Fmt(run.ttft_p99_ms, 1) << " ms, ITL p99 " << Fmt(run.itl_p99_ms, 2) << " ms, "
          << Fmt(run.decode_tokens_per_s, 0) << " tok/s, " << run.migrated << " moves ("
          << static_cast<int64_t>(run.block_moves)
          << " with blocks); verified: " << (run.verified ? "yes" : "NO: " + run.first_error) << "\n";
        all_verified = all_verified && run.verified;
        runs.push_back(run);
      }
    }
  }
  t << "\nmedians over rounds" << (r.rounds > 1 ? " (min..max)" : "")
    << "; disagg/mixed: the same round's ratio; moves: requests moved to a decode group, block moves: those whose "
       "blocks it fetched\n";
  serve_bench::PrintPairHeader(Table(r.rounds), t);
  doc["rows"] = Json::array();
  doc["ratios"] = Json::array();
  for (const std::string workload : kWorkloads) Report(runs, workload, r.rounds, t, doc);
  doc["runs"] = Json::array();
  for (const RunResult& run : runs) doc["runs"].push_back(RunJson(run));
  doc["all_verified"] = all_verified;
  if (o.json) out << doc.dump(2) << std::endl;
  if (!all_verified) return InternalError("some requests failed verification (see the runs above)");
  return Status::Ok();
}

}  // namespace mlarun
