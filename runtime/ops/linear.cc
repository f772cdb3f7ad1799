#include "runtime/ops/linear.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <vector>

#include "base/large_buffer.h"
#include "gemm/convert.h"
#include "runtime/ops/backend.h"

namespace mlarun {

Linear Linear::Owned(int64_t out, int64_t in, DType dtype, int64_t group, bool offsets) {
  Linear l;
  l.out = out, l.in = in, l.dtype = dtype;
  l.ld = dtype == DType::kInt4 ? in + (in & 1) : in;
  const size_t bytes = static_cast<size_t>(out * DTypeBytes(dtype, l.ld));
  std::shared_ptr<std::byte> buf(static_cast<std::byte*>(AllocateLarge(bytes, /*zero=*/true)),
                                 [](std::byte* p) { std::free(p); });
  l.data = buf.get();
  l.storage = std::move(buf);
  l.owned_ = l.data != nullptr;
  int64_t scale_rows = 0;
  if (dtype == DType::kF8E4M3) {
    l.scale_ld = Fp8Blocks(in);
    scale_rows = Fp8Blocks(out);
  } else if (IsIntWeight(dtype)) {
    l.group = group > 0 ? group : std::max<int64_t>(in, 1);
    l.scale_ld = l.groups();
    scale_rows = out;
    l.zero = dtype == DType::kInt4 && !offsets ? 8 : 0;
  } else {
    return l;
  }
  const size_t one = static_cast<size_t>(scale_rows * l.scale_ld);
  const size_t scale_bytes = std::max<size_t>(1, (offsets ? 2 * one : one) * sizeof(float));
  std::shared_ptr<float> s(static_cast<float*>(AllocateLarge(scale_bytes, /*zero=*/true)),
                           [](float* p) { std::free(p); });
  l.scale = s.get();
  if (offsets && l.scale != nullptr) l.offset = l.scale + one;
  l.scale_storage = std::move(s);
  l.owned_scale_ = l.scale != nullptr;
  // A matrix without its scales is no matrix: both allocations or neither
  // (callers see mutable_data() == nullptr with bytes() > 0).
  if (l.scale == nullptr) {
    l.data = nullptr;
    l.storage.reset();
    l.owned_ = false;
  }
  return l;
}

int64_t Linear::scale_bytes() const {
  if (dtype == DType::kF8E4M3) return Fp8Blocks(out) * Fp8Blocks(in) * 4;
  if (IsIntWeight(dtype)) return out * groups() * 4 * (offset != nullptr ? 2 : 1);
  return 0;
}

float Linear::At(int64_t r, int64_t c) const {
  float v = 0;
  DequantizeRow(r, c, c + 1, &v);
  return v;
}

void Linear::DequantizeRow(int64_t r, int64_t c0, int64_t c1, float* dst) const {
  const std::byte* p = row(r);
  switch (dtype) {
    case DType::kF8E4M3:
      for (int64_t c = c0; c < c1; ++c)
        dst[c - c0] = E4M3ToFloat(static_cast<uint8_t>(p[c])) * scale[(r / kFp8Block) * scale_ld + c / kFp8Block];
      return;
    case DType::kInt8:
    case DType::kInt4:
      for (int64_t c = c0; c < c1; ++c) {
        const uint8_t b = static_cast<uint8_t>(p[dtype == DType::kInt4 ? c / 2 : c]);
        const int32_t q = dtype == DType::kInt8 ? static_cast<int8_t>(b) : (c & 1) ? b >> 4 : b & 15;
        const int64_t g = r * scale_ld + c / group;
        dst[c - c0] =
            offset != nullptr ? static_cast<float>(q) * scale[g] + offset[g] : static_cast<float>(q - zero) * scale[g];
      }
      return;
    default:
      LoadToF32(p + c0 * static_cast<int64_t>(DTypeSize(dtype)), dtype, dst, c1 - c0);
  }
}

namespace {

float RoundHalfEven(float x) { return std::nearbyint(x); }

// compressed-tensors' round-to-nearest (calculate_qparams, then _quantize),
// step by step in the weight's own dtype, as torch evaluates it on a bf16 or
// f32 model: every tensor op's result is rounded to that dtype (`Round`: to
// bf16, round to nearest even, for a bf16 weight; nothing for f32), and
// torch.round rounds half to even (nearbyint in the default rounding mode).
struct QuantArith {
  bool bf16 = false;
  float Round(float x) const { return bf16 ? Bf16ToFloat(FloatToBf16(x)) : x; }
  // torch.finfo(dtype).eps: the scale of a group whose range is 0.
  float Eps() const { return bf16 ? 0.0078125f : 1.1920928955078125e-7f; }
};

// One group of n values quantized into signed q[0 .. n) in [qmin, qmax] with
// its scale and integer zero point (0 when symmetric):
//   lo = min(min x, 0), hi = max(max x, 0)   (0 is always representable)
//   symmetric:  s = max(-lo, hi) / ((qmax - qmin) / 2)   (7.5 for int4, 127.5 for int8)
//   asymmetric: s = (hi - lo) / (qmax - qmin), zp = round(clamp(qmin - lo / s, qmin, qmax))
//   s == 0 -> eps (after zp: 0 / 0 gives a NaN zp, which torch's int8 cast makes 0)
//   q = round(clamp(x / s + zp, qmin, qmax))
void QuantizeGroup(const float* x, int64_t n, const QuantArith& a, int32_t qmin, int32_t qmax, bool symmetric,
                   int32_t* q, float* scale, int32_t* zero_point) {
  float lo = 0, hi = 0;
  for (int64_t i = 0; i < n; ++i) lo = std::min(lo, x[i]), hi = std::max(hi, x[i]);
  const float range = static_cast<float>(qmax - qmin);
  float s = 0, zp = 0;
  if (symmetric) {
    s = a.Round(std::max(-lo, hi) / (range / 2));
  } else {
    s = a.Round(a.Round(hi - lo) / range);
    const float z = a.Round(static_cast<float>(qmin) - a.Round(lo / s));
    zp = std::isnan(z) ? 0.0f : RoundHalfEven(std::clamp(z, static_cast<float>(qmin), static_cast<float>(qmax)));
  }
  if (s == 0) s = a.Eps();
  for (int64_t i = 0; i < n; ++i) {
    const float v = a.Round(a.Round(x[i] / s) + zp);
    q[i] = static_cast<int32_t>(RoundHalfEven(std::clamp(v, static_cast<float>(qmin), static_cast<float>(qmax))));
  }
  *scale = s;
  *zero_point = static_cast<int32_t>(zp);
}

// Row r of w into q (QuantizeLinear's layout), through the scratch row
// (w.in values) and qs (q.group).
void QuantizeRow(const Linear& w, int64_t r, const QuantArith& arith, bool symmetric, float* row, int32_t* qs,
                 Linear& q) {
  const bool int4 = q.dtype == DType::kInt4;
  const int32_t qmin = int4 ? -8 : -128, qmax = int4 ? 7 : 127;
  w.DequantizeRow(r, 0, w.in, row);
  auto* dst = reinterpret_cast<uint8_t*>(q.mutable_data()) + DTypeBytes(q.dtype, r * q.ld);
  for (int64_t g = 0; g < q.groups(); ++g) {
    const int64_t c0 = g * q.group, n = std::min(q.group, w.in - c0);
    float s = 0;
    int32_t zp = 0;
    QuantizeGroup(row + c0, n, arith, qmin, qmax, symmetric, qs, &s, &zp);
    q.mutable_scale()[r * q.scale_ld + g] = s;
    // w = (q - zp) s with q signed; the nibble is q + 8.
    if (!symmetric) q.mutable_offset()[r * q.scale_ld + g] = static_cast<float>(-(zp + (int4 ? 8 : 0))) * s;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t c = c0 + i;
      if (!int4) {
        dst[c] = static_cast<uint8_t>(static_cast<int8_t>(qs[i]));
      } else {
        const uint8_t nib = static_cast<uint8_t>(qs[i] + 8);
        dst[c / 2] = (c & 1) ? static_cast<uint8_t>((dst[c / 2] & 0x0f) | (nib << 4))
                             : static_cast<uint8_t>((dst[c / 2] & 0xf0) | nib);
      }
    }
  }
}

}  // namespace

