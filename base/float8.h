// FP8 E4M3 (the "e4m3fn" variant DeepSeek-V3 checkpoints use: no infinities,
// NaN = S.1111.111, max 448) to fp32, and the index math of 128 x 128 block
// scales.
//
// The MLARUN_HD functions below are plain bit manipulation, shared by the CPU
// kernels' scalar code, the CUDA kernels and the host tests, so the tests
// cover exactly what the kernels compute (tests/base/float8_test.cc checks all
// 256 codes against an independent float64 decoding).
#pragma once

#include <bit>
#include <cstdint>

#include "base/host_device.h"

namespace mlarun {

// Exact conversion of one e4m3fn byte (a 256-entry table).
float Float8E4M3ToFloat(uint8_t v);

// n bytes -> n floats.
void ConvertF8E4M3ToF32(const uint8_t* src, float* dst, int64_t n);

// ---- Host and device -----------------------------------------------------------

// The IEEE binary32 bit pattern of e4m3fn `v`, exactly: normals rebias the
// exponent (7 -> 127), subnormals (m * 2^-9) are normalized, NaN codes give a
// quiet NaN with v's sign.
MLARUN_HD constexpr uint32_t E4M3ToF32Bits(uint8_t v) {
  const uint32_t sign = static_cast<uint32_t>(v & 0x80u) << 24;
  const uint32_t e = (v >> 3) & 0xfu, m = v & 0x7u;
  if (e == 0xfu && m == 0x7u) return sign | 0x7fc00000u;
  if (e == 0) {
    if (m == 0) return sign;  // +-0
    // m * 2^-9 with m in [1, 7]: leading bit k, value 2^(k - 9) * (m / 2^k).
    const uint32_t k = m >= 4 ? 2u : m >= 2 ? 1u : 0u;
    return sign | ((k + 127u - 9u) << 23) | ((m - (1u << k)) << (23u - k));
  }
  return sign | ((e + 120u) << 23) | (m << 20);
}

// The e4m3 bits moved into an IEEE binary16 (sign to bit 15, exponent and
// mantissa to bits 13..7): the half's value is exactly the e4m3 value / 256
// (both biases differ by 8; e4m3 subnormals land on half subnormals), so one
// half -> fp32 conversion (F16C, AVX-512, CUDA's cvt) and a multiply by
// kE4M3HalfScale decode it. The NaN codes 0x7f / 0xff give +-1.875 (+-480
// after the multiply): finite, where E4M3ToF32Bits gives NaN. Weights never
// hold them (the loader refuses NaN codes), so the kernels need not care.
MLARUN_HD constexpr uint16_t E4M3ToF16Bits(uint8_t v) {
  return static_cast<uint16_t>(((v & 0x80u) << 8) | ((v & 0x7fu) << 7));
}
// Two of them at once: bytes b0 | b1 << 8 (in the low 16 bits of `two`) to
// the binary16 pair f16(b0) | f16(b1) << 16, in 32-bit integer operations
// (what a CUDA kernel converts with one half2 -> float2 step).
MLARUN_HD constexpr uint32_t E4M3PairToF16x2Bits(uint32_t two) {
  // Each byte into the high byte of its 16-bit lane; then the sign stays at
  // bit 15 and exponent + mantissa shift down by one.
  const uint32_t x = ((two & 0xffu) << 8) | ((two & 0xff00u) << 16);
  return (x & 0x80008000u) | ((x >> 1) & 0x3f803f80u);
}
inline constexpr float kE4M3HalfScale = 256.0f;

// The DeepSeek-V3 block scales: one fp32 per kFp8Block x kFp8Block block of a
// weight [out, in], [Fp8Blocks(out), scale_ld >= Fp8Blocks(in)] row-major.
inline constexpr int64_t kFp8Block = 128;
MLARUN_HD constexpr int64_t Fp8Blocks(int64_t n) { return (n + kFp8Block - 1) / kFp8Block; }
// Where the scale of element (r, c) is: element (r, c) of the weight is
// e4m3(data[r * ld + c]) * scale[Fp8ScaleIndex(r, c, scale_ld)].
MLARUN_HD constexpr int64_t Fp8ScaleIndex(int64_t r, int64_t c, int64_t scale_ld) {
  return (r / kFp8Block) * scale_ld + c / kFp8Block;
}
// A slice of a block-scaled weight keeps its scales' meaning only when it
// starts on a block boundary in both dimensions (its blocks are then the
// original blocks, the last ones possibly cut short).
MLARUN_HD constexpr bool Fp8SliceAligned(int64_t row_begin, int64_t col_begin) {
  return row_begin % kFp8Block == 0 && col_begin % kFp8Block == 0;
}

// Host only (the device converts bits with __uint_as_float).
constexpr float E4M3ToFloat(uint8_t v) { return std::bit_cast<float>(E4M3ToF32Bits(v)); }

}  // namespace mlarun
