#include "gemm/cpu_gemm.h"

#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "base/cpu_isa.h"
#include "gemm/convert.h"
#include "gemm/cpu/kernels.h"

namespace mlarun {
namespace {

// Runs `desc` (prepared as `impl` asks) on random operands and compares it
// with a double loop: returns the largest error; columns between n and ldc
// must stay untouched.
double RunAgainstDouble(const GemmDesc& desc, std::mt19937& rng, GemmImpl impl = GemmImpl::kAuto,
                        std::string* impl_name = nullptr) {
  std::normal_distribution<float> d;
  const int64_t m = desc.m, n = desc.n, k = desc.k, lda = desc.lda, ldc = desc.ldc;
  const int64_t bsk = desc.b_stride_k, bsn = desc.b_stride_n;
  const DType t = desc.a_type;
  const size_t es = DTypeSize(t);
  std::vector<float> a(static_cast<size_t>(m * lda)), b(static_cast<size_t>(std::max(k * bsk + n * bsn, int64_t{1})));
  for (float& v : a) v = d(rng);
  for (float& v : b) v = d(rng);
  std::vector<std::byte> ac(a.size() * es), bc(b.size() * es);
  StoreFromF32(a.data(), ac.data(), t, static_cast<int64_t>(a.size()));
  StoreFromF32(b.data(), bc.data(), t, static_cast<int64_t>(b.size()));
  LoadToF32(ac.data(), t, a.data(), static_cast<int64_t>(a.size()));  // values as stored
  LoadToF32(bc.data(), t, b.data(), static_cast<int64_t>(b.size()));
  std::vector<float> c(static_cast<size_t>(m * ldc));
  for (float& v : c) v = d(rng);
  const std::vector<float> c0 = c;
  auto g = CpuGemm::Get(desc, impl);
  EXPECT_TRUE(g.ok()) << g.status();
  if (!g.ok()) return INFINITY;
  if (impl_name) *impl_name = (*g)->impl_name();
  std::vector<std::byte> scratch((*g)->scratch_bytes() + 64);
  const Status st = (*g)->Run(ac.data(), bc.data(), c.data(), scratch.data());
  EXPECT_TRUE(st.ok()) << st;
  if (!st.ok()) return INFINITY;
  double max_err = 0;
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double ref = desc.accumulate ? c0[static_cast<size_t>(i * ldc + j)] : 0.0;
      for (int64_t p = 0; p < k; ++p)
        ref += double{a[static_cast<size_t>(i * lda + p)]} * b[static_cast<size_t>(p * bsk + j * bsn)];
      max_err = std::max(max_err, std::abs(ref - c[static_cast<size_t>(i * ldc + j)]));
    }
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = n; j < ldc; ++j)
      if (c[static_cast<size_t>(i * ldc + j)] != c0[static_cast<size_t>(i * ldc + j)]) {
        ADD_FAILURE() << "column " << j << " of row " << i << " (beyond n) was written in " << desc;
        return INFINITY;
      }
  return max_err;
}

// C (=|+=) A x B with strided views against a double loop, for both dtypes,
// both B orientations, a bf16 result and accumulation.
TEST(CpuGemm, MatchesDoubleReference) {
  std::mt19937 rng(11);
  for (DType t : {DType::kF32, DType::kBF16}) {
    for (bool b_col_major : {false, true}) {
      for (bool accumulate : {false, true}) {
        const int64_t m = 37, n = 53, k = 71, lda = k + 3, ldc = n + 5;
        const int64_t bsk = b_col_major ? 1 : n + 2, bsn = b_col_major ? k + 4 : 1;
        const GemmDesc desc{.m = m,
                            .n = n,
                            .k = k,
                            .a_type = t,
                            .b_type = t,
                            .c_type = DType::kF32,
                            .lda = lda,
                            .b_stride_k = bsk,
                            .b_stride_n = bsn,
                            .ldc = ldc,
                            .accumulate = accumulate};
        EXPECT_LT(RunAgainstDouble(desc, rng), 1e-3) << desc;
      }
    }
  }
}

