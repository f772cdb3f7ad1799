// The AWQ reader (quantized_weights.h): autoawq's GEMM packing repacked into
// mlarun's int4 layout (runtime/ops/linear.h).
//
// A module `prefix` of logical weight W [rows = out, cols = in] is stored as
//   <prefix>.qweight  I32 [cols, rows / 8]: 8 output channels per int32,
//                     channel 8k + e in the nibble at bit kNibbleShift[e]
//                     (autoawq's pack order 0 2 4 6 1 3 5 7);
//   <prefix>.qzeros   I32 [groups, rows / 8], zero points packed the same way;
//   <prefix>.scales   F16 (or BF16, F32) [groups, rows];
// with groups = ceil(cols / group) and W[o][i] = (q - z) * s of i's group.
// mlarun wants each output channel's `in` elements contiguous, so the repack
// is a nibble transpose; the zero points become offsets -z * s (exact in fp32:
// z * s and (q - z) * s both fit a float's mantissa).
#include <algorithm>
#include <cstring>
#include <initializer_list>
#include <string>
#include <vector>

#include "runtime/model/quantized_weights.h"

namespace mlarun::quant_internal {
namespace {

// Bit position of output channel 8k + e inside its int32.
constexpr int kNibbleShift[8] = {0, 16, 4, 20, 8, 24, 12, 28};

Status CheckAwqRequest(const QuantScheme& s, const std::string& prefix, int64_t rows, int64_t cols, int64_t group,
                       int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
  if (s.bits != 4) return InvalidArgumentError("AWQ module ", prefix, ": bits ", s.bits, " (AWQ GEMM packs 4 bits)");
  if (rows <= 0 || cols <= 0 || rows % 8 != 0)
    return InvalidArgumentError("AWQ module ", prefix, ": shape [", rows, ", ", cols,
                                "] (rows must be a positive multiple of 8, the channels of one int32)");
  if (s.group > 0 && s.group % 2 != 0)
    return InvalidArgumentError("AWQ module ", prefix, ": group ", s.group, " is odd (int4 groups hold byte pairs)");
  if (r0 < 0 || r1 > rows || r0 >= r1 || c0 < 0 || c1 > cols || c0 >= c1)
    return OutOfRangeError("AWQ module ", prefix, ": slice rows [", r0, ", ", r1, ") x cols [", c0, ", ", c1,
                           ") outside [", rows, ", ", cols, "]");
  if (c0 % group != 0 || (c1 % group != 0 && c1 != cols))
    return InvalidArgumentError("AWQ module ", prefix, ": cols [", c0, ", ", c1, ") do not start and end groups of ",
                                group);
  return Status::Ok();
}

// Nibbles of columns [c0, c1) for output channels [r0, r1), from qweight
// [cols, rows / 8] into q's rows. Threads take blocks of 16 int32 columns
// (128 channels: one cache line of each qweight row), transposed through a
// tile of 128 channels x 128 inputs (64 bytes each) so that every output row
// is written a cache line at a time: row strides are often powers of two,
// and byte stores 128 rows apart would all fall into one cache set.
void RepackAwqNibbles(const std::byte* qweight, int64_t rows, int64_t r0, int64_t r1, int64_t c0, int64_t c1,
                      Linear& q) {
  constexpr int64_t kWords = 16, kTileBytes = 64;
  const int64_t words = rows / 8, w0 = r0 / 8, w1 = (r1 + 7) / 8;
  const int64_t blocks = (w1 - w0 + kWords - 1) / kWords;
  auto* dst = reinterpret_cast<uint8_t*>(q.mutable_data());
  const int64_t row_bytes = DTypeBytes(DType::kInt4, q.ld);
#pragma omp parallel for schedule(static) if (blocks > 1 && (c1 - c0) * (r1 - r0) > (1 << 16))
  for (int64_t b = 0; b < blocks; ++b) {
    alignas(64) uint8_t tile[8 * kWords][kTileBytes];
    const int64_t wb = w0 + b * kWords, we = std::min(w1, wb + kWords);
    const int64_t ob = std::max(r0, 8 * wb), oe = std::min(r1, 8 * we);
    for (int64_t ct = c0; ct < c1; ct += 2 * kTileBytes) {
      const int64_t ce = std::min(c1, ct + 2 * kTileBytes);
      for (int64_t i = ct; i < ce; i += 2) {
        for (int64_t w = wb; w < we; ++w) {
          const uint32_t lo = Word32(qweight, i * words + w);
          const uint32_t hi = i + 1 < ce ? Word32(qweight, (i + 1) * words + w) : 0;
          // Byte p of `even` pairs the nibbles at bit 8p (channels 0 4 1 5
          // of kNibbleShift), of `odd` those at bit 8p + 4 (2 6 3 7).
          const uint32_t even = (lo & 0x0f0f0f0fu) | ((hi & 0x0f0f0f0fu) << 4);
          const uint32_t odd = ((lo >> 4) & 0x0f0f0f0fu) | (hi & 0xf0f0f0f0u);
          uint8_t(*t)[kTileBytes] = tile + 8 * (w - wb);
          const int64_t j = (i - ct) / 2;
          t[0][j] = static_cast<uint8_t>(even), t[4][j] = static_cast<uint8_t>(even >> 8);
          t[1][j] = static_cast<uint8_t>(even >> 16), t[5][j] = static_cast<uint8_t>(even >> 24);
          t[2][j] = static_cast<uint8_t>(odd), t[6][j] = static_cast<uint8_t>(odd >> 8);
          t[3][j] = static_cast<uint8_t>(odd >> 16), t[7][j] = static_cast<uint8_t>(odd >> 24);
        }
      }
      for (int64_t o = ob; o < oe; ++o)
        std::memcpy(dst + (o - r0) * row_bytes + (ct - c0) / 2, tile[o - 8 * wb],
                    static_cast<size_t>((ce - ct + 1) / 2));
    }
  }
}

// Scales and offsets (-z * s) of groups [g0, g1) for channels [r0, r1).
Status RepackAwqScales(const Checkpoint& ckpt, const TensorRef& scales, const TensorRef& qzeros, int64_t rows,
                       int64_t r0, int64_t r1, int64_t g0, int64_t g1, Linear& q) {
  const int64_t n = r1 - r0, ng = g1 - g0;
  std::vector<float> s(static_cast<size_t>(ng * n));
  MLARUN_RETURN_IF_ERROR(ckpt.LoadSlice(scales.name, scales.shape, g0, g1, r0, r1, DType::kF32, s.data()));
  const int64_t words = rows / 8;
  for (int64_t g = 0; g < ng; ++g) {
    for (int64_t o = r0; o < r1; ++o) {
      const float sc = s[g * n + (o - r0)];
      const uint32_t z = (Word32(qzeros.data, (g0 + g) * words + o / 8) >> kNibbleShift[o % 8]) & 15u;
      q.mutable_scale()[(o - r0) * q.scale_ld + g] = sc;
      q.mutable_offset()[(o - r0) * q.scale_ld + g] = -static_cast<float>(z) * sc;
    }
  }
  return Status::Ok();
}

}  // namespace

StatusOr<Linear> LoadAwq(const Checkpoint& ckpt, const QuantScheme& s, const std::string& prefix, int64_t rows,
                         int64_t cols, int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
  const int64_t group = s.group > 0 ? s.group : cols;
  MLARUN_RETURN_IF_ERROR(CheckAwqRequest(s, prefix, rows, cols, group, r0, r1, c0, c1));
  const int64_t groups = (cols + group - 1) / group;
  using D = SafetensorsDType;
  MLARUN_ASSIGN_OR_RETURN(const TensorRef* qweight,
                          ModuleTensor(ckpt, "AWQ", prefix, "qweight", {D::kI32, D::kU32}, {cols, rows / 8}));
  MLARUN_ASSIGN_OR_RETURN(const TensorRef* qzeros,
                          ModuleTensor(ckpt, "AWQ", prefix, "qzeros", {D::kI32, D::kU32}, {groups, rows / 8}));
  MLARUN_ASSIGN_OR_RETURN(const TensorRef* scales,
                          ModuleTensor(ckpt, "AWQ", prefix, "scales", {D::kF16, D::kBF16, D::kF32}, {groups, rows}));
  Linear q = Linear::Owned(r1 - r0, c1 - c0, DType::kInt4, group, /*offsets=*/true);
  if (q.mutable_data() == nullptr)
    return ResourceExhaustedError("AWQ module ", prefix, ": cannot allocate ", q.bytes(), " bytes");
  RepackAwqNibbles(qweight->data, rows, r0, r1, c0, c1, q);
  MLARUN_RETURN_IF_ERROR(
      RepackAwqScales(ckpt, *scales, *qzeros, rows, r0, r1, c0 / group, (c1 + group - 1) / group, q));
  return q;
}

}  // namespace mlarun::quant_internal