StatusOr<Linear> QuantizeLinear(const Linear& w, const QuantizeOptions& o) {
  if (!IsIntWeight(o.dtype))
    return InvalidArgumentError("quantize: target dtype ", IsValidDType(o.dtype) ? DTypeName(o.dtype) : "invalid",
                                " is not int8 or int4");
  if (w.data == nullptr) return FailedPreconditionError("quantize: weight has no data");
  if (o.group > 0 && o.group % 2 != 0) return InvalidArgumentError("quantize: group size ", o.group, " is odd");
  // Per channel: one group as wide as the row (rounded up to even, as Linear's
  // groups must be).
  const int64_t group = o.group > 0 ? o.group : std::max<int64_t>(w.in + (w.in & 1), 2);
  Linear q = Linear::Owned(w.out, w.in, o.dtype, group, !o.symmetric);
  if (q.mutable_data() == nullptr && q.bytes() > 0)
    return ResourceExhaustedError("quantize: cannot allocate ", q.bytes(), " bytes");
  // Signed q in [qmin, qmax]: int8 stored as is; int4 stored as q + 8 (the
  // nibble), so zero = 8 symmetric and the offsets shift by 8 scales. Rows
  // are independent: any split over threads gives the same bytes.
  const QuantArith arith{.bf16 = w.dtype == DType::kBF16};
#pragma omp parallel if (o.parallel && w.out > 1)
  {
    std::vector<float> row(static_cast<size_t>(w.in));
    std::vector<int32_t> qs(static_cast<size_t>(group));
#pragma omp for schedule(static)
    for (int64_t r = 0; r < w.out; ++r) QuantizeRow(w, r, arith, o.symmetric, row.data(), qs.data(), q);
  }
  return q;
}

