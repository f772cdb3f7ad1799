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

}  // namespace

Status RunGemmBench(const GemmBenchOptions& o, std::ostream& out, std::ostream& err) {
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

  const DType t = o.dtype == "bf16" ? DType::kBF16 : DType::kF32;
  const int64_t es = static_cast<int64_t>(DTypeSize(t)), k = o.k;
  const int64_t n = o.n > 0 ? o.n : std::max<int64_t>(1, DefaultStreamBytes() / (k * es));
  const int64_t max_m = *std::max_element(o.rows.begin(), o.rows.end());
  if (max_m * n * 4 > (int64_t{4} << 30))
    return InvalidArgumentError("--rows / --n: C of ", max_m, " x ", n, " fp32 is over 4 GiB");
  const bool weight = o.layout == "weight";
  const int64_t b_elems = n * k, b_bytes = b_elems * es;

  // B, A and C, filled with values in [-1, 1) (C poisoned with NaN before
  // every checked run, so a product that skips a column is caught).
  using Buffer = std::unique_ptr<void, void (*)(void*)>;
  const Buffer b(AllocateLarge(static_cast<size_t>(b_bytes), false), std::free);
  const Buffer a(AllocateLarge(static_cast<size_t>(max_m * k * es), false), std::free);
  if (b == nullptr || a == nullptr)
    return ResourceExhaustedError("bench gemm: cannot allocate B of ", b_bytes, " bytes");
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
  fill(b.get(), b_elems, 1);
  fill(a.get(), max_m * k, 2);
  std::vector<float> c(static_cast<size_t>(max_m * n));
  auto elem = [&](const void* p, int64_t i) {
    return t == DType::kBF16 ? double{Bf16ToFloat(static_cast<const bf16_t*>(p)[i])}
                             : double{static_cast<const float*>(p)[i]};
  };
  // The columns checked against float64: 16 spread over n, the first and last among them.
  std::vector<int64_t> check_cols;
  for (int s = 0; s < 16; ++s) check_cols.push_back((n - 1) * s / 15);

  InitBenchmarkLibrary();
  const int threads = std::max(1, omp_get_max_threads());
  nlohmann::json doc;
  std::ostringstream table;
  table << "mlarun bench gemm: C[m, " << n << "] (f32) = A[m, " << k << "] x B, " << o.dtype << ", B "
        << (weight ? "a weight [n, k] (k contiguous)" : "[k, n] (n contiguous)") << " of " << b_bytes / (1 << 20)
        << " MiB, " << threads << " threads, median of " << o.repetitions << "\n"
        << "  cpu: " << CpuSummary() << "\n"
        << "  GFLOP/s (B's GB/s); '-': the implementation does not run here\n"
        << "   rows |";
  for (const std::string& s : o.impls) table << std::setw(18) << s << " |";
  table << " auto takes             | fastest\n";
  for (int64_t m : o.rows) {
    const GemmDesc d{.m = m,
                     .n = n,
                     .k = k,
                     .a_type = t,
                     .b_type = t,
                     .c_type = DType::kF32,
                     .lda = k,
                     .b_stride_k = weight ? 1 : n,
                     .b_stride_n = weight ? k : 1,
                     .ldc = n};
    MLARUN_ASSIGN_OR_RETURN(const std::shared_ptr<const CpuGemm> chosen, CpuGemm::Get(d));
    std::vector<Result> results;
    for (size_t x = 0; x < impls.size(); ++x) {
      Result r{.impl = o.impls[x]};
      auto g = CpuGemm::Get(d, impls[x]);
      if (!g.ok()) {
        r.unavailable = g.status().message();
        results.push_back(r);
        continue;
      }
      r.impl_name = (*g)->impl_name();
      std::vector<std::byte> scratch((*g)->scratch_bytes() + 64);
      void* sc = (*g)->scratch_bytes() == 0
                     ? nullptr
                     : reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(scratch.data()) + 63) & ~uintptr_t{63});
      auto run = [&] { return (*g)->Run(a.get(), b.get(), c.data(), sc); };
      std::fill(c.begin(), c.begin() + m * n, std::numeric_limits<float>::quiet_NaN());
      MLARUN_RETURN_IF_ERROR(run());
      double worst = 0;  // error over tolerance (the kernel tests' fp32 bound, 4x)
      for (int64_t i = 0; i < m; ++i)
        for (int64_t j : check_cols) {
          double ref = 0, mag = 0;
          for (int64_t p = 0; p < k; ++p) {
            const double prod = elem(a.get(), i * k + p) * elem(b.get(), weight ? j * k + p : p * n + j);
            ref += prod;
            mag += std::abs(prod);
          }
          const double got = c[static_cast<size_t>(i * n + j)];
          const double tol = 4e-6 * mag * std::sqrt(static_cast<double>(k)) + 1e-6;
          worst = std::isfinite(got) ? std::max(worst, std::abs(got - ref) / tol) : INFINITY;
        }
      r.max_error = worst;
      if (!(worst <= 1))
        return InternalError("bench gemm: ", r.impl_name, " at ", m, " rows is off the float64 reference (error ",
                             worst, " x the tolerance); not timing a wrong product");
      MLARUN_ASSIGN_OR_RETURN(r.ms, TimeMs("gemm/" + o.impls[x] + "/" + std::to_string(m), run,
                                           Timing{.repetitions = o.repetitions, .min_time_s = 0.2}));
      r.gflop_per_s = 2.0 * static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k) / (r.ms * 1e6);
      r.b_gb_per_s = static_cast<double>(b_bytes) / (r.ms * 1e6);
      results.push_back(r);
    }
    const Result* fastest = nullptr;
    for (const Result& r : results)
      if (std::isfinite(r.ms) && (fastest == nullptr || r.ms < fastest->ms)) fastest = &r;
    table << "  " << std::setw(5) << m << " |";
    nlohmann::json row = {{"m", m}, {"auto", chosen->impl_name()}, {"small_rows_limit", GemmSmallRowsLimit(d)}};
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
    table << " " << std::left << std::setw(22) << chosen->impl_name() << std::right << " | "
          << (fastest ? fastest->impl_name : std::string("-")) << "\n";
    row["fastest"] = fastest ? nlohmann::json(fastest->impl) : nlohmann::json(nullptr);
    doc["rows"].push_back(row);
  }
  (o.json ? err : out) << table.str();
  if (o.json) {
    doc["cpu"] = CpuJson();
    doc["date"] = Today();
    doc.update({{"n", n},
                {"k", k},
                {"dtype", o.dtype},
                {"layout", o.layout},
                {"b_bytes", b_bytes},
                {"threads", threads},
                {"repetitions", o.repetitions}});
    out << doc.dump(2) << "\n";
  }
  return Status::Ok();
}

}  // namespace mlarun
