// Bulk conversions between fp32 and the element types weights and caches are
// stored in, through the CPU kernel family in force (gemm/cpu/kernels.h).
// The scalar forms (FloatToBf16, Bf16ToFloat) are in base/dtype.h.
#pragma once

#include <cstdint>

#include "base/dtype.h"

namespace mlarun {

// Bulk conversions (vectorized where the CPU allows). `n` elements each.
void ConvertF32ToBf16(const float* src, bf16_t* dst, int64_t n);
void ConvertBf16ToF32(const bf16_t* src, float* dst, int64_t n);
// Copies n elements of fp32 `src` into `dst` of type `dst_type` (f32 or bf16).
void StoreFromF32(const float* src, void* dst, DType dst_type, int64_t n);
// Copies n elements of `src` of type `src_type` (f32 or bf16) into fp32 `dst`.
void LoadToF32(const void* src, DType src_type, float* dst, int64_t n);

}  // namespace mlarun
