#include "runtime/model/model_config.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <regex>
#include <string>
#include <utility>

#include "base/file.h"
#include "base/suggest.h"

namespace mlarun {
namespace {

using Json = nlohmann::json;

// DeepseekV32Config's indexer defaults (transformers 5.x,
// models/deepseek_v32/configuration_deepseek_v32.py).
constexpr int64_t kDefaultIndexNHeads = 64;
constexpr int64_t kDefaultIndexHeadDim = 128;
constexpr int64_t kDefaultIndexTopk = 2048;

// transformers' RotaryEmbeddingConfigMixin.default_theta (modeling_rope_utils.py).
constexpr double kDefaultRopeTheta = 10000.0;
// YaRN ramp bounds when the config leaves them out (or sets them to 0/null):
// `rope_parameters.get("beta_fast") or 32`, `... or 1` in _compute_yarn_parameters.
constexpr double kDefaultBetaFast = 32.0;
constexpr double kDefaultBetaSlow = 1.0;

std::string_view ModelTypeName(ModelType t) {
  switch (t) {
    case ModelType::kDeepSeekV2:
      return "deepseek_v2";
    case ModelType::kDeepSeekV3:
      return "deepseek_v3";
  }
  return "?";
}

std::string_view TopkMethodName(TopkMethod m) {
  switch (m) {
    case TopkMethod::kGreedy:
      return "greedy";
    case TopkMethod::kGroupLimitedGreedy:
      return "group_limited_greedy";
    case TopkMethod::kNoauxTc:
      return "noaux_tc";
  }
  return "?";
}

std::string_view ScoringFuncName(ScoringFunc f) {
  switch (f) {
    case ScoringFunc::kSoftmax:
      return "softmax";
    case ScoringFunc::kSigmoid:
      return "sigmoid";
  }
  return "?";
}

// The defaults of DeepseekV3Config / DeepseekV2Config in transformers 5.24
// (models/deepseek_v{2,3}/configuration_deepseek_v{2,3}.py). Fields that are
// None there get the value this struct documents for null (n_group/topk_group
// 1, num_experts_per_tok 0, which validation rejects while experts exist).
ModelConfig TransformersDefaults(ModelType type) {
  ModelConfig c;
  c.model_type = type;
  c.kv_lora_rank = 512;
  c.q_lora_rank = 1536;
  c.qk_nope_head_dim = 128;
  c.qk_rope_head_dim = 64;
  c.v_head_dim = 128;
  c.rms_norm_eps = 1e-6;
  c.tie_word_embeddings = false;
  c.hidden_act = "silu";
  c.attention_bias = false;
  c.moe_layer_freq = 1;  // original DeepSeek field; transformers has none and makes every layer MoE
  c.rope.theta = kDefaultRopeTheta;
  c.weight_dtype = DType::kBF16;
  c.kv_dtype = DType::kBF16;
  if (type == ModelType::kDeepSeekV3) {
    c.vocab_size = 129280;
    c.hidden_size = 7168;
    c.intermediate_size = 18432;
    c.moe_intermediate_size = 2048;
    c.num_hidden_layers = 61;
    c.num_attention_heads = 128;
    c.n_shared_experts = 1;
    c.n_routed_experts = 256;
    c.routed_scaling_factor = 2.5;
    c.n_group = 8;
    c.topk_group = 4;
    c.num_experts_per_tok = 8;
    c.first_k_dense_replace = 3;
    c.norm_topk_prob = true;
    c.max_position_embeddings = 4096;
    c.bos_token_id = 0;
    c.eos_token_ids = {1};
    // HF DeepseekV3TopkRouter always scores with sigmoid + e_score_correction_bias
    // and selects groups first (the original "noaux_tc").
    c.topk_method = TopkMethod::kNoauxTc;
    c.scoring_func = ScoringFunc::kSigmoid;
    c.rope.layout = RopeLayout::kInterleavedToHalf;  // rope_interleave = True
  } else {
    c.vocab_size = 102400;
    c.hidden_size = 4096;
    c.intermediate_size = 11008;
    c.moe_intermediate_size = 1407;
    c.num_hidden_layers = 32;
    c.num_attention_heads = 32;
    c.n_shared_experts = 2;
    c.n_routed_experts = 64;
    c.routed_scaling_factor = 1.0;
    c.n_group = 1;              // None
    c.topk_group = 1;           // None
    c.num_experts_per_tok = 0;  // None
    c.first_k_dense_replace = 0;
    c.norm_topk_prob = false;
    c.max_position_embeddings = 2048;
    c.bos_token_id = 1;
    c.eos_token_ids = {2};
    c.topk_method = TopkMethod::kGreedy;
    c.scoring_func = ScoringFunc::kSoftmax;    // DeepseekV2TopkRouter: softmax only
    c.rope.layout = RopeLayout::kInterleaved;  // apply_rotary_emb on complex pairs
  }
  c.rope.dim = c.qk_rope_head_dim;
  return c;
}

std::string Describe(const Json& v) {
  // replace: a YAML scalar may hold bytes that are not UTF-8 (dump would throw).
  std::string s = v.dump(-1, ' ', false, Json::error_handler_t::replace);
  if (s.size() > 60) s = s.substr(0, 57) + "...";
  return s;
}

// Typed access to the fields of one JSON object. Every error names the origin
// file and the field's dotted path, so a user can find the line to fix. Both
// config.json and YAML go through here (YAML is converted to JSON first), so
// the field list, defaults and validation exist once.
class FieldReader {
 public:
  FieldReader(const Json& object, std::string_view origin, std::string prefix = "")
      : object_(object), origin_(origin), prefix_(std::move(prefix)) {}

  const Json* Find(std::string_view key) const {
    auto it = object_.find(key);
    return it == object_.end() ? nullptr : &*it;
  }
  bool Has(std::string_view key) const { return Find(key) != nullptr; }
  bool HasNonNull(std::string_view key) const {
    const Json* v = Find(key);
    return v != nullptr && !v->is_null();
  }

  std::string Path(std::string_view key) const { return prefix_ + std::string(key); }

  template <typename... Args>
  Status Error(std::string_view key, const Args&... args) const {
    return InvalidArgumentError(origin_, ": ", Path(key), ": ", args...);
  }

