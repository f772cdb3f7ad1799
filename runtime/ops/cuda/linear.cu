// Linear layers and the SiLU-gated MLP on the GPU (linear.h).
//
// A product is one cublasGemmEx: in cuBLAS's column-major terms y^T [n, rows]
// (ld ldy) = W_slice [n, in] (the rows col_begin.. of W, which column-major
// reads as W^T [in, n] with ld w.ld, hence OP_T) times x^T [in, rows].
// fp32 accumulation (CUBLAS_COMPUTE_32F; the handle's math mode keeps fp32
// products off TF32). bf16 weights: the activations are rounded to bf16 first
// (F32ToBf16Kernel, into a grow-only scratch), as the CPU rounds them.
// beta = 1 accumulates into y; beta = 0 never reads it. f8_e4m3 weights go to
// ApplyLinearFp8 (linear_fp8.cu).
#include <cuda_bf16.h>

#include "gemm/cuda/cublas.h"
#include "runtime/ops/backend.h"
#include "runtime/ops/cuda/common.cuh"

namespace mlarun::cuda {
namespace {

constexpr int kThreads = 256;

// out[r][c] = bf16(x[r][c]) for r < rows, c < cols, out contiguous.
__global__ void F32ToBf16Kernel(const float* __restrict__ x, int64_t ldx, int64_t rows, int64_t cols,
                                __nv_bfloat16* __restrict__ out) {
  const int64_t total = rows * cols;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = e / cols, c = e - r * cols;
    out[e] = __float2bfloat16_rn(x[r * ldx + c]);
  }
}

// h[r][i] = silu(h[r][i]) * h[r][inter + i], rows of 2 * inter.
__global__ void SiluMulKernel(float* __restrict__ hidden, int64_t rows, int64_t inter) {
  const int64_t total = rows * inter;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = e / inter, i = e - r * inter;
    float* h = hidden + r * 2 * inter;
    const float g = h[i];
    h[i] = g / (1.f + expf(-g)) * h[inter + i];
  }
}

}  // namespace

Status ApplyLinear(const LinearParams& p) {
  const Linear& w = *p.w;
  if (w.dtype == DType::kF8E4M3) return ApplyLinearFp8(p);
  const int64_t rows = p.rows, n = p.col_end - p.col_begin;
  if (rows == 0 || n == 0) return Status::Ok();
  if (w.data == nullptr) return FailedPreconditionError("linear: weight [", w.out, ", ", w.in, "] has no data");
  if (w.dtype != DType::kF32 && w.dtype != DType::kBF16)
    return InvalidArgumentError("linear: weight dtype ", DTypeName(w.dtype), " is not supported on cuda");
  MLARUN_RETURN_IF_ERROR(CheckInt("linear", "rows", rows));
  MLARUN_RETURN_IF_ERROR(CheckInt("linear", "col_end - col_begin", n));
  MLARUN_RETURN_IF_ERROR(CheckInt("linear", "w->in", w.in));
  MLARUN_RETURN_IF_ERROR(CheckInt("linear", "w->ld", w.ld));
  MLARUN_RETURN_IF_ERROR(CheckInt("linear", "ldx", p.ldx));
  MLARUN_RETURN_IF_ERROR(CheckInt("linear", "ldy", p.ldy));
  MLARUN_ASSIGN_OR_RETURN(cublasHandle_t handle, CublasHandle());
  const float alpha = 1.f, beta = p.accumulate ? 1.f : 0.f;
  const void* a = w.row(p.col_begin);
  const void* b = p.x;
  int ldb = static_cast<int>(p.ldx);
  cudaDataType_t type = CUDA_R_32F;
  if (w.dtype == DType::kBF16) {
    thread_local DeviceScratch scratch;
    MLARUN_ASSIGN_OR_RETURN(void* xb, scratch.Get(static_cast<size_t>(rows * w.in) * sizeof(__nv_bfloat16),
                                                  "linear: the bf16 activations"));
    F32ToBf16Kernel<<<GridFor(rows * w.in, kThreads), kThreads>>>(p.x, p.ldx, rows, w.in,
                                                                  static_cast<__nv_bfloat16*>(xb));
    MLARUN_CUDA_RETURN_IF_LAUNCH_FAILED("F32ToBf16Kernel");
    b = xb;
    ldb = static_cast<int>(w.in);
    type = CUDA_R_16BF;
  }
  MLARUN_CUBLAS_RETURN_IF_ERROR(cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(n),
                                             static_cast<int>(rows), static_cast<int>(w.in), &alpha, a, type,
                                             static_cast<int>(w.ld), b, type, ldb, &beta, p.y, CUDA_R_32F,
                                             static_cast<int>(p.ldy), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  return Status::Ok();
}

Status SiluMul(const SiluMulParams& p) {
  if (p.rows == 0 || p.inter == 0) return Status::Ok();
  SiluMulKernel<<<GridFor(p.rows * p.inter, kThreads), kThreads>>>(p.hidden, p.rows, p.inter);
  MLARUN_CUDA_RETURN_IF_LAUNCH_FAILED("SiluMulKernel");
  return Status::Ok();
}

// As the CPU: gate and up into the two halves of each hidden row, SiLU-mul
// in place, then down into y.
Status ApplyMlp(const MlpParams& p) {
  const Mlp& m = *p.mlp;
  const int64_t inter = m.intermediate();
  MLARUN_RETURN_IF_ERROR(ApplyLinear({.w = &m.gate,
                                      .col_end = m.gate.out,
                                      .x = p.x,
                                      .rows = p.rows,
                                      .ldx = p.ldx,
                                      .y = p.hidden,
                                      .ldy = 2 * inter,
                                      .backend = Backend::kCuda}));
  MLARUN_RETURN_IF_ERROR(ApplyLinear({.w = &m.up,
                                      .col_end = m.up.out,
                                      .x = p.x,
                                      .rows = p.rows,
                                      .ldx = p.ldx,
                                      .y = p.hidden + inter,
                                      .ldy = 2 * inter,
                                      .backend = Backend::kCuda}));
  MLARUN_RETURN_IF_ERROR(SiluMul({.hidden = p.hidden, .rows = p.rows, .inter = inter, .backend = Backend::kCuda}));
  return ApplyLinear({.w = &m.down,
                      .col_end = m.down.out,
                      .x = p.hidden,
                      .rows = p.rows,
                      .ldx = 2 * inter,
                      .y = p.y,
                      .ldy = p.ldy,
                      .accumulate = p.accumulate,
                      .backend = Backend::kCuda});
}

}  // namespace mlarun::cuda
