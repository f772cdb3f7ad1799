// Linear layers on the CPU: the activations converted to the weight dtype
// into per-thread scratch (kept fp32 for f8_e4m3 weights, which the kernels
// decode with their block scales), then one CpuGemm product
// (runtime/base/cpu_gemm.h: the kernel family the CPU detection chose, or
// oneDNN).
#include <cmath>
#include <cstring>
#include <vector>

#include "runtime/base/cpu_gemm.h"
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

}  // namespace

Status ApplyLinear(const LinearParams& p) {
  const Linear& w = *p.w;
  const int64_t rows = p.rows, col_begin = p.col_begin, n = p.col_end - p.col_begin;
  const float* x = p.x;
  float* y = p.y;
  if (rows == 0 || n == 0) return Status::Ok();
  if (w.data == nullptr) return FailedPreconditionError("linear: weight [", w.out, ", ", w.in, "] has no data");
  const int64_t rows_pad = rows <= kGemmSmallRows ? rows : (rows + kRowPad - 1) / kRowPad * kRowPad;
  const bool fp8 = w.dtype == DType::kF8E4M3;
  if (fp8 && w.scale == nullptr) return FailedPreconditionError("linear: f8_e4m3 weight [", w.out, ", ", w.in, "] has no scales");
  const DType a_type = fp8 ? DType::kF32 : w.dtype;
  const size_t es = DTypeSize(a_type);
  ThreadBuffers& tb = Buffers();
  // A: the activations in the weight dtype (fp32 for fp8), padded rows zeroed.
  if (tb.a.size() < static_cast<size_t>(rows_pad * w.in) * es) tb.a.resize(static_cast<size_t>(rows_pad * w.in) * es);
  for (int64_t r = 0; r < rows; ++r) StoreFromF32(x + r * p.ldx, tb.a.data() + r * w.in * static_cast<int64_t>(es), a_type, w.in);
  std::memset(tb.a.data() + rows * w.in * static_cast<int64_t>(es), 0, static_cast<size_t>((rows_pad - rows) * w.in) * es);
  // Straight into y when no padding and no accumulation has to be undone.
  const bool direct = rows_pad == rows && !p.accumulate;
  MLARUN_ASSIGN_OR_RETURN(auto gemm, CpuGemm::Get(GemmDesc{.m = rows_pad, .n = n, .k = w.in, .a_type = a_type,
                                                          .b_type = w.dtype, .c_type = DType::kF32, .lda = w.in,
                                                          .b_stride_k = 1, .b_stride_n = w.ld,
                                                          .ldc = direct ? p.ldy : n}));
  if (tb.scratch.size() < gemm->scratch_bytes() + 64) tb.scratch.resize(gemm->scratch_bytes() + 64);
  const std::byte* b = w.row(col_begin);
  // The product's column 0 is weight row col_begin: its block row of scales.
  const GemmBScales scales{.scale = w.scale, .ld = w.scale_ld, .row0 = col_begin};
  const GemmBScales* sc = fp8 ? &scales : nullptr;
  if (direct) return gemm->Run(tb.a.data(), b, y, tb.scratch.data(), sc);
  if (tb.c.size() < static_cast<size_t>(rows_pad * n)) tb.c.resize(static_cast<size_t>(rows_pad * n));
  MLARUN_RETURN_IF_ERROR(gemm->Run(tb.a.data(), b, tb.c.data(), tb.scratch.data(), sc));
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
  MLARUN_RETURN_IF_ERROR(ApplyLinear({.w = &m.gate, .col_end = m.gate.out, .x = p.x, .rows = p.rows, .ldx = p.ldx,
                                      .y = p.hidden, .ldy = 2 * inter}));
  MLARUN_RETURN_IF_ERROR(ApplyLinear({.w = &m.up, .col_end = m.up.out, .x = p.x, .rows = p.rows, .ldx = p.ldx,
                                      .y = p.hidden + inter, .ldy = 2 * inter}));
  MLARUN_RETURN_IF_ERROR(SiluMul({.hidden = p.hidden, .rows = p.rows, .inter = inter}));
  return ApplyLinear({.w = &m.down, .col_end = m.down.out, .x = p.hidden, .rows = p.rows, .ldx = 2 * inter, .y = p.y,
                      .ldy = p.ldy, .accumulate = p.accumulate});
}

}  // namespace mlarun::cpu
