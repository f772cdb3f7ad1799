// The e4m3 decodings of base/float8.h (the host-and-device functions
// the CPU and CUDA kernels use) against an independent float64 decoding of
// all 256 codes, and the block-scale index math.
#include "base/float8.h"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>

namespace mlarun {
namespace {

// e4m3fn from its definition (OCP FP8, "E4M3"): bias 7, subnormals at
// exponent 0, no infinities, S.1111.111 NaN. Written from the spec, sharing
// nothing with float8.h.
double ReferenceE4M3(int code) {
  const int s = (code >> 7) & 1, e = (code >> 3) & 15, m = code & 7;
  if (e == 15 && m == 7) return std::nan("");
  const double mag = e == 0 ? std::ldexp(m / 8.0, -6) : std::ldexp(1.0 + m / 8.0, e - 7);
  return s ? -mag : mag;
}

// binary16 from its definition, likewise independent of the code under test.
double ReferenceHalf(uint16_t h) {
  const int s = h >> 15, e = (h >> 10) & 31, m = h & 1023;
  if (e == 31) return m ? std::nan("") : (s ? -INFINITY : INFINITY);
  const double mag = e == 0 ? std::ldexp(m / 1024.0, -14) : std::ldexp(1.0 + m / 1024.0, e - 15);
  return s ? -mag : mag;
}

bool IsNanCode(int code) { return (code & 0x7f) == 0x7f; }

TEST(Float8, AllCodesExact) {
  int finite = 0;
  for (int code = 0; code < 256; ++code) {
    const uint8_t v = static_cast<uint8_t>(code);
    const double want = ReferenceE4M3(code);
    const float got = E4M3ToFloat(v);
    const float table = Float8E4M3ToFloat(v);
    if (IsNanCode(code)) {
      EXPECT_TRUE(std::isnan(got)) << code;
      EXPECT_TRUE(std::isnan(table)) << code;
      EXPECT_EQ(std::signbit(got), code >= 128) << code;
      continue;
    }
    ++finite;
    EXPECT_EQ(static_cast<double>(got), want) << "code 0x" << std::hex << code;
    EXPECT_EQ(static_cast<double>(table), want) << "code 0x" << std::hex << code;
    EXPECT_EQ(std::signbit(got), code >= 128) << code;  // -0 keeps its sign
  }
  EXPECT_EQ(finite, 254);
  EXPECT_EQ(E4M3ToFloat(0x7e), 448.0f);
  EXPECT_EQ(E4M3ToFloat(0xfe), -448.0f);
  EXPECT_EQ(E4M3ToFloat(0x01), std::ldexp(1.0f, -9));
  EXPECT_EQ(E4M3ToFloat(0x08), std::ldexp(1.0f, -6));  // smallest normal
  EXPECT_EQ(E4M3ToFloat(0x07), 7.0f / 512.0f);         // largest subnormal
}

// The binary16 route the SIMD and CUDA kernels take: value / 256 exactly for
// every finite code; the NaN codes become +-1.875 (documented: weights never
// hold them).
TEST(Float8, HalfRouteIsExactTimes256) {
  for (int code = 0; code < 256; ++code) {
    const uint16_t h = E4M3ToF16Bits(static_cast<uint8_t>(code));
    const double half = ReferenceHalf(h);
    if (IsNanCode(code)) {
      EXPECT_EQ(half, code >= 128 ? -1.875 : 1.875) << code;
      continue;
    }
    EXPECT_EQ(half * kE4M3HalfScale, ReferenceE4M3(code)) << "code 0x" << std::hex << code;
    EXPECT_EQ(std::signbit(half), code >= 128) << code;
  }
}

TEST(Float8, PairRouteMatchesSingle) {
  for (uint32_t two = 0; two < 65536; ++two) {
    const uint32_t pair = E4M3PairToF16x2Bits(two);
    ASSERT_EQ(pair & 0xffffu, E4M3ToF16Bits(static_cast<uint8_t>(two & 0xff))) << two;
    ASSERT_EQ(pair >> 16, E4M3ToF16Bits(static_cast<uint8_t>(two >> 8))) << two;
  }
  // Bits above the two bytes do not leak in.
  EXPECT_EQ(E4M3PairToF16x2Bits(0xabcd0000u | 0x3812u), E4M3PairToF16x2Bits(0x3812u));
}

TEST(Float8, BlockScaleIndex) {
  EXPECT_EQ(Fp8Blocks(0), 0);
  EXPECT_EQ(Fp8Blocks(1), 1);
  EXPECT_EQ(Fp8Blocks(128), 1);
  EXPECT_EQ(Fp8Blocks(129), 2);
  EXPECT_EQ(Fp8Blocks(7168), 56);
  // [out, in] = [300, 200]: 3 x 2 blocks, scale_ld 5 (a wider buffer).
  EXPECT_EQ(Fp8ScaleIndex(0, 0, 5), 0);
  EXPECT_EQ(Fp8ScaleIndex(127, 127, 5), 0);
  EXPECT_EQ(Fp8ScaleIndex(127, 128, 5), 1);
  EXPECT_EQ(Fp8ScaleIndex(128, 0, 5), 5);
  EXPECT_EQ(Fp8ScaleIndex(299, 199, 5), 2 * 5 + 1);
  for (int64_t r = 0; r < 400; r += 7)
    for (int64_t c = 0; c < 400; c += 11) EXPECT_EQ(Fp8ScaleIndex(r, c, 9), (r >> 7) * 9 + (c >> 7)) << r << "," << c;
  EXPECT_TRUE(Fp8SliceAligned(0, 0));
  EXPECT_TRUE(Fp8SliceAligned(256, 128));
  EXPECT_FALSE(Fp8SliceAligned(48, 0));
  EXPECT_FALSE(Fp8SliceAligned(0, 64));
}

}  // namespace
}  // namespace mlarun
