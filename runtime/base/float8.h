// FP8 E4M3 (the "e4m3fn" variant DeepSeek-V3 checkpoints use: no infinities,
// NaN = S.1111.111, max 448) to fp32.
#pragma once

#include <cstdint>

namespace mlarun {

// Exact conversion of one e4m3fn byte.
float Float8E4M3ToFloat(uint8_t v);

// n bytes -> n floats.
void ConvertF8E4M3ToF32(const uint8_t* src, float* dst, int64_t n);

}  // namespace mlarun
