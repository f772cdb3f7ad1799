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

// For the reports: the CPU's model name (/proc/cpuinfo), today's date
// (UTC, YYYY-MM-DD), and `v` with `prec` decimals ("-" when not finite).
std::string CpuModel();
std::string Today();
std::string Fmt(double v, int prec = 2);

// `v` as a JSON number, or null when it is not finite (JSON has no NaN).
nlohmann::json OrNull(double v);

}  // namespace mlarun
