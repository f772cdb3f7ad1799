// Timing for `mlarun bench ...`: Google Benchmark runs the repetitions and
// reports the median; the benchmarks decide what to time and verify it first.
#pragma once

#include <functional>
#include <nlohmann/json_fwd.hpp>
#include <string>

#include "runtime/base/status.h"

namespace mlarun {

struct Timing {
  int repetitions = 3;
  double min_time_s = 0.3;
  // Run once untimed first (warm caches, fault in memory, size iterations).
  // Heavy runs skip it: one iteration per repetition, after the run that
  // verified them has already warmed everything.
  bool warm_up = true;
};

// Median per-iteration time of `fn`, in milliseconds, over t.repetitions
// repetitions of enough iterations to fill t.min_time_s (one when there is no
// warm-up run to size them). Call InitBenchmarkLibrary() once first.
StatusOr<double> TimeMs(const std::string& name, const std::function<Status()>& fn, const Timing& t);

// Initializes Google Benchmark without command-line flags (idempotent).
void InitBenchmarkLibrary();

// Runs `fn` untimed until its time per call has settled: the last `window`
// calls within `tolerance` (relative) of their median, after at least
// `min_calls` and at most `max_calls` calls (first calls fault in memory, fill
// caches and prepare products). Returns how many calls it discarded.
struct WarmUpPolicy {
  int min_calls = 3;
  int max_calls = 40;
  int window = 3;
  double tolerance = 0.05;
};
StatusOr<int> WarmUpUntilStable(const std::function<Status()>& fn, const WarmUpPolicy& p = {});

// The machine's streaming read bandwidth: `bytes` (0: 16 x the last-level
// cache, at least 1 GiB) of huge-page memory read by every OpenMP thread, each
// its own contiguous share, with the widest loads of the kernel family in
// force. Best of `repetitions` passes after one warm-up pass (what the memory
// can deliver; a decode step competes with nothing else either).
struct ReadBandwidth {
  double gb_per_s = 0;
  int64_t bytes = 0;
  int threads = 0;
};
StatusOr<ReadBandwidth> MeasureReadBandwidth(int64_t bytes = 0, int repetitions = 5);

// For the reports: the CPU's model name (/proc/cpuinfo), today's date
// (UTC, YYYY-MM-DD), and `v` with `prec` decimals ("-" when not finite).
std::string CpuModel();
// This process's CPU for a report's JSON: model, vendor, the usable flags,
// the kernel family in use and the best the CPU supports.
nlohmann::json CpuJson();
std::string Today();
std::string Fmt(double v, int prec = 2);

// `v` as a JSON number, or null when it is not finite (JSON has no NaN).
nlohmann::json OrNull(double v);

}  // namespace mlarun
