// Which integer format a checkpoint uses, and the dispatch to its reader.
#include "runtime/model/quantized_weights.h"

namespace mlarun {

std::string_view QuantFormatName(QuantFormat f) {
  switch (f) {
    case QuantFormat::kNone:
      return "none";
    case QuantFormat::kCompressedTensors:
      return "compressed-tensors";
    case QuantFormat::kAwq:
      return "awq";
    case QuantFormat::kGptq:
      return "gptq";
  }
  return "invalid";
}

bool QuantScheme::Covers(const Checkpoint&, std::string_view) const { return false; }

StatusOr<QuantScheme> ReadQuantScheme(const std::string&) { return QuantScheme{}; }

StatusOr<Linear> LoadQuantizedLinear(const Checkpoint& ckpt, const QuantScheme& s, const std::string& prefix,
                                     int64_t rows, int64_t cols, int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
  switch (s.format) {
    case QuantFormat::kCompressedTensors:
      return quant_internal::LoadCompressedTensors(ckpt, s, prefix, rows, cols, r0, r1, c0, c1);
    case QuantFormat::kAwq:
      return quant_internal::LoadAwq(ckpt, s, prefix, rows, cols, r0, r1, c0, c1);
    case QuantFormat::kGptq:
      return quant_internal::LoadGptq(ckpt, s, prefix, rows, cols, r0, r1, c0, c1);
    case QuantFormat::kNone:
      break;
  }
  return FailedPreconditionError("module ", prefix, " is not quantized");
}

bool QuantizedSliceAligned(const QuantScheme& s, int64_t cols, int64_t c0, int64_t c1) {
  if (s.group <= 0) return c0 == 0 && c1 == cols;
  return c0 % s.group == 0 && (c1 % s.group == 0 || c1 == cols);
}

std::vector<std::string> QuantizedTensorNames(const QuantScheme&, const std::string&) { return {}; }

}  // namespace mlarun
