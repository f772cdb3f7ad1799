// Linear layers over rows of fp32 activations and the SiLU-gated MLP, behind
// params -> run (the op's entry checks the params and dispatches on backend).
//
// A product runs on whatever the backend's weights are: on the CPU, the
// checkpoint's mapped bytes or a buffer of the model's own, with fp32
// accumulation. bf16 weights: the activations are rounded to bf16 first.
// f8_e4m3 weights (docs/fp8-weights.md): read as stored and decoded with their
// block scales inside the product; the activations stay fp32 (on the CPU and
// on CUDA alike).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "base/backend.h"
#include "base/device_memory.h"
#include "base/dtype.h"
#include "base/float8.h"
#include "base/status.h"

namespace mlarun {

// A weight W [out, in] in `dtype` (f32, bf16, or f8_e4m3 with block scales),
// row r at data + r * ld elements (ld >= in: a column slice of a wider matrix
// keeps its stride). A view: `storage` keeps `data` alive, either a buffer of
// its own (Linear::Owned) or the memory-mapped checkpoint it is read from in
// place, so copies of a Linear share the same bytes.
//
// f8_e4m3 (DeepSeek-V3's release format): element (r, c) is
// e4m3(data[r * ld + c]) * scale[(r / 128) * scale_ld + c / 128], one fp32
// scale per 128 x 128 block (the checkpoint's weight_scale_inv).
struct Linear {
  static constexpr int64_t kFp8Block = mlarun::kFp8Block;  // base/float8.h
  int64_t out = 0, in = 0;
  DType dtype = DType::kF32;
  const std::byte* data = nullptr;
  int64_t ld = 0;
  std::shared_ptr<const void> storage;
  // f8_e4m3 only: [ceil(out / 128), scale_ld >= ceil(in / 128)] fp32, kept
  // alive by scale_storage.
  const float* scale = nullptr;
  int64_t scale_ld = 0;
  std::shared_ptr<const void> scale_storage;

  // Memory the weight holds: its elements, plus its block scales for f8_e4m3
  // ([ceil(out / 128), ceil(in / 128)] fp32: what the loader keeps, and what
  // PredictWeightBytes counts).
  int64_t bytes() const { return data_bytes() + scale_bytes(); }
  int64_t data_bytes() const { return out * in * static_cast<int64_t>(DTypeSize(dtype)); }
  int64_t elements() const { return out * in; }
  int64_t scale_bytes() const { return dtype == DType::kF8E4M3 ? Fp8Blocks(out) * Fp8Blocks(in) * 4 : 0; }
  const std::byte* row(int64_t r) const { return data + r * ld * static_cast<int64_t>(DTypeSize(dtype)); }
  // A zero-filled [out, in] matrix of its own (ld = in, 64-byte aligned); for
  // f8_e4m3 also zero-filled scales of its own (scale_ld = ceil(in / 128)).
  static Linear Owned(int64_t out, int64_t in, DType dtype);
  // Writable bytes of an Owned matrix (nullptr for a view of other memory).
  std::byte* mutable_data() const { return owned_ ? const_cast<std::byte*>(data) : nullptr; }
  // Writable scales of an Owned f8_e4m3 matrix (nullptr otherwise).
  float* mutable_scale() const { return owned_scale_ ? const_cast<float*>(scale) : nullptr; }
  // True when `data` is memory this Linear does not own (a mapped file).
  bool in_place() const { return data != nullptr && !owned_; }
  // Gives the matrix a copy in `memory` when the host cannot address it
  // (a no-op on the host's memory): `data` (and an f8_e4m3 matrix's `scale`)
  // then point there, and copies of this Linear made afterwards share them.
  // `what` names it in errors.
  Status Place(DeviceMemory& memory, std::string_view what);

 private:
  bool owned_ = false;
  bool owned_scale_ = false;
};

// down(silu(gate(x)) * up(x)), HF's DeepseekV2MLP / DeepseekV3MLP.
struct Mlp {
  Linear gate, up, down;  // [I, H], [I, H], [H, I]
  int64_t intermediate() const { return gate.out; }
  int64_t bytes() const { return gate.bytes() + up.bytes() + down.bytes(); }
  int64_t elements() const { return gate.elements() + up.elements() + down.elements(); }
};

// y[r][j - col_begin] (=|+=) (x[r] W^T)[j] for r < rows, j in [col_begin,
// col_end): the whole product, or a column range of it (rows of W) so that
// callers can split one product over threads themselves.
struct LinearParams {
  const Linear* w = nullptr;
  int64_t col_begin = 0;
  int64_t col_end = -1;      // -1: w->out
  const float* x = nullptr;  // [rows, w->in], row stride ldx; may be nullptr when rows == 0
  int64_t rows = 0;
  int64_t ldx = 0;
  float* y = nullptr;  // [rows, col_end - col_begin], row stride ldy
  int64_t ldy = 0;
  bool accumulate = false;
  // The MoE router's logits: a narrow fp32 product (one column per expert).
  // The CPU runs it on its streaming kernels at any row count: as fast as a
  // packed product at these widths, and never through oneDNN, whose every
  // call allocates.
  bool router = false;
  Backend backend = Backend::kCpu;
};
// CPU: all OpenMP threads when called outside a parallel region, the calling
// thread inside one. Thread-safe (scratch is per thread); allocates only when
// a thread first sees a larger product.
Status LinearRun(const LinearParams& p);

// hidden[r][i] <- silu(hidden[r][i]) * hidden[r][inter + i] for i < inter:
// rows of 2 * inter, the gate half then the up half, in place in the gate half.
struct SiluMulParams {
  float* hidden = nullptr;  // [rows, 2 * inter]
  int64_t rows = 0;
  int64_t inter = 0;
  Backend backend = Backend::kCpu;
};
Status SiluMulRun(const SiluMulParams& p);

// y (=|+=) Mlp(x) for `rows` rows of width H.
struct MlpParams {
  const Mlp* mlp = nullptr;
  const float* x = nullptr;  // [rows, H], row stride ldx
  int64_t rows = 0;
  int64_t ldx = 0;
  float* y = nullptr;  // [rows, H], row stride ldy
  int64_t ldy = 0;
  bool accumulate = false;
  float* hidden = nullptr;  // scratch [rows, 2 * mlp->intermediate()], caller-owned
  Backend backend = Backend::kCpu;
};
Status MlpRun(const MlpParams& p);

}  // namespace mlarun
