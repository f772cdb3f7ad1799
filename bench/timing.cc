#include "bench/timing.h"

#include <benchmark/benchmark.h>
#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <ctime>
#include <fstream>
#include <iomanip>
#include <nlohmann/json.hpp>
#include <sstream>
#include <vector>

#include "base/cpu_isa.h"
#include "base/float8.h"
#include "base/large_buffer.h"
#include "gemm/cpu/kernels.h"
#include "gemm/cpu_gemm.h"
#include "runtime/ops/linear.h"

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
    iterations =
        std::clamp<int64_t>(static_cast<int64_t>(std::ceil(t.min_time_s / std::max(first_s, 1e-6))), 1, 100000);
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

double Median(std::vector<double> v) {
  if (v.empty()) return NAN;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

StatusOr<int> WarmUpUntilStable(const std::function<Status()>& fn, const WarmUpPolicy& p) {
  std::vector<double> times;
  for (int call = 0; call < p.max_calls; ++call) {
    const auto t0 = std::chrono::steady_clock::now();
    MLARUN_RETURN_IF_ERROR(fn());
    times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    if (static_cast<int>(times.size()) < std::max(p.min_calls, p.window)) continue;
    const auto [lo, hi] = std::minmax_element(times.end() - p.window, times.end());
    if (*hi - *lo <= p.tolerance * Median(std::vector<double>(times.end() - p.window, times.end()))) return call + 1;
  }
  return p.max_calls;
}

int64_t DefaultStreamBytes() {
  const long llc = sysconf(_SC_LEVEL3_CACHE_SIZE);
  return std::clamp<int64_t>(4 * static_cast<int64_t>(llc > 0 ? llc : 0), int64_t{1} << 30, int64_t{2} << 30);
}

StatusOr<std::unique_ptr<BandwidthProbe>> BandwidthProbe::Create(int64_t bytes) {
  if (bytes <= 0) bytes = DefaultStreamBytes();
  constexpr int64_t kCols = 2048;
  std::unique_ptr<BandwidthProbe> p(new BandwidthProbe());
  p->rows_ = std::max<int64_t>(1, bytes / (kCols * 2));
  p->bytes_ = p->rows_ * kCols * 2;
  p->buf_ = static_cast<std::byte*>(AllocateLarge(static_cast<size_t>(p->bytes_), false));
  if (p->buf_ == nullptr) return ResourceExhaustedError("bandwidth probe: cannot allocate ", p->bytes_, " bytes");
  // Small finite bf16 values: the product must not meet NaNs or denormals.
  auto* h = reinterpret_cast<bf16_t*>(p->buf_);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < p->bytes_ / 2; ++i) h[i] = static_cast<bf16_t>(0x3c00 + ((i * 2654435761u) >> 24 & 0xff));
  const GemmDesc d{.m = 1,
                   .n = p->rows_,
                   .k = kCols,
                   .a_type = DType::kBF16,
                   .b_type = DType::kBF16,
                   .c_type = DType::kF32,
                   .lda = kCols,
                   .b_stride_k = 1,
                   .b_stride_n = kCols,
                   .ldc = p->rows_};
  MLARUN_ASSIGN_OR_RETURN(p->product_, CpuGemm::Get(d));
  p->a_.assign(static_cast<size_t>(kCols), static_cast<bf16_t>(0x3c00));
  p->c_.resize(static_cast<size_t>(p->rows_));
  p->scratch_.resize(p->product_->scratch_bytes() + 64);
  p->threads_ = omp_get_max_threads();
  return p;
}

BandwidthProbe::~BandwidthProbe() { std::free(buf_); }

StatusOr<ReadBandwidth> BandwidthProbe::Pass() {
  const cpu::CpuKernels& k = cpu::Kernels();
  uint64_t sink = 0;
  auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(threads_) reduction(+ : sink)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t lines = bytes_ / 64, l0 = lines * t / nt, l1 = lines * (t + 1) / nt;
    sink += k.stream_read(buf_ + l0 * 64, static_cast<size_t>((l1 - l0) * 64));
  }
  ReadBandwidth out;
  out.plain_gb_per_s =
      static_cast<double>(bytes_) / std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() * 1e-9;
  t0 = std::chrono::steady_clock::now();
  MLARUN_RETURN_IF_ERROR(product_->Run(a_.data(), buf_, c_.data(), scratch_.data()));
  out.product_gb_per_s =
      static_cast<double>(bytes_) / std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() * 1e-9;
  benchmark::DoNotOptimize(sink);
  benchmark::DoNotOptimize(c_.data());
  return out;
}

