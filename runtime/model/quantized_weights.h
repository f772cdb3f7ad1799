// Integer-quantized projections in Hugging Face checkpoints: the formats vLLM
// and SGLang read (config.json's "quantization_config"), each read into an
// int8 / int4 Linear (runtime/ops/linear.h; docs/quantized-weights.md).
//
//  * compressed-tensors (llm-compressor): "pack-quantized" int4 (W4A16) and
//    "int-quantized" / "naive-quantized" int8 (W8A16, W8A8), symmetric or
//    not, per group or per channel; modules in its `ignore` list stay as
//    stored (bf16 / f32).
//  * AWQ (autoawq, GEMM packing): 4-bit, zero points, group 128 (any even).
//  * GPTQ (auto-gptq / gptqmodel): 4 and 8 bit, symmetric or not; desc_act
//    (act-order) through g_idx, or refused by name.
//
// Each format's reader takes a module's tensors (`<prefix>.weight_packed`,
// `<prefix>.qweight`, ...) and gives the rows [r0, r1) x columns [c0, c1) of
// its logical weight [rows = out, cols = in] in mlarun's layout: read in place
// where the stored layout is mlarun's own (compressed-tensors), repacked into
// memory of its own otherwise. Every error names the tensor and the field.
#pragma once

#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"
#include "runtime/model/safetensors.h"
#include "runtime/ops/linear.h"

namespace mlarun {

enum class QuantFormat : uint8_t {
  kNone = 0,  // no integer quantization (bf16 / f32 / fp8 checkpoints)
  kCompressedTensors = 1,
  kAwq = 2,
  kGptq = 3,
};
std::string_view QuantFormatName(QuantFormat f);

// What config.json's quantization_config says about the projections.
struct QuantScheme {
  QuantFormat format = QuantFormat::kNone;
  int bits = 0;           // 4 or 8
  int64_t group = 0;      // elements of `in` per scale; <= 0: one per output channel
  bool symmetric = true;  // false: zero points stored
  bool desc_act = false;  // GPTQ act-order (g_idx permutes the groups)
  // GPTQ checkpoint_format "gptq_v2" (gptqmodel): zero points stored as they
  // are, not minus one as "gptq" (auto-gptq) stores them.
  bool gptq_v2 = false;
  // compressed-tensors W8A8: its input_activations are dynamic per-token int8.
  // Accepted; mlarun keeps the activations fp32 (no activation quantization).
  bool int8_activations = false;
  // Module names (or "re:" regular expressions, compressed-tensors' syntax)
  // left unquantized, e.g. "lm_head".
  std::vector<std::string> ignore;
  // compressed-tensors "mixed-precision": a config group of its own that
  // targets lm_head (bits, group, symmetry of its own; `mlarun quantize
  // --lm-head` writes one). nullptr: lm_head, where quantized, follows this
  // scheme.
  std::shared_ptr<const QuantScheme> lm_head;
  // The `ignore` list as ReadQuantScheme compiled it (SetIgnore).
  struct IgnoreMatcher;
  std::shared_ptr<const IgnoreMatcher> ignore_matcher;

  // Sets `ignore`, compiling its "re:" patterns once (a pattern matches a
  // module name from its start, as Python's re.match). INVALID_ARGUMENT naming
  // the pattern when one does not compile.
  Status SetIgnore(std::vector<std::string> names);
  // `module` (e.g. "lm_head", "model.layers.0.mlp.down_proj") is in `ignore`.
  bool Ignores(std::string_view module) const;
  // The checkpoint stores the Linear `module` quantized under this scheme,
  // judging by the name alone (what memory prediction assumes): not ignored,
  // and for AWQ / GPTQ not lm_head (neither quantizes it).
  bool Quantizes(std::string_view module) const;
  // The module `prefix` is stored quantized under this scheme (false for an
  // ignored one, or one whose quantized tensors are absent).
  bool Covers(const Checkpoint& ckpt, std::string_view prefix) const;
  // The scheme `module` is stored under: lm_head's own for "lm_head" when
  // there is one, else this.
  const QuantScheme& For(std::string_view module) const {
    return lm_head != nullptr && module == "lm_head" ? *lm_head : *this;
  }
  // The Linear's dtype it loads into: kInt4 or kInt8.
  DType dtype() const { return bits == 4 ? DType::kInt4 : DType::kInt8; }
};

// The scheme of the checkpoint in `dir` (its config.json): kNone when there
// is no quantization_config or it names fp8 (read by dtype elsewhere). An
// unsupported method, bit width, strategy or option is an error naming the
// field and its value.
StatusOr<QuantScheme> ReadQuantScheme(const std::string& dir);

// Rows [r0, r1) x columns [c0, c1) of the quantized module `prefix` (e.g.
// "model.layers.3.mlp.down_proj"), whose logical weight is [rows, cols].
// c0 must start a group (c0 % group == 0) and c1 end one or be cols; callers
// whose slice does not dequantize instead (QuantizedSliceAligned). A Linear
// read in place points into the checkpoint's mapping with `storage` null:
// the caller keeps the checkpoint alive (it sets `storage`).
StatusOr<Linear> LoadQuantizedLinear(const Checkpoint& ckpt, const QuantScheme& s, const std::string& prefix,
                                     int64_t rows, int64_t cols, int64_t r0, int64_t r1, int64_t c0, int64_t c1);
bool QuantizedSliceAligned(const QuantScheme& s, int64_t cols, int64_t c0, int64_t c1);

// The tensors a quantized module `prefix` consists of under `s` (so the
// loader counts them as used).
std::vector<std::string> QuantizedTensorNames(const QuantScheme& s, const std::string& prefix);

namespace quant_internal {
// Tensor `<prefix>.<field>` of a module stored in `format` ("AWQ",
// "compressed-tensors", ...): present, of one of `dtypes`, shaped `shape`.
// Errors name the checkpoint, the format, the tensor and, when given,
// `layout` (what the expected shape means).
StatusOr<const TensorRef*> ModuleTensor(const Checkpoint& ckpt, std::string_view format, const std::string& prefix,
                                        std::string_view field, std::initializer_list<SafetensorsDType> dtypes,
                                        const std::vector<int64_t>& shape, std::string_view layout = {});
// The little-endian 32-bit word i at p (packed int4 / int8 tensors).
inline uint32_t Word32(const std::byte* p, int64_t i) {
  uint32_t w;
  std::memcpy(&w, p + 4 * i, 4);
  return w;
}

// The readers, one per format (quantized_weights.cc dispatches). Same
// contract as LoadQuantizedLinear.
StatusOr<Linear> LoadCompressedTensors(const Checkpoint& ckpt, const QuantScheme& s, const std::string& prefix,
                                       int64_t rows, int64_t cols, int64_t r0, int64_t r1, int64_t c0, int64_t c1);
StatusOr<Linear> LoadAwq(const Checkpoint& ckpt, const QuantScheme& s, const std::string& prefix, int64_t rows,
                         int64_t cols, int64_t r0, int64_t r1, int64_t c0, int64_t c1);
StatusOr<Linear> LoadGptq(const Checkpoint& ckpt, const QuantScheme& s, const std::string& prefix, int64_t rows,
                          int64_t cols, int64_t r0, int64_t r1, int64_t c0, int64_t c1);
}  // namespace quant_internal

}  // namespace mlarun
