// `mlarun bench rebalance` (rebalance_bench.h says what is measured).
//
// Threads: the calling thread sends each request at its arrival time to a
// pool of client threads that grows whenever none is idle, so no request
// waits for a thread (open loop); each client thread runs one streaming
// Generate at a time with a blocking stub, on one of kConnections
// connections. A sampler thread polls GetStats. The coordinator runs on
// gRPC's callback threads and the simulated groups on RunSimWorker's.
#include "bench/rebalance_bench.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <deque>
#include <functional>
#include <iomanip>
#include <latch>
#include <mutex>
#include <nlohmann/json.hpp>
#include <ostream>
#include <thread>

#include "bench/sim_target.h"
#include "bench/timing.h"
#include "bench/workload.h"
#include "serving/client/grpc_util.h"

namespace mlarun {

namespace {

using Json = nlohmann::json;
using serve_bench::CallGenerate;
using serve_bench::Clock;
using serve_bench::GetStats;
using serve_bench::InProcessTarget;
using serve_bench::MsSince;
using serve_bench::Outcome;
using serve_bench::Percentile;
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
constexpr int kConnections = 8;
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

// ---- Open-loop clients -----------------------------------------------------------

// Runs each job on an idle thread, or on a new one when none is idle, so a
// job never waits for another to end. The destructor joins every thread
// once the jobs handed to it have run.
class ClientPool {
 public:
  ClientPool() = default;
  ClientPool(const ClientPool&) = delete;
  ClientPool& operator=(const ClientPool&) = delete;
  ~ClientPool() {
    {
      std::lock_guard lock(mu_);
      closed_ = true;
    }
    cv_.notify_all();
    for (std::thread& t : threads_) t.join();
  }

  void Run(std::function<void()> job) {
    std::lock_guard lock(mu_);
    // Each queued job will be taken by one idle thread: the idle threads not
    // yet claimed are idle_ - jobs_.size().
    const bool spawn = idle_ <= jobs_.size();
    jobs_.push_back(std::move(job));
    if (spawn) {
      threads_.emplace_back([this] { Loop(); });
    } else {
      cv_.notify_one();
    }
  }
  size_t threads() const { return threads_.size(); }  // from the thread that calls Run

