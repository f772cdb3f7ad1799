// The architecture of a DeepSeek-V2/V3/V3.2 model, read from a Hugging Face
// config.json or from a YAML file in configs/models/ with the same field names.
//
// Absent fields take the defaults transformers uses for the model_type
// (DeepseekV2Config / DeepseekV3Config / DeepseekV32Config, transformers 5.x).
// "deepseek_v32" is a V3 config plus the indexer fields of DeepSeek Sparse
// Attention: it parses to ModelType::kDeepSeekV3 with has_indexer(). A field
// of the wrong type, an unknown model_type or inconsistent values is an error
// naming the file and the field.
#pragma once

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "attention/mla_params.h"
#include "attention/rope.h"
#include "base/dtype.h"
#include "base/status.h"
#include "runtime/ops/moe_gate.h"  // TopkMethod, ScoringFunc

namespace mlarun {

enum class ModelType : uint8_t { kDeepSeekV2 = 0, kDeepSeekV3 = 1 };

struct ModelConfig {
  ModelType model_type = ModelType::kDeepSeekV3;
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;      // dense MLP
  int64_t moe_intermediate_size = 0;  // per expert
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  // MLA
  int64_t q_lora_rank = 0;  // 0: unset (q_proj instead of q_a_proj / q_b_proj)
  int64_t kv_lora_rank = 0;
  int64_t qk_nope_head_dim = 0;
  int64_t qk_rope_head_dim = 0;
  int64_t v_head_dim = 0;
  // MoE
  int64_t n_routed_experts = 0;  // 0: no MoE layers
  int64_t n_shared_experts = 0;
  int64_t num_experts_per_tok = 0;
  int64_t first_k_dense_replace = 0;
  int64_t moe_layer_freq = 1;
  // Multi-token-prediction modules the checkpoint ships after the decoder
  // layers (DeepSeek-V3: 1, as model.layers.61.*). Not used for decoding.
  int64_t num_nextn_predict_layers = 0;
  int64_t n_group = 1;     // expert groups (absent/null: 1)
  int64_t topk_group = 1;  // groups kept per token (absent/null: 1)
  TopkMethod topk_method = TopkMethod::kGreedy;
  ScoringFunc scoring_func = ScoringFunc::kSoftmax;
  bool norm_topk_prob = false;
  double routed_scaling_factor = 1.0;
  // DeepSeek Sparse Attention (DeepSeek-V3.2): the "lightning indexer" that
  // picks, per query token, the index_topk cached tokens MLA attends to. 0 means
  // no indexer (V2/V3 configs, where any index_* keys are ignored); a
  // deepseek_v32 config without the keys gets transformers' defaults 64/128/2048.
  // Parsed so memory planning can size such a model; Model refuses to run it.
  int64_t index_n_heads = 0;
  int64_t index_head_dim = 0;
  int64_t index_topk = 0;
  // Norms, positions, tokens
  double rms_norm_eps = 1e-6;
  RopeConfig rope;  // dim = qk_rope_head_dim; layout: V3 interleave-to-half (rope_interleave), V2 interleaved
  int64_t max_position_embeddings = 0;
  int64_t bos_token_id = -1;           // -1: none
  std::vector<int64_t> eos_token_ids;  // config's eos_token_id (int or list)
  bool tie_word_embeddings = false;
  std::string hidden_act = "silu";  // only silu is supported
  bool attention_bias = false;      // only false is supported
  // Storage
  DType weight_dtype = DType::kBF16;  // compute weights (torch_dtype / dtype): f32 or bf16
  DType kv_dtype = DType::kBF16;      // latent cache (mlarun field kv_dtype; default bf16)

  // Derived.
  bool IsMoeLayer(
      int64_t layer) const;      // n_routed_experts > 0, layer >= first_k_dense_replace, layer % moe_layer_freq == 0
  MlaShape mla_shape() const;    // h_q = num_attention_heads
  double softmax_scale() const;  // MlaSoftmaxScale(qk_nope, qk_rope, rope.scaling)
  int64_t q_head_dim() const { return qk_nope_head_dim + qk_rope_head_dim; }
  bool has_indexer() const { return index_n_heads > 0; }  // a DeepSeek-V3.2 (sparse attention) config

  friend bool operator==(const ModelConfig&, const ModelConfig&) = default;
};
std::ostream& operator<<(std::ostream& os, const ModelConfig& c);

// Sizes no model reaches. A config beyond them is refused by
// ValidateModelConfig (INVALID_ARGUMENT naming the fields, the tensor and the
// bytes) before anything is allocated, so every size computed from a valid
// config fits int64. DeepSeek-V3 is far below each: 61 layers, 256 experts,
// 0.93 G elements in its largest tensor, 1.3 TB of bf16 weights.
inline constexpr int64_t kMaxLayers = int64_t{1} << 16;            // num_hidden_layers, num_nextn_predict_layers
inline constexpr int64_t kMaxExperts = int64_t{1} << 16;           // n_routed_experts, n_shared_experts
inline constexpr int64_t kMaxTensorElems = int64_t{1} << 40;       // any one weight tensor
inline constexpr int64_t kMaxModelWeightBytes = int64_t{1} << 60;  // all weights together

// One kind of weight tensor of a config, as the whole (unsharded) model holds
// it: `count` tensors of [rows, cols] elements of `elem_bytes` each. Sizes
// are doubles so that a config whose products overflow int64 can still be
// described (and refused) exactly enough.
struct WeightTensorSize {
  std::string tensor;  // e.g. "model.layers.*.mlp.experts.*.gate_proj.weight"
  std::string fields;  // the config fields of its shape, e.g. "moe_intermediate_size x hidden_size"
  double rows = 0, cols = 0, count = 0;
  int64_t elem_bytes = 0;
  double elems() const { return rows * cols; }
  double total_bytes() const { return rows * cols * count * static_cast<double>(elem_bytes); }
};
// The matrices of `c` (norms and biases, whose sizes are bounded by these,
// left out). Requires positive sizes and a valid weight/kv dtype; any
// layer and expert counts (it does not loop over them).
std::vector<WeightTensorSize> WeightTensorSizes(const ModelConfig& c);

// Checks value ranges and consistency (positive sizes, even rope dim,
// num_experts_per_tok <= n_routed_experts, n_routed_experts divisible by
// n_group, topk_group <= n_group, supported hidden_act, positive indexer sizes
// with has_indexer(), ...), and the limits above.
Status ValidateModelConfig(const ModelConfig& c);

// Parses a Hugging Face config.json (text). `origin` names the file in errors.
StatusOr<ModelConfig> ParseHfConfigJson(std::string_view json_text, std::string_view origin);
// Reads <dir>/config.json, or the given .json file.
StatusOr<ModelConfig> LoadHfConfig(const std::string& dir_or_file);

// A YAML model description: the config.json fields, plus
//   seed: <int>                     random weights from this seed (default 0)
//   num_hidden_layers may be overridden by the caller for reduced depth.
// Unlike config.json, a key the parser does not read (at the top level or in
// rope_scaling / rope_parameters) is an error naming the key.
struct YamlModel {
  ModelConfig config;
  uint64_t seed = 0;
};
StatusOr<YamlModel> ParseModelYaml(std::string_view yaml_text, std::string_view origin);
StatusOr<YamlModel> LoadModelYaml(const std::string& path);

}  // namespace mlarun
