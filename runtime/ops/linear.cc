#include "runtime/ops/linear.h"

#include <cstdlib>

#include "base/large_buffer.h"
#include "runtime/ops/backend.h"

namespace mlarun {

Linear Linear::Owned(int64_t out, int64_t in, DType dtype) {
  const size_t bytes = static_cast<size_t>(out * in) * DTypeSize(dtype);
  std::shared_ptr<std::byte> buf(static_cast<std::byte*>(AllocateLarge(bytes, /*zero=*/true)),
                                 [](std::byte* p) { std::free(p); });
  Linear l;
  l.out = out, l.in = in, l.dtype = dtype, l.ld = in;
  l.data = buf.get();
  l.storage = std::move(buf);
  l.owned_ = l.data != nullptr;
  if (dtype == DType::kF8E4M3) {
    l.scale_ld = Fp8Blocks(in);
    const size_t scale_bytes = static_cast<size_t>(Fp8Blocks(out) * l.scale_ld) * sizeof(float);
    std::shared_ptr<float> s(static_cast<float*>(AllocateLarge(scale_bytes, /*zero=*/true)),
                             [](float* p) { std::free(p); });
    l.scale = s.get();
    l.scale_storage = std::move(s);
    l.owned_scale_ = l.scale != nullptr;
    // A matrix without its scales is no matrix: both allocations or neither
    // (callers see mutable_data() == nullptr with bytes() > 0).
    if (l.scale == nullptr) {
      l.data = nullptr;
      l.storage.reset();
      l.owned_ = false;
    }
  }
  return l;
}

Status Linear::Place(DeviceMemory& memory, std::string_view what) {
  if (memory.host_accessible() || data == nullptr || out == 0) return Status::Ok();
  // Rows of `in` at stride `ld`: the last row ends at (out - 1) * ld + in.
  const size_t bytes = static_cast<size_t>((out - 1) * ld + in) * DTypeSize(dtype);
  MLARUN_ASSIGN_OR_RETURN(DeviceBuffer b, DeviceBuffer::Allocate(memory, bytes, what));
  MLARUN_RETURN_IF_ERROR(memory.CopyIn(b.data(), data, bytes));
  auto placed = std::make_shared<DeviceBuffer>(std::move(b));
  data = static_cast<const std::byte*>(placed->data());
  storage = std::move(placed);
  owned_ = true;
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
  if (w.dtype != DType::kF32 && w.dtype != DType::kBF16 && w.dtype != DType::kF8E4M3)
    return InvalidArgumentError(op, ": weight ", name, " dtype ",
                                IsValidDType(w.dtype) ? DTypeName(w.dtype) : std::string_view("invalid"),
                                " is not supported (f32, bf16 or f8_e4m3)");
  if (w.ld < w.in) return InvalidArgumentError(op, ": weight ", name, " ld (", w.ld, ") < in (", w.in, ")");
  if (w.dtype == DType::kF8E4M3) {
    if (w.scale == nullptr)
      return FailedPreconditionError(op, ": f8_e4m3 weight ", name, " [", w.out, ", ", w.in, "] has no block scales");
    const int64_t block_cols = Fp8Blocks(w.in);
    if (w.scale_ld < block_cols)
      return InvalidArgumentError(op, ": f8_e4m3 weight ", name, " scale_ld (", w.scale_ld, ") < ceil(in / 128) (",
                                  block_cols, ")");
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