namespace {
// The instruction product_peak_loop runs on family `k`.
const char* PeakInstruction(const cpu::CpuKernels& k, bool dot) {
  if (dot) return "vdpbf16ps zmm";
  if (k.isa == CpuIsa::kAvx512 || k.isa == CpuIsa::kAmx) return "vfmadd zmm";
  return k.isa == CpuIsa::kAvx2 ? "vfmadd ymm" : "mulps + addps xmm";
}
}  // namespace

ProductPeak MeasureProductPeak(bool bf16, double seconds) {
  const cpu::CpuKernels& k = cpu::Kernels();
  const bool dot = bf16 && cpu::UseBf16Dot(k);
  ProductPeak peak{.instruction = PeakInstruction(k, dot), .threads = omp_get_max_threads()};
  // Steps of one timed call, sized from a short one.
  auto t0 = std::chrono::steady_clock::now();
  k.product_peak_loop(int64_t{1} << 16, dot);
  const double probe = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const int64_t steps = std::max<int64_t>(1 << 16, static_cast<int64_t>(seconds / std::max(probe, 1e-9) * (1 << 16)));
  for (int pass = 0; pass < 3; ++pass) {
    double gflops = 0;
#pragma omp parallel reduction(+ : gflops)
    {
      const auto s0 = std::chrono::steady_clock::now();
      const int64_t flop = k.product_peak_loop(steps, dot);
      gflops += static_cast<double>(flop) /
                std::chrono::duration<double>(std::chrono::steady_clock::now() - s0).count() * 1e-9;
    }
    peak.gflop_per_s = std::max(peak.gflop_per_s, gflops);
  }
  return peak;
}

StatusOr<ReadBandwidth> BandwidthProbe::Best(int passes) {
  MLARUN_RETURN_IF_ERROR(Pass().status());
  ReadBandwidth best;
  for (int i = 0; i < passes; ++i) {
    MLARUN_ASSIGN_OR_RETURN(const ReadBandwidth b, Pass());
    best.plain_gb_per_s = std::max(best.plain_gb_per_s, b.plain_gb_per_s);
    best.product_gb_per_s = std::max(best.product_gb_per_s, b.product_gb_per_s);
  }
  return best;
}

namespace {

// A [n, k] int8 (symmetric) or int4 (with offsets) weight in groups of 128:
// hashed integers, scales 2^-9 .. 2^-6 (either sign), offsets of a few
// scales.
Linear RandomIntWeight(int64_t n, int64_t k, DType dtype, bool offsets) {
  Linear w = Linear::Owned(n, k, dtype, 128, offsets);
  if (w.mutable_data() == nullptr) return w;
  auto* d = reinterpret_cast<uint8_t*>(w.mutable_data());
  const int64_t row_bytes = DTypeBytes(dtype, w.ld);
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t c = 0; c < row_bytes; ++c)
      d[r * row_bytes + c] =
          static_cast<uint8_t>(((static_cast<uint64_t>(r * row_bytes + c) + 1) * 0x9e3779b97f4a7c15ull) >> 56);
    for (int64_t g = 0; g < w.scale_ld; ++g) {
      const int64_t i = r * w.scale_ld + g;
      w.mutable_scale()[i] = std::ldexp(i % 5 == 0 ? -1.0f : 1.0f, -9 + static_cast<int>(i % 4));
      if (offsets) w.mutable_offset()[i] = -static_cast<float>(i % 11) * w.mutable_scale()[i];
    }
  }
  return w;
}

