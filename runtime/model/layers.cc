#include "runtime/model/layers.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "runtime/base/cpu_gemm.h"

namespace mlarun {
namespace {

// GEMM rows are padded to a multiple of this so prepared products come from a
// small set of shapes (oneDNN takes ~50-100 us to prepare one).
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

Status ApplyLinear(const Linear& w, const float* x, int64_t rows, int64_t ldx, float* y, int64_t ldy,
                   bool accumulate) {
  if (rows == 0) return Status::Ok();
  const int64_t rows_pad = (rows + kRowPad - 1) / kRowPad * kRowPad;
  const size_t es = DTypeSize(w.dtype);
  ThreadBuffers& tb = Buffers();
  // A: the activations in the weight dtype, padded rows zeroed.
  if (tb.a.size() < static_cast<size_t>(rows_pad * w.in) * es) tb.a.resize(static_cast<size_t>(rows_pad * w.in) * es);
  for (int64_t r = 0; r < rows; ++r) StoreFromF32(x + r * ldx, tb.a.data() + r * w.in * static_cast<int64_t>(es), w.dtype, w.in);
  std::memset(tb.a.data() + rows * w.in * static_cast<int64_t>(es), 0, static_cast<size_t>((rows_pad - rows) * w.in) * es);
  MLARUN_ASSIGN_OR_RETURN(auto gemm, CpuGemm::Get(GemmDesc{.m = rows_pad, .n = w.out, .k = w.in, .a_type = w.dtype,
                                                          .b_type = w.dtype, .c_type = DType::kF32, .lda = w.in,
                                                          .b_stride_k = 1, .b_stride_n = w.in, .ldc = w.out}));
  if (tb.scratch.size() < gemm->scratch_bytes() + 64) tb.scratch.resize(gemm->scratch_bytes() + 64);
  if (tb.c.size() < static_cast<size_t>(rows_pad * w.out)) tb.c.resize(static_cast<size_t>(rows_pad * w.out));
  MLARUN_RETURN_IF_ERROR(gemm->Run(tb.a.data(), w.data.data(), tb.c.data(), tb.scratch.data()));
  for (int64_t r = 0; r < rows; ++r) {
    const float* src = tb.c.data() + r * w.out;
    float* dst = y + r * ldy;
    if (accumulate) {
      for (int64_t j = 0; j < w.out; ++j) dst[j] += src[j];
    } else {
      std::memcpy(dst, src, static_cast<size_t>(w.out) * sizeof(float));
    }
  }
  return Status::Ok();
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

Status ApplyMlp(const Mlp& m, const float* x, int64_t rows, int64_t ldx, float* y, int64_t ldy, bool accumulate,
                std::vector<float>& hidden) {
  const int64_t inter = m.intermediate();
  if (hidden.size() < static_cast<size_t>(rows * 2 * inter)) hidden.resize(static_cast<size_t>(rows * 2 * inter));
  MLARUN_RETURN_IF_ERROR(ApplyLinear(m.gate_up, x, rows, ldx, hidden.data(), 2 * inter));
  for (int64_t r = 0; r < rows; ++r) {
    float* h = hidden.data() + r * 2 * inter;
    for (int64_t i = 0; i < inter; ++i) {
      const float g = h[i];
      h[i] = g / (1.f + std::exp(-g)) * h[inter + i];  // silu(gate) * up
    }
  }
  return ApplyLinear(m.down, hidden.data(), rows, 2 * inter, y, ldy, accumulate);
}

}  // namespace mlarun