Status Linear::Place(DeviceMemory& memory, std::string_view what) {
  if (memory.host_accessible() || data == nullptr || out == 0) return Status::Ok();
  // Rows of `in` at stride `ld`: the last row ends at (out - 1) * ld + in.
  const size_t bytes = static_cast<size_t>(DTypeBytes(dtype, (out - 1) * ld + in));
  MLARUN_ASSIGN_OR_RETURN(DeviceBuffer b, DeviceBuffer::Allocate(memory, bytes, what));
  MLARUN_RETURN_IF_ERROR(memory.CopyIn(b.data(), data, bytes));
  auto placed = std::make_shared<DeviceBuffer>(std::move(b));
  data = static_cast<const std::byte*>(placed->data());
  storage = std::move(placed);
  owned_ = true;
  if (IsIntWeight(dtype))
    return UnimplementedError(what,
                              ": int8 / int4 weights are held on the CPU only (the CUDA backend has no "
                              "integer kernels yet)");
  if (dtype != DType::kF8E4M3 || scale == nullptr) return Status::Ok();
  // The scales the kernels read next to the e4m3 bytes: block rows at stride
  // scale_ld, the last one ending at its ceil(in / 128)-th block.
  const int64_t block_rows = Fp8Blocks(out), block_cols = Fp8Blocks(in);
  const size_t scale_bytes = static_cast<size_t>((block_rows - 1) * scale_ld + block_cols) * sizeof(float);
  MLARUN_ASSIGN_OR_RETURN(DeviceBuffer sb, DeviceBuffer::Allocate(memory, scale_bytes, std::string(what) + " scales"));
  MLARUN_RETURN_IF_ERROR(memory.CopyIn(sb.data(), scale, scale_bytes));
  auto placed_scale = std::make_shared<DeviceBuffer>(std::move(sb));
  scale = static_cast<const float*>(placed_scale->data());
  scale_storage = std::move(placed_scale);
  owned_scale_ = true;
  return Status::Ok();
}

namespace {

Status CheckWeight(std::string_view op, std::string_view name, const Linear& w) {
  if (w.data == nullptr)
    return FailedPreconditionError(op, ": weight ", name, " [", w.out, ", ", w.in, "] has no data");
  if (w.dtype != DType::kF32 && w.dtype != DType::kBF16 && w.dtype != DType::kF8E4M3 && !IsIntWeight(w.dtype))
    return InvalidArgumentError(op, ": weight ", name, " dtype ",
                                IsValidDType(w.dtype) ? DTypeName(w.dtype) : std::string_view("invalid"),
                                " is not supported (f32, bf16, f8_e4m3, int8 or int4)");
  if (w.ld < w.in) return InvalidArgumentError(op, ": weight ", name, " ld (", w.ld, ") < in (", w.in, ")");
  if (w.dtype == DType::kF8E4M3) {
    if (w.scale == nullptr)
      return FailedPreconditionError(op, ": f8_e4m3 weight ", name, " [", w.out, ", ", w.in, "] has no block scales");
    const int64_t block_cols = Fp8Blocks(w.in);
    if (w.scale_ld < block_cols)
      return InvalidArgumentError(op, ": f8_e4m3 weight ", name, " scale_ld (", w.scale_ld, ") < ceil(in / 128) (",
                                  block_cols, ")");
  }
  if (IsIntWeight(w.dtype)) {
    if (w.scale == nullptr || w.group <= 0 || w.group % 2 != 0)
      return FailedPreconditionError(op, ": ", DTypeName(w.dtype), " weight ", name, " [", w.out, ", ", w.in,
                                     "] has no scales or an odd group size (", w.group, ")");
    if (w.scale_ld < w.groups())
      return InvalidArgumentError(op, ": ", DTypeName(w.dtype), " weight ", name, " scale_ld (", w.scale_ld,
                                  ") < ceil(in / group) (", w.groups(), ")");
    if (w.dtype == DType::kInt4 && w.ld % 2 != 0)
      return InvalidArgumentError(op, ": int4 weight ", name, " ld (", w.ld, ") is odd");
  }
  return Status::Ok();
}

}  // namespace