// MLARUN_ONEDNN=off: products that would go to oneDNN (many rows) run on ours
// and still match; asking for oneDNN by name is an error that says why.
TEST(CpuGemm, OneDnnTurnedOffRunsOurs) {
  struct Restore {
    bool was = OneDnnEnabled();
    ~Restore() { SetOneDnnEnabled(was); }
  } restore;
  SetOneDnnEnabled(false);
  std::mt19937 rng(12);
  for (DType t : {DType::kF32, DType::kBF16}) {
    const GemmDesc desc{.m = 96,
                        .n = 80,
                        .k = 64,
                        .a_type = t,
                        .b_type = t,
                        .c_type = DType::kF32,
                        .lda = 64,
                        .b_stride_k = 1,
                        .b_stride_n = 64,
                        .ldc = 80};
    std::string name;
    EXPECT_LT(RunAgainstDouble(desc, rng, GemmImpl::kAuto, &name), 1e-3) << desc;
    EXPECT_EQ(name.rfind("onednn", 0), std::string::npos) << name << " for " << desc;
    const auto forced = CpuGemm::Get(desc, GemmImpl::kOneDnn);
    ASSERT_FALSE(forced.ok());
    EXPECT_NE(forced.status().message().find("MLARUN_ONEDNN=off"), std::string::npos) << forced.status();
  }
}

// A oneDNN product keeps one set of argument memory objects per OpenMP
// thread; more callers at once than that make their own. Many threads
// running one product at once must each get their own result.
TEST(CpuGemm, OneDnnProductRunByManyThreadsAtOnce) {
  const GemmDesc desc{.m = 64,
                      .n = 48,
                      .k = 40,
                      .a_type = DType::kF32,
                      .b_type = DType::kF32,
                      .c_type = DType::kF32,
                      .lda = 40,
                      .b_stride_k = 1,
                      .b_stride_n = 40,
                      .ldc = 48};
  auto g = CpuGemm::Get(desc, GemmImpl::kOneDnn);
  if (!g.ok()) GTEST_SKIP() << "no oneDNN f32 product under this kernel family: " << g.status();
  const int callers = 3 * std::max(1, omp_get_max_threads()) + 1, rounds = 200;
  std::mt19937 rng(13);
  std::normal_distribution<float> d;
  std::vector<float> b(static_cast<size_t>(desc.n * desc.k));
  for (float& v : b) v = d(rng);
  std::vector<std::vector<float>> a(static_cast<size_t>(callers)), c(a.size()), want(a.size());
  for (size_t i = 0; i < a.size(); ++i) {
    a[i].resize(static_cast<size_t>(desc.m * desc.k));
    for (float& v : a[i]) v = d(rng);
    want[i].assign(static_cast<size_t>(desc.m * desc.n), 0.f);
    for (int64_t r = 0; r < desc.m; ++r)
      for (int64_t j = 0; j < desc.n; ++j) {
        double s = 0;
        for (int64_t p = 0; p < desc.k; ++p)
          s += double{a[i][static_cast<size_t>(r * desc.k + p)]} * b[static_cast<size_t>(j * desc.k + p)];
        want[i][static_cast<size_t>(r * desc.n + j)] = static_cast<float>(s);
      }
  }
  std::vector<double> err(a.size(), 0.0);
  std::vector<std::string> failed(a.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < a.size(); ++i)
    threads.emplace_back([&, i] {
      std::vector<std::byte> scratch((*g)->scratch_bytes() + 64);
      for (int r = 0; r < rounds; ++r) {
        c[i].assign(want[i].size(), NAN);
        const Status st = (*g)->Run(a[i].data(), b.data(), c[i].data(), scratch.data());
        if (!st.ok()) failed[i] = st.ToString();
        for (size_t j = 0; j < want[i].size(); ++j) err[i] = std::max(err[i], std::abs(double{c[i][j]} - want[i][j]));
      }
    });
  for (std::thread& t : threads) t.join();
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(failed[i], "") << "caller " << i;
    EXPECT_LT(err[i], 1e-3) << "caller " << i;  // NaN (a result never written) fails too
  }
}

// A product C [m, n] = A [m, k] x B of `t` operands (f8_e4m3: an f32 A) and an
// f32 C, A and C packed; B a weight [n, k] as stored (k contiguous), or with
// `fold` a [k, n] matrix (n contiguous: the attention's folds).
GemmDesc Product(DType t, int64_t m, int64_t n, int64_t k, bool fold = false) {
  return GemmDesc{.m = m,
                  .n = n,
                  .k = k,
                  .a_type = t == DType::kF8E4M3 ? DType::kF32 : t,
                  .b_type = t,
                  .c_type = DType::kF32,
                  .lda = k,
                  .b_stride_k = fold ? n : 1,
                  .b_stride_n = fold ? 1 : k,
                  .ldc = n};
}

// What kAuto chooses for one shape, one letter per kernel family (scalar,
// avx2, avx512, amx): S small (streaming), T tiles, O oneDNN, P packed; with
// the default settings, with the AVX512-BF16 dot products turned off, and
// with oneDNN turned off.
struct ChoiceRow {
  GemmDesc desc;
  const char* by_default;
  const char* no_bf16_dot;
  const char* no_onednn;
};

