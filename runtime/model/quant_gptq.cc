// The GPTQ reader (quantized_weights.h): auto-gptq / gptqmodel checkpoints
// (checkpoint_format "gptq", v1) repacked into mlarun's int4 / int8 layout
// (runtime/ops/linear.h).
//
// A module `prefix` of logical weight W [rows = out, cols = in], `bits` 4 or
// 8 and p = 32 / bits values per int32, is stored as
//   <prefix>.qweight  I32 [cols / p, rows]: input c of channel o in word
//                     [c / p][o] at bit bits * (c % p);
//   <prefix>.qzeros   I32 [groups, rows / p]: zero point of (g, o) in word
//                     [g][o / p] at bit bits * (o % p), stored as zero - 1
//                     in the v1 format (read back as (field & mask) + 1, as
//                     auto-gptq does), as is in "gptq_v2" (gptqmodel);
//   <prefix>.scales   F16 (or BF16, F32) [groups, rows];
//   <prefix>.g_idx    I32 [cols] (may be absent): the group of each input;
// with W[o][c] = (q - z) * s of group g_idx[c]. Read down a column of
// qweight, channel o's words are its inputs in order, bits * c from the
// start: little-endian, mlarun's own order (element 2j in the low nibble of
// byte j), so the repack is a word transpose. 8-bit values are unsigned
// 0..255: stored as q - 128 (signed) with the offsets shifted by 128 scales.
//
// desc_act (act-order) checkpoints whose g_idx permutes the groups are
// refused: mlarun's layout needs each group contiguous along `in`, and the
// permutation would have to move into the activations.
#include <algorithm>
#include <cstring>
#include <initializer_list>
#include <string>
#include <vector>

#include "runtime/model/quantized_weights.h"