  // Integer field. Absent: *out keeps its value (the default). null: *out =
  // *null_value if the field is nullable, else an error.
  Status Int(std::string_view key, int64_t* out, std::optional<int64_t> null_value = std::nullopt) const {
    const Json* v = Find(key);
    if (v == nullptr) return Status::Ok();
    if (v->is_null() && null_value) {
      *out = *null_value;
      return Status::Ok();
    }
    return ToInt(key, *v, out);
  }

  Status ToInt(std::string_view key, const Json& v, int64_t* out) const {
    // JSON integers only: 3.5 and also 7168.0 are rejected, as transformers'
    // strict config dataclasses do.
    if (v.is_number_unsigned()) {
      const uint64_t u = v.get<uint64_t>();
      if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
        return Error(key, "integer out of range: ", Describe(v));
      *out = static_cast<int64_t>(u);
      return Status::Ok();
    }
    if (v.is_number_integer()) {
      *out = v.get<int64_t>();
      return Status::Ok();
    }
    return Error(key, "must be an integer, got ", Describe(v));
  }

  // Floating-point field; integers are accepted (configs write "rope_theta": 10000).
  Status Double(std::string_view key, double* out, std::optional<double> null_value = std::nullopt) const {
    const Json* v = Find(key);
    if (v == nullptr) return Status::Ok();
    if (v->is_null() && null_value) {
      *out = *null_value;
      return Status::Ok();
    }
    if (!v->is_number()) return Error(key, "must be a number, got ", Describe(*v));
    *out = v->get<double>();
    if (!std::isfinite(*out)) return Error(key, "must be finite, got ", *out);
    return Status::Ok();
  }

  Status Bool(std::string_view key, bool* out, std::optional<bool> null_value = std::nullopt) const {
    const Json* v = Find(key);
    if (v == nullptr) return Status::Ok();
    if (v->is_null() && null_value) {
      *out = *null_value;
      return Status::Ok();
    }
    if (!v->is_boolean()) return Error(key, "must be true or false, got ", Describe(*v));
    *out = v->get<bool>();
    return Status::Ok();
  }

  // String field; absent leaves *out, null is an error unless allowed (then *out is untouched).
  Status String(std::string_view key, std::string* out, bool null_keeps_default = false) const {
    const Json* v = Find(key);
    if (v == nullptr) return Status::Ok();
    if (v->is_null() && null_keeps_default) return Status::Ok();
    if (!v->is_string()) return Error(key, "must be a string, got ", Describe(*v));
    *out = v->get<std::string>();
    return Status::Ok();
  }

