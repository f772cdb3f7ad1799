#include "gemm/convert.h"

#include <cstring>

#include "gemm/cpu/kernels.h"

namespace mlarun {

// Through the kernel family in force (gemm/cpu/kernels.h).
void ConvertF32ToBf16(const float* src, bf16_t* dst, int64_t n) { cpu::Kernels().f32_to_bf16(src, dst, n); }

void ConvertBf16ToF32(const bf16_t* src, float* dst, int64_t n) { cpu::Kernels().bf16_to_f32(src, dst, n); }

void StoreFromF32(const float* src, void* dst, DType dst_type, int64_t n) {
  if (dst_type == DType::kBF16) {
    ConvertF32ToBf16(src, static_cast<bf16_t*>(dst), n);
  } else {
    std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
  }
}

void LoadToF32(const void* src, DType src_type, float* dst, int64_t n) {
  if (src_type == DType::kBF16) {
    ConvertBf16ToF32(static_cast<const bf16_t*>(src), dst, n);
  } else {
    std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
  }
}

}  // namespace mlarun