namespace mlarun::quant_internal {
namespace {

// One module's request, checked, and what the repack needs.
struct GptqModule {
  int bits = 4;
  int64_t per_word = 8;  // values per int32
  int64_t rows = 0, cols = 0, group = 0, groups = 0;
  int64_t r0 = 0, r1 = 0, c0 = 0, c1 = 0;
  const TensorRef* qweight = nullptr;
  const TensorRef* qzeros = nullptr;
  const TensorRef* scales = nullptr;
  const TensorRef* g_idx = nullptr;  // may be nullptr
  uint32_t zero_bias = 1;            // added to a stored zero point: 1 in v1, 0 in v2
  uint32_t Zero(int64_t g, int64_t o) const {
    const uint32_t field = Word32(qzeros->data, g * (rows / per_word) + o / per_word) >> (bits * (o % per_word));
    return (field & ((1u << bits) - 1)) + zero_bias;
  }
};

Status CheckGptqRequest(const QuantScheme& s, const std::string& prefix, const GptqModule& m) {
  if (s.bits != 4 && s.bits != 8)
    return InvalidArgumentError("GPTQ module ", prefix, ": bits ", s.bits, " (4 or 8 are read)");
  if (m.rows <= 0 || m.cols <= 0 || m.rows % m.per_word != 0 || m.cols % m.per_word != 0)
    return InvalidArgumentError("GPTQ module ", prefix, ": shape [", m.rows, ", ", m.cols,
                                "] (rows and cols must be positive multiples of ", m.per_word,
                                ", the values of one int32)");
  if (s.group > 0 && s.group % 2 != 0)
    return InvalidArgumentError("GPTQ module ", prefix, ": group ", s.group, " is odd (int4 groups hold byte pairs)");
  if (m.r0 < 0 || m.r1 > m.rows || m.r0 >= m.r1 || m.c0 < 0 || m.c1 > m.cols || m.c0 >= m.c1)
    return OutOfRangeError("GPTQ module ", prefix, ": slice rows [", m.r0, ", ", m.r1, ") x cols [", m.c0, ", ", m.c1,
                           ") outside [", m.rows, ", ", m.cols, "]");
  if (m.c0 % m.group != 0 || (m.c1 % m.group != 0 && m.c1 != m.cols))
    return InvalidArgumentError("GPTQ module ", prefix, ": cols [", m.c0, ", ", m.c1,
                                ") do not start and end groups of ", m.group);
  return Status::Ok();
}

// g_idx, where present, must be the trivial c / group: groups contiguous
// along `in`. A desc_act export may write it so; a real act-order
// permutation is refused.
Status CheckGIdx(const QuantScheme& s, const std::string& prefix, const GptqModule& m) {
  if (m.g_idx == nullptr) return Status::Ok();
  const bool wide = m.g_idx->dtype == SafetensorsDType::kI64;
  for (int64_t c = 0; c < m.cols; ++c) {
    int64_t g = 0;
    if (wide) {
      std::memcpy(&g, m.g_idx->data + 8 * c, 8);
    } else {
      int32_t g32;
      std::memcpy(&g32, m.g_idx->data + 4 * c, 4);
      g = g32;
    }
    if (g == c / m.group) continue;
    return UnimplementedError("GPTQ module ", prefix, ": tensor ", m.g_idx->name, " puts input ", c, " in group ", g,
                              ", not ", c / m.group, " (desc_act ", s.desc_act ? "true" : "false",
                              "): act-order checkpoints whose g_idx permutes the groups are not read, mlarun needs "
                              "each group contiguous along the input; re-export with desc_act false");
  }
  return Status::Ok();
}

StatusOr<GptqModule> FindGptqModule(const Checkpoint& ckpt, const QuantScheme& s, const std::string& prefix,
                                    GptqModule m) {
  MLARUN_RETURN_IF_ERROR(CheckGptqRequest(s, prefix, m));
  using D = SafetensorsDType;
  MLARUN_ASSIGN_OR_RETURN(
      m.qweight, ModuleTensor(ckpt, "GPTQ", prefix, "qweight", {D::kI32, D::kU32}, {m.cols / m.per_word, m.rows}));
  MLARUN_ASSIGN_OR_RETURN(
      m.qzeros, ModuleTensor(ckpt, "GPTQ", prefix, "qzeros", {D::kI32, D::kU32}, {m.groups, m.rows / m.per_word}));
  MLARUN_ASSIGN_OR_RETURN(
      m.scales, ModuleTensor(ckpt, "GPTQ", prefix, "scales", {D::kF16, D::kBF16, D::kF32}, {m.groups, m.rows}));
  if (ckpt.Find(prefix + ".g_idx") != nullptr) {
    MLARUN_ASSIGN_OR_RETURN(m.g_idx, ModuleTensor(ckpt, "GPTQ", prefix, "g_idx", {D::kI32, D::kI64}, {m.cols}));
  }
  MLARUN_RETURN_IF_ERROR(CheckGIdx(s, prefix, m));
  return m;
}

// Bytes [c0 * bits / 8, c1 * bits / 8) of each channel's column of qweight
// into q's rows (8-bit: each byte's top bit flipped, q - 128). Threads take
// blocks of 64 channels (4 cache lines of each qweight row), transposed
// through a tile of 64 channels x 16 words so that every output row is
// written a cache line at a time: row strides are often powers of two, and
// word stores 64 rows apart would all fall into one cache set.
void RepackGptqWords(const GptqModule& m, Linear& q) {
  constexpr int64_t kBlock = 64, kTileWords = 16;
  const int64_t b0 = m.c0 * m.bits / 8, b1 = m.c1 * m.bits / 8;
  const int64_t k0 = b0 / 4, k1 = (b1 + 3) / 4;
  const uint32_t flip = m.bits == 8 ? 0x80808080u : 0u;
  const int64_t blocks = (m.r1 - m.r0 + kBlock - 1) / kBlock;
  auto* dst = reinterpret_cast<uint8_t*>(q.mutable_data());
  const int64_t row_bytes = DTypeBytes(q.dtype, q.ld);
#pragma omp parallel for schedule(static) if (blocks > 1 && (m.c1 - m.c0) * (m.r1 - m.r0) > (1 << 16))
  for (int64_t blk = 0; blk < blocks; ++blk) {
    alignas(64) uint32_t tile[kBlock][kTileWords];
    const int64_t ob = m.r0 + blk * kBlock, oe = std::min(m.r1, ob + kBlock);
    for (int64_t kt = k0; kt < k1; kt += kTileWords) {
      const int64_t ke = std::min(k1, kt + kTileWords);
      for (int64_t k = kt; k < ke; ++k)
        for (int64_t o = ob; o < oe; ++o) tile[o - ob][k - kt] = Word32(m.qweight->data, k * m.rows + o) ^ flip;
      // Bytes [first, last) of the rows, taken from the tile's little-endian words.
      const int64_t first = std::max(b0, 4 * kt), last = std::min(b1, 4 * ke);
      for (int64_t o = ob; o < oe; ++o) {
        uint8_t bytes[4 * kTileWords];
        for (int64_t k = 0; k < ke - kt; ++k)
          for (int j = 0; j < 4; ++j) bytes[4 * k + j] = static_cast<uint8_t>(tile[o - ob][k] >> (8 * j));
        std::memcpy(dst + (o - m.r0) * row_bytes + (first - b0), bytes + (first - 4 * kt),
                    static_cast<size_t>(last - first));
      }
    }
  }
}

// Scales, and offsets where the zero points are not the symmetric 2^(bits-1)
// (q.offset set then), of groups [g0, g1) for channels [r0, r1).
Status RepackGptqScales(const Checkpoint& ckpt, const GptqModule& m, int64_t g0, int64_t g1, Linear& q) {
  const int64_t n = m.r1 - m.r0, ng = g1 - g0;
  std::vector<float> s(static_cast<size_t>(ng * n));
  MLARUN_RETURN_IF_ERROR(ckpt.LoadSlice(m.scales->name, m.scales->shape, g0, g1, m.r0, m.r1, DType::kF32, s.data()));
  // 8-bit values are stored shifted by -128: w = (q - z) * s = (q - 128) * s + (128 - z) * s.
  const float shift = m.bits == 8 ? 128.0f : 0.0f;
  for (int64_t g = 0; g < ng; ++g) {
    for (int64_t o = m.r0; o < m.r1; ++o) {
      const float sc = s[g * n + (o - m.r0)];
      q.mutable_scale()[(o - m.r0) * q.scale_ld + g] = sc;
      if (q.offset != nullptr)
        q.mutable_offset()[(o - m.r0) * q.scale_ld + g] = (shift - static_cast<float>(m.Zero(g0 + g, o))) * sc;
    }
  }
  return Status::Ok();
}

// Whether every zero point of the slice is the symmetric one (8 or 128), so
// that Linear's fixed `zero` replaces the offsets.
bool SymmetricZeros(const GptqModule& m, int64_t g0, int64_t g1) {
  const uint32_t sym = 1u << (m.bits - 1);
  for (int64_t g = g0; g < g1; ++g)
    for (int64_t o = m.r0; o < m.r1; ++o)
      if (m.Zero(g, o) != sym) return false;
  return true;
}

}  // namespace

StatusOr<Linear> LoadGptq(const Checkpoint& ckpt, const QuantScheme& s, const std::string& prefix, int64_t rows,
                          int64_t cols, int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
  GptqModule req;
  req.bits = s.bits;
  req.per_word = s.bits == 8 ? 4 : 8;
  req.rows = rows, req.cols = cols;
  req.group = s.group > 0 ? s.group : cols;
  req.groups = (cols + req.group - 1) / req.group;
  req.r0 = r0, req.r1 = r1, req.c0 = c0, req.c1 = c1;
  req.zero_bias = s.gptq_v2 ? 0u : 1u;  // v1 stores zero points minus one
  MLARUN_ASSIGN_OR_RETURN(const GptqModule m, FindGptqModule(ckpt, s, prefix, req));
  const int64_t g0 = c0 / m.group, g1 = (c1 + m.group - 1) / m.group;
  const bool offsets = !SymmetricZeros(m, g0, g1);
  Linear q = Linear::Owned(r1 - r0, c1 - c0, m.bits == 8 ? DType::kInt8 : DType::kInt4, m.group, offsets);
  if (q.mutable_data() == nullptr)
    return ResourceExhaustedError("GPTQ module ", prefix, ": cannot allocate ", q.bytes(), " bytes");
  RepackGptqWords(m, q);
  MLARUN_RETURN_IF_ERROR(RepackGptqScales(ckpt, m, g0, g1, q));
  return q;
}

}  // namespace mlarun::quant_internal