 private:
  const Json& object_;
  std::string_view origin_;
  std::string prefix_;
};

// Reads the rope slice: rope_theta, rope_interleave and either the legacy
// rope_scaling dict or transformers-5's rope_parameters.
Status ReadRope(const FieldReader& f, std::string_view origin, ModelConfig* c) {
  // transformers' convert_rope_params_to_dict: `rope_parameters = rope_scaling
  // or rope_parameters`, i.e. a non-empty legacy rope_scaling replaces
  // rope_parameters entirely. transformers 5 itself only writes rope_parameters,
  // so a file with both was edited by hand after the fact.
  const Json* scaling = nullptr;
  std::string_view scaling_key;
  for (std::string_view key : {"rope_scaling", "rope_parameters"}) {
    const Json* v = f.Find(key);
    if (v == nullptr || v->is_null()) continue;
    if (!v->is_object()) return f.Error(key, "must be an object or null, got ", Describe(*v));
    if (v->empty() && key == "rope_scaling") continue;  // `{} or rope_parameters`
    scaling = v;
    scaling_key = key;
    break;
  }

  // rope_theta: inside the dict wins (setdefault), then the top-level field,
  // then default_theta.
  c->rope.theta = kDefaultRopeTheta;
  MLARUN_RETURN_IF_ERROR(f.Double("rope_theta", &c->rope.theta));
  c->rope.scaling = RopeScaling{};
  c->rope.scaling.type = RopeScaling::Type::kNone;
  if (scaling != nullptr) {
    const FieldReader s(*scaling, origin, std::string(scaling_key) + ".");
    MLARUN_RETURN_IF_ERROR(s.Double("rope_theta", &c->rope.theta));
    // `rope_type` wins over the legacy `type`; neither means "default".
    std::string rope_type = "default";
    std::string_view type_key = "rope_type";
    if (!s.HasNonNull("rope_type") && s.HasNonNull("type")) type_key = "type";
    if (!(c->rope.theta > 1.0)) return s.Error("rope_theta", "must be > 1, got ", c->rope.theta);
    MLARUN_RETURN_IF_ERROR(s.String(type_key, &rope_type, /*null_keeps_default=*/true));
    if (rope_type == "yarn") {
      RopeScaling& y = c->rope.scaling;
      y.type = RopeScaling::Type::kYarn;
      // standardize_rope_params: original_max_position_embeddings defaults to
      // max_position_embeddings under yarn.
      y.original_max_position_embeddings = c->max_position_embeddings;
      MLARUN_RETURN_IF_ERROR(
          s.Int("original_max_position_embeddings", &y.original_max_position_embeddings, c->max_position_embeddings));
      if (y.original_max_position_embeddings <= 0)
        return s.Error("original_max_position_embeddings", "must be positive, got ",
                       y.original_max_position_embeddings);
      // _compute_yarn_parameters: factor None -> max_position_embeddings /
      // original_max_position_embeddings (transformers itself requires the key
      // to be present; an absent key is treated like null here).
      y.factor =
          static_cast<double>(c->max_position_embeddings) / static_cast<double>(y.original_max_position_embeddings);
      MLARUN_RETURN_IF_ERROR(s.Double("factor", &y.factor, y.factor));
      // `beta_fast or 32`: absent, null and 0 all mean the default.
      y.beta_fast = kDefaultBetaFast;
      y.beta_slow = kDefaultBetaSlow;
      MLARUN_RETURN_IF_ERROR(s.Double("beta_fast", &y.beta_fast, kDefaultBetaFast));
      MLARUN_RETURN_IF_ERROR(s.Double("beta_slow", &y.beta_slow, kDefaultBetaSlow));
      if (y.beta_fast == 0.0) y.beta_fast = kDefaultBetaFast;
      if (y.beta_slow == 0.0) y.beta_slow = kDefaultBetaSlow;
      // 0 means absent for both, which is also how HF tests them (`if mscale and mscale_all_dim`).
      y.mscale = 0.0;
      y.mscale_all_dim = 0.0;
      MLARUN_RETURN_IF_ERROR(s.Double("mscale", &y.mscale, 0.0));
      MLARUN_RETURN_IF_ERROR(s.Double("mscale_all_dim", &y.mscale_all_dim, 0.0));
      y.attention_factor = 0.0;
      MLARUN_RETURN_IF_ERROR(s.Double("attention_factor", &y.attention_factor, 0.0));
      // `rope_parameters.get("truncate", True)`: null is falsy there.
      y.truncate = true;
      MLARUN_RETURN_IF_ERROR(s.Bool("truncate", &y.truncate, false));
      // Checked here, where the exact key is known; ValidateModelConfig repeats
      // them for configs built in code.
      if (!(y.factor > 0.0)) return s.Error("factor", "must be positive, got ", y.factor);
      if (y.beta_fast < 0.0) return s.Error("beta_fast", "must be positive, got ", y.beta_fast);
      if (y.beta_slow < 0.0) return s.Error("beta_slow", "must be positive, got ", y.beta_slow);
      if (y.attention_factor < 0.0)
        return s.Error("attention_factor", "must be non-negative, got ", y.attention_factor);
    } else if (rope_type != "default") {
      return s.Error(type_key, "unsupported rope type '", rope_type, "' (expected 'default' or 'yarn')");
    }
  }

  if (!(c->rope.theta > 1.0)) return f.Error("rope_theta", "must be > 1, got ", c->rope.theta);
  c->rope.dim = c->qk_rope_head_dim;
  if (c->model_type == ModelType::kDeepSeekV3) {
    // `if self.config.rope_interleave:` -- null is falsy, so rotate_half.
    bool interleave = true;
    MLARUN_RETURN_IF_ERROR(f.Bool("rope_interleave", &interleave, false));
    c->rope.layout = interleave ? RopeLayout::kInterleavedToHalf : RopeLayout::kHalf;
  } else {
    // DeepseekV2Attention always uses apply_rotary_emb (complex pairs); it has
    // no rope_interleave switch, so the field is ignored like any unknown one.
    c->rope.layout = RopeLayout::kInterleaved;
  }
  return Status::Ok();
}

// Maps a torch dtype name to the compute-weight dtype.
Status ReadWeightDtype(const FieldReader& f, ModelConfig* c) {
  // transformers 5: `dtype` wins, the legacy `torch_dtype` fills in when dtype is None.
  std::string_view key;
  if (f.HasNonNull("dtype")) {
    key = "dtype";
  } else if (f.HasNonNull("torch_dtype")) {
    key = "torch_dtype";
  } else {
    c->weight_dtype = DType::kBF16;
    return Status::Ok();
  }
  std::string name;
  MLARUN_RETURN_IF_ERROR(f.String(key, &name));
  StatusOr<DType> dtype = ParseDType(name);
  if (!dtype.ok()) return f.Error(key, "unsupported dtype '", name, "' (expected float32 or bfloat16)");
  switch (*dtype) {
    case DType::kF32:
      c->weight_dtype = DType::kF32;
      break;
    case DType::kBF16:
      c->weight_dtype = DType::kBF16;
      break;
    // fp16 -> bf16 would drop 3 mantissa bits; fp16 -> fp32 is exact, so an fp16
    // checkpoint computes in fp32 (the loader widens at load time).
    case DType::kF16:
      c->weight_dtype = DType::kF32;
      break;
    default:
      return f.Error(key, "unsupported dtype '", name, "' (expected float32 or bfloat16)");
  }
  return Status::Ok();
}

Status ReadTokenIds(const FieldReader& f, ModelConfig* c) {
  MLARUN_RETURN_IF_ERROR(f.Int("bos_token_id", &c->bos_token_id, -1));
  const Json* eos = f.Find("eos_token_id");
  if (eos == nullptr) return Status::Ok();
  c->eos_token_ids.clear();
  if (eos->is_null()) return Status::Ok();
  if (eos->is_array()) {
    for (size_t i = 0; i < eos->size(); ++i) {
      int64_t id = 0;
      MLARUN_RETURN_IF_ERROR(f.ToInt("eos_token_id[" + std::to_string(i) + "]", (*eos)[i], &id));
      c->eos_token_ids.push_back(id);
    }
    return Status::Ok();
  }
  int64_t id = 0;
  if (!eos->is_number_integer())
    return f.Error("eos_token_id", "must be an integer, a list of integers or null, got ", Describe(*eos));
  MLARUN_RETURN_IF_ERROR(f.ToInt("eos_token_id", *eos, &id));
  c->eos_token_ids.push_back(id);
  return Status::Ok();
}

// Reads an integer field that transformers also accepts under an attribute_map
// alias. When both are present the alias wins, as in transformers (the alias
// kwarg is applied after the dataclass field).
Status IntWithAlias(const FieldReader& f, std::string_view key, std::string_view alias, int64_t* out) {
  if (f.Has(alias)) return f.Int(alias, out);
  return f.Int(key, out);
}

// The gating fields. The HF routers hard-code the scoring function (V3
// sigmoid, V2 softmax), and V3 ignores topk_method; the original DeepSeek
// fields are still accepted when they agree, since real config.json files
// carry them.
Status ReadGating(const FieldReader& f, const std::string& model_type_name, bool v3, ModelConfig* c) {
  std::string scoring = std::string(ScoringFuncName(c->scoring_func));
  MLARUN_RETURN_IF_ERROR(f.String("scoring_func", &scoring, /*null_keeps_default=*/true));
  if (scoring != ScoringFuncName(c->scoring_func))
    return f.Error("scoring_func", "unsupported value '", scoring, "' for ", model_type_name, " (expected '",
                   ScoringFuncName(c->scoring_func), "')");
  std::string topk_method = std::string(TopkMethodName(c->topk_method));
  MLARUN_RETURN_IF_ERROR(f.String("topk_method", &topk_method));
  if (v3) {
    if (topk_method != "noaux_tc")
      return f.Error("topk_method", "unsupported value '", topk_method, "' for ", model_type_name,
                     " (expected 'noaux_tc')");
  } else if (topk_method == "greedy") {
    c->topk_method = TopkMethod::kGreedy;
  } else if (topk_method == "group_limited_greedy") {
    c->topk_method = TopkMethod::kGroupLimitedGreedy;
  } else {
    return f.Error("topk_method", "unsupported value '", topk_method,
                   "' for deepseek_v2 (expected 'greedy' or 'group_limited_greedy')");
  }
  return Status::Ok();
}

// DeepSeek Sparse Attention's indexer (the caller reads it for deepseek_v32
// only). Only deepseek_v32 has the fields; DeepseekV2Config/DeepseekV3Config
// do not, so index_* keys in those configs are ignored like any unknown key
// (left 0: no indexer).
Status ReadIndexer(const FieldReader& f, ModelConfig* c) {
  c->index_n_heads = kDefaultIndexNHeads;
  c->index_head_dim = kDefaultIndexHeadDim;
  c->index_topk = kDefaultIndexTopk;
  const std::pair<std::string_view, int64_t*> index_fields[] = {
      {"index_n_heads", &c->index_n_heads},
      {"index_head_dim", &c->index_head_dim},
      {"index_topk", &c->index_topk},
  };
  for (const auto& [key, value] : index_fields) {
    MLARUN_RETURN_IF_ERROR(f.Int(key, value));
    // Checked here, where the key is known: 0 would silently mean "no indexer".
    if (*value <= 0) return f.Error(key, "must be positive, got ", *value);
  }
  return Status::Ok();
}

// The shared parser: `root` is the config as JSON, whichever file it came from.
StatusOr<ModelConfig> ParseConfigObject(const Json& root, std::string_view origin) {
  if (!root.is_object())
    return InvalidArgumentError(origin, ": top level must be an object/mapping, got ", Describe(root));
  const FieldReader f(root, origin);

  std::string model_type_name;
  if (!f.HasNonNull("model_type"))
    return f.Error("model_type", "missing (expected 'deepseek_v3', 'deepseek_v32' or 'deepseek_v2')");
  MLARUN_RETURN_IF_ERROR(f.String("model_type", &model_type_name));
  ModelType model_type;
  // DeepseekV32Config subclasses DeepseekV3Config and only adds the indexer
  // fields, so a V3.2 config is a V3 one (same defaults and checks) plus those.
  const bool v32 = model_type_name == "deepseek_v32";
  if (model_type_name == "deepseek_v3" || v32) {
    model_type = ModelType::kDeepSeekV3;
  } else if (model_type_name == "deepseek_v2") {
    model_type = ModelType::kDeepSeekV2;
  } else {
    return f.Error("model_type", "unsupported model type '", model_type_name,
                   "' (expected 'deepseek_v3', 'deepseek_v32' or 'deepseek_v2')");
  }
  ModelConfig c = TransformersDefaults(model_type);
  const bool v3 = model_type == ModelType::kDeepSeekV3;

  MLARUN_RETURN_IF_ERROR(f.Int("vocab_size", &c.vocab_size));
  MLARUN_RETURN_IF_ERROR(f.Int("hidden_size", &c.hidden_size));
  MLARUN_RETURN_IF_ERROR(f.Int("intermediate_size", &c.intermediate_size));
  MLARUN_RETURN_IF_ERROR(f.Int("moe_intermediate_size", &c.moe_intermediate_size));
  MLARUN_RETURN_IF_ERROR(f.Int("num_hidden_layers", &c.num_hidden_layers));
  MLARUN_RETURN_IF_ERROR(f.Int("num_attention_heads", &c.num_attention_heads));
  // null: no query compression (q_proj instead of q_a_proj/q_b_proj), as in V2-Lite.
  MLARUN_RETURN_IF_ERROR(f.Int("q_lora_rank", &c.q_lora_rank, 0));
  MLARUN_RETURN_IF_ERROR(f.Int("kv_lora_rank", &c.kv_lora_rank));
  MLARUN_RETURN_IF_ERROR(f.Int("qk_nope_head_dim", &c.qk_nope_head_dim));
  MLARUN_RETURN_IF_ERROR(f.Int("qk_rope_head_dim", &c.qk_rope_head_dim));
  MLARUN_RETURN_IF_ERROR(f.Int("v_head_dim", &c.v_head_dim));

  MLARUN_RETURN_IF_ERROR(
      IntWithAlias(f, "n_routed_experts", v3 ? "num_local_experts" : "num_experts", &c.n_routed_experts));
  MLARUN_RETURN_IF_ERROR(f.Int("n_shared_experts", &c.n_shared_experts));
  MLARUN_RETURN_IF_ERROR(f.Int("num_experts_per_tok", &c.num_experts_per_tok, 0));
  MLARUN_RETURN_IF_ERROR(f.Int("first_k_dense_replace", &c.first_k_dense_replace));
  MLARUN_RETURN_IF_ERROR(f.Int("moe_layer_freq", &c.moe_layer_freq));
  MLARUN_RETURN_IF_ERROR(f.Int("num_nextn_predict_layers", &c.num_nextn_predict_layers));
  MLARUN_RETURN_IF_ERROR(f.Int("n_group", &c.n_group, 1));
  MLARUN_RETURN_IF_ERROR(f.Int("topk_group", &c.topk_group, 1));
  MLARUN_RETURN_IF_ERROR(f.Bool("norm_topk_prob", &c.norm_topk_prob, false));
  MLARUN_RETURN_IF_ERROR(f.Double("routed_scaling_factor", &c.routed_scaling_factor));

  MLARUN_RETURN_IF_ERROR(ReadGating(f, model_type_name, v3, &c));
  if (v32) MLARUN_RETURN_IF_ERROR(ReadIndexer(f, &c));

  MLARUN_RETURN_IF_ERROR(f.Double("rms_norm_eps", &c.rms_norm_eps));
  MLARUN_RETURN_IF_ERROR(f.Int("max_position_embeddings", &c.max_position_embeddings));
  MLARUN_RETURN_IF_ERROR(ReadTokenIds(f, &c));
  MLARUN_RETURN_IF_ERROR(f.Bool("tie_word_embeddings", &c.tie_word_embeddings));
  MLARUN_RETURN_IF_ERROR(f.String("hidden_act", &c.hidden_act));
  MLARUN_RETURN_IF_ERROR(f.Bool("attention_bias", &c.attention_bias));
  // After max_position_embeddings and qk_rope_head_dim, which yarn and rope.dim derive from.
  MLARUN_RETURN_IF_ERROR(ReadRope(f, origin, &c));
  MLARUN_RETURN_IF_ERROR(ReadWeightDtype(f, &c));

  // mlarun's own field: the latent cache element type.
  if (f.HasNonNull("kv_dtype")) {
    std::string name;
    MLARUN_RETURN_IF_ERROR(f.String("kv_dtype", &name));
    StatusOr<DType> dtype = ParseDType(name);
    if (!dtype.ok() || (*dtype != DType::kF32 && *dtype != DType::kBF16))
      return f.Error("kv_dtype", "unsupported value '", name, "' (expected bf16 or fp32)");
    c.kv_dtype = *dtype;
  }

  Status valid = ValidateModelConfig(c);
  if (!valid.ok()) return valid.WithContext(origin);
  return c;
}

// YAML 1.2 core-schema resolution of a plain (unquoted) scalar.
Json ResolvePlainScalar(const std::string& s) {
  static const std::regex kNull("~|null|Null|NULL|");
  static const std::regex kTrue("true|True|TRUE");
  static const std::regex kFalse("false|False|FALSE");
  static const std::regex kInt("[-+]?[0-9]+");
  static const std::regex kHex("0x[0-9a-fA-F]+");
  static const std::regex kOct("0o[0-7]+");
  static const std::regex kFloat("[-+]?(\\.[0-9]+|[0-9]+(\\.[0-9]*)?)([eE][-+]?[0-9]+)?");
  if (std::regex_match(s, kNull)) return nullptr;
  if (std::regex_match(s, kTrue)) return true;
  if (std::regex_match(s, kFalse)) return false;
  auto parse_int = [&](size_t skip, int base) -> Json {
    std::string_view digits(s);
    bool negative = false;
    if (!digits.empty() && (digits[0] == '-' || digits[0] == '+')) {
      negative = digits[0] == '-';
      digits.remove_prefix(1);
    }
    digits.remove_prefix(skip);
    uint64_t u = 0;
    auto [ptr, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), u, base);
    if (ec != std::errc() || ptr != digits.data() + digits.size()) return s;  // too big: left as text
    if (negative) {
      if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) + 1) return s;
      return u == 0 ? int64_t{0} : static_cast<int64_t>(0 - u);
    }
    return u;
  };
  if (std::regex_match(s, kInt)) return parse_int(0, 10);
  if (std::regex_match(s, kHex)) return parse_int(2, 16);
  if (std::regex_match(s, kOct)) return parse_int(2, 8);
  if (std::regex_match(s, kFloat)) return std::strtod(s.c_str(), nullptr);
  // Everything else is text, including .inf/.nan: JSON cannot hold them, and
  // no field accepts a non-finite number anyway.
  return s;
}

