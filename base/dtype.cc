#include "base/dtype.h"

#include <string>

namespace mlarun {

size_t DTypeSize(DType t) {
  switch (t) {
    case DType::kF32:
      return 4;
    case DType::kBF16:
      return 2;
    case DType::kF16:
      return 2;
    case DType::kF8E4M3:
    case DType::kInt8:
    case DType::kInt4:
      return 1;
  }
  return 0;
}

std::string_view DTypeName(DType t) {
  switch (t) {
    case DType::kF32:
      return "f32";
    case DType::kBF16:
      return "bf16";
    case DType::kF16:
      return "f16";
    case DType::kF8E4M3:
      return "f8_e4m3";
    case DType::kInt8:
      return "int8";
    case DType::kInt4:
      return "int4";
  }
  return "invalid";
}

bool IsValidDType(DType t) { return DTypeSize(t) != 0; }

StatusOr<DType> ParseDType(std::string_view name) {
  if (name == "f32" || name == "fp32" || name == "float32") return DType::kF32;
  if (name == "bf16" || name == "bfloat16") return DType::kBF16;
  if (name == "f16" || name == "fp16" || name == "float16") return DType::kF16;
  if (name == "f8_e4m3" || name == "fp8_e4m3") return DType::kF8E4M3;
  if (name == "int8" || name == "i8") return DType::kInt8;
  if (name == "int4" || name == "i4") return DType::kInt4;
  return InvalidArgumentError("unknown dtype '", std::string(name),
                              "' (expected one of f32, bf16, f16, f8_e4m3, int8, int4)");
}

}  // namespace mlarun
