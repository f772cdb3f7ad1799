// `mlarun bench gemm`: bad options are refused by name; every implementation
// asked for is reported, run (checked against float64 inside the benchmark)
// and timed where this CPU can run it, or said not to run; the figures are
// consistent with the times (the times themselves are the machine's).
#include "bench/gemm_bench.h"

#include <gtest/gtest.h>

#include <cmath>
#include <nlohmann/json.hpp>
#include <sstream>

#include "base/cpu_isa.h"
#include "bench/timing.h"
#include "gemm/cpu/kernels.h"
#include "gemm/cpu_gemm.h"

namespace mlarun {
namespace {

TEST(GemmBench, RefusesBadOptionsNamingThem) {
  const struct {
    GemmBenchOptions o;
    const char* names;
  } cases[] = {
      {{.rows = {}}, "--rows"},
      {{.rows = {0}}, "--rows"},
      {{.rows = {4, 70000}}, "--rows"},
      {{.n = -1}, "--n"},
      {{.k = 0}, "--k"},
      {{.dtype = "fp16"}, "--dtype"},
      {{.layout = "columns"}, "--layout"},
      {{.impls = {"small", "fastest"}}, "--impl"},
      {{.impls = {}}, "--impl"},
      {{.repetitions = 0}, "--repetitions"},
      {{.rows = {65536}, .n = 1 << 20}, "--rows / --n"},
  };
  for (const auto& c : cases) {
    std::ostringstream out, err;
    const Status st = RunGemmBench(c.o, out, err);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << c.names << ": " << st;
    EXPECT_NE(st.message().find(c.names), std::string::npos) << st;
    EXPECT_EQ(out.str(), "");
  }
}

TEST(GemmBench, ReportsEveryImplementationRunOrNot) {
  for (const char* dtype : {"bf16", "f32"})
    for (const char* layout : {"weight", "rows"}) {
      GemmBenchOptions o{.rows = {1, 7},
                         .n = 80,
                         .k = 70,
                         .dtype = dtype,
                         .layout = layout,
                         .impls = {"small", "packed", "tiles", "onednn", "auto"},
                         .repetitions = 1,
                         .json = true};
      std::ostringstream out, err;
      const Status st = RunGemmBench(o, out, err);
      ASSERT_TRUE(st.ok()) << dtype << " " << layout << ": " << st;
      const nlohmann::json doc = nlohmann::json::parse(out.str());
      EXPECT_EQ(doc["n"], 80);
      EXPECT_EQ(doc["k"], 70);
      EXPECT_TRUE(doc["cpu"].contains("kernels"));
      ASSERT_EQ(doc["rows"].size(), 2u);
      for (const auto& row : doc["rows"]) {
        const int64_t m = row["m"];
        const bool weight = std::string(layout) == "weight";
        const DType t = std::string(dtype) == "bf16" ? DType::kBF16 : DType::kF32;
        const GemmDesc d{.m = m,
                         .n = 80,
                         .k = 70,
                         .a_type = t,
                         .b_type = t,
                         .c_type = DType::kF32,
                         .lda = 70,
                         .b_stride_k = weight ? 1 : 80,
                         .b_stride_n = weight ? 70 : 1,
                         .ldc = 80};
        auto chosen = CpuGemm::Get(d);
        ASSERT_TRUE(chosen.ok()) << chosen.status();
        EXPECT_EQ(row["auto"], (*chosen)->impl_name());
        ASSERT_EQ(row["results"].size(), 5u);
        std::string fastest;
        double best = INFINITY;
        for (size_t x = 0; x < 5; ++x) {
          const auto& r = row["results"][x];
          EXPECT_EQ(r["impl"], o.impls[x]);
          if (r.contains("unavailable")) {
            // Our own kernels run on every family; tiles only under AMX
            // with bf16 weights.
            EXPECT_NE(o.impls[x], "small") << r.dump();
            EXPECT_NE(o.impls[x], "packed") << r.dump();
            EXPECT_NE(o.impls[x], "auto") << r.dump();
            if (o.impls[x] == "tiles") {
              EXPECT_FALSE(ActiveCpuIsa() == CpuIsa::kAmx && t == DType::kBF16 && weight) << r.dump();
            }
            continue;
          }
          const double ms = r["ms"];
          ASSERT_TRUE(std::isfinite(ms) && ms > 0) << r.dump();
          EXPECT_NEAR(r["gflop_per_s"].get<double>(), 2.0 * m * 80 * 70 / (ms * 1e6),
                      1e-9 * r["gflop_per_s"].get<double>());
          EXPECT_NEAR(r["b_gb_per_s"].get<double>(), 80.0 * 70 * DTypeSize(t) / (ms * 1e6),
                      1e-9 * r["b_gb_per_s"].get<double>());
          EXPECT_LE(r["error_over_tolerance"].get<double>(), 1.0);
          if (ms < best) best = ms, fastest = o.impls[x];
        }
        EXPECT_EQ(row["fastest"], fastest);
      }
      EXPECT_NE(err.str().find("fastest"), std::string::npos) << err.str();  // the table, beside the JSON
      // The arithmetic peak of the family in force, in the table and the JSON.
      const auto& peak = doc["arithmetic_peak"];
      EXPECT_GT(peak["gflop_per_s"].get<double>(), 0) << doc.dump();
      EXPECT_TRUE(std::isfinite(peak["gflop_per_s"].get<double>())) << doc.dump();
      EXPECT_NE(err.str().find("arithmetic peak: "), std::string::npos) << err.str();
      EXPECT_NE(err.str().find(peak["instruction"].get<std::string>()), std::string::npos) << err.str();
    }
}

// Each family's peak loop counts the FLOP of its instruction: 12 chains of
// multiply-adds a step (16 in AVX-512's registers), 2 FLOP per fp32 lane
// (FMA), 4 per lane of vdpbf16ps (two products and two adds), which it runs
// exactly where UseBf16Dot; a family or instruction counted wrong would set
// every share of the peak off.
TEST(GemmBench, PeakLoopsCountTheirInstructionsFlop) {
  const struct {
    CpuIsa isa;
    int64_t lanes, chains;
  } families[] = {{CpuIsa::kScalar, 4, 12}, {CpuIsa::kAvx2, 8, 12}, {CpuIsa::kAvx512, 16, 16}, {CpuIsa::kAmx, 16, 16}};
  for (const auto& f : families) {
    const cpu::CpuKernels* k = cpu::KernelsFor(f.isa);
    if (k == nullptr) continue;  // this CPU cannot run the family
    ASSERT_NE(k->product_peak_loop, nullptr) << CpuIsaName(f.isa);
    EXPECT_EQ(k->product_peak_loop(1000, false), 1000 * f.chains * 2 * f.lanes) << CpuIsaName(f.isa);
    const int64_t per_lane = cpu::UseBf16Dot(*k) ? 4 : 2;
    EXPECT_EQ(k->product_peak_loop(1000, true), 1000 * f.chains * per_lane * f.lanes) << CpuIsaName(f.isa);
  }
  const ProductPeak bf16 = MeasureProductPeak(true, 0.01), f32 = MeasureProductPeak(false, 0.01);
  EXPECT_GT(bf16.gflop_per_s, 0);
  EXPECT_GT(f32.gflop_per_s, 0);
  EXPECT_GE(bf16.threads, 1);
  EXPECT_EQ(bf16.instruction == "vdpbf16ps zmm", cpu::UseBf16Dot(cpu::Kernels())) << bf16.instruction;
  EXPECT_NE(f32.instruction, "vdpbf16ps zmm");
}

}  // namespace
}  // namespace mlarun
