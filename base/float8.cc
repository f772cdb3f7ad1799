#include "base/float8.h"

#include <array>
#include <cstddef>

namespace mlarun {
namespace {

// Every e4m3fn value is exactly representable in fp32, so a 256-entry table
// built from the bit fields (E4M3ToFloat) makes bulk conversion one load each.
constexpr std::array<float, 256> MakeTable() {
  std::array<float, 256> t{};
  for (int i = 0; i < 256; ++i) t[static_cast<size_t>(i)] = E4M3ToFloat(static_cast<uint8_t>(i));
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