// y (m rows of n) of `w` against float64 from Linear::At on a few columns.
// Where the mode lets the integer dot products take this weight
// (cpu::UseIntDot), x may be rounded per block of 32 to d = max|x| / 127
// steps: the bound then allows half a step of each block times |w|.
Status CheckIntColumns(const Linear& w, const std::vector<float>& x, const std::vector<float>& y, int64_t m) {
  const int64_t n = w.out, k = w.in;
  const bool rounded = cpu::UseIntDot(ActiveCpuIsa(), w.dtype, k, w.group);
  for (int64_t j = 0; j < n; j += n / 7 + 1)
    for (int64_t r = 0; r < m; ++r) {
      double want = 0, mag = 0, rounding = 0;
      for (int64_t c0 = 0; c0 < k; c0 += 32) {
        double amax = 0;
        for (int64_t c = c0; c < std::min(k, c0 + 32); ++c)
          amax = std::max(amax, std::abs(static_cast<double>(x[static_cast<size_t>(r * k + c)])));
        for (int64_t c = c0; c < std::min(k, c0 + 32); ++c) {
          const double wc = w.At(j, c), v = static_cast<double>(x[static_cast<size_t>(r * k + c)]) * wc;
          want += v, mag += std::abs(v);
          if (rounded) rounding += amax / 254 * std::abs(wc);
        }
      }
      const double got = y[static_cast<size_t>(r * n + j)];
      if (!(std::abs(got - want) <= 1e-4 * mag + rounding))
        return InternalError("weight streaming: the ", DTypeName(w.dtype), " product's y[", r, "][", j, "] is ", got,
                             ", float64 gives ", want, rounded ? " (A rounded to int8: within " : " (within ",
                             1e-4 * mag + rounding, ")");
    }
  return Status::Ok();
}

}  // namespace

