// `mlarun bench disagg`: prefill and decode groups (disaggregation) against
// the same number of mixed groups, everything in this process over loopback
// (a Coordinator on 127.0.0.1:0 and RunSimWorker's simulated groups).
//
// The simulated groups model the costs that decide it: a step takes
// step_ms + decode rows / tokens_per_s + prefill rows / prefill_tokens_per_s,
// prompts are computed in chunks of at most max_batched_tokens per step
// beside the running requests' decode rows (so on a mixed group a long
// prompt slows every request decoding there), and a moved request's blocks
// take rows x 1 KiB / (transfer_gbps Gbit/s) in its new group's next step.
// Two layouts of `groups` groups: mixed (every group prefills and decodes)
// and disagg (groups / 2 prefill groups and the rest decode groups, as a
// prefill worker job and a decode worker job: the coordinator moves each
// request to a decode group after its first token, with its blocks).
//
// Two workloads, each deterministic in the seed and the same for both
// layouts: open-loop Poisson arrivals at `rate` requests/s (across all
// groups) for duration_s, outputs of output_min..output_max tokens
// (ignore_eos), random prompts: "prefill-heavy", short_fraction of them
// short (short_prompt_min..max tokens) and the rest long
// (long_prompt_min..max), and "short", every prompt short. Every request is
// one streaming Generate sent at its arrival time whether or not earlier
// ones have ended, verified (completed once, OK, with exactly the simulated
// group's tokens) before its numbers count.
//
// For every workload, `rounds` rounds of mixed then disagg (A B A B), each
// run on a fresh coordinator and groups. Per run: TTFT and inter-token
// latency p50/p99 (client receive times), decode throughput (tokens / last
// completion - first arrival), the coordinator's moves (requests_migrated)
// and the block moves (the decode groups' simulated fetches), with the
// prefill groups' migrated_out and the decode groups' migrated_in. The
// report gives the median over rounds with the spread (min..max) and the
// same-round ratio disagg / mixed.
//
// Blocks until done; every coordinator and simulated group it starts is
// stopped before it returns.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <optional>

#include "base/status.h"

namespace mlarun {

// Unset optional fields take their defaults, smaller with `quick`.
struct DisaggBenchOptions {
  int groups = 4;                          // in each layout; disagg: groups / 2 prefill, the rest decode
  std::optional<int> rounds;               // mixed/disagg pairs per workload; 3 (1 with quick)
  std::optional<double> duration_s;        // arrival window of one run; 20 s (1.5 s with quick)
  double rate = 8;                         // requests/s across the groups
  double prefill_tokens_per_s = 20000;     // per simulated group
  int64_t max_batched_tokens = 2048;       // prompt tokens per step at most
  double tokens_per_s = 2000;              // per simulated group: a decode row's cost
  double step_ms = 10;                     // per simulated step: its fixed cost
  double transfer_gbps = 25;               // simulated block moves
  double short_fraction = 0.3;             // of the prefill-heavy workload's prompts
  std::optional<int64_t> long_prompt_min;  // 1024 (512 with quick)
  std::optional<int64_t> long_prompt_max;  // 4096 (1024 with quick)
  int64_t short_prompt_min = 64;
  int64_t short_prompt_max = 256;
  std::optional<int64_t> output_min;  // 64 (16 with quick)
  std::optional<int64_t> output_max;  // 256 (32 with quick)
  uint64_t seed = 1;
  bool quick = false;  // small numbers (well under 30 s)
  bool json = false;   // one JSON document on `out`
};

// Runs the benchmark. The table goes to `table`; with o.json the JSON
// document goes to `out`. INVALID_ARGUMENT naming the option for bad
// options; INTERNAL (after printing what was measured) if any request
// failed verification; UNAVAILABLE if the groups never came up.
Status RunDisaggBench(const DisaggBenchOptions& o, std::ostream& out, std::ostream& table);

}  // namespace mlarun
