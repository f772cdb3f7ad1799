// Timing for `mlarun bench ...`: Google Benchmark runs the repetitions and
// reports the median; the benchmarks decide what to time and verify it first.
#pragma once

#include <algorithm>
#include <functional>
#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

#include "base/dtype.h"
#include "base/status.h"
#include "gemm/cpu_gemm.h"

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

// The median of `v` (the mean of the middle two for an even count); NaN when
// empty.
double Median(std::vector<double> v);

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

// The machine's streaming read bandwidth, two ways over one buffer of
// `bytes` (0: 4 x the last-level cache, at least 1 GiB, at most 2 GiB) of
// huge-page memory, every OpenMP thread reading its own contiguous share: a
// plain read loop with the widest loads of the kernel family in force, and
// the product a decode step streams its weights with (one row times a bf16
// matrix of rows of 2048). The product's rows are read one after the other,
// which the hardware prefetchers follow at least as well as the plain loop:
// where it reads faster, that is what memory delivers to a decode step.
//
// A shared host's memory bandwidth can change by half from one minute to the
// next (docs/performance.md), so a benchmark measures a pass right next to
// each timed step and takes ratios pair by pair.
struct ReadBandwidth {
  double plain_gb_per_s = 0;
  double product_gb_per_s = 0;
  double bound_gb_per_s() const { return std::max(plain_gb_per_s, product_gb_per_s); }
};
// The default buffer of a streaming measurement: 4 x the last-level cache,
// at least 1 GiB, at most 2 GiB (BandwidthProbe, bench gemm's weight).
int64_t DefaultStreamBytes();
class BandwidthProbe {
 public:
  static StatusOr<std::unique_ptr<BandwidthProbe>> Create(int64_t bytes = 0);
  ~BandwidthProbe();
  // One pass of each way (blocks; uses all OpenMP threads).
  StatusOr<ReadBandwidth> Pass();
  // The best of `passes` passes each, after one warm-up pass.
  StatusOr<ReadBandwidth> Best(int passes = 3);
  int64_t bytes() const { return bytes_; }
  int threads() const { return threads_; }

 private:
  BandwidthProbe() = default;
  std::byte* buf_ = nullptr;
  int64_t bytes_ = 0, rows_ = 0;
  int threads_ = 0;
  std::shared_ptr<const CpuGemm> product_;
  std::vector<bf16_t> a_;
  std::vector<float> c_;
  std::vector<std::byte> scratch_;
};

// The arithmetic peak of the kernel family in force: every OpenMP thread runs
// independent multiply-adds of the family's widest product instruction on
// registers (vdpbf16ps for a bf16 product where the family's products use
// it, else the fp32 FMA; kernels.h, product_peak_loop) for about
// `seconds`; the best of three passes. A product's GFLOP/s over this is the
// share of the instruction's peak it reaches, whatever kernel computes it.
struct ProductPeak {
  double gflop_per_s = 0;
  std::string instruction;  // "vdpbf16ps zmm", "vfmadd ymm", ...
  int threads = 0;
};
ProductPeak MeasureProductPeak(bool bf16, double seconds = 0.1);

// Weight streaming by dtype: one [n, k] weight of `bf16_bytes` as bf16 and
// the same values as f8_e4m3 with 128 x 128 block scales (the bf16 weight is
// the fp8 one dequantized and rounded), each multiplied with `rows` fp32 rows
// through LinearRun on all OpenMP threads, the two results checked against
// each other first. GB/s: the weight's bytes (fp8: e4m3 + scales) over the
// median time; few rows are bound by reading them, so fp8 should approach
// twice bf16's rows per second. Beside them, a weight of the same shape as
// int8 (symmetric) and as int4 (with offsets), both in groups of 128 along
// k, random integers and scales, each checked on some of its columns
// against float64 first; their bytes are the packed integers, the scales
// and the offsets.
struct WeightStreamRow {
  int64_t rows = 0;
  double bf16_ms = 0, fp8_ms = 0, int8_ms = 0, int4_ms = 0;
  double bf16_gb_per_s = 0, fp8_gb_per_s = 0, int8_gb_per_s = 0, int4_gb_per_s = 0;
  std::string bf16_impl, fp8_impl, int8_impl, int4_impl;  // CpuGemm::impl_name of each product
};
struct WeightStreaming {
  int64_t n = 0, k = 0, bf16_bytes = 0, fp8_bytes = 0, int8_bytes = 0, int4_bytes = 0;
  std::vector<WeightStreamRow> rows;
};
StatusOr<WeightStreaming> MeasureWeightStreaming(int64_t k, int64_t bf16_bytes, const std::vector<int64_t>& rows,
                                                 const Timing& t);

// For the reports: the CPU's model name (/proc/cpuinfo), today's date
// (UTC, YYYY-MM-DD), and `v` with `prec` decimals ("-" when not finite).
std::string CpuModel();
// The 1-minute load average (/proc/loadavg; NaN where there is none): other
// work on the machine shares its cores with what a benchmark measures, so a
// report says how busy it was.
double LoadAverage();
// This process's CPU for a report's JSON: model, vendor, the usable flags,
// the kernel family in use and the best the CPU supports.
nlohmann::json CpuJson();
std::string Today();
std::string Fmt(double v, int prec = 2);

// `v` as a JSON number, or null when it is not finite (JSON has no NaN).
nlohmann::json OrNull(double v);

}  // namespace mlarun
