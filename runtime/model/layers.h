// Building blocks of the model's forward pass on the CPU: linear layers over
// rows of fp32 activations, RMSNorm, the SiLU-gated MLP.
#pragma once

#include <cstdint>
#include <vector>

#include "runtime/base/dtype.h"
#include "runtime/base/status.h"

namespace mlarun {

// y = x W^T for x [rows, in]; W stored [out, in] row-major in `dtype` (f32 or bf16).
struct Linear {
  int64_t out = 0, in = 0;
  DType dtype = DType::kF32;
  std::vector<std::byte> data;
  int64_t bytes() const { return static_cast<int64_t>(data.size()); }
};

// y[r] (=|+=) x[r] W^T for r < rows. x is fp32 with row stride ldx; y fp32 with
// row stride ldy. bf16 weights: x is rounded to bf16 first (fp32 accumulation).
// Uses all OpenMP threads when called outside a parallel region, the calling
// thread inside one. Thread-safe (scratch is per thread).
Status ApplyLinear(const Linear& w, const float* x, int64_t rows, int64_t ldx, float* y, int64_t ldy,
                   bool accumulate = false);

// x[r] <- x[r] / sqrt(mean(x[r]^2) + eps) * weight, in place, fp32 (as HF).
void RmsNorm(float* x, int64_t rows, int64_t ld, const float* weight, int64_t n, double eps);
// Same, out of place.
void RmsNormTo(const float* x, int64_t rows, int64_t ldx, const float* weight, int64_t n, double eps, float* y,
               int64_t ldy);

// down(silu(gate(x)) * up(x)); gate and up are fused as one [2I, H] weight
// (rows [0, I) gate, [I, 2I) up).
struct Mlp {
  Linear gate_up, down;
  int64_t intermediate() const { return gate_up.out / 2; }
};
// y (=|+=) Mlp(x) for `rows` rows of width H. `hidden` is scratch of rows x 2I floats.
Status ApplyMlp(const Mlp& m, const float* x, int64_t rows, int64_t ldx, float* y, int64_t ldy, bool accumulate,
                std::vector<float>& hidden);

}  // namespace mlarun
