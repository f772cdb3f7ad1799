// What the open-loop benchmarks over simulated groups (`mlarun bench
// rebalance`, `mlarun bench disagg`) share: sending a timed workload to a
// coordinator at its arrival times whatever the earlier requests do, the
// figures of such a run, and the report of one setting against another over
// rounds (medians, spread, same-round ratios).
#pragma once

#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <functional>
#include <iosfwd>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "base/status.h"
#include "bench/sim_target.h"
#include "bench/workload.h"

namespace mlarun {
namespace serve_bench {

// ---- One run ------------------------------------------------------------------

// What the load of one run saw, before it is summarized.
struct OpenLoopLoad {
  std::vector<Outcome> outcomes;           // by request, in the workload's order
  std::vector<Clock::time_point> sent_at;  // when each was sent
  double max_late_ms = 0;                  // how late the latest request was sent
  size_t client_threads = 0;
  v1::GetStatsResponse before, after;  // GetStats before the first request and after the last ended
};

// Called with GetStats every sample period while a load runs, on a thread
// of its own.
using StatsSampler = std::function<void(const v1::GetStatsResponse&)>;

// Sends every request of `work` at its arrival time (from the call) as one
// streaming Generate (CallGenerate, its tokens checked against the
// simulated groups'), on one of 8 connections made before the clock
// starts, from a pool of client threads that grows whenever none is idle,
// so no request waits for another; returns once every one has ended. With
// `sample`, GetStats every `sample_period` meanwhile.
StatusOr<OpenLoopLoad> DriveOpenLoop(const std::string& address, const std::vector<TimedRequest>& work,
                                     const StatsSampler& sample = nullptr,
                                     std::chrono::milliseconds sample_period = std::chrono::milliseconds(25));

// The figures of one run: decode throughput (tokens generated / last
// completion - first arrival), inter-token latency and time to first token
// p50/p99 (client receive times), the coordinator's moves; verified when
// every request passed CallGenerate's checks and the coordinator (the
// load its only client) received and completed each once.
struct LoadFigures {
  int64_t requests = 0, failed = 0, tokens = 0;
  std::string first_error;
  bool verified = false;
  double decode_tokens_per_s = NAN, itl_p50_ms = NAN, itl_p99_ms = NAN, ttft_p50_ms = NAN, ttft_p99_ms = NAN;
  double span_s = NAN;  // first arrival to last completion
  int64_t migrated = 0, migrations_failed = 0, client_threads = 0;
  double max_dispatch_late_ms = 0;
};
LoadFigures SummarizeLoad(const OpenLoopLoad& load);
// Its fields in a run's JSON object (requests_migrated for `migrated`).
void AddFiguresJson(const LoadFigures& f, nlohmann::json& run);

// The machine in a report: the document's "machine" object, and the
// table's words for it.
nlohmann::json LoopbackMachineJson();
std::string LoopbackMachineLine();

// ---- One setting against another, over rounds ----------------------------------

// A metric's median over rounds with the smallest and largest value (NaN
// when no round has a finite one).
struct Spread {
  double median = NAN, min = NAN, max = NAN;
};
Spread SpreadOf(const std::vector<double>& values);
nlohmann::json ToJson(const Spread& s);
// "median" or, with `spread`, "median (min..max)".
std::string Cell(const Spread& s, int precision, bool spread);

struct PairMetric {
  const char* key;     // in the JSON rows
  const char* header;  // in the table
  int precision;
  bool ratio;  // reported as the same-round ratio too (those without come last)
};
// A run of one side in one round: its figures by metric, in the table's order.
struct PairRun {
  int round = 0;
  int side = 0;  // 0 or 1, as PairTable::sides
  int64_t requests = 0;
  bool verified = false;
  std::vector<double> values;
};
// How the table reads: `case_header` names the first column (a group count,
// a workload), `side_key` the second, whose values are `sides` and, on the
// ratio row (side 1 / side 0), `ratio`.
struct PairTable {
  std::string case_header;
  int case_width = 6;
  std::string side_key;
  std::array<std::string, 2> sides;
  std::string ratio;
  std::vector<PairMetric> metrics;
  int rounds = 1;
};
void PrintPairHeader(const PairTable& t, std::ostream& out);
// The rows of one case: per side the medians over rounds (with the spread
// over several), then the ratios; into the table on `out` and into the
// document's "rows" and "ratios" arrays, each object led by `fields` (the
// case, as {"groups": 4}).
void ReportPair(const PairTable& t, const std::string& case_label, const nlohmann::json& fields,
                const std::vector<PairRun>& runs, std::ostream& out, nlohmann::json& doc);

}  // namespace serve_bench
}  // namespace mlarun