Status YamlToJson(const YAML::Node& node, std::string_view origin, const std::string& path, Json* out) {
  const std::string where = path.empty() ? "top level" : path;
  switch (node.Type()) {
    case YAML::NodeType::Undefined:
    case YAML::NodeType::Null:
      *out = nullptr;
      return Status::Ok();
    case YAML::NodeType::Scalar: {
      const std::string& tag = node.Tag();
      // "!" marks a quoted scalar: always a string ("7168" stays text, so a
      // quoted number in an integer field is a type error as in JSON).
      if (tag == "!" || tag == "tag:yaml.org,2002:str") {
        *out = node.Scalar();
      } else {
        *out = ResolvePlainScalar(node.Scalar());
      }
      return Status::Ok();
    }
    case YAML::NodeType::Sequence: {
      *out = Json::array();
      size_t i = 0;
      for (const YAML::Node& item : node) {
        Json v;
        MLARUN_RETURN_IF_ERROR(YamlToJson(item, origin, path + "[" + std::to_string(i++) + "]", &v));
        out->push_back(std::move(v));
      }
      return Status::Ok();
    }
    case YAML::NodeType::Map: {
      *out = Json::object();
      for (const auto& kv : node) {
        if (!kv.first.IsScalar())
          return InvalidArgumentError(origin, ": ", where, ": mapping keys must be plain strings");
        const std::string key = kv.first.Scalar();
        Json v;
        MLARUN_RETURN_IF_ERROR(YamlToJson(kv.second, origin, path.empty() ? key : path + "." + key, &v));
        (*out)[key] = std::move(v);
      }
      return Status::Ok();
    }
  }
  return InvalidArgumentError(origin, ": ", where, ": unsupported YAML node");
}

