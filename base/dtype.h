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
  // Integer weights with per-group scales (runtime/ops/linear.h,
  // docs/quantized-weights.md): int8 one per byte; int4 two per byte, element
  // 2j in the low nibble of byte j and 2j + 1 in the high one (the order of
  // compressed-tensors' little-endian int32 packing).
  kInt8 = 4,
  kInt4 = 5,
};

// Bytes per element; 1 for int4, which packs two per byte (size int4 data
// with DTypeBytes). REQUIRES: a valid enumerator.
size_t DTypeSize(DType t);
// Bytes `elements` elements of `t` take: (elements + 1) / 2 for int4.
inline int64_t DTypeBytes(DType t, int64_t elements) {
  return t == DType::kInt4 ? (elements + 1) / 2 : elements * static_cast<int64_t>(DTypeSize(t));
}
// Whether `t` is an integer weight type (int8, int4) with group scales.
inline bool IsIntWeight(DType t) { return t == DType::kInt8 || t == DType::kInt4; }
// "f32", "bf16", "f16", "f8_e4m3", "int8", "int4".
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
