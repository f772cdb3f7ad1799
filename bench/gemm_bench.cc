#include "bench/gemm_bench.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <iomanip>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <ostream>
#include <sstream>

#include "base/cpu_isa.h"
#include "base/dtype.h"
#include "base/large_buffer.h"
#include "bench/timing.h"
#include "gemm/cpu_gemm.h"

namespace mlarun {
namespace {

StatusOr<GemmImpl> ParseImpl(const std::string& name) {
  for (GemmImpl i : {GemmImpl::kAuto, GemmImpl::kSmall, GemmImpl::kPacked, GemmImpl::kTiles, GemmImpl::kOneDnn}) {
    if (name == GemmImplName(i)) return i;
  }
  return InvalidArgumentError("--impl: unknown implementation '", name, "' (auto, small, packed, tiles, onednn)");
}

// A deterministic value in [-1, 1) per element index: a multiplicative hash,
// so the threads fill a 2 GiB weight in parallel without a shared generator.
float Pseudo(uint64_t i, uint64_t salt) {
  const uint64_t h = (i + salt) * 0x9e3779b97f4a7c15ull;
  return static_cast<float>((h >> 40) & 0xffff) / 32768.f - 1.f;
}

// One implementation at one row count: its time, or why it did not run.
struct Result {
  std::string impl;       // as asked (small, packed, ...)
  std::string impl_name;  // CpuGemm::impl_name
  std::string unavailable;
  double ms = NAN, gflop_per_s = NAN, b_gb_per_s = NAN, max_error = NAN;
};

// The product the options describe: C [m, n] (f32) = A [m, k] x B, B a
// weight [n, k] (k contiguous) or [k, n] (n contiguous), for every row count
// up to max_m.
struct GemmShape {
  DType t = DType::kBF16;
  int64_t es = 0, k = 0, n = 0, max_m = 0;
  bool weight = true;
  int64_t b_elems = 0, b_bytes = 0;
};

// Refuses bad options with InvalidArgument naming the option (gemm_bench.h);
// returns the implementations asked for, parsed.
StatusOr<std::vector<GemmImpl>> CheckOptions(const GemmBenchOptions& o) {
  if (o.rows.empty()) return InvalidArgumentError("--rows: give at least one row count");
  for (int64_t m : o.rows)
    if (m < 1 || m > 65536) return InvalidArgumentError("--rows: ", m, " is outside [1, 65536]");
  if (o.k < 1) return InvalidArgumentError("--k must be at least 1, got ", o.k);
  if (o.n < 0)
    return InvalidArgumentError("--n must be 0 (a weight of 4 x the last-level cache) or positive, got ", o.n);
  if (o.dtype != "bf16" && o.dtype != "f32") return InvalidArgumentError("--dtype: '", o.dtype, "' is not bf16 or f32");
  if (o.layout != "weight" && o.layout != "rows")
    return InvalidArgumentError("--layout: '", o.layout, "' is not weight (B [n, k]) or rows (B [k, n])");
  if (o.impls.empty()) return InvalidArgumentError("--impl: give at least one implementation");
  std::vector<GemmImpl> impls;
  for (const std::string& s : o.impls) {
    MLARUN_ASSIGN_OR_RETURN(const GemmImpl i, ParseImpl(s));
    impls.push_back(i);
  }
  if (o.repetitions < 1) return InvalidArgumentError("--repetitions must be at least 1, got ", o.repetitions);
  return impls;
}

// The shape of checked options; InvalidArgument when C would be over 4 GiB.
StatusOr<GemmShape> ResolveShape(const GemmBenchOptions& o) {
  GemmShape s;
  s.t = o.dtype == "bf16" ? DType::kBF16 : DType::kF32;
  s.es = static_cast<int64_t>(DTypeSize(s.t)), s.k = o.k;
  s.n = o.n > 0 ? o.n : std::max<int64_t>(1, DefaultStreamBytes() / (s.k * s.es));
  s.max_m = *std::max_element(o.rows.begin(), o.rows.end());
  if (s.max_m * s.n * 4 > (int64_t{4} << 30))
    return InvalidArgumentError("--rows / --n: C of ", s.max_m, " x ", s.n, " fp32 is over 4 GiB");
  s.weight = o.layout == "weight";
  s.b_elems = s.n * s.k, s.b_bytes = s.b_elems * s.es;
  return s;
}

using Buffer = std::unique_ptr<void, void (*)(void*)>;

// B, A and C, and the columns of C checked against float64.
struct Operands {
  Buffer b, a;
  std::vector<float> c;
  std::vector<int64_t> check_cols;
};

StatusOr<Operands> MakeOperands(const GemmShape& s) {
  const DType t = s.t;
  // B, A and C, filled with values in [-1, 1) (C poisoned with NaN before
  // every checked run, so a product that skips a column is caught).
  Operands ops{.b = Buffer(AllocateLarge(static_cast<size_t>(s.b_bytes), false), std::free),
               .a = Buffer(AllocateLarge(static_cast<size_t>(s.max_m * s.k * s.es), false), std::free)};
  if (ops.b == nullptr || ops.a == nullptr)
    return ResourceExhaustedError("bench gemm: cannot allocate B of ", s.b_bytes, " bytes");
  auto fill = [&](void* p, int64_t count, uint64_t salt) {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < count; ++i) {
      const float v = Pseudo(static_cast<uint64_t>(i), salt);
      if (t == DType::kBF16)
        static_cast<bf16_t*>(p)[i] = FloatToBf16(v);
      else
        static_cast<float*>(p)[i] = v;
    }
  };
  fill(ops.b.get(), s.b_elems, 1);
  fill(ops.a.get(), s.max_m * s.k, 2);
  ops.c.resize(static_cast<size_t>(s.max_m * s.n));
  // The columns checked against float64: 16 spread over n, the first and last among them.
  for (int i = 0; i < 16; ++i) ops.check_cols.push_back((s.n - 1) * i / 15);
  return ops;
}

// The worst error of rows [0, m) of C over the checked columns, against a
// float64 reference, in units of the tolerance (the kernel tests' fp32
// bound, 4x); infinite where C is not finite.
double ErrorOverTolerance(const GemmShape& s, const Operands& ops, int64_t m) {
  const DType t = s.t;
  const int64_t k = s.k, n = s.n;
  const Buffer &a = ops.a, &b = ops.b;
  auto elem = [&](const void* p, int64_t i) {
    return t == DType::kBF16 ? double{Bf16ToFloat(static_cast<const bf16_t*>(p)[i])}
                             : double{static_cast<const float*>(p)[i]};
  };
  double worst = 0;  // error over tolerance (the kernel tests' fp32 bound, 4x)
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j : ops.check_cols) {
      double ref = 0, mag = 0;
      for (int64_t p = 0; p < k; ++p) {
        const double prod = elem(a.get(), i * k + p) * elem(b.get(), s.weight ? j * k + p : p * n + j);
        ref += prod;
        mag += std::abs(prod);
      }
      const double got = ops.c[static_cast<size_t>(i * n + j)];
      const double tol = 4e-6 * mag * std::sqrt(static_cast<double>(k)) + 1e-6;
      worst = std::isfinite(got) ? std::max(worst, std::abs(got - ref) / tol) : INFINITY;
    }
  return worst;
}

