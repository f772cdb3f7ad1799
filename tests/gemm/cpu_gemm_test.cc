#include "gemm/cpu_gemm.h"

#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "gemm/convert.h"

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

}  // namespace
}  // namespace mlarun
