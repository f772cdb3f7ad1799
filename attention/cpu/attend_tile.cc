#include "attention/cpu/attend_tile.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

namespace mlarun::cpu {
namespace {

constexpr float kLog2e = 1.4426950408889634f;

// 2^t for t <= 0, written so the compiler vectorizes it: round to the nearest
// integer n, 2^(t - n) by a degree-7 Taylor polynomial on [-1/2, 1/2] (relative
// error ~1e-7, below fp32 rounding of the scores), times 2^n built in the
// exponent bits. Inputs below -126 give ~1e-38 instead of 0, which no sum of
// at least one 1 can notice.
inline float Exp2NonPositive(float t) {
  t = t < -126.f ? -126.f : t;
  const float r = t + 12582912.f;  // 1.5 * 2^23: rounds t to an integer in the low bits
  const float n = r - 12582912.f;
  const float f = t - n;
  float p = 1.525273380405984e-05f;
  p = p * f + 1.5403530393381606e-04f;
  p = p * f + 1.3333558146428443e-03f;
  p = p * f + 9.6181291076284772e-03f;
  p = p * f + 5.5504108664821580e-02f;
  p = p * f + 2.4022650695910071e-01f;
  p = p * f + 6.9314718055994531e-01f;
  p = p * f + 1.f;
  const int32_t e = static_cast<int32_t>(n) + 127;
  const uint32_t bits = static_cast<uint32_t>(e) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

__attribute__((target_clones("avx512f", "avx2", "default")))
float RowMax(const float* x, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
  // The simd reduction lets the compiler reorder the maximum across lanes.
#pragma omp simd reduction(max : m)
  for (int64_t j = 0; j < n; ++j) m = x[j] > m ? x[j] : m;
  return m;
}

// x[j] <- exp((x[j] - mx) * scale), returns the sum.
__attribute__((target_clones("avx512f", "avx2", "default")))
float ExpInPlace(float* x, int64_t n, float mx, float scale) {
  const float k = scale * kLog2e;
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < n; ++j) {
    const float e = Exp2NonPositive((x[j] - mx) * k);
    x[j] = e;
    sum += e;
  }
  return sum;
}

__attribute__((target_clones("avx512f", "avx2", "default")))
void ScaleRow(float* x, int64_t n, float s) {
  for (int64_t j = 0; j < n; ++j) x[j] *= s;
}

__attribute__((target_clones("avx512f", "avx2", "default")))
void Axpby(float* acc, const float* part, int64_t n, float wa, float wb) {
  for (int64_t j = 0; j < n; ++j) acc[j] = acc[j] * wa + part[j] * wb;
}

}  // namespace

GemmDesc TileScoresDesc(DType dtype, int64_t rows, int64_t n_pad, int64_t d_qk, int64_t ldq, int64_t ldk) {
  return GemmDesc{.m = rows, .n = n_pad, .k = d_qk, .a_type = dtype, .b_type = dtype, .c_type = DType::kF32,
                  .lda = ldq, .b_stride_k = 1, .b_stride_n = ldk, .ldc = n_pad};
}

GemmDesc TilePvDesc(DType dtype, int64_t rows, int64_t n_pad, int64_t d_v, int64_t ldv, int64_t ldo) {
  return GemmDesc{.m = rows, .n = d_v, .k = n_pad, .a_type = dtype, .b_type = dtype, .c_type = DType::kF32,
                  .lda = n_pad, .b_stride_k = ldv, .b_stride_n = 1, .ldc = ldo};
}

Status AttendTile(const TileArgs& a) {
  MLARUN_RETURN_IF_ERROR(a.scores_gemm->Run(a.q, a.k, a.scores, a.gemm_scratch));

  // Fused masked softmax and log-sum-exp, row by row. For f32 the
  // probabilities stay in the scores buffer; for bf16 they are rounded into
  // `probs` for the second product. Columns past a row's limit become 0, so
  // the product never picks up a masked (or padded) key.
  const bool in_place = a.dtype == DType::kF32;
  for (int64_t i = 0; i < a.rows; ++i) {
    float* s = a.scores + i * a.n_pad;
    const int64_t lim = std::clamp<int64_t>(a.vis_offset + (a.row_base + i) / a.rows_per_token, 0, a.n_keys);
    float row_lse = -std::numeric_limits<float>::infinity(), inv = 0.f;
    if (lim > 0) {
      const float mx = RowMax(s, lim);
      const float sum = ExpInPlace(s, lim, mx, a.scale);
      row_lse = mx * a.scale + std::log(sum);
      inv = 1.f / sum;
    }
    std::fill(s + lim, s + a.n_pad, 0.f);
    if (!in_place) ConvertF32ToBf16(s, static_cast<bf16_t*>(a.probs) + i * a.n_pad, a.n_pad);
    a.lse[i] = row_lse;
    a.row_scale[i] = inv;
  }

  MLARUN_RETURN_IF_ERROR(a.pv_gemm->Run(in_place ? a.scores : a.probs, a.v, a.out, a.gemm_scratch));
  for (int64_t i = 0; i < a.rows; ++i) ScaleRow(a.out + i * a.ldo, a.d_v, a.row_scale[i]);
  return Status::Ok();
}

void MergeLse(float* acc, int64_t ld_acc, float* acc_lse, const float* part, int64_t ld_part,
              const float* part_lse, int64_t rows, int64_t d) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < rows; ++i) {
    const float b = part_lse[i];
    if (b == neg_inf) continue;
    const float a = acc_lse[i];
    float* ar = acc + i * ld_acc;
    const float* pr = part + i * ld_part;
    if (a == neg_inf) {
      std::memcpy(ar, pr, static_cast<size_t>(d) * sizeof(float));
      acc_lse[i] = b;
      continue;
    }
    const float m = std::max(a, b);
    const float lse = m + std::log(std::exp(a - m) + std::exp(b - m));
    Axpby(ar, pr, d, std::exp(a - lse), std::exp(b - lse));
    acc_lse[i] = lse;
  }
}

}  // namespace mlarun::cpu
