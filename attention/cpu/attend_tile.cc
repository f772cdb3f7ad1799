#include "attention/cpu/attend_tile.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "gemm/convert.h"
#include "gemm/cpu/kernels.h"

namespace mlarun::cpu {

GemmDesc TileScoresDesc(DType dtype, int64_t rows, int64_t n_pad, int64_t d_qk, int64_t ldq, int64_t ldk) {
  return GemmDesc{.m = rows,
                  .n = n_pad,
                  .k = d_qk,
                  .a_type = dtype,
                  .b_type = dtype,
                  .c_type = DType::kF32,
                  .lda = ldq,
                  .b_stride_k = 1,
                  .b_stride_n = ldk,
                  .ldc = n_pad};
}

GemmDesc TilePvDesc(DType dtype, int64_t rows, int64_t n_pad, int64_t d_v, int64_t ldv, int64_t ldo) {
  return GemmDesc{.m = rows,
                  .n = d_v,
                  .k = n_pad,
                  .a_type = dtype,
                  .b_type = dtype,
                  .c_type = DType::kF32,
                  .lda = n_pad,
                  .b_stride_k = ldv,
                  .b_stride_n = 1,
                  .ldc = ldo};
}

Status AttendTile(const TileArgs& a) {
  const cpu::CpuKernels& kn = cpu::Kernels();
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
      const float mx = kn.row_max(s, lim);
      const float sum = kn.exp_shifted(s, lim, mx, a.scale);
      row_lse = mx * a.scale + std::log(sum);
      inv = 1.f / sum;
    }
    std::fill(s + lim, s + a.n_pad, 0.f);
    if (!in_place) ConvertF32ToBf16(s, static_cast<bf16_t*>(a.probs) + i * a.n_pad, a.n_pad);
    a.lse[i] = row_lse;
    a.row_scale[i] = inv;
  }

  MLARUN_RETURN_IF_ERROR(a.pv_gemm->Run(in_place ? a.scores : a.probs, a.v, a.out, a.gemm_scratch));
  for (int64_t i = 0; i < a.rows; ++i) kn.scale(a.out + i * a.ldo, a.d_v, a.row_scale[i]);
  return Status::Ok();
}

void MergeLse(float* acc, int64_t ld_acc, float* acc_lse, const float* part, int64_t ld_part, const float* part_lse,
              int64_t rows, int64_t d) {
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
    cpu::Kernels().axpby(ar, pr, d, std::exp(a - lse), std::exp(b - lse));
    acc_lse[i] = lse;
  }
}

}  // namespace mlarun::cpu