char ChoiceLetter(const GemmDesc& desc) {
  auto g = CpuGemm::Get(desc);
  if (!g.ok()) return '!';
  switch ((*g)->impl()) {
    case GemmImpl::kSmall:
      return 'S';
    case GemmImpl::kTiles:
      return 'T';
    case GemmImpl::kOneDnn:
      return 'O';
    case GemmImpl::kPacked:
      return 'P';
    case GemmImpl::kAuto:
      break;
  }
  return '?';
}

// The automatic choice, pinned per family and shape: the streaming kernels'
// row limits, the tile kernel's shapes, oneDNN only where its product is the
// faster one. Families are checked up to the process's own (a run under
// MLARUN_CPU_ISA caps oneDNN's code there too); avx512 and amx only on a CPU
// with AVX512-BF16, whose letters these are.
TEST(CpuGemm, AutoChoicePerFamilyAndShape) {
  const DType bf16 = DType::kBF16, f32 = DType::kF32, fp8 = DType::kF8E4M3;
  const ChoiceRow rows[] = {
      // bf16 weights [2048, 2048]: the streaming limits, tiles up to 256 rows.
      {Product(bf16, 1, 2048, 2048), "SSSS", "SSSS", "SSSS"},
      {Product(bf16, 6, 2048, 2048), "SSSS", "SSSS", "SSSS"},
      {Product(bf16, 7, 2048, 2048), "SSST", "SSST", "SSST"},
      {Product(bf16, 8, 2048, 2048), "SSST", "SSST", "SSST"},
      {Product(bf16, 9, 2048, 2048), "SSST", "SSOT", "SSST"},
      {Product(bf16, 16, 2048, 2048), "SSST", "SSOT", "SSST"},
      {Product(bf16, 17, 2048, 2048), "SSPT", "SSOT", "SSPT"},
      {Product(bf16, 20, 2048, 2048), "SSPT", "SSOT", "SSPT"},
      {Product(bf16, 21, 2048, 2048), "SPPT", "SPOT", "SPPT"},
      {Product(bf16, 32, 2048, 2048), "SPPT", "SPOT", "SPPT"},
      {Product(bf16, 33, 2048, 2048), "PPPT", "PPOT", "PPPT"},
      {Product(bf16, 64, 2048, 2048), "PPPT", "PPOT", "PPPT"},
      {Product(bf16, 65, 2048, 2048), "PPPT", "PPOT", "PPPT"},
      {Product(bf16, 256, 2048, 2048), "PPPT", "PPOT", "PPPT"},
      {Product(bf16, 257, 2048, 2048), "PPPO", "PPOO", "PPPP"},
      // A weight past 128 MB (an lm_head): tiles up to 64 rows only.
      {Product(bf16, 64, 102400, 2048), "PPPT", "PPOT", "PPPT"},
      {Product(bf16, 65, 102400, 2048), "PPPO", "PPOO", "PPPP"},
      // k past 8192: tiles up to 32 rows only.
      {Product(bf16, 6, 2048, 16384), "SSSS", "SSSS", "SSSS"},
      {Product(bf16, 16, 2048, 16384), "SSST", "SSOT", "SSST"},
      {Product(bf16, 17, 2048, 16384), "SSPT", "SSOT", "SSPT"},
      {Product(bf16, 32, 2048, 16384), "SPPT", "SPOT", "SPPT"},
      {Product(bf16, 33, 2048, 16384), "PPPO", "PPOO", "PPPP"},
      // Fewer than 128 columns (score tiles): no tiles.
      {Product(bf16, 16, 64, 512), "SSSS", "SSOS", "SSSS"},
      {Product(bf16, 17, 64, 512), "SSPO", "SSOO", "SSPP"},
      {Product(bf16, 64, 64, 512), "PPPO", "PPOO", "PPPP"},
      // B n-contiguous (the folds through W_UK^T and W_UV).
      {Product(bf16, 4, 512, 128, true), "SSSS", "SSSS", "SSSS"},
      {Product(bf16, 5, 512, 128, true), "SSSO", "SSSO", "SSSS"},
      {Product(bf16, 8, 512, 128, true), "SSSO", "SSSO", "SSSS"},
      {Product(bf16, 9, 512, 128, true), "SSSO", "SSOO", "SSSS"},
      {Product(bf16, 16, 512, 128, true), "SSSO", "SSOO", "SSSS"},
      {Product(bf16, 17, 512, 128, true), "SSPO", "SSOO", "SSPS"},
      {Product(bf16, 20, 512, 128, true), "SSPO", "SSOO", "SSPS"},
      {Product(bf16, 21, 512, 128, true), "SSPO", "SSOO", "SSPS"},
      {Product(bf16, 32, 512, 128, true), "SSPO", "SSOO", "SSPS"},
      {Product(bf16, 33, 512, 128, true), "PPPO", "PPOO", "PPPP"},
      {Product(bf16, 128, 512, 128, true), "PPPO", "PPOO", "PPPP"},
      // f32.
      {Product(f32, 8, 2048, 2048), "SSSS", "SSSS", "SSSS"},
      {Product(f32, 9, 2048, 2048), "SPSS", "SPSS", "SPSS"},
      {Product(f32, 16, 2048, 2048), "SPSS", "SPSS", "SPSS"},
      {Product(f32, 17, 2048, 2048), "PPSS", "PPSS", "PPSS"},
      {Product(f32, 32, 2048, 2048), "PPSS", "PPSS", "PPSS"},
      {Product(f32, 33, 2048, 2048), "PPPP", "PPPP", "PPPP"},
      {Product(f32, 128, 2048, 2048), "PPPP", "PPPP", "PPPP"},
      {Product(f32, 17, 512, 128, true), "PPSS", "PPSS", "PPSS"},
      {Product(f32, 128, 512, 128, true), "PPPP", "PPPP", "PPPP"},
      // f32 x f8_e4m3 weights: the bf16 dot products from 17 rows.
      {Product(fp8, 16, 2048, 2048), "SSSS", "SSSS", "SSSS"},
      {Product(fp8, 17, 2048, 2048), "SSPP", "SSSS", "SSPP"},
      {Product(fp8, 32, 2048, 2048), "SSPP", "SSSS", "SSPP"},
      {Product(fp8, 33, 2048, 2048), "PPPP", "PPPP", "PPPP"},
      {Product(fp8, 128, 2048, 2048), "PPPP", "PPPP", "PPPP"},
  };
  const CpuIsa limit = ActiveCpuIsa();
  struct Restore {
    bool onednn = OneDnnEnabled();
    bool dot = cpu::SetBf16DotAllowed(true);
    ~Restore() { SetOneDnnEnabled(onednn), cpu::SetBf16DotAllowed(dot); }
  } restore;
  for (int setting = 0; setting < 3; ++setting) {
    cpu::SetBf16DotAllowed(setting != 1);
    SetOneDnnEnabled(setting != 2);
    for (const ChoiceRow& row : rows) {
      const char* want = setting == 0 ? row.by_default : setting == 1 ? row.no_bf16_dot : row.no_onednn;
      std::string got = want, expected = want;
      for (CpuIsa isa : HostCpu().supported()) {
        if (isa > limit || (isa >= CpuIsa::kAvx512 && !HostCpu().avx512_bf16)) continue;
        ScopedCpuIsa scope(isa);
        ASSERT_TRUE(scope.status().ok()) << scope.status();
        got[static_cast<size_t>(isa)] = ChoiceLetter(row.desc);
      }
      EXPECT_EQ(got, expected) << row.desc << (setting == 1 ? " without the bf16 dot products" : "")
                               << (setting == 2 ? " without oneDNN" : "");
    }
  }
}

