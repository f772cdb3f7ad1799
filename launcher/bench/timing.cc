#include "launcher/bench/timing.h"

#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <ctime>
#include <fstream>
#include <iomanip>
#include <nlohmann/json.hpp>
#include <sstream>

namespace mlarun {
namespace {

// Keeps the median (or the single run) per-iteration real time, in ms.
class MedianReporter : public benchmark::BenchmarkReporter {
 public:
  bool ReportContext(const Context&) override { return true; }
  void ReportRuns(const std::vector<Run>& runs) override {
    for (const Run& r : runs) {
      if (r.error_occurred) continue;
      const bool single = r.run_type == Run::RT_Iteration && r.repetitions <= 1;
      if (single || (r.run_type == Run::RT_Aggregate && r.aggregate_name == "median"))
        median_ms = r.GetAdjustedRealTime();  // in the benchmark's unit: ms
    }
  }
  double median_ms = NAN;
};

}  // namespace

void InitBenchmarkLibrary() {
  static bool done = [] {
    int argc = 1;
    char arg0[] = "mlarun";
    char* argv[] = {arg0, nullptr};
    benchmark::Initialize(&argc, argv);
    return true;
  }();
  (void)done;
}

StatusOr<double> TimeMs(const std::string& name, const std::function<Status()>& fn, const Timing& t) {
  int64_t iterations = 1;
  if (t.warm_up) {
    const auto t0 = std::chrono::steady_clock::now();
    MLARUN_RETURN_IF_ERROR(fn());
    const double first_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    iterations = std::clamp<int64_t>(static_cast<int64_t>(std::ceil(t.min_time_s / std::max(first_s, 1e-6))), 1, 100000);
  }
  Status err;
  auto* b = benchmark::RegisterBenchmark(name.c_str(), [&](benchmark::State& state) {
    for (auto _ : state) {
      Status s = fn();
      if (!s.ok()) {
        err = s;
        state.SkipWithError(s.ToString().c_str());
        break;
      }
    }
  });
  b->Iterations(iterations)->Repetitions(t.repetitions)->UseRealTime()->Unit(benchmark::kMillisecond);
  if (t.repetitions > 1) b->ReportAggregatesOnly(true);
  MedianReporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  benchmark::ClearRegisteredBenchmarks();
  MLARUN_RETURN_IF_ERROR(err);
  if (!std::isfinite(reporter.median_ms)) return InternalError("benchmark ", name, " produced no timing");
  return reporter.median_ms;
}

std::string CpuModel() {
  std::ifstream f("/proc/cpuinfo");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  return "unknown";
}

std::string Today() {
  const std::time_t now = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%d", std::gmtime(&now));
  return buf;
}

std::string Fmt(double v, int prec) {
  if (!std::isfinite(v)) return "-";
  std::ostringstream os;
  os << std::fixed << std::setprecision(prec) << v;
  return os.str();
}

nlohmann::json OrNull(double v) { return std::isfinite(v) ? nlohmann::json(v) : nlohmann::json(nullptr); }

}  // namespace mlarun