Status LinearRun(const LinearParams& p) {
  if (p.w == nullptr) return InvalidArgumentError("linear: w is null");
  LinearParams q = p;
  if (q.col_end == -1) q.col_end = p.w->out;
  if (q.col_begin < 0 || q.col_end > p.w->out || q.col_end < q.col_begin)
    return InvalidArgumentError("linear: columns [col_begin, col_end) = [", q.col_begin, ", ", q.col_end,
                                ") outside [0, ", p.w->out, ")");
  if (p.rows < 0) return InvalidArgumentError("linear: rows is negative (", p.rows, ")");
  const int64_t n = q.col_end - q.col_begin;
  if (p.rows == 0 || n == 0) return Status::Ok();
  MLARUN_RETURN_IF_ERROR(CheckWeight("linear", "w", *p.w));
  if (p.x == nullptr || p.y == nullptr) return InvalidArgumentError("linear: x and y must be set");
  if (p.ldx < p.w->in) return InvalidArgumentError("linear: ldx (", p.ldx, ") < w->in (", p.w->in, ")");
  if (p.ldy < n) return InvalidArgumentError("linear: ldy (", p.ldy, ") < col_end - col_begin (", n, ")");
  switch (p.backend) {
    case Backend::kCpu:
      return cpu::ApplyLinear(q);
    case Backend::kCuda:
      return cuda::ApplyLinear(q);
  }
  return NoBackend("linear", p.backend);
}

Status SiluMulRun(const SiluMulParams& p) {
  if (p.rows < 0 || p.inter < 0)
    return InvalidArgumentError("silu_mul: rows (", p.rows, ") and inter (", p.inter, ") must be >= 0");
  if (p.rows > 0 && p.inter > 0 && p.hidden == nullptr) return InvalidArgumentError("silu_mul: hidden is null");
  switch (p.backend) {
    case Backend::kCpu:
      return cpu::SiluMul(p);
    case Backend::kCuda:
      return cuda::SiluMul(p);
  }
  return NoBackend("silu_mul", p.backend);
}

Status MlpRun(const MlpParams& p) {
  if (p.mlp == nullptr) return InvalidArgumentError("mlp: mlp is null");
  if (p.rows < 0) return InvalidArgumentError("mlp: rows is negative (", p.rows, ")");
  if (p.rows == 0) return Status::Ok();
  const Mlp& m = *p.mlp;
  MLARUN_RETURN_IF_ERROR(CheckWeight("mlp", "gate", m.gate));
  MLARUN_RETURN_IF_ERROR(CheckWeight("mlp", "up", m.up));
  MLARUN_RETURN_IF_ERROR(CheckWeight("mlp", "down", m.down));
  if (m.up.out != m.gate.out || m.up.in != m.gate.in || m.down.in != m.gate.out)
    return InvalidArgumentError("mlp: shapes of gate [", m.gate.out, ", ", m.gate.in, "], up [", m.up.out, ", ",
                                m.up.in, "] and down [", m.down.out, ", ", m.down.in, "] do not chain");
  if (p.x == nullptr || p.y == nullptr || p.hidden == nullptr)
    return InvalidArgumentError("mlp: x, y and hidden must be set");
  if (p.ldx < m.gate.in) return InvalidArgumentError("mlp: ldx (", p.ldx, ") < gate.in (", m.gate.in, ")");
  if (p.ldy < m.down.out) return InvalidArgumentError("mlp: ldy (", p.ldy, ") < down.out (", m.down.out, ")");
  switch (p.backend) {
    case Backend::kCpu:
      return cpu::ApplyMlp(p);
    case Backend::kCuda:
      return cuda::ApplyMlp(p);
  }
  return NoBackend("mlp", p.backend);
}

}  // namespace mlarun
