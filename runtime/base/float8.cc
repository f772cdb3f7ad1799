#include "runtime/base/float8.h"

#include <array>
#include <bit>
#include <cstddef>

namespace mlarun {
namespace {

// Every e4m3fn value is exactly representable in fp32, so a 256-entry table
// built from the bit fields is exact and makes bulk conversion one load each.
constexpr float DecodeE4M3(uint8_t v) {
  const uint32_t sign = static_cast<uint32_t>(v >> 7) << 31;
  const uint32_t exponent = (v >> 3) & 0xfu;
  const uint32_t mantissa = v & 0x7u;
  if (exponent == 0xfu && mantissa == 0x7u) {
    // The fn variant spends only S.1111.111 on NaN; S.1111.xxx otherwise is finite.
    return std::bit_cast<float>(sign | 0x7fc00000u);
  }
  if (exponent == 0) {
    // Subnormal: mantissa * 2^-9 (2^(1-7) * m/8). Exact in fp32; sign kept for -0.
    const float magnitude = static_cast<float>(mantissa) * (1.0f / 512.0f);
    return sign ? -magnitude : magnitude;
  }
  // Normal: rebias 7 -> 127 and widen the 3-bit mantissa to 23 bits.
  return std::bit_cast<float>(sign | ((exponent - 7u + 127u) << 23) | (mantissa << 20));
}

constexpr std::array<float, 256> MakeTable() {
  std::array<float, 256> t{};
  for (int i = 0; i < 256; ++i) t[static_cast<size_t>(i)] = DecodeE4M3(static_cast<uint8_t>(i));
  return t;
}

constexpr std::array<float, 256> kE4M3Table = MakeTable();

static_assert(kE4M3Table[0x7e] == 448.0f, "max finite e4m3fn is 448");
static_assert(kE4M3Table[0x01] == 1.0f / 512.0f, "smallest subnormal is 2^-9");
static_assert(kE4M3Table[0x38] == 1.0f, "bias is 7");

}  // namespace

float Float8E4M3ToFloat(uint8_t v) { return kE4M3Table[v]; }

void ConvertF8E4M3ToF32(const uint8_t* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = kE4M3Table[src[i]];
}

}  // namespace mlarun
