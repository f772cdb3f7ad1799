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

// A weight W [out, in] in `dtype` (f32, bf16, f8_e4m3 with block scales, or
// int8 / int4 with group scales), row r at data + DTypeBytes(dtype, r * ld)
// (ld >= in elements: a column slice of a wider matrix keeps its stride; even
// for int4). A view: `storage` keeps `data` alive, either a buffer of its own
// (Linear::Owned) or the memory-mapped checkpoint it is read from in place,
// so copies of a Linear share the same bytes.
//
// f8_e4m3 (DeepSeek-V3's release format): element (r, c) is
// e4m3(data[r * ld + c]) * scale[(r / 128) * scale_ld + c / 128], one fp32
// scale per 128 x 128 block (the checkpoint's weight_scale_inv).
//
// int8 / int4 (docs/quantized-weights.md): q(r, c) is the stored integer
// (int8: signed, as stored; int4: the unsigned nibble 0..15, element 2j in the
// low nibble of byte j), g = c / group its group along `in`, and element
// (r, c) is
//   q(r, c) * scale[r * scale_ld + g] + offset[r * scale_ld + g]  (offset set),
//   (q(r, c) - zero) * scale[r * scale_ld + g]                    (offset null),
// with scale_ld >= ceil(in / group). Symmetric int4 has zero 8, symmetric
// int8 zero 0; asymmetric formats carry offset = -zero_point * scale.
struct Linear {
  static constexpr int64_t kFp8Block = mlarun::kFp8Block;  // base/float8.h
  int64_t out = 0, in = 0;
  DType dtype = DType::kF32;
  const std::byte* data = nullptr;
  int64_t ld = 0;
  std::shared_ptr<const void> storage;
  // f8_e4m3: [ceil(out / 128), scale_ld >= ceil(in / 128)] fp32.
  // int8 / int4: [out, scale_ld >= ceil(in / group)] fp32, and `offset` null
  // or of the same shape. scale_storage keeps both alive.
  const float* scale = nullptr;
  int64_t scale_ld = 0;
  std::shared_ptr<const void> scale_storage;
  int64_t group = 0;              // int8 / int4: elements of `in` per scale (a multiple of 2)
  const float* offset = nullptr;  // int8 / int4: nullptr, or per-group offsets
  int32_t zero = 0;               // int8 / int4 with offset null: the integer that is 0.0

  // Memory the weight holds: its elements, plus its scales (f8_e4m3:
  // [ceil(out / 128), ceil(in / 128)] fp32; int8 / int4: [out, ceil(in /
  // group)] fp32, twice with offsets): what the loader keeps, and what
  // PredictWeightBytes counts.
  int64_t bytes() const { return data_bytes() + scale_bytes(); }
  int64_t data_bytes() const { return out * DTypeBytes(dtype, in); }
  int64_t elements() const { return out * in; }
  int64_t scale_bytes() const;
  int64_t groups() const { return group > 0 ? (in + group - 1) / group : 0; }
  const std::byte* row(int64_t r) const { return data + DTypeBytes(dtype, r * ld); }
  // Element (r, c) as fp32, for every dtype (tests, references, the slow
  // paths; the kernels decode in registers).
  float At(int64_t r, int64_t c) const;
  // Row r, elements [c0, c1), as fp32 into out[0 .. c1 - c0).
  void DequantizeRow(int64_t r, int64_t c0, int64_t c1, float* out) const;
  // A zero-filled [out, in] matrix of its own (ld = in, 64-byte aligned; int4:
  // `in` rounded up to even); for f8_e4m3 also zero-filled scales of its own
  // (scale_ld = ceil(in / 128)); for int8 / int4 zero-filled scales of
  // [out, ceil(in / group)] (scale_ld = ceil(in / group)) and, with
  // `offsets`, offsets of that shape.
  static Linear Owned(int64_t out, int64_t in, DType dtype, int64_t group = 0, bool offsets = false);
  // Writable bytes of an Owned matrix (nullptr for a view of other memory).
  std::byte* mutable_data() const { return owned_ ? const_cast<std::byte*>(data) : nullptr; }
  // Writable scales (and offsets) of an Owned f8_e4m3 / int8 / int4 matrix
  // (nullptr otherwise).
  float* mutable_scale() const { return owned_scale_ ? const_cast<float*>(scale) : nullptr; }
  float* mutable_offset() const { return owned_scale_ ? const_cast<float*>(offset) : nullptr; }
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

// Round-to-nearest quantization of `w` (any dtype) to int8 or int4 in groups
// of `group` elements of a row (group <= 0: the whole row, one scale per
// output channel), exactly as compressed-tensors quantizes a weight from its
// per-group min / max (llm-compressor's minmax observer; the .cc spells out
// the steps): symmetric scale = max|w| / 7.5 (int4) or / 127.5 (int8), zero 8
// (int4) or 0 (int8); asymmetric scale = (max - min) / 15 or / 255 with an
// integer zero point, kept as offset = -(zp + 8) * scale (int4) or -zp * scale
// (int8), zp = round(-offset / scale) - (8 or 0) recovers it exactly. The
// arithmetic is done in the weight's dtype as torch does it: each step rounded
// to bf16 for a bf16 weight, fp32 otherwise; ties round half to even. A group
// whose range is 0 gets the dtype's epsilon as scale (bf16 2^-7, fp32 2^-23).
// The result owns its memory; its scales are fp32 holding values of w's dtype.
struct QuantizeOptions {
  DType dtype = DType::kInt8;
  int64_t group = 128;  // <= 0: per output channel
  bool symmetric = true;
  // Rows over the OpenMP threads (the loader's lm_head); false where the
  // caller runs tensors on threads of its own (mlarun quantize). The result
  // is the same either way.
  bool parallel = false;
};
StatusOr<Linear> QuantizeLinear(const Linear& w, const QuantizeOptions& o);

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
