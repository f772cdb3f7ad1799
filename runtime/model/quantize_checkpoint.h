// `mlarun quantize`: a Hugging Face DeepSeek-V2 / V3 checkpoint (bf16, f32,
// or the fp8 release format) rewritten as a compressed-tensors checkpoint, as
// llm-compressor writes one with a W4A16 / W8A16 round-to-nearest scheme, so
// that vLLM, SGLang and mlarun load it (docs/quantized-weights.md).
//
// Quantized (QuantizeLinear, runtime/ops/linear.h): the decoder layers'
// projections, self_attn.{q_proj, q_a_proj, q_b_proj, kv_a_proj_with_mqa,
// kv_b_proj, o_proj} and mlp.{gate,up,down}_proj of the dense MLP, of every
// routed expert and of the shared experts; lm_head as `lm_head` says. A
// module whose input width the group size does not divide stays as it is
// (compressed-tensors refuses it) and is named in `ignore`.
// Stored per quantized module M [out, in] with g = ceil(in / group) groups
// (1 per channel):
//   int4 ("pack-quantized"): M.weight_packed I32 [out, ceil(in / 8)] (element
//     c in bits 4 (c % 8) of word c / 8, as q + 8), M.weight_scale [out, g],
//     M.weight_shape I64 [2], and asymmetric M.weight_zero_point I32
//     [ceil(out / 8), g] (packed the same way along `out`);
//   int8 ("int-quantized"): M.weight I8 [out, in], M.weight_scale [out, g],
//     and asymmetric M.weight_zero_point I8 [out, g].
// Scales are in the weight's dtype (bf16 for bf16 and fp8 checkpoints).
// Everything else (embeddings, norms, the router mlp.gate and its bias) is
// copied as stored, fp8 tensors dequantized to bf16 (their _scale_inv
// dropped). The layers past num_hidden_layers (DeepSeek-V3's multi-token
// prediction layer) are left out, as transformers, and so llm-compressor,
// leave them out.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "base/dtype.h"
#include "base/status.h"
#include "runtime/model/checkpoint_writer.h"
#include "runtime/model/model.h"
#include "runtime/ops/linear.h"

namespace mlarun {

struct QuantizeProgress {
  int64_t tensors_done = 0, tensors_total = 0;
  int64_t bytes_done = 0, bytes_total = 0;  // of the output's tensors
  double seconds = 0;
  bool finished = false;
};

struct QuantizeCheckpointOptions {
  std::string model_dir;  // IN: a Hugging Face checkpoint directory
  std::string out_dir;    // OUT: created; must not exist or be an empty directory
  DType dtype = DType::kInt4;
  int64_t group = 128;  // elements per scale along `in`; 0: one per output channel
  bool symmetric = true;
  LmHeadMode lm_head = LmHeadMode::kKeep;
  int threads = 0;                             // <= 0: one per CPU
  int64_t max_shard_bytes = int64_t{5} << 30;  // output shard size
  // Called from one thread at a time after every tensor and once at the end
  // (finished); may be empty.
  std::function<void(const QuantizeProgress&)> progress;
  // Told, before the tensors are written, what the plan leaves out (modules
  // kept unquantized, layers dropped); may be empty.
  std::function<void(const std::string&)> note;
};

// Writes OUT. Blocks; reads IN through the memory map one tensor at a time
// per thread (memory stays bounded by a few tensors per thread). Errors name
// the file, tensor or option; on an error OUT may hold a partial checkpoint.
Status QuantizeCheckpoint(const QuantizeCheckpointOptions& o);

// The tensors compressed-tensors stores for module `module` (e.g.
// "model.layers.0.self_attn.o_proj") quantized as `q` (QuantizeLinear's
// result: int8 / int4, offsets when asymmetric), in the order weight_packed /
// weight, weight_shape (int4), weight_zero_point (asymmetric), weight_scale;
// the scales stored as `scale_dtype` (kBF16 or kF32).
struct EncodedTensor {
  TensorSpec spec;
  std::vector<std::byte> data;
};
std::vector<EncodedTensor> EncodeCompressedTensors(std::string_view module, const Linear& q, DType scale_dtype);

}  // namespace mlarun