// A forced implementation runs where it can and otherwise says why.
TEST(CpuGemm, ForcedImplementationErrors) {
  const GemmDesc bf16 = Product(DType::kBF16, 128, 64, 40), f32 = Product(DType::kF32, 128, 64, 40);
  const std::string bf16_text = "gemm{m=128 n=64 k=40 types=bf16xbf16->f32 lda=40 b_strides=(1,40) ldc=64}";
  const std::string f32_text = "gemm{m=128 n=64 k=40 types=f32xf32->f32 lda=40 b_strides=(1,40) ldc=64}";
  const auto unknown = CpuGemm::Get(f32, static_cast<GemmImpl>(9));
  EXPECT_EQ(unknown.status(), InvalidArgumentError("unknown GemmImpl value 9"));
  {
    ScopedCpuIsa scalar(CpuIsa::kScalar);
    for (GemmImpl impl : {GemmImpl::kSmall, GemmImpl::kPacked}) {
      const auto g = CpuGemm::Get(bf16, impl);
      ASSERT_TRUE(g.ok()) << g.status();
      EXPECT_EQ((*g)->impl(), impl);
    }
    EXPECT_EQ(CpuGemm::Get(bf16, GemmImpl::kTiles).status(),
              InvalidArgumentError("the tile kernel needs the amx kernel family and bf16 A and B with B "
                                   "k-contiguous: " +
                                   bf16_text + " under scalar"));
    EXPECT_EQ(
        CpuGemm::Get(f32, GemmImpl::kOneDnn).status(),
        InternalError("oneDNN cannot prepare " + f32_text + ": not used for f32 products by the scalar kernel family"));
  }
  struct Restore {
    bool was = OneDnnEnabled();
    ~Restore() { SetOneDnnEnabled(was); }
  } restore;
  SetOneDnnEnabled(false);
  EXPECT_EQ(CpuGemm::Get(f32, GemmImpl::kOneDnn).status(),
            InternalError("oneDNN cannot prepare " + f32_text + ": oneDNN is turned off (MLARUN_ONEDNN=off)"));
}

