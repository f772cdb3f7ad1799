// `mlarun bench rebalance`: the coordinator's rebalancing
// (CoordinatorOptions::rebalance_threshold) on a skewed workload, off
// against on, everything in this process over loopback (a Coordinator on
// 127.0.0.1:0 and RunSimWorker's simulated groups).
//
// The workload (serve_bench::MakeSkewedWorkload, deterministic in the seed):
// open-loop Poisson arrivals at `rate` requests/s per group for duration_s,
// each request long (long_tokens) with probability long_fraction, else short
// (short_tokens), random prompts of 16..256 ids, ignore_eos so each makes
// exactly max_tokens tokens. Every request is one streaming Generate call
// sent at its arrival time, whether or not earlier ones have ended. The
// simulated groups take step_ms + n / tokens_per_s per step of n tokens, so
// a group running more requests gives each of them its tokens more slowly.
//
// For every group count, `rounds` rounds of two runs with the same workload,
// rebalancing off then on (A B A B), each on a fresh coordinator and groups.
// Every request is verified (completed once, OK, with exactly the tokens the
// simulated group makes) before its numbers count. Per run: decode
// throughput (tokens generated / last completion - first arrival),
// inter-token latency and time to first token p50/p99 (client receive
// times), group balance (mean / max of the groups' requests in flight from
// GetStats every 25 ms, the mean of the samples where some group has one)
// and the coordinator's rebalance moves. The report gives the median over
// rounds with the spread (min..max) and the same-round ratio on / off.
//
// Blocks until done; every coordinator and simulated group it starts is
// stopped before it returns.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <optional>
#include <string>
#include <vector>

#include "base/status.h"

namespace mlarun {

// Unset optional fields take their defaults, smaller with `quick`.
struct RebalanceBenchOptions {
  std::vector<int> groups;              // simulated group counts; empty: 2, 4
  std::optional<int> rounds;            // off/on pairs per group count; 3 (1 with quick)
  std::optional<double> duration_s;     // arrival window of one run; 20 s (2 s with quick)
  std::optional<double> rate;           // requests/s per group; 8
  double long_fraction = 0.1;           // share of long requests, in [0, 1]
  std::optional<int64_t> short_tokens;  // 32 (16 with quick)
  std::optional<int64_t> long_tokens;   // 1024 (128 with quick)
  double tokens_per_s = 2000;           // per simulated group (the per-token part of a step)
  double step_ms = 10;                  // per simulated step (its fixed part)
  int64_t threshold = 2;                // rebalance_threshold when on
  std::string policy = "least_loaded";  // round_robin | least_loaded | prefix_affinity
  uint64_t seed = 1;
  bool quick = false;  // small numbers (well under 30 s)
  bool json = false;   // one JSON document on `out`
};

// Runs the benchmark. The table goes to `table`; with o.json the JSON
// document goes to `out`. INVALID_ARGUMENT naming the option for bad
// options; INTERNAL (after printing what was measured) if any request
// failed verification; UNAVAILABLE if the groups never came up.
Status RunRebalanceBench(const RebalanceBenchOptions& o, std::ostream& out, std::ostream& table);

}  // namespace mlarun
