#include "runtime/base/cpu_gemm.h"

#include <gtest/gtest.h>

#include <random>

namespace mlarun {
namespace {

// C (=|+=) A x B with strided views against a double loop, for both dtypes,
// both B orientations, a bf16 result and accumulation.
TEST(CpuGemm, MatchesDoubleReference) {
  std::mt19937 rng(11);
  std::normal_distribution<float> d;
  for (DType t : {DType::kF32, DType::kBF16}) {
    for (bool b_col_major : {false, true}) {
      for (bool accumulate : {false, true}) {
        const int64_t m = 37, n = 53, k = 71, lda = k + 3, ldc = n + 5;
        const int64_t bsk = b_col_major ? 1 : n + 2, bsn = b_col_major ? k + 4 : 1;
        GemmDesc desc{.m = m, .n = n, .k = k, .a_type = t, .b_type = t, .c_type = DType::kF32, .lda = lda,
                      .b_stride_k = bsk, .b_stride_n = bsn, .ldc = ldc, .accumulate = accumulate};
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
        std::vector<float> c0 = c;
        auto g = CpuGemm::Get(desc);
        ASSERT_TRUE(g.ok()) << g.status();
        std::vector<std::byte> scratch((*g)->scratch_bytes() + 64);
        ASSERT_TRUE((*g)->Run(ac.data(), bc.data(), c.data(), scratch.data()).ok());
        double max_err = 0;
        for (int64_t i = 0; i < m; ++i)
          for (int64_t j = 0; j < n; ++j) {
            double ref = accumulate ? c0[static_cast<size_t>(i * ldc + j)] : 0.0;
            for (int64_t p = 0; p < k; ++p)
              ref += double{a[static_cast<size_t>(i * lda + p)]} * b[static_cast<size_t>(p * bsk + j * bsn)];
            max_err = std::max(max_err, std::abs(ref - c[static_cast<size_t>(i * ldc + j)]));
          }
        EXPECT_LT(max_err, 1e-3) << desc;
        // Columns between n and ldc are untouched.
        for (int64_t i = 0; i < m; ++i)
          for (int64_t j = n; j < ldc; ++j)
            ASSERT_EQ(c[static_cast<size_t>(i * ldc + j)], c0[static_cast<size_t>(i * ldc + j)]);
      }
    }
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
