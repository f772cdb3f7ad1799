#include "runtime/model/layers.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "runtime/base/cpu_gemm.h"
#include "runtime/base/large_buffer.h"

namespace mlarun {
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

Linear Linear::Owned(int64_t out, int64_t in, DType dtype) {
  const size_t bytes = static_cast<size_t>(out * in) * DTypeSize(dtype);
  std::shared_ptr<std::byte> buf(static_cast<std::byte*>(AllocateLarge(bytes, /*zero=*/true)),
                                 [](std::byte* p) { std::free(p); });
  Linear l;
  l.out = out, l.in = in, l.dtype = dtype, l.ld = in;
  l.data = buf.get();
  l.storage = std::move(buf);
  l.owned_ = l.data != nullptr;
  return l;
}

Status ApplyLinearCols(const Linear& w, int64_t col_begin, int64_t col_end, const float* x, int64_t rows, int64_t ldx,
                       float* y, int64_t ldy, bool accumulate) {
  const int64_t n = col_end - col_begin;
  if (rows == 0 || n == 0) return Status::Ok();
  if (col_begin < 0 || col_end > w.out || n < 0)
    return InvalidArgumentError("linear: columns [", col_begin, ", ", col_end, ") outside [0, ", w.out, ")");
  if (w.data == nullptr) return FailedPreconditionError("linear: weight [", w.out, ", ", w.in, "] has no data");
  const int64_t rows_pad = rows <= kGemmSmallRows ? rows : (rows + kRowPad - 1) / kRowPad * kRowPad;
  const size_t es = DTypeSize(w.dtype);
  ThreadBuffers& tb = Buffers();
  // A: the activations in the weight dtype, padded rows zeroed.
  if (tb.a.size() < static_cast<size_t>(rows_pad * w.in) * es) tb.a.resize(static_cast<size_t>(rows_pad * w.in) * es);
  for (int64_t r = 0; r < rows; ++r) StoreFromF32(x + r * ldx, tb.a.data() + r * w.in * static_cast<int64_t>(es), w.dtype, w.in);
  std::memset(tb.a.data() + rows * w.in * static_cast<int64_t>(es), 0, static_cast<size_t>((rows_pad - rows) * w.in) * es);
  // Straight into y when no padding and no accumulation has to be undone.
  const bool direct = rows_pad == rows && !accumulate;
  MLARUN_ASSIGN_OR_RETURN(auto gemm, CpuGemm::Get(GemmDesc{.m = rows_pad, .n = n, .k = w.in, .a_type = w.dtype,
                                                          .b_type = w.dtype, .c_type = DType::kF32, .lda = w.in,
                                                          .b_stride_k = 1, .b_stride_n = w.ld,
                                                          .ldc = direct ? ldy : n}));
  if (tb.scratch.size() < gemm->scratch_bytes() + 64) tb.scratch.resize(gemm->scratch_bytes() + 64);
  const std::byte* b = w.row(col_begin);
  if (direct) return gemm->Run(tb.a.data(), b, y, tb.scratch.data());
  if (tb.c.size() < static_cast<size_t>(rows_pad * n)) tb.c.resize(static_cast<size_t>(rows_pad * n));
  MLARUN_RETURN_IF_ERROR(gemm->Run(tb.a.data(), b, tb.c.data(), tb.scratch.data()));
  for (int64_t r = 0; r < rows; ++r) {
    const float* src = tb.c.data() + r * n;
    float* dst = y + r * ldy;
    if (accumulate) {
      for (int64_t j = 0; j < n; ++j) dst[j] += src[j];
    } else {
      std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
    }
  }
  return Status::Ok();
}

Status ApplyLinear(const Linear& w, const float* x, int64_t rows, int64_t ldx, float* y, int64_t ldy,
                   bool accumulate) {
  return ApplyLinearCols(w, 0, w.out, x, rows, ldx, y, ldy, accumulate);
}

void RmsNormTo(const float* x, int64_t rows, int64_t ldx, const float* weight, int64_t n, double eps, float* y,
               int64_t ldy) {
#pragma omp parallel for schedule(static) if (rows > 16 && !omp_in_parallel())
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * ldx;
    float* yr = y + r * ldy;
    float sum = 0.f;  // fp32 accumulation, as torch's mean over an fp32 tensor
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; ++i) sum += xr[i] * xr[i];
    const float inv = 1.f / std::sqrt(sum / static_cast<float>(n) + static_cast<float>(eps));
    for (int64_t i = 0; i < n; ++i) yr[i] = weight[i] * (xr[i] * inv);
  }
}

void RmsNorm(float* x, int64_t rows, int64_t ld, const float* weight, int64_t n, double eps) {
  RmsNormTo(x, rows, ld, weight, n, eps, x, ld);
}

void SiluMul(float* hidden, int64_t rows, int64_t inter) {
  for (int64_t r = 0; r < rows; ++r) {
    float* h = hidden + r * 2 * inter;
    for (int64_t i = 0; i < inter; ++i) {
      const float g = h[i];
      h[i] = g / (1.f + std::exp(-g)) * h[inter + i];  // silu(gate) * up
    }
  }
}

Status ApplyMlp(const Mlp& m, const float* x, int64_t rows, int64_t ldx, float* y, int64_t ldy, bool accumulate,
                std::vector<float>& hidden) {
  const int64_t inter = m.intermediate();
  if (hidden.size() < static_cast<size_t>(rows * 2 * inter)) hidden.resize(static_cast<size_t>(rows * 2 * inter));
  MLARUN_RETURN_IF_ERROR(ApplyLinear(m.gate, x, rows, ldx, hidden.data(), 2 * inter));
  MLARUN_RETURN_IF_ERROR(ApplyLinear(m.up, x, rows, ldx, hidden.data() + inter, 2 * inter));
  SiluMul(hidden.data(), rows, inter);
  return ApplyLinear(m.down, hidden.data(), rows, 2 * inter, y, ldy, accumulate);
}

}  // namespace mlarun
