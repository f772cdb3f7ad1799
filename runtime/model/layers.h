// Building blocks of the model's forward pass on the CPU: linear layers over
// rows of fp32 activations, RMSNorm, the SiLU-gated MLP.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "runtime/base/dtype.h"
#include "runtime/base/status.h"

namespace mlarun {

// A weight W [out, in] in `dtype` (f32 or bf16), row r at data + r * ld
// elements (ld >= in: a column slice of a wider matrix keeps its stride).
// A view: `storage` keeps `data` alive, either a buffer of its own
// (Linear::Owned) or the memory-mapped checkpoint it is read from in place, so
// copies of a Linear share the same bytes.
struct Linear {
  int64_t out = 0, in = 0;
  DType dtype = DType::kF32;
  const std::byte* data = nullptr;
  int64_t ld = 0;
  std::shared_ptr<const void> storage;

  int64_t bytes() const { return out * in * static_cast<int64_t>(DTypeSize(dtype)); }
  const std::byte* row(int64_t r) const { return data + r * ld * static_cast<int64_t>(DTypeSize(dtype)); }
  // A zero-filled [out, in] matrix of its own (ld = in, 64-byte aligned).
  static Linear Owned(int64_t out, int64_t in, DType dtype);
  // Writable bytes of an Owned matrix (nullptr for a view of other memory).
  std::byte* mutable_data() const { return owned_ ? const_cast<std::byte*>(data) : nullptr; }
  // True when `data` is memory this Linear does not own (a mapped file).
  bool in_place() const { return data != nullptr && !owned_; }

 private:
  bool owned_ = false;
};

// y[r] (=|+=) x[r] W^T for r < rows. x is fp32 with row stride ldx; y fp32 with
// row stride ldy. bf16 weights: x is rounded to bf16 first (fp32 accumulation).
// Uses all OpenMP threads when called outside a parallel region, the calling
// thread inside one. Thread-safe (scratch is per thread).
Status ApplyLinear(const Linear& w, const float* x, int64_t rows, int64_t ldx, float* y, int64_t ldy,
                   bool accumulate = false);
// The same for output columns [col_begin, col_end) of W only (rows of W):
// y[r][j - col_begin] for j in the range. Lets callers split one product's
// columns over threads themselves.
Status ApplyLinearCols(const Linear& w, int64_t col_begin, int64_t col_end, const float* x, int64_t rows, int64_t ldx,
                       float* y, int64_t ldy, bool accumulate = false);

// x[r] <- x[r] / sqrt(mean(x[r]^2) + eps) * weight, in place, fp32 (as HF).
void RmsNorm(float* x, int64_t rows, int64_t ld, const float* weight, int64_t n, double eps);
// Same, out of place.
void RmsNormTo(const float* x, int64_t rows, int64_t ldx, const float* weight, int64_t n, double eps, float* y,
               int64_t ldy);

// down(silu(gate(x)) * up(x)), HF's DeepseekV2MLP / DeepseekV3MLP.
struct Mlp {
  Linear gate, up, down;  // [I, H], [I, H], [H, I]
  int64_t intermediate() const { return gate.out; }
  int64_t bytes() const { return gate.bytes() + up.bytes() + down.bytes(); }
};
// hidden[r][i] <- silu(hidden[r][i]) * hidden[r][I + i] for i < I (the gate
// half, then the up half, of rows of 2I), in place in the gate half.
void SiluMul(float* hidden, int64_t rows, int64_t inter);
// y (=|+=) Mlp(x) for `rows` rows of width H. `hidden` is scratch of rows x 2I floats.
Status ApplyMlp(const Mlp& m, const float* x, int64_t rows, int64_t ldx, float* y, int64_t ldy, bool accumulate,
                std::vector<float>& hidden);

}  // namespace mlarun