 private:
  void Loop() {
    std::unique_lock lock(mu_);
    while (true) {
      ++idle_;
      cv_.wait(lock, [this] { return !jobs_.empty() || closed_; });
      --idle_;
      if (jobs_.empty()) return;  // closed
      std::function<void()> job = std::move(jobs_.front());
      jobs_.pop_front();
      lock.unlock();
      job();
      lock.lock();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> jobs_;
  size_t idle_ = 0;
  bool closed_ = false;
  std::vector<std::thread> threads_;  // touched by Run's caller and the destructor only
};

// ---- One run ----------------------------------------------------------------------

// What one run (a group count, rebalancing off or on, a round) measured.
struct RunResult {
  int groups = 0, round = 0;
  bool rebalance = false;
  int64_t requests = 0, failed = 0, tokens = 0;
  std::string first_error;
  bool verified = false;
  // The figures the report summarizes over rounds (kMetrics).
  double decode_tokens_per_s = NAN, itl_p50_ms = NAN, itl_p99_ms = NAN, ttft_p50_ms = NAN, ttft_p99_ms = NAN,
         balance = NAN, moves = 0;
  int64_t balance_samples = 0, migrated = 0, migrations_failed = 0, client_threads = 0;
  double span_s = NAN;              // first arrival to last completion
  double max_dispatch_late_ms = 0;  // how late the latest request was sent
};

// What the load itself saw, before it is summarized.
struct Load {
  std::vector<Outcome> outcomes;
  std::vector<Clock::time_point> sent_at;
  std::vector<double> balance;  // one per sample with a request in flight
  double max_late_ms = 0;
  size_t client_threads = 0;
  v1::GetStatsResponse before, after;
};

double SampleBalance(const v1::GetStatsResponse& s) {
  std::vector<int64_t> in_flight;
  for (const v1::GroupStats& g : s.groups())
    if (g.connected()) in_flight.push_back(g.requests_in_flight());
  return serve_bench::GroupBalance(in_flight);
}

// Sends every request of `work` at its arrival time and waits for them all,
// sampling the groups' balance meanwhile.
StatusOr<Load> DriveLoad(const std::string& address, const std::vector<TimedRequest>& work) {
  const size_t n = work.size();
  std::vector<std::unique_ptr<v1::Mlarun::Stub>> stubs;
  for (int c = 0; c < kConnections; ++c) {
    auto channel = client_internal::MakeChannel(address);
    // Connect before the clock starts, so no request pays the handshake.
    if (!client_internal::AwaitConnection(*channel, 10))
      return UnavailableError("cannot connect to the coordinator at ", address);
    stubs.push_back(v1::Mlarun::NewStub(channel));
  }
  auto control = v1::Mlarun::NewStub(client_internal::MakeChannel(address));
  Load load;
  MLARUN_ASSIGN_OR_RETURN(load.before, GetStats(*control));
  load.outcomes.resize(n);
  load.sent_at.resize(n);
  std::atomic<bool> sampling{true};
  std::thread sampler([&] {
    while (sampling.load()) {
      auto s = GetStats(*control);
      if (s.ok()) {
        const double b = SampleBalance(*s);
        if (std::isfinite(b)) load.balance.push_back(b);
      }
      std::this_thread::sleep_for(kSamplePeriod);
    }
  });
  std::latch done(static_cast<std::ptrdiff_t>(n));
  {
    ClientPool pool;
    const Clock::time_point t0 = Clock::now();
    for (size_t i = 0; i < n; ++i) {
      const Clock::time_point due =
          t0 + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(work[i].arrival_s));
      std::this_thread::sleep_until(due);
      load.max_late_ms = std::max(load.max_late_ms, MsSince(due, Clock::now()));
      pool.Run([&, i, stub = stubs[i % stubs.size()].get()] {
        load.sent_at[i] = Clock::now();
        load.outcomes[i] = CallGenerate(*stub, work[i].request, {.sim_tokens = true});
        done.count_down();
      });
    }
    load.client_threads = pool.threads();
    done.wait();
  }
  sampling = false;
  sampler.join();
  MLARUN_ASSIGN_OR_RETURN(load.after, GetStats(*control));
  return load;
}

// The figures of one run from what its load saw.
RunResult Summarize(const Load& load, int groups, bool rebalance, int round) {
  RunResult r{.groups = groups, .round = round, .rebalance = rebalance};
  r.requests = static_cast<int64_t>(load.outcomes.size());
  std::vector<double> itl, ttft;
  Clock::time_point first = Clock::time_point::max(), last = Clock::time_point::min();
  for (size_t i = 0; i < load.outcomes.size(); ++i) {
    const Outcome& o = load.outcomes[i];
    first = std::min(first, load.sent_at[i]);
    if (!o.ok) {
      ++r.failed;
      if (r.first_error.empty()) r.first_error = o.error;
      continue;
    }
    r.tokens += o.tokens;
    ttft.push_back(o.ttft_ms);
    itl.insert(itl.end(), o.gaps_ms.begin(), o.gaps_ms.end());
    last = std::max(last, o.finished_at);
  }
  const v1::CoordinatorStats &c0 = load.before.coordinator(), &c1 = load.after.coordinator();
  const int64_t received = c1.requests_received() - c0.requests_received();
  const int64_t completed = c1.requests_completed() - c0.requests_completed();
  // Exactly once: every request verified on the client, and the coordinator
  // (this benchmark its only client) received and completed each once.
  r.verified = r.failed == 0 && received == r.requests && completed == r.requests;
  if (!r.verified && r.first_error.empty())
    r.first_error = internal::StrCat("the coordinator counted ", received, " received and ", completed,
                                     " completed for ", r.requests, " requests");
  if (r.failed < r.requests) {
    r.span_s = std::chrono::duration<double>(last - first).count();
    r.decode_tokens_per_s = static_cast<double>(r.tokens) / r.span_s;
  }
  r.itl_p50_ms = Percentile(itl, 50);
  r.itl_p99_ms = Percentile(itl, 99);
  r.ttft_p50_ms = Percentile(ttft, 50);
  r.ttft_p99_ms = Percentile(ttft, 99);
  r.balance = serve_bench::MeanOfFinite(load.balance);
  r.balance_samples = static_cast<int64_t>(load.balance.size());
  r.moves = static_cast<double>(c1.rebalance_moves() - c0.rebalance_moves());
  r.migrated = c1.requests_migrated() - c0.requests_migrated();
  r.migrations_failed = c1.migrations_failed() - c0.migrations_failed();
  r.client_threads = static_cast<int64_t>(load.client_threads);
  r.max_dispatch_late_ms = load.max_late_ms;
  return r;
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
  auto load = DriveLoad(target->address(), work);
  target->Stop();
  if (!load.ok()) return load.status();
  return Summarize(*load, groups, rebalance, round);
}

// ---- The report -------------------------------------------------------------------

// The figures summarized over rounds: median, spread and (where `ratio`)
// the same-round ratio on / off.
struct Metric {
  const char* key;
  const char* header;
  int precision;
  double RunResult::*field;
  bool ratio;
};
// Those without a ratio come last (the ratio row leaves them out).
constexpr Metric kMetrics[] = {
    {"decode_tokens_per_s", "decode tok/s", 0, &RunResult::decode_tokens_per_s, true},
    {"itl_p50_ms", "ITL p50 ms", 2, &RunResult::itl_p50_ms, true},
    {"itl_p99_ms", "ITL p99 ms", 2, &RunResult::itl_p99_ms, true},
    {"ttft_p50_ms", "TTFT p50 ms", 2, &RunResult::ttft_p50_ms, true},
    {"ttft_p99_ms", "TTFT p99 ms", 2, &RunResult::ttft_p99_ms, true},
    {"balance", "balance", 3, &RunResult::balance, true},
    {"rebalance_moves", "moves", 0, &RunResult::moves, false},
};

struct Spread {
  double median = NAN, min = NAN, max = NAN;
};
Spread SpreadOf(const std::vector<double>& v) {
  std::vector<double> finite;
  for (double x : v)
    if (std::isfinite(x)) finite.push_back(x);
  if (finite.empty()) return {};
  const auto [lo, hi] = std::minmax_element(finite.begin(), finite.end());
  return {.median = Median(finite), .min = *lo, .max = *hi};
}
Json ToJson(const Spread& s) { return {{"median", OrNull(s.median)}, {"min", OrNull(s.min)}, {"max", OrNull(s.max)}}; }

// "median" or, over several rounds, "median (min..max)".
std::string Cell(const Spread& s, int precision, bool spread) {
  if (!spread || !std::isfinite(s.median)) return Fmt(s.median, precision);
  return Fmt(s.median, precision) + " (" + Fmt(s.min, precision) + ".." + Fmt(s.max, precision) + ")";
}

Json RunJson(const RunResult& r) {
  Json j = {{"groups", r.groups},
            {"rebalance", r.rebalance ? "on" : "off"},
            {"round", r.round},
            {"requests", r.requests},
            {"failed", r.failed},
            {"verified", r.verified},
            {"first_error", r.first_error.empty() ? Json(nullptr) : Json(r.first_error)},
            {"tokens", r.tokens},
            {"span_s", OrNull(r.span_s)},
            {"balance_samples", r.balance_samples},
            {"requests_migrated", r.migrated},
            {"migrations_failed", r.migrations_failed},
            {"client_threads", r.client_threads},
            {"max_dispatch_late_ms", r.max_dispatch_late_ms}};
  for (const Metric& m : kMetrics) j[m.key] = OrNull(r.*m.field);
  j["rebalance_moves"] = static_cast<int64_t>(r.moves);
  return j;
}

// The rows of one group count (both modes, then the ratio) into the table
// and the document.
void Report(const std::vector<RunResult>& runs, int groups, int rounds, std::ostream& t, Json& doc) {
  const bool spread = rounds > 1;
  const int w = spread ? 24 : 12;
  for (bool on : {false, true}) {
    Json row = {{"groups", groups}, {"rebalance", on ? "on" : "off"}, {"rounds", rounds}};
    int64_t requests = 0;
    bool verified = true;
    for (const RunResult& r : runs)
      if (r.groups == groups && r.rebalance == on) requests = r.requests, verified = verified && r.verified;
    row["requests"] = requests;
    row["verified"] = verified;
    t << "  " << std::setw(6) << groups << "  " << std::left << std::setw(9) << (on ? "on" : "off") << std::right
      << "  " << std::setw(8) << requests;
    for (const Metric& m : kMetrics) {
      std::vector<double> v;
      for (const RunResult& r : runs)
        if (r.groups == groups && r.rebalance == on) v.push_back(r.*m.field);
      const Spread s = SpreadOf(v);
      row[m.key] = ToJson(s);
      t << "  " << std::setw(w) << Cell(s, m.precision, spread);
    }
    t << "  " << (verified ? "yes" : "NO") << "\n";
    doc["rows"].push_back(row);
  }
  Json ratio = {{"groups", groups}, {"rounds", rounds}};
  t << "  " << std::setw(6) << groups << "  " << std::left << std::setw(9) << "on/off" << std::right << "  "
    << std::setw(8) << "";
  for (const Metric& m : kMetrics) {
    if (!m.ratio) continue;  // the last columns (moves): off makes none
    std::vector<double> v;
    for (const RunResult& on : runs) {
      if (on.groups != groups || !on.rebalance) continue;
      for (const RunResult& off : runs)
        if (off.groups == groups && !off.rebalance && off.round == on.round) v.push_back(on.*m.field / off.*m.field);
    }
    const Spread s = SpreadOf(v);
    ratio[m.key] = ToJson(s);
    t << "  " << std::setw(w) << Cell(s, 3, spread);
  }
  t << "\n";
  doc["ratios"].push_back(ratio);
}

void PrintHeader(std::ostream& t, int rounds) {
  const int w = rounds > 1 ? 24 : 12;
  t << "  groups  rebalance  requests";
  for (const Metric& m : kMetrics) t << "  " << std::setw(w) << m.header;
  t << "  verified\n";
}

// The document's leading fields and the table's first lines.
void Describe(const RebalanceBenchOptions& o, const Resolved& r, std::ostream& t, Json& doc) {
  const CoordinatorOptions defaults;
  doc["benchmark"] = "rebalance";
  doc["date"] = Today();
  doc["machine"] = {{"cpu", CpuModel()},
                    {"cores", std::thread::hardware_concurrency()},
                    {"network", "loopback (127.0.0.1)"},
                    {"load_average_1min_at_start", OrNull(LoadAverage())}};
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
  t << "mlarun bench rebalance: in-process coordinator and simulated groups, over loopback (127.0.0.1); " << CpuModel()
    << ", " << std::thread::hardware_concurrency() << " cores shared by clients, coordinator and groups; load average "
    << Fmt(LoadAverage(), 1) << " at start; " << Today() << "\n";
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
  PrintHeader(t, r.rounds);
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