// Every key ParseConfigObject and ReadRope read (in any model_type), plus
// the YAML format's own `seed`.
constexpr std::string_view kYamlKeys[] = {
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "moe_intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "n_routed_experts",
    "num_local_experts",
    "num_experts",
    "n_shared_experts",
    "num_experts_per_tok",
    "first_k_dense_replace",
    "moe_layer_freq",
    "num_nextn_predict_layers",
    "n_group",
    "topk_group",
    "norm_topk_prob",
    "routed_scaling_factor",
    "scoring_func",
    "topk_method",
    "index_n_heads",
    "index_head_dim",
    "index_topk",
    "rms_norm_eps",
    "max_position_embeddings",
    "bos_token_id",
    "eos_token_id",
    "tie_word_embeddings",
    "hidden_act",
    "attention_bias",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "rope_interleave",
    "dtype",
    "torch_dtype",
    "kv_dtype",
    "seed",
    "tokenizer",  // a directory with tokenizer.json, relative to the YAML (text/tokenizer.h)
};
constexpr std::string_view kYamlRopeKeys[] = {
    "rope_theta", "rope_type", "type",   "factor",         "original_max_position_embeddings",
    "beta_fast",  "beta_slow", "mscale", "mscale_all_dim", "attention_factor",
    "truncate",
};

// A YAML model file is mlarun's own format, so a key it does not know (a
// typo that would silently leave a default in place) is an error naming the
// key. config.json stays lenient: Hugging Face configs carry many keys that
// do not concern the architecture.
template <size_t N>
Status CheckKeys(const Json& object, std::string_view origin, const std::string& prefix,
                 const std::string_view (&known)[N]) {
  for (auto it = object.begin(); it != object.end(); ++it) {
    const std::string& key = it.key();
    if (std::find(std::begin(known), std::end(known), key) != std::end(known)) continue;
    const std::string best = NearestName(key, std::vector<std::string>(std::begin(known), std::end(known)));
    return InvalidArgumentError(origin, ": ", prefix, key, ": unknown key",
                                best.empty() ? std::string() : " (did you mean '" + prefix + best + "'?)");
  }
  return Status::Ok();
}

Status CheckYamlKeys(const Json& root, std::string_view origin) {
  if (!root.is_object()) return Status::Ok();  // ParseConfigObject says what is wrong
  MLARUN_RETURN_IF_ERROR(CheckKeys(root, origin, "", kYamlKeys));
  for (const char* key : {"rope_scaling", "rope_parameters"}) {
    auto it = root.find(key);
    if (it != root.end() && it->is_object())
      MLARUN_RETURN_IF_ERROR(CheckKeys(*it, origin, std::string(key) + ".", kYamlRopeKeys));
  }
  return Status::Ok();
}