// Where oneDNN may run a product but cannot build it, kAuto falls back to
// our packed kernel; asking for oneDNN by name is an error. Run under
// MLARUN_CPU_ISA=avx2 (or scalar) on a CPU with bf16 arithmetic: oneDNN's
// code is capped there and has no bf16 product, while our family can still
// be raised to the CPU's own.
TEST(CpuGemm, AutoFallsBackToPackedWhereOneDnnCannotBuild) {
  const CpuIsa best = HostCpu().best();
  if (ActiveCpuIsa() > CpuIsa::kAvx2 || best < CpuIsa::kAvx512 || !HostCpu().avx512_bf16)
    GTEST_SKIP() << "needs a run capped at avx2 or below on a CPU with AVX512-BF16";
  struct Restore {
    bool dot = cpu::SetBf16DotAllowed(false);
    ~Restore() { cpu::SetBf16DotAllowed(dot); }
  } restore;
  ScopedCpuIsa scope(best);
  ASSERT_TRUE(scope.status().ok()) << scope.status();
  const GemmDesc fold = Product(DType::kBF16, 128, 512, 128, true);  // oneDNN's under avx512 and amx
  const auto g = CpuGemm::Get(fold);
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ((*g)->impl(), GemmImpl::kPacked) << (*g)->impl_name();
  const auto forced = CpuGemm::Get(fold, GemmImpl::kOneDnn);
  EXPECT_EQ(forced.status().code(), StatusCode::kInternal) << forced.status();
  EXPECT_EQ(forced.status().message().rfind("oneDNN cannot prepare gemm{m=128 n=512 k=128 ", 0), 0u) << forced.status();
}

TEST(CpuGemm, RejectsBadDescriptions) {
  GemmDesc ok{.m = 4, .n = 4, .k = 4, .lda = 4, .b_stride_k = 4, .b_stride_n = 1, .ldc = 4};
  EXPECT_TRUE(CpuGemm::Get(ok).ok());
  GemmDesc bad = ok;
  bad.lda = 2;
  EXPECT_EQ(CpuGemm::Get(bad).status().code(), StatusCode::kInvalidArgument);
  bad = ok;
  bad.b_stride_n = 2;
  EXPECT_EQ(CpuGemm::Get(bad).status().code(), StatusCode::kInvalidArgument);
  bad = ok;
  bad.a_type = DType::kBF16;
  EXPECT_EQ(CpuGemm::Get(bad).status().code(), StatusCode::kInvalidArgument);
  bad = ok;
  bad.m = 0;
  EXPECT_EQ(CpuGemm::Get(bad).status().code(), StatusCode::kInvalidArgument);
}

