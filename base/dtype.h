// Element types and the bf16 conversions every CPU kernel uses.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "base/status.h"

namespace mlarun {

// Values are frozen: they appear in configs and on the wire.
enum class DType : uint8_t {
  kF32 = 0,
  kBF16 = 1,
  kF16 = 2,
  kF8E4M3 = 3,
};

// Bytes per element. REQUIRES: a valid enumerator.
size_t DTypeSize(DType t);
// "f32", "bf16", "f16", "f8_e4m3".
std::string_view DTypeName(DType t);
// Accepts the names above (and "fp32"/"float32", "bfloat16", "fp16"/"float16").
StatusOr<DType> ParseDType(std::string_view name);
// True for enumerators this build knows; guards values that came from casts.
bool IsValidDType(DType t);

// bf16 is stored as its upper 16 bits of an IEEE binary32.
using bf16_t = uint16_t;

// Round to nearest even; NaN stays NaN (quiet), infinities stay infinities.
inline bf16_t FloatToBf16(float f) {
  uint32_t u = std::bit_cast<uint32_t>(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<bf16_t>((u >> 16) | 0x0040u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<bf16_t>(u >> 16);
}

inline float Bf16ToFloat(bf16_t h) { return std::bit_cast<float>(static_cast<uint32_t>(h) << 16); }

}  // namespace mlarun