// A byte or element count as an integer, however large (doubles print
// 1e+12 otherwise).
std::string Count(double x) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.0f", x);
  return buf;
}

// The per-tensor and whole-model limits of model_config.h.
Status ValidateModelSizes(const ModelConfig& c) {
  double total_bytes = 0;
  for (const WeightTensorSize& t : WeightTensorSizes(c)) {
    if (t.elems() > static_cast<double>(kMaxTensorElems))
      return InvalidArgumentError(t.fields, ": ", t.tensor, " would be [", Count(t.rows), ", ", Count(t.cols),
                                  "] = ", Count(t.elems()), " elements (", Count(t.elems() * t.elem_bytes),
                                  " bytes), more than the ", kMaxTensorElems, " elements (2^40) a tensor may have");
    total_bytes += t.total_bytes();
  }
  if (total_bytes > static_cast<double>(kMaxModelWeightBytes))
    return InvalidArgumentError("num_hidden_layers, n_routed_experts and the sizes: the weights would need ",
                                Count(total_bytes), " bytes, more than the ", kMaxModelWeightBytes,
                                " bytes (2^60) a model may have");
  return Status::Ok();
}

}  // namespace

std::vector<WeightTensorSize> WeightTensorSizes(const ModelConfig& c) {
  const int64_t w = static_cast<int64_t>(DTypeSize(c.weight_dtype));
  // kv_b_proj is read as fp32 at load, then split into W_UK / W_UV in the cache dtype.
  const int64_t kvb = std::max<int64_t>(4, static_cast<int64_t>(DTypeSize(c.kv_dtype)));
  const double H = static_cast<double>(c.hidden_size), N = static_cast<double>(c.num_attention_heads);
  const double L = static_cast<double>(c.kv_lora_rank), R = static_cast<double>(c.qk_rope_head_dim);
  const double P = static_cast<double>(c.qk_nope_head_dim), V = static_cast<double>(c.v_head_dim);
  const double Q = static_cast<double>(c.q_lora_rank), E = static_cast<double>(c.n_routed_experts);
  const double Im = static_cast<double>(c.moe_intermediate_size);
  // MoE layers without walking the layers: multiples of moe_layer_freq in
  // [first_k_dense_replace, num_hidden_layers) when there are experts.
  double moe_layers = 0;
  if (c.n_routed_experts > 0 && c.moe_layer_freq > 0 && c.first_k_dense_replace < c.num_hidden_layers) {
    const int64_t f = c.moe_layer_freq, a = std::max<int64_t>(c.first_k_dense_replace, 0), b = c.num_hidden_layers;
    moe_layers = static_cast<double>((b - 1) / f - (a == 0 ? -1 : (a - 1) / f));
  }
  const double layers = static_cast<double>(c.num_hidden_layers);
  const double dense_layers = layers - moe_layers;
  std::vector<WeightTensorSize> t;
  auto add = [&](std::string tensor, std::string fields, double rows, double cols, double count, int64_t bytes) {
    if (count > 0) t.push_back({std::move(tensor), std::move(fields), rows, cols, count, bytes});
  };
  add("model.embed_tokens.weight", "vocab_size x hidden_size", static_cast<double>(c.vocab_size), H,
      c.tie_word_embeddings ? 1 : 2, w);
  const std::string a = "model.layers.*.self_attn.";
  if (c.q_lora_rank > 0) {
    add(a + "q_a_proj.weight", "q_lora_rank x hidden_size", Q, H, layers, w);
    add(a + "q_b_proj.weight", "num_attention_heads x (qk_nope_head_dim + qk_rope_head_dim) x q_lora_rank", N * (P + R),
        Q, layers, w);
  } else {
    add(a + "q_proj.weight", "num_attention_heads x (qk_nope_head_dim + qk_rope_head_dim) x hidden_size", N * (P + R),
        H, layers, w);
  }
  add(a + "kv_a_proj_with_mqa.weight", "(kv_lora_rank + qk_rope_head_dim) x hidden_size", L + R, H, layers, w);
  add(a + "kv_b_proj.weight", "num_attention_heads x (qk_nope_head_dim + v_head_dim) x kv_lora_rank", N * (P + V), L,
      layers, kvb);
  add(a + "o_proj.weight", "hidden_size x num_attention_heads x v_head_dim", H, N * V, layers, w);
  if (c.has_indexer()) {
    const double ih = static_cast<double>(c.index_n_heads), id = static_cast<double>(c.index_head_dim);
    add(a + "indexer.wq_b.weight", "index_n_heads x index_head_dim x q_lora_rank", ih * id, Q, layers, w);
    add(a + "indexer.wk.weight", "index_head_dim x hidden_size", id, H, layers, w);
    add(a + "indexer.weights_proj.weight", "index_n_heads x hidden_size", ih, H, layers, w);
  }
  const std::string m = "model.layers.*.mlp.";
  add(m + "{gate,up,down}_proj.weight", "intermediate_size x hidden_size", static_cast<double>(c.intermediate_size), H,
      3 * dense_layers, w);
  add(m + "gate.weight", "n_routed_experts x hidden_size", E, H, moe_layers, 4);
  add(m + "experts.*.{gate,up,down}_proj.weight", "moe_intermediate_size x hidden_size", Im, H, 3 * E * moe_layers, w);
  if (c.n_shared_experts > 0)
    add(m + "shared_experts.{gate,up,down}_proj.weight", "moe_intermediate_size x n_shared_experts x hidden_size",
        Im * static_cast<double>(c.n_shared_experts), H, 3 * moe_layers, w);
  return t;
}

bool ModelConfig::IsMoeLayer(int64_t layer) const {
  return n_routed_experts > 0 && layer >= first_k_dense_replace && moe_layer_freq > 0 && layer % moe_layer_freq == 0;
}

MlaShape ModelConfig::mla_shape() const {
  return MlaShape{.h_q = num_attention_heads,
                  .d_latent = kv_lora_rank,
                  .d_rope = qk_rope_head_dim,
                  .d_nope = qk_nope_head_dim,
                  .d_v = v_head_dim};
}

double ModelConfig::softmax_scale() const { return MlaSoftmaxScale(qk_nope_head_dim, qk_rope_head_dim, rope.scaling); }