// int8 / int4 B (a weight [n, k] with ld > k, group scales from row0 on, a
// short last group, offsets or a zero point) through each of our
// implementations at any row count, against float64 decoded here.
TEST(CpuGemm, IntWeightsOnEveryImplementationAnyRows) {
  const int64_t n = 37, k = 200, ld = 210, group = 64, groups = 4, row0 = 2, scale_ld = 5;
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  std::vector<uint8_t> b(static_cast<size_t>(n * ld));
  for (uint8_t& v : b) v = static_cast<uint8_t>(rng());
  std::vector<float> scale(static_cast<size_t>((row0 + n) * scale_ld)), offset(scale.size());
  for (size_t i = 0; i < scale.size(); ++i) scale[i] = 0.01f * u(rng), offset[i] = 0.1f * u(rng);
  for (DType dt : {DType::kInt8, DType::kInt4})
    for (bool offsets : {false, true}) {
      const int32_t zero = dt == DType::kInt4 ? 8 : 0;
      const GemmBScales sc{.scale = scale.data(),
                           .ld = scale_ld,
                           .row0 = row0,
                           .offset = offsets ? offset.data() : nullptr,
                           .zero = zero};
      auto w = [&](int64_t j, int64_t p) {  // B[p, j]
        const int64_t bytes = dt == DType::kInt4 ? ld / 2 : ld;
        const uint8_t v = b[static_cast<size_t>(j * bytes + (dt == DType::kInt4 ? p / 2 : p))];
        const double q = dt == DType::kInt4 ? (p % 2 ? v >> 4 : v & 15) : static_cast<int8_t>(v);
        const size_t i = static_cast<size_t>((row0 + j) * scale_ld + p / group);
        return offsets ? q * scale[i] + offset[i] : (q - zero) * scale[i];
      };
      for (GemmImpl impl : {GemmImpl::kSmall, GemmImpl::kPacked})
        for (int64_t m : {1, 2, 3, 5, 40}) {
          GemmDesc d = Product(DType::kF32, m, n, k);
          d.b_type = dt, d.b_stride_n = ld, d.b_group = group, d.accumulate = true;
          auto g = CpuGemm::Get(d, impl);
          ASSERT_TRUE(g.ok()) << g.status();
          std::vector<float> a(static_cast<size_t>(m * k)), c(static_cast<size_t>(m * n));
          for (float& v : a) v = u(rng);
          for (float& v : c) v = u(rng);
          std::vector<double> want(c.begin(), c.end());
          for (int64_t i = 0; i < m; ++i)
            for (int64_t j = 0; j < n; ++j)
              for (int64_t p = 0; p < k; ++p)
                want[static_cast<size_t>(i * n + j)] += a[static_cast<size_t>(i * k + p)] * w(j, p);
          std::vector<std::byte> scratch((*g)->scratch_bytes());
          ASSERT_TRUE((*g)->Run(a.data(), b.data(), c.data(), scratch.data(), &sc).ok());
          double err = 0;
          for (size_t i = 0; i < c.size(); ++i) err = std::max(err, std::abs(c[i] - want[i]));
          EXPECT_LT(err, 1e-4) << (*g)->impl_name() << " " << d << (offsets ? " offsets" : " zero");
          EXPECT_EQ((*g)->Run(a.data(), b.data(), c.data(), scratch.data()).code(), StatusCode::kInvalidArgument);
          GemmBScales narrow = sc;
          narrow.ld = groups - 1;
          EXPECT_EQ((*g)->Run(a.data(), b.data(), c.data(), scratch.data(), &narrow).code(),
                    StatusCode::kInvalidArgument);
        }
    }
}

// The int-dot kernels' product as int_dot.inc specifies it, in float64: A
// [m, k] rounded per block of 32 to codes of at most qmax (d = max|x| /
// qmax, in fp32 as the kernels compute it; qmax 0: A as it is) times B
// given by w(j, p); and each element's sum of |terms|, which bounds its
// rounding.
template <class W>
void RoundedProduct(const std::vector<float>& a, int64_t m, int64_t n, int64_t k, float qmax, W w,
                    std::vector<double>& want, std::vector<double>& bound) {
  want.assign(static_cast<size_t>(m * n), 0.0);
  bound.assign(want.size(), 0.0);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t p0 = 0; p0 < k; p0 += 32) {
      float amax = 0;
      for (int64_t p = p0; p < p0 + 32; ++p) amax = std::max(amax, std::abs(a[static_cast<size_t>(i * k + p)]));
      const float inv = qmax / amax, dq = amax / qmax;
      for (int64_t p = p0; p < p0 + 32; ++p) {
        const float xv = a[static_cast<size_t>(i * k + p)];
        const double x = qmax > 0 ? static_cast<double>(dq) * std::nearbyint(xv * inv) : xv;
        for (int64_t j = 0; j < n; ++j) {
          want[static_cast<size_t>(i * n + j)] += x * w(j, p);
          bound[static_cast<size_t>(i * n + j)] += std::abs(x * w(j, p));
        }
      }
    }
}