// Implementation `impl` (asked for as `name`) at descriptor d: checked against
// the float64 reference, then timed. Unavailable here: a Result saying why.
StatusOr<Result> MeasureImpl(const GemmBenchOptions& o, const GemmShape& s, Operands& ops, const GemmDesc& d,
                             const std::string& name, GemmImpl impl) {
  const int64_t m = d.m, n = s.n, k = s.k;
  const Buffer &a = ops.a, &b = ops.b;
  std::vector<float>& c = ops.c;
  Result r{.impl = name};
  auto g = CpuGemm::Get(d, impl);
  if (!g.ok()) {
    r.unavailable = g.status().message();
    return r;
  }
  r.impl_name = (*g)->impl_name();
  std::vector<std::byte> scratch((*g)->scratch_bytes() + 64);
  void* sc = (*g)->scratch_bytes() == 0
                 ? nullptr
                 : reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(scratch.data()) + 63) & ~uintptr_t{63});
  auto run = [&] { return (*g)->Run(a.get(), b.get(), c.data(), sc); };
  std::fill(c.begin(), c.begin() + m * n, std::numeric_limits<float>::quiet_NaN());
  MLARUN_RETURN_IF_ERROR(run());
  const double worst = ErrorOverTolerance(s, ops, m);
  r.max_error = worst;
  if (!(worst <= 1))
    return InternalError("bench gemm: ", r.impl_name, " at ", m, " rows is off the float64 reference (error ", worst,
                         " x the tolerance); not timing a wrong product");
  MLARUN_ASSIGN_OR_RETURN(r.ms, TimeMs("gemm/" + name + "/" + std::to_string(m), run,
                                       Timing{.repetitions = o.repetitions, .min_time_s = 0.2}));
  r.gflop_per_s = 2.0 * static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k) / (r.ms * 1e6);
  r.b_gb_per_s = static_cast<double>(s.b_bytes) / (r.ms * 1e6);
  return r;
}

