// The compressed-tensors reader (quantized_weights.h): llm-compressor's
// "pack-quantized" int4 and "int-quantized" / "naive-quantized" int8.
//
// Stored, for a Linear `prefix` of logical weight [out, in]:
//  * int4: `weight_packed` I32 [out, ceil(in / 8)], eight values per word,
//    value j in bits 4j..4j+3 (little-endian: the low nibble of byte j / 2
//    for even j), each value q + 8 for q in [-8, 7]: byte for byte mlarun's
//    int4 layout with zero 8, so the rows are read in place.
//    `weight_shape` I64 / I32 [2] = [out, in].
//  * int8: `weight` I8 [out, in], q as stored (read in place).
//  * `weight_scale` F32 / BF16 / F16 [out, ceil(in / group)] ([out, 1] per
//    channel), copied to fp32.
//  * asymmetric: `weight_zero_point`, int4: I32 [ceil(out / 8), groups], the
//    zero points packed as the values are but along `out` (column g holds
//    rows 8k..8k+7 of group g in word [k, g]), each zp + 8; int8: I8
//    [out, groups]. w = (q - zp) * scale, held as q * scale + offset with
//    offset = -zp * scale (both q and zp in their stored, offset form).
#include <cmath>
#include <cstring>

#include "base/dtype.h"
#include "runtime/model/quantized_weights.h"