// The packed int-dot kernel (int4 B, A rounded to int8 per block of 32) at
// every row count modulo its tiles (3 rows under AVX2's byte products, 6
// under AVX512-VNNI's), panels of 16 and 32 columns with a short last one,
// groups of 32, 128 and per channel, against float64 of the rounded A; where
// the CPU has VNNI, both byte products run and must give the same C bit for
// bit (the same integer sums, scaled in the same order).
TEST(CpuGemm, PackedIntDotAnyRowsOnBothByteProducts) {
  const int64_t n = 70, k = 256;
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  std::vector<uint8_t> b(static_cast<size_t>(n * k / 2));
  for (uint8_t& v : b) v = static_cast<uint8_t>(rng());
  std::vector<float> scale(static_cast<size_t>(n * (k / 32))), offset(scale.size());
  for (size_t i = 0; i < scale.size(); ++i) scale[i] = 0.01f * u(rng), offset[i] = 0.1f * u(rng);
  const bool vnni = HostCpu().avx512_vnni && ActiveCpuIsa() >= CpuIsa::kAvx512;
  for (int64_t group : {int64_t{32}, int64_t{128}, k})
    for (bool offsets : {false, true}) {
      const int64_t scale_ld = k / group;
      const GemmBScales sc{
          .scale = scale.data(), .ld = scale_ld, .row0 = 0, .offset = offsets ? offset.data() : nullptr, .zero = 8};
      auto w = [&](int64_t j, int64_t p) {  // B[p, j]
        const uint8_t v = b[static_cast<size_t>(j * k / 2 + p / 2)];
        const double q = p % 2 ? v >> 4 : v & 15;
        const size_t i = static_cast<size_t>(j * scale_ld + p / group);
        return offsets ? q * scale[i] + offset[i] : (q - 8) * scale[i];
      };
      for (int64_t m : {1, 2, 3, 4, 5, 6, 7, 13, 40, 47}) {
        GemmDesc d = Product(DType::kF32, m, n, k);
        d.b_type = DType::kInt4, d.b_stride_n = k, d.b_group = group;
        std::vector<float> a(static_cast<size_t>(m * k));
        for (float& v : a) v = u(rng);
        std::vector<double> want, bound;
        RoundedProduct(a, m, n, k, 127.0f, w, want, bound);
        std::vector<std::vector<float>> results;
        for (bool allow : {false, true}) {
          if (allow && !vnni) break;
          const bool was = cpu::SetVnniAllowed(allow);
          auto g = CpuGemm::Get(d, GemmImpl::kPacked);
          ASSERT_TRUE(g.ok()) << g.status();
          const bool int_dot = (*g)->impl_name().find("int8a") != std::string::npos;
          EXPECT_EQ(int_dot, ActiveCpuIsa() != CpuIsa::kScalar) << (*g)->impl_name();
          std::vector<float> c(static_cast<size_t>(m * n), std::numeric_limits<float>::quiet_NaN());
          std::vector<std::byte> scratch((*g)->scratch_bytes());
          ASSERT_TRUE((*g)->Run(a.data(), b.data(), c.data(), scratch.data(), &sc).ok());
          cpu::SetVnniAllowed(was);
          int bad = 0;
          for (size_t i = 0; i < c.size() && int_dot; ++i)
            if (!(std::abs(c[i] - want[i]) <= 1e-5 * bound[i] + 1e-6) && ++bad <= 3)
              ADD_FAILURE() << (*g)->impl_name() << (allow ? " vnni " : " ") << d << " group " << group
                            << (offsets ? " offsets" : " zero") << ": C[" << i / n << "][" << i % n << "] = " << c[i]
                            << ", want " << want[i];
          results.push_back(std::move(c));
        }
        if (results.size() == 2) {
          EXPECT_EQ(0, std::memcmp(results[0].data(), results[1].data(), results[0].size() * sizeof(float)))
              << "VNNI and AVX2 byte products differ: " << d << " group " << group;
        }
      }
    }
}

