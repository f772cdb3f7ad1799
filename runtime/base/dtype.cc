#include "runtime/base/dtype.h"

#include "runtime/base/cpu/kernels.h"

#include <cstring>
#include <string>

namespace mlarun {

size_t DTypeSize(DType t) {
  switch (t) {
    case DType::kF32: return 4;
    case DType::kBF16: return 2;
    case DType::kF16: return 2;
    case DType::kF8E4M3: return 1;
  }
  return 0;
}

std::string_view DTypeName(DType t) {
  switch (t) {
    case DType::kF32: return "f32";
    case DType::kBF16: return "bf16";
    case DType::kF16: return "f16";
    case DType::kF8E4M3: return "f8_e4m3";
  }
  return "invalid";
}

bool IsValidDType(DType t) { return DTypeSize(t) != 0; }

StatusOr<DType> ParseDType(std::string_view name) {
  if (name == "f32" || name == "fp32" || name == "float32") return DType::kF32;
  if (name == "bf16" || name == "bfloat16") return DType::kBF16;
  if (name == "f16" || name == "fp16" || name == "float16") return DType::kF16;
  if (name == "f8_e4m3" || name == "fp8_e4m3") return DType::kF8E4M3;
  return InvalidArgumentError("unknown dtype '", std::string(name),
                              "' (expected one of f32, bf16, f16, f8_e4m3)");
}

// Through the kernel family in force (runtime/base/cpu/kernels.h).
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