// One row count's results: a table row, and a row of the document.
void ReportRow(std::ostream& table, nlohmann::json& doc, const GemmDesc& d, const CpuGemm& chosen,
               const std::vector<Result>& results) {
  const int64_t m = d.m;
  const Result* fastest = nullptr;
  for (const Result& r : results)
    if (std::isfinite(r.ms) && (fastest == nullptr || r.ms < fastest->ms)) fastest = &r;
  table << "  " << std::setw(5) << m << " |";
  nlohmann::json row = {{"m", m}, {"auto", chosen.impl_name()}, {"small_rows_limit", GemmSmallRowsLimit(d)}};
  for (const Result& r : results) {
    std::string cell = "-";
    if (r.unavailable.empty()) cell = Fmt(r.gflop_per_s, 1) + " (" + Fmt(r.b_gb_per_s, 1) + ")";
    table << std::setw(18) << cell << " |";
    nlohmann::json j = {{"impl", r.impl}};
    if (r.unavailable.empty())
      j.update({{"impl_name", r.impl_name},
                {"ms", r.ms},
                {"gflop_per_s", r.gflop_per_s},
                {"b_gb_per_s", r.b_gb_per_s},
                {"error_over_tolerance", r.max_error}});
    else
      j["unavailable"] = r.unavailable;
    row["results"].push_back(j);
  }
  table << " " << std::left << std::setw(22) << chosen.impl_name() << std::right << " | "
        << (fastest ? fastest->impl_name : std::string("-")) << "\n";
  row["fastest"] = fastest ? nlohmann::json(fastest->impl) : nlohmann::json(nullptr);
  doc["rows"].push_back(row);
}

}  // namespace

Status RunGemmBench(const GemmBenchOptions& o, std::ostream& out, std::ostream& err) {
  MLARUN_ASSIGN_OR_RETURN(const std::vector<GemmImpl> impls, CheckOptions(o));
  MLARUN_ASSIGN_OR_RETURN(const GemmShape s, ResolveShape(o));
  MLARUN_ASSIGN_OR_RETURN(Operands ops, MakeOperands(s));

  InitBenchmarkLibrary();
  const int threads = std::max(1, omp_get_max_threads());
  const ProductPeak peak = MeasureProductPeak(s.t == DType::kBF16);
  nlohmann::json doc;
  std::ostringstream table;
  table << "mlarun bench gemm: C[m, " << s.n << "] (f32) = A[m, " << s.k << "] x B, " << o.dtype << ", B "
        << (s.weight ? "a weight [n, k] (k contiguous)" : "[k, n] (n contiguous)") << " of " << s.b_bytes / (1 << 20)
        << " MiB, " << threads << " threads, median of " << o.repetitions << "\n"
        << "  cpu: " << CpuSummary() << "\n"
        << "  arithmetic peak: " << Fmt(peak.gflop_per_s, 1) << " GFLOP/s (" << peak.instruction << ", " << peak.threads
        << " threads)\n"
        << "  GFLOP/s (B's GB/s); '-': the implementation does not run here\n"
        << "   rows |";
  for (const std::string& name : o.impls) table << std::setw(18) << name << " |";
  table << " auto takes             | fastest\n";
  for (int64_t m : o.rows) {
    const GemmDesc d{.m = m,
                     .n = s.n,
                     .k = s.k,
                     .a_type = s.t,
                     .b_type = s.t,
                     .c_type = DType::kF32,
                     .lda = s.k,
                     .b_stride_k = s.weight ? 1 : s.n,
                     .b_stride_n = s.weight ? s.k : 1,
                     .ldc = s.n};
    MLARUN_ASSIGN_OR_RETURN(const std::shared_ptr<const CpuGemm> chosen, CpuGemm::Get(d));
    std::vector<Result> results;
    for (size_t x = 0; x < impls.size(); ++x) {
      MLARUN_ASSIGN_OR_RETURN(Result r, MeasureImpl(o, s, ops, d, o.impls[x], impls[x]));
      results.push_back(r);
    }
    ReportRow(table, doc, d, *chosen, results);
  }
  (o.json ? err : out) << table.str();
  if (o.json) {
    doc["cpu"] = CpuJson();
    doc["date"] = Today();
    doc.update({{"n", s.n},
                {"k", s.k},
                {"dtype", o.dtype},
                {"layout", o.layout},
                {"b_bytes", s.b_bytes},
                {"threads", threads},
                {"repetitions", o.repetitions},
                {"arithmetic_peak", {{"gflop_per_s", peak.gflop_per_s}, {"instruction", peak.instruction}}}});
    out << doc.dump(2) << "\n";
  }
  return Status::Ok();
}

}  // namespace mlarun
