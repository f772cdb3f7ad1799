#include "base/dtype.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>

#include "gemm/convert.h"

namespace mlarun {
namespace {

// Nearest bf16 by brute force: compare the two neighbours in double; ties to even.
bf16_t NearestBf16(float f) {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  const bf16_t lo = static_cast<bf16_t>(u >> 16), hi = static_cast<bf16_t>(lo + 1);
  const double dl = std::abs(double{Bf16ToFloat(lo)} - f), dh = std::abs(double{Bf16ToFloat(hi)} - f);
  if (dl < dh) return lo;
  if (dh < dl) return hi;
  return (lo & 1) ? hi : lo;
}

TEST(DType, Bf16RoundsToNearestEven) {
  std::mt19937 rng(5);
  std::uniform_int_distribution<uint32_t> bits;
  std::vector<float> xs;
  for (int i = 0; i < 20000; ++i) {
    const float f = std::bit_cast<float>(bits(rng));
    if (std::isfinite(f) && std::abs(f) < 3e38f) xs.push_back(f);
  }
  std::vector<bf16_t> bulk(xs.size());
  ConvertF32ToBf16(xs.data(), bulk.data(), static_cast<int64_t>(xs.size()));
  for (size_t i = 0; i < xs.size(); ++i) {
    ASSERT_EQ(FloatToBf16(xs[i]), NearestBf16(xs[i])) << xs[i];
    ASSERT_EQ(bulk[i], FloatToBf16(xs[i])) << xs[i];
  }
}

TEST(DType, SpecialValues) {
  EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(std::numeric_limits<float>::quiet_NaN()))));
  const float nan = std::numeric_limits<float>::quiet_NaN();
  bf16_t b;
  ConvertF32ToBf16(&nan, &b, 1);
  EXPECT_TRUE(std::isnan(Bf16ToFloat(b)));
  EXPECT_EQ(Bf16ToFloat(FloatToBf16(INFINITY)), INFINITY);
  EXPECT_EQ(Bf16ToFloat(FloatToBf16(1.0f)), 1.0f);
}

TEST(DType, Names) {
  EXPECT_EQ(*ParseDType("bf16"), DType::kBF16);
  EXPECT_EQ(*ParseDType("fp32"), DType::kF32);
  EXPECT_EQ(DTypeSize(DType::kBF16), 2u);
  const Status st = ParseDType("f64").status();
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("f64"), std::string::npos);
  EXPECT_FALSE(IsValidDType(static_cast<DType>(77)));
}

}  // namespace
}  // namespace mlarun