namespace mlarun::quant_internal {
namespace {

// weight_shape must say [rows, cols].
Status CheckWeightShape(const Checkpoint& ckpt, const std::string& prefix, int64_t rows, int64_t cols) {
  const std::string name = prefix + ".weight_shape";
  MLARUN_ASSIGN_OR_RETURN(const TensorRef* t,
                          ModuleTensor(ckpt, "compressed-tensors", prefix, "weight_shape",
                                       {SafetensorsDType::kI64, SafetensorsDType::kI32}, {2}, "the weight's shape"));
  int64_t v[2];
  for (int i = 0; i < 2; ++i) {
    if (t->dtype == SafetensorsDType::kI64) {
      std::memcpy(&v[i], t->data + 8 * i, 8);
    } else {
      int32_t x;
      std::memcpy(&x, t->data + 4 * i, 4);
      v[i] = x;
    }
  }
  if (v[0] != rows || v[1] != cols)
    return InvalidArgumentError("checkpoint ", ckpt.dir(), ": tensor '", name, "' says [", v[0], ", ", v[1],
                                "], expected [", rows, ", ", cols, "] (the model's config)");
  return Status::Ok();
}

// The unsigned zero point (as stored, + 8 for int4) of row r, group g.
int32_t ZeroPoint(const TensorRef& zp, int bits, int64_t r, int64_t g) {
  if (bits == 8) return static_cast<int8_t>(zp.data[r * zp.shape[1] + g]);
  const int64_t word = (r / 8) * zp.shape[1] + g;  // [ceil(out / 8), groups]
  const uint8_t byte = static_cast<uint8_t>(zp.data[word * 4 + (r % 8) / 2]);
  return (r % 2 == 0) ? (byte & 0xf) : (byte >> 4);
}

// The tensors of module `prefix` under `s`, checked: the values `q`, the
// scales, and the zero points `zp` (nullptr when symmetric).
Status ExpectTensors(const Checkpoint& ckpt, const QuantScheme& s, const std::string& prefix, int64_t rows,
                     int64_t cols, const TensorRef** q, const TensorRef** scale, const TensorRef** zp) {
  const int64_t groups = s.group > 0 ? (cols + s.group - 1) / s.group : 1;
  if (s.bits == 4) {
    MLARUN_ASSIGN_OR_RETURN(*q,
                            ModuleTensor(ckpt, "compressed-tensors", prefix, "weight_packed", {SafetensorsDType::kI32},
                                         {rows, (cols + 7) / 8}, "[out, ceil(in / 8)] int4 values packed in int32"));
    MLARUN_RETURN_IF_ERROR(CheckWeightShape(ckpt, prefix, rows, cols));
  } else {
    MLARUN_ASSIGN_OR_RETURN(*q, ModuleTensor(ckpt, "compressed-tensors", prefix, "weight", {SafetensorsDType::kI8},
                                             {rows, cols}, "[out, in] int8"));
  }
  MLARUN_ASSIGN_OR_RETURN(
      *scale, ModuleTensor(ckpt, "compressed-tensors", prefix, "weight_scale",
                           {SafetensorsDType::kF32, SafetensorsDType::kBF16, SafetensorsDType::kF16}, {rows, groups},
                           s.group > 0 ? "[out, ceil(in / group_size)]" : "[out, 1] per channel"));
  *zp = nullptr;
  if (s.symmetric) return Status::Ok();
  if (s.bits == 4) {
    MLARUN_ASSIGN_OR_RETURN(
        *zp, ModuleTensor(ckpt, "compressed-tensors", prefix, "weight_zero_point", {SafetensorsDType::kI32},
                          {(rows + 7) / 8, groups}, "[ceil(out / 8), groups] packed along out"));
  } else {
    MLARUN_ASSIGN_OR_RETURN(*zp, ModuleTensor(ckpt, "compressed-tensors", prefix, "weight_zero_point",
                                              {SafetensorsDType::kI8}, {rows, groups}, "[out, groups]"));
  }
  return Status::Ok();
}

}  // namespace

StatusOr<Linear> LoadCompressedTensors(const Checkpoint& ckpt, const QuantScheme& s, const std::string& prefix,
                                       int64_t rows, int64_t cols, int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
  if (r0 < 0 || r0 > r1 || r1 > rows || c0 < 0 || c0 > c1 || c1 > cols)
    return InvalidArgumentError("weight ", prefix, ": slice [", r0, ", ", r1, ") x [", c0, ", ", c1,
                                ") outside its shape [", rows, ", ", cols, "]");
  if (!QuantizedSliceAligned(s, cols, c0, c1))
    return InvalidArgumentError("weight ", prefix, ": columns [", c0, ", ", c1, ") do not start and end on groups of ",
                                s.group);
  const TensorRef *q = nullptr, *scale = nullptr, *zp = nullptr;
  MLARUN_RETURN_IF_ERROR(ExpectTensors(ckpt, s, prefix, rows, cols, &q, &scale, &zp));
  const bool int4 = s.bits == 4;
  Linear l;
  l.out = r1 - r0, l.in = c1 - c0, l.dtype = s.dtype();
  l.ld = int4 ? (cols + 7) / 8 * 8 : cols;
  l.data = q->data + DTypeBytes(l.dtype, r0 * l.ld + c0);
  l.group = s.group > 0 ? s.group : l.in + (l.in & 1);
  const int64_t g0 = s.group > 0 ? c0 / s.group : 0, g1 = g0 + l.groups();
  l.scale_ld = g1 - g0;
  const int64_t n = l.out * l.scale_ld;
  std::shared_ptr<float[]> buf(new (std::nothrow) float[static_cast<size_t>(std::max<int64_t>(1, zp ? 2 * n : n))]);
  if (buf == nullptr) return ResourceExhaustedError("cannot allocate the scales of weight ", prefix);
  const int64_t scale_shape[2] = {rows, scale->shape[1]};  // F32 / BF16 / F16 -> fp32, exactly
  MLARUN_RETURN_IF_ERROR(ckpt.LoadSlice(scale->name, scale_shape, r0, r1, g0, g1, DType::kF32, buf.get()));
  for (int64_t i = 0; i < n; ++i)
    if (!std::isfinite(buf[i]))
      return InvalidArgumentError("checkpoint ", ckpt.dir(), ": tensor '", prefix,
                                  ".weight_scale' is not finite at element [", r0 + i / l.scale_ld, ", ",
                                  g0 + i % l.scale_ld, "]");
  l.scale = buf.get();
  if (zp != nullptr) {
    float* off = buf.get() + n;
    for (int64_t r = 0; r < l.out; ++r)
      for (int64_t g = 0; g < l.scale_ld; ++g)
        off[r * l.scale_ld + g] =
            -static_cast<float>(ZeroPoint(*zp, s.bits, r0 + r, g0 + g)) * l.scale[r * l.scale_ld + g];
    l.offset = off;
    l.zero = 0;
  } else {
    l.zero = int4 ? 8 : 0;
  }
  l.scale_storage = std::move(buf);
  return l;
}

}  // namespace mlarun::quant_internal
