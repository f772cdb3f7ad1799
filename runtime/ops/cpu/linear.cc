// Linear layers on the CPU: the activations converted to the weight dtype
// into per-thread scratch (kept fp32 for f8_e4m3, int8 and int4 weights,
// which the kernels decode with their block or group scales), then one
// CpuGemm product
// (gemm/cpu_gemm.h: the kernel family the CPU detection chose, or
// oneDNN).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <vector>

#include "gemm/convert.h"
#include "gemm/cpu_gemm.h"
#include "runtime/ops/backend.h"

namespace mlarun::cpu {
namespace {

// Products of more rows are padded to a multiple of this so the prepared
// oneDNN products come from a small set of shapes (preparing one takes
// ~50-100 us); fewer rows run exactly (our streaming kernels prepare nothing).
constexpr int64_t kRowPad = 8;

struct ThreadBuffers {
  std::vector<std::byte> a, scratch;
  std::vector<float> c;
};
ThreadBuffers& Buffers() {
  thread_local ThreadBuffers b;
  return b;
}

// One call's product: its rows (padded), the activations' dtype, the CpuGemm
// and the buffer sizes it needs.
struct Product {
  int64_t rows_pad = 0;
  DType a_type = DType::kF32;
  bool direct = false;  // straight into y: no padding and no accumulation to undo
  std::shared_ptr<const CpuGemm> gemm;
  LinearBufferSizes sizes;
};

StatusOr<Product> Prepare(const LinearParams& p) {
  const Linear& w = *p.w;
  const int64_t rows = p.rows, n = p.col_end - p.col_begin;
  if (w.data == nullptr) return FailedPreconditionError("linear: weight [", w.out, ", ", w.in, "] has no data");
  const bool scaled = w.dtype == DType::kF8E4M3 || IsIntWeight(w.dtype);
  if (scaled && w.scale == nullptr)
    return FailedPreconditionError("linear: ", DTypeName(w.dtype), " weight [", w.out, ", ", w.in, "] has no scales");
  Product q;
  q.rows_pad = rows <= kGemmSmallRows ? rows : (rows + kRowPad - 1) / kRowPad * kRowPad;
  q.a_type = scaled ? DType::kF32 : w.dtype;
  q.direct = q.rows_pad == rows && !p.accumulate;
  MLARUN_ASSIGN_OR_RETURN(q.gemm, CpuGemm::Get(GemmDesc{.m = q.rows_pad,
                                                        .n = n,
                                                        .k = w.in,
                                                        .a_type = q.a_type,
                                                        .b_type = w.dtype,
                                                        .c_type = DType::kF32,
                                                        .lda = w.in,
                                                        .b_stride_k = 1,
                                                        .b_stride_n = w.ld,
                                                        .ldc = q.direct ? p.ldy : n,
                                                        .b_group = IsIntWeight(w.dtype) ? w.group : 0},
                                               p.router ? GemmImpl::kSmall : GemmImpl::kAuto));
  q.sizes.a_bytes = static_cast<size_t>(q.rows_pad * w.in) * DTypeSize(q.a_type);
  q.sizes.c_elems = q.direct ? 0 : static_cast<size_t>(q.rows_pad * n);
  q.sizes.scratch_bytes = q.gemm->scratch_bytes() + 64;
  return q;
}

}  // namespace

void LinearBufferSizes::Grow(const LinearBufferSizes& o) {
  a_bytes = std::max(a_bytes, o.a_bytes);
  c_elems = std::max(c_elems, o.c_elems);
  scratch_bytes = std::max(scratch_bytes, o.scratch_bytes);
}

StatusOr<LinearBufferSizes> LinearBuffersFor(const LinearParams& p) {
  if (p.rows == 0 || p.col_end == p.col_begin) return LinearBufferSizes{};
  MLARUN_ASSIGN_OR_RETURN(const Product q, Prepare(p));
  return q.sizes;
}

void ReserveLinearBuffers(const LinearBufferSizes& s) {
  ThreadBuffers& tb = Buffers();
  if (tb.a.size() < s.a_bytes) tb.a.resize(s.a_bytes);
  if (tb.c.size() < s.c_elems) tb.c.resize(s.c_elems);
  if (tb.scratch.size() < s.scratch_bytes) tb.scratch.resize(s.scratch_bytes);
}

Status ApplyLinear(const LinearParams& p) {
  const Linear& w = *p.w;
  const int64_t rows = p.rows, col_begin = p.col_begin, n = p.col_end - p.col_begin;
  const float* x = p.x;
  float* y = p.y;
  if (rows == 0 || n == 0) return Status::Ok();
  MLARUN_ASSIGN_OR_RETURN(const Product q, Prepare(p));
  ReserveLinearBuffers(q.sizes);
  ThreadBuffers& tb = Buffers();
  // A: the activations in the weight dtype (fp32 for fp8 and int), padded rows zeroed.
  const size_t es = DTypeSize(q.a_type);
  for (int64_t r = 0; r < rows; ++r)
    StoreFromF32(x + r * p.ldx, tb.a.data() + r * w.in * static_cast<int64_t>(es), q.a_type, w.in);
  std::memset(tb.a.data() + rows * w.in * static_cast<int64_t>(es), 0,
              static_cast<size_t>((q.rows_pad - rows) * w.in) * es);
  const std::byte* b = w.row(col_begin);
  // The product's column 0 is weight row col_begin: its (block) row of scales.
  const GemmBScales scales{.scale = w.scale, .ld = w.scale_ld, .row0 = col_begin, .offset = w.offset, .zero = w.zero};
  const GemmBScales* sc = w.dtype == DType::kF8E4M3 || IsIntWeight(w.dtype) ? &scales : nullptr;
  if (q.direct) return q.gemm->Run(tb.a.data(), b, y, tb.scratch.data(), sc);
  MLARUN_RETURN_IF_ERROR(q.gemm->Run(tb.a.data(), b, tb.c.data(), tb.scratch.data(), sc));
  for (int64_t r = 0; r < rows; ++r) {
    const float* src = tb.c.data() + r * n;
    float* dst = y + r * p.ldy;
    if (p.accumulate) {
      for (int64_t j = 0; j < n; ++j) dst[j] += src[j];
    } else {
      std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
    }
  }
  return Status::Ok();
}

Status SiluMul(const SiluMulParams& p) {
  const int64_t inter = p.inter;
  for (int64_t r = 0; r < p.rows; ++r) {
    float* h = p.hidden + r * 2 * inter;
    for (int64_t i = 0; i < inter; ++i) {
      const float g = h[i];
      h[i] = g / (1.f + std::exp(-g)) * h[inter + i];  // silu(gate) * up
    }
  }
  return Status::Ok();
}

Status ApplyMlp(const MlpParams& p) {
  const Mlp& m = *p.mlp;
  const int64_t inter = m.intermediate();
  MLARUN_RETURN_IF_ERROR(ApplyLinear(
      {.w = &m.gate, .col_end = m.gate.out, .x = p.x, .rows = p.rows, .ldx = p.ldx, .y = p.hidden, .ldy = 2 * inter}));
  MLARUN_RETURN_IF_ERROR(ApplyLinear({.w = &m.up,
                                      .col_end = m.up.out,
                                      .x = p.x,
                                      .rows = p.rows,
                                      .ldx = p.ldx,
                                      .y = p.hidden + inter,
                                      .ldy = 2 * inter}));
  MLARUN_RETURN_IF_ERROR(SiluMul({.hidden = p.hidden, .rows = p.rows, .inter = inter}));
  return ApplyLinear({.w = &m.down,
                      .col_end = m.down.out,
                      .x = p.hidden,
                      .rows = p.rows,
                      .ldx = 2 * inter,
                      .y = p.y,
                      .ldy = p.ldy,
                      .accumulate = p.accumulate});
}

}  // namespace mlarun::cpu