std::ostream& operator<<(std::ostream& os, const ModelConfig& c) {
  os << "ModelConfig{" << ModelTypeName(c.model_type) << " vocab=" << c.vocab_size << " hidden=" << c.hidden_size
     << " inter=" << c.intermediate_size << " layers=" << c.num_hidden_layers << " heads=" << c.num_attention_heads
     << " mla{q_lora=" << c.q_lora_rank << " kv_lora=" << c.kv_lora_rank << " nope=" << c.qk_nope_head_dim
     << " rope=" << c.qk_rope_head_dim << " v=" << c.v_head_dim << "}";
  os << " moe{routed=" << c.n_routed_experts << " shared=" << c.n_shared_experts << " top=" << c.num_experts_per_tok
     << " inter=" << c.moe_intermediate_size << " group=" << c.topk_group << "/" << c.n_group
     << " first_dense=" << c.first_k_dense_replace << " freq=" << c.moe_layer_freq << " "
     << TopkMethodName(c.topk_method) << " " << ScoringFuncName(c.scoring_func) << " norm=" << c.norm_topk_prob
     << " scale=" << c.routed_scaling_factor << "}";
  if (c.has_indexer())
    os << " indexer{heads=" << c.index_n_heads << " dim=" << c.index_head_dim << " topk=" << c.index_topk << "}";
  os << " " << c.rope << " max_pos=" << c.max_position_embeddings << " eps=" << c.rms_norm_eps
     << " bos=" << c.bos_token_id << " eos=[";
  for (size_t i = 0; i < c.eos_token_ids.size(); ++i) os << (i ? "," : "") << c.eos_token_ids[i];
  os << "] tie=" << c.tie_word_embeddings << " act=" << c.hidden_act << " weights=" << DTypeName(c.weight_dtype)
     << " kv=" << DTypeName(c.kv_dtype) << "}";
  return os;
}

namespace {

// The dimensions and counts: positive, non-negative and bounded where they
// must be, and consistent with one another.
Status ValidateDimensions(const ModelConfig& c) {
  const std::pair<const char*, int64_t> positive[] = {
      {"vocab_size", c.vocab_size},
      {"hidden_size", c.hidden_size},
      {"intermediate_size", c.intermediate_size},
      {"num_hidden_layers", c.num_hidden_layers},
      {"num_attention_heads", c.num_attention_heads},
      {"kv_lora_rank", c.kv_lora_rank},
      {"qk_nope_head_dim", c.qk_nope_head_dim},
      {"qk_rope_head_dim", c.qk_rope_head_dim},
      {"v_head_dim", c.v_head_dim},
      {"max_position_embeddings", c.max_position_embeddings},
      {"moe_layer_freq", c.moe_layer_freq},
      {"n_group", c.n_group},
      {"topk_group", c.topk_group},
  };
  for (const auto& [name, value] : positive)
    if (value <= 0) return InvalidArgumentError(name, " must be positive, got ", value);
  const std::pair<const char*, int64_t> non_negative[] = {
      {"q_lora_rank", c.q_lora_rank},
      {"n_routed_experts", c.n_routed_experts},
      {"n_shared_experts", c.n_shared_experts},
      {"num_experts_per_tok", c.num_experts_per_tok},
      {"first_k_dense_replace", c.first_k_dense_replace},
      {"moe_intermediate_size", c.moe_intermediate_size},
      {"num_nextn_predict_layers", c.num_nextn_predict_layers},
      {"index_n_heads", c.index_n_heads},
  };
  for (const auto& [name, value] : non_negative)
    if (value < 0) return InvalidArgumentError(name, " must be non-negative, got ", value);
  const std::pair<const char*, int64_t> counts[] = {
      {"num_hidden_layers", c.num_hidden_layers},
      {"num_nextn_predict_layers", c.num_nextn_predict_layers},
      {"n_routed_experts", c.n_routed_experts},
      {"n_shared_experts", c.n_shared_experts},
  };
  for (const auto& [name, value] : counts) {
    const int64_t limit = std::string_view(name).find("layers") != std::string_view::npos ? kMaxLayers : kMaxExperts;
    if (value > limit) return InvalidArgumentError(name, " must be at most ", limit, ", got ", value);
  }
  if (c.qk_rope_head_dim % 2 != 0)
    return InvalidArgumentError("qk_rope_head_dim must be even (rotary pairs), got ", c.qk_rope_head_dim);
  // DeepSeek Sparse Attention: an indexer needs a key width and a token budget.
  if (c.has_indexer()) {
    if (c.index_head_dim <= 0)
      return InvalidArgumentError("index_head_dim must be positive with an indexer (index_n_heads ", c.index_n_heads,
                                  "), got ", c.index_head_dim);
    if (c.index_topk <= 0)
      return InvalidArgumentError("index_topk must be positive with an indexer (index_n_heads ", c.index_n_heads,
                                  "), got ", c.index_topk);
  }
  if (c.first_k_dense_replace > c.num_hidden_layers)
    return InvalidArgumentError("first_k_dense_replace (", c.first_k_dense_replace,
                                ") must not exceed num_hidden_layers (", c.num_hidden_layers, ")");
  return Status::Ok();
}

// The MoE gate: the scoring function and top-k method of the model type,
// and expert, group and top-k counts it can route with.
Status ValidateRouting(const ModelConfig& c) {
  if (c.model_type == ModelType::kDeepSeekV3) {
    if (c.scoring_func != ScoringFunc::kSigmoid)
      return InvalidArgumentError("scoring_func must be sigmoid for deepseek_v3");
    if (c.topk_method != TopkMethod::kNoauxTc)
      return InvalidArgumentError("topk_method must be noaux_tc for deepseek_v3");
  } else {
    if (c.scoring_func != ScoringFunc::kSoftmax)
      return InvalidArgumentError("scoring_func must be softmax for deepseek_v2");
    if (c.topk_method != TopkMethod::kGreedy && c.topk_method != TopkMethod::kGroupLimitedGreedy)
      return InvalidArgumentError("topk_method must be greedy or group_limited_greedy for deepseek_v2");
  }
  if (c.n_routed_experts > 0) {
    if (c.moe_intermediate_size <= 0)
      return InvalidArgumentError("moe_intermediate_size must be positive with routed experts, got ",
                                  c.moe_intermediate_size);
    if (c.num_experts_per_tok <= 0)
      return InvalidArgumentError("num_experts_per_tok must be set (positive) when n_routed_experts > 0, got ",
                                  c.num_experts_per_tok);
    if (c.num_experts_per_tok > c.n_routed_experts)
      return InvalidArgumentError("num_experts_per_tok (", c.num_experts_per_tok, ") exceeds n_routed_experts (",
                                  c.n_routed_experts, ")");
    if (c.n_routed_experts % c.n_group != 0)
      return InvalidArgumentError("n_group (", c.n_group, ") must divide n_routed_experts (", c.n_routed_experts, ")");
    if (c.topk_group > c.n_group)
      return InvalidArgumentError("topk_group (", c.topk_group, ") exceeds n_group (", c.n_group, ")");
    const int64_t per_group = c.n_routed_experts / c.n_group;
    // DeepseekV3TopkRouter scores a group by the sum of its top-2 experts.
    if (c.topk_method == TopkMethod::kNoauxTc && per_group < 2)
      return InvalidArgumentError("n_group (", c.n_group, ") leaves fewer than 2 experts per group (n_routed_experts ",
                                  c.n_routed_experts, "); noaux_tc scores a group by its top-2 experts");
    if (c.topk_method != TopkMethod::kGreedy) {
      // Only the experts of the kept groups are candidates.
      if (c.num_experts_per_tok > c.topk_group * per_group)
        return InvalidArgumentError("num_experts_per_tok (", c.num_experts_per_tok, ") exceeds the ",
                                    c.topk_group * per_group, " experts of topk_group (", c.topk_group, ") groups of ",
                                    per_group);
    }
  }
  if (!std::isfinite(c.routed_scaling_factor) || !(c.routed_scaling_factor > 0.0))
    return InvalidArgumentError("routed_scaling_factor must be positive, got ", c.routed_scaling_factor);
  return Status::Ok();
}

}  // namespace