StatusOr<WeightStreaming> MeasureWeightStreaming(int64_t k, int64_t bf16_bytes, const std::vector<int64_t>& rows,
                                                 const Timing& t) {
  WeightStreaming ws;
  ws.k = k;
  ws.n = std::max<int64_t>(1, bf16_bytes / (2 * k));
  const int64_t n = ws.n;
  Linear f8 = Linear::Owned(n, k, DType::kF8E4M3), b16 = Linear::Owned(n, k, DType::kBF16);
  if (f8.mutable_data() == nullptr || b16.mutable_data() == nullptr)
    return ResourceExhaustedError("weight streaming: cannot allocate a [", n, ", ", k, "] weight twice");
  ws.bf16_bytes = b16.bytes();
  ws.fp8_bytes = f8.bytes();
  // Codes of magnitude 2^-3 .. 2^4 with either sign (exponent fields 4 ..
  // 11), scales 2^-6 .. 2^-3: trained weights' range, no subnormals or NaN.
  auto* codes = reinterpret_cast<uint8_t*>(f8.mutable_data());
  float* scales = f8.mutable_scale();
  for (int64_t i = 0; i < Fp8Blocks(n) * f8.scale_ld; ++i) scales[i] = std::ldexp(1.0f, -6 + static_cast<int>(i % 4));
  auto* h = reinterpret_cast<bf16_t*>(b16.mutable_data());
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < n; ++r)
    for (int64_t c = 0; c < k; ++c) {
      const uint64_t z = (static_cast<uint64_t>(r * k + c) + 1) * 0x9e3779b97f4a7c15ull;
      const uint32_t bits = static_cast<uint32_t>(z >> 40);
      const uint8_t code = static_cast<uint8_t>((bits & 0x80u) | ((4u + (bits >> 8) % 8u) << 3) | (bits & 7u));
      codes[r * k + c] = code;
      h[r * k + c] = FloatToBf16(E4M3ToFloat(code) * scales[Fp8ScaleIndex(r, c, f8.scale_ld)]);
    }
  Linear i8 = RandomIntWeight(n, k, DType::kInt8, /*offsets=*/false);
  Linear i4 = RandomIntWeight(n, k, DType::kInt4, /*offsets=*/true);
  if (i8.mutable_data() == nullptr || i4.mutable_data() == nullptr)
    return ResourceExhaustedError("weight streaming: cannot allocate a [", n, ", ", k, "] int8 and int4 weight");
  ws.int8_bytes = i8.bytes();
  ws.int4_bytes = i4.bytes();
  const int64_t max_rows = rows.empty() ? 1 : *std::max_element(rows.begin(), rows.end());
  std::vector<float> x(static_cast<size_t>(max_rows * k)), y8(static_cast<size_t>(max_rows * n)),
      y16(static_cast<size_t>(max_rows * n)), yi(static_cast<size_t>(max_rows * n));
  for (size_t i = 0; i < x.size(); ++i) x[i] = 0.5f + static_cast<float>((i * 2654435761u) >> 28) / 16.f;
  for (int64_t m : rows) {
    if (m < 1) return InvalidArgumentError("weight streaming: rows must be positive, got ", m);
    WeightStreamRow row;
    row.rows = m;
    auto run = [&](const Linear& w, std::vector<float>& y) {
      return LinearRun({.w = &w, .x = x.data(), .rows = m, .ldx = k, .y = y.data(), .ldy = n});
    };
    // Verify: the same weights (bf16-rounded) and activations (bf16-rounded
    // for the bf16 product) give the same products within that rounding.
    MLARUN_RETURN_IF_ERROR(run(f8, y8));
    MLARUN_RETURN_IF_ERROR(run(b16, y16));
    double worst = 0, scale = 0;
    for (int64_t i = 0; i < m * n; ++i) {
      worst = std::max(worst, std::abs(static_cast<double>(y8[static_cast<size_t>(i)]) - y16[static_cast<size_t>(i)]));
      scale = std::max(scale, std::abs(static_cast<double>(y8[static_cast<size_t>(i)])));
    }
    if (!(worst <= 1e-2 * scale))
      return InternalError("weight streaming: the fp8 and bf16 products differ by ", worst, " (scale ", scale, ") at ",
                           m, " rows");
    MLARUN_RETURN_IF_ERROR(run(i8, yi));
    MLARUN_RETURN_IF_ERROR(CheckIntColumns(i8, x, yi, m));
    MLARUN_RETURN_IF_ERROR(run(i4, yi));
    MLARUN_RETURN_IF_ERROR(CheckIntColumns(i4, x, yi, m));
    for (DType dt : {DType::kBF16, DType::kF8E4M3, DType::kInt8, DType::kInt4}) {
      const GemmDesc d{.m = m,
                       .n = n,
                       .k = k,
                       .a_type = dt == DType::kBF16 ? DType::kBF16 : DType::kF32,
                       .b_type = dt,
                       .c_type = DType::kF32,
                       .lda = k,
                       .b_stride_k = 1,
                       .b_stride_n = k,
                       .ldc = n,
                       .b_group = IsIntWeight(dt) ? 128 : 0};
      MLARUN_ASSIGN_OR_RETURN(auto g, CpuGemm::Get(d));
      (dt == DType::kBF16   ? row.bf16_impl
       : dt == DType::kInt8 ? row.int8_impl
       : dt == DType::kInt4 ? row.int4_impl
                            : row.fp8_impl) = g->impl_name();
    }
    MLARUN_ASSIGN_OR_RETURN(row.bf16_ms, TimeMs(
                                             "weights_bf16", [&] { return run(b16, y16); }, t));
    MLARUN_ASSIGN_OR_RETURN(row.fp8_ms, TimeMs(
                                            "weights_fp8", [&] { return run(f8, y8); }, t));
    MLARUN_ASSIGN_OR_RETURN(row.int8_ms, TimeMs(
                                             "weights_int8", [&] { return run(i8, yi); }, t));
    MLARUN_ASSIGN_OR_RETURN(row.int4_ms, TimeMs(
                                             "weights_int4", [&] { return run(i4, yi); }, t));
    row.int8_gb_per_s = static_cast<double>(ws.int8_bytes) / (row.int8_ms * 1e-3) * 1e-9;
    row.int4_gb_per_s = static_cast<double>(ws.int4_bytes) / (row.int4_ms * 1e-3) * 1e-9;
    row.bf16_gb_per_s = static_cast<double>(ws.bf16_bytes) / (row.bf16_ms * 1e-3) * 1e-9;
    row.fp8_gb_per_s = static_cast<double>(ws.fp8_bytes) / (row.fp8_ms * 1e-3) * 1e-9;
    ws.rows.push_back(row);
  }
  return ws;
}

std::string CpuModel() {
  std::ifstream f("/proc/cpuinfo");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  return "unknown";
}

double LoadAverage() {
  std::ifstream f("/proc/loadavg");
  double v = NAN;
  f >> v;
  return v;
}

const char* IntDotModeName(cpu::IntDotMode m) {
  return m == cpu::IntDotMode::kOn ? "on" : m == cpu::IntDotMode::kOff ? "off" : "auto";
}

nlohmann::json CpuJson() {
  const CpuFeatures& f = HostCpu();
  return {{"model", f.model_name.empty() ? CpuModel() : f.model_name},
          {"vendor", f.vendor},
          {"flags", f.FlagList()},
          {"kernels", std::string(CpuIsaName(ActiveCpuIsa()))},
          {"best_kernels", std::string(CpuIsaName(f.best()))},
          {"stream_prefetch", cpu::StreamPrefetch()},
          {"int_dot", IntDotModeName(cpu::GetIntDotMode())},
          {"bf16_dot", cpu::UseBf16Dot(cpu::Kernels())},
          {"vnni", cpu::UseVnni()}};
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