// Many rows of an int8 B on the SIMD families take the packed kernel with A
// rounded to int16 per block of 32 (d = max|x| / 32767): vpmaddwd panels,
// or vpdpwssd ones on AVX512-VNNI, which must give the same C bit for bit;
// the scalar family, or MLARUN_INT_DOT=off, the fp32 panels with A as it
// is. Every row count modulo 4 and 6, a short last panel, groups of 32, 128
// and per channel, a zero point or offsets, B's bytes over all of
// -128..127: against float64 of the A each path specifies.
TEST(CpuGemm, PackedInt8WithInt16ActivationsAnyRows) {
  const int64_t n = 70, k = 256;
  std::mt19937 rng(13);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  std::vector<uint8_t> b(static_cast<size_t>(n * k));
  for (uint8_t& v : b) v = static_cast<uint8_t>(rng());
  std::vector<float> scale(static_cast<size_t>(n * (k / 32))), offset(scale.size());
  for (size_t i = 0; i < scale.size(); ++i) scale[i] = 0.01f * u(rng), offset[i] = 0.1f * u(rng);
  const bool simd = ActiveCpuIsa() >= CpuIsa::kAvx2;
  const bool vnni = cpu::UseVnni() && ActiveCpuIsa() >= CpuIsa::kAvx512;
  for (cpu::IntDotMode mode : {cpu::IntDotMode::kAuto, cpu::IntDotMode::kOff})
    for (int64_t group : {int64_t{32}, int64_t{128}, k})
      for (bool offsets : {false, true}) {
        const int64_t scale_ld = k / group;
        const GemmBScales sc{
            .scale = scale.data(), .ld = scale_ld, .row0 = 0, .offset = offsets ? offset.data() : nullptr, .zero = 3};
        auto w = [&](int64_t j, int64_t p) {  // B[p, j]
          const double q = static_cast<int8_t>(b[static_cast<size_t>(j * k + p)]);
          const size_t i = static_cast<size_t>(j * scale_ld + p / group);
          return offsets ? q * scale[i] + offset[i] : (q - 3) * scale[i];
        };
        for (int64_t m : {1, 2, 3, 4, 5, 6, 7, 9, 40, 47}) {
          GemmDesc d = Product(DType::kF32, m, n, k);
          d.b_type = DType::kInt8, d.b_stride_n = k, d.b_group = group;
          std::vector<float> a(static_cast<size_t>(m * k));
          for (float& v : a) v = u(rng);
          std::vector<std::vector<float>> results;
          for (bool allow : {false, true}) {
            if (allow && !vnni) break;
            const bool was_vnni = cpu::SetVnniAllowed(allow);
            const cpu::IntDotMode was = cpu::SetIntDotMode(mode);
            auto g = CpuGemm::Get(d, GemmImpl::kPacked);
            cpu::SetIntDotMode(was);
            ASSERT_TRUE(g.ok()) << g.status();
            const bool int16 = (*g)->impl_name().find("int16a") != std::string::npos;
            EXPECT_EQ(int16, simd && mode == cpu::IntDotMode::kAuto) << (*g)->impl_name();
            std::vector<double> want, bound;
            RoundedProduct(a, m, n, k, int16 ? 32767.0f : 0.0f, w, want, bound);
            std::vector<float> c(static_cast<size_t>(m * n), std::numeric_limits<float>::quiet_NaN());
            std::vector<std::byte> scratch((*g)->scratch_bytes());
            ASSERT_TRUE((*g)->Run(a.data(), b.data(), c.data(), scratch.data(), &sc).ok());
            cpu::SetVnniAllowed(was_vnni);
            int bad = 0;
            for (size_t i = 0; i < c.size(); ++i)
              if (!(std::abs(c[i] - want[i]) <= 1e-6 * bound[i] + 1e-6) && ++bad <= 3)
                ADD_FAILURE() << (*g)->impl_name() << (allow ? " vnni " : " ") << d << " group " << group
                              << (offsets ? " offsets" : " zero") << ": C[" << i / n << "][" << i % n << "] = " << c[i]
                              << ", want " << want[i];
            if (int16) results.push_back(std::move(c));
          }
          if (results.size() == 2) {
            EXPECT_EQ(0, std::memcmp(results[0].data(), results[1].data(), results[0].size() * sizeof(float)))
                << "vpdpwssd and vpmaddwd panels differ: " << d << " group " << group;
          }
        }
      }
}

TEST(CpuGemm, RejectsBadIntDescriptions) {
  GemmDesc ok = Product(DType::kF32, 4, 8, 64);
  ok.b_type = DType::kInt4, ok.b_group = 32;
  EXPECT_TRUE(CpuGemm::Get(ok).ok());
  GemmDesc bad = ok;
  bad.b_group = 0;
  EXPECT_EQ(CpuGemm::Get(bad).status().code(), StatusCode::kInvalidArgument);
  bad.b_group = 33;
  EXPECT_EQ(CpuGemm::Get(bad).status().code(), StatusCode::kInvalidArgument);
  bad = ok;
  bad.b_stride_n = 65;
  EXPECT_EQ(CpuGemm::Get(bad).status().code(), StatusCode::kInvalidArgument);
  bad = ok;
  bad.a_type = DType::kBF16;
  EXPECT_EQ(CpuGemm::Get(bad).status().code(), StatusCode::kInvalidArgument);
  bad = Product(DType::kF32, 4, 8, 64, /*fold=*/true);
  bad.b_type = DType::kInt8, bad.b_group = 32;
  EXPECT_EQ(CpuGemm::Get(bad).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(CpuGemm::Get(ok, GemmImpl::kOneDnn).status().code(), StatusCode::kInternal);
}

}  // namespace
}  // namespace mlarun