Status ValidateModelConfig(const ModelConfig& c) {
  if (c.model_type != ModelType::kDeepSeekV2 && c.model_type != ModelType::kDeepSeekV3)
    return InvalidArgumentError("model_type: unknown value ", static_cast<int>(c.model_type));
  MLARUN_RETURN_IF_ERROR(ValidateDimensions(c));
  MLARUN_RETURN_IF_ERROR(ValidateRouting(c));
  if (!std::isfinite(c.rms_norm_eps) || !(c.rms_norm_eps > 0.0))
    return InvalidArgumentError("rms_norm_eps must be positive, got ", c.rms_norm_eps);

  // RoPE: same slice width as the heads, and whatever Rope itself refuses.
  if (c.rope.dim != c.qk_rope_head_dim)
    return InvalidArgumentError("rope.dim (", c.rope.dim, ") must equal qk_rope_head_dim (", c.qk_rope_head_dim, ")");
  if (!(c.rope.theta > 1.0)) return InvalidArgumentError("rope_theta must be > 1, got ", c.rope.theta);
  if (c.rope.scaling.type == RopeScaling::Type::kYarn) {
    const RopeScaling& y = c.rope.scaling;
    if (!(y.factor > 0.0)) return InvalidArgumentError("rope factor must be positive, got ", y.factor);
    if (y.original_max_position_embeddings <= 0)
      return InvalidArgumentError("rope original_max_position_embeddings must be positive, got ",
                                  y.original_max_position_embeddings);
  }
  // Whatever else Rope refuses (its messages name the rope field).
  if (Status st = Rope::Create(c.rope).status(); !st.ok()) return st;

  if (c.bos_token_id < -1) return InvalidArgumentError("bos_token_id must be -1 (none) or an id, got ", c.bos_token_id);
  for (int64_t id : c.eos_token_ids)
    if (id < 0) return InvalidArgumentError("eos_token_id must be non-negative, got ", id);
  if (c.hidden_act != "silu") return InvalidArgumentError("hidden_act '", c.hidden_act, "' is unsupported (only silu)");
  if (c.attention_bias) return InvalidArgumentError("attention_bias true is unsupported (only false)");
  if (c.weight_dtype != DType::kF32 && c.weight_dtype != DType::kBF16)
    return InvalidArgumentError("weight_dtype (torch_dtype/dtype) must be f32 or bf16, got ",
                                IsValidDType(c.weight_dtype) ? DTypeName(c.weight_dtype) : "?");
  if (c.kv_dtype != DType::kF32 && c.kv_dtype != DType::kBF16)
    return InvalidArgumentError("kv_dtype must be f32 or bf16, got ",
                                IsValidDType(c.kv_dtype) ? DTypeName(c.kv_dtype) : "?");
  return ValidateModelSizes(c);
}

StatusOr<ModelConfig> ParseHfConfigJson(std::string_view json_text, std::string_view origin) {
  Json root;
  try {
    root = Json::parse(json_text.begin(), json_text.end());
  } catch (const Json::exception& e) {
    return InvalidArgumentError(origin, ": malformed JSON: ", e.what());
  }
  return ParseConfigObject(root, origin);
}

StatusOr<ModelConfig> LoadHfConfig(const std::string& dir_or_file) {
  const std::string path = dir_or_file.ends_with(".json") ? dir_or_file : dir_or_file + "/config.json";
  MLARUN_ASSIGN_OR_RETURN(std::string text, ReadFileToString(path));
  return ParseHfConfigJson(text, path);
}

StatusOr<YamlModel> ParseModelYaml(std::string_view yaml_text, std::string_view origin) {
  Json root;
  try {
    const YAML::Node node = YAML::Load(std::string(yaml_text));
    MLARUN_RETURN_IF_ERROR(YamlToJson(node, origin, "", &root));
  } catch (const std::exception& e) {  // YAML::Exception and anything yaml-cpp lets through
    return InvalidArgumentError(origin, ": malformed YAML: ", e.what());
  }
  MLARUN_RETURN_IF_ERROR(CheckYamlKeys(root, origin));
  YamlModel model;
  MLARUN_ASSIGN_OR_RETURN(model.config, ParseConfigObject(root, origin));
  const FieldReader f(root, origin);
  int64_t seed = 0;
  MLARUN_RETURN_IF_ERROR(f.Int("seed", &seed));
  if (seed < 0) return f.Error("seed", "must be non-negative, got ", seed);
  model.seed = static_cast<uint64_t>(seed);
  return model;
}

StatusOr<YamlModel> LoadModelYaml(const std::string& path) {
  MLARUN_ASSIGN_OR_RETURN(std::string text, ReadFileToString(path));
  return ParseModelYaml(text, path);
}

}  // namespace mlarun
