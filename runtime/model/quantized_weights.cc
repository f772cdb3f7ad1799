// Which integer format a checkpoint uses (config.json's quantization_config),
// and the dispatch to its reader.
#include "runtime/model/quantized_weights.h"

#include <algorithm>
#include <nlohmann/json.hpp>
#include <regex>

#include "base/file.h"

namespace mlarun {

struct QuantScheme::IgnoreMatcher {
  std::vector<std::string> names;
  std::vector<std::regex> patterns;
};

namespace {

using Json = nlohmann::json;

// A JSON value as config.json spells it, for messages.
std::string Spell(const Json& v) {
  if (!v.is_string()) return v.dump();
  std::string s = "'";
  s.append(v.get_ref<const std::string&>()).push_back('\'');
  return s;
}

Status Refuse(const std::string& field, const Json& value, const std::string& why) {
  return InvalidArgumentError("quantization_config.", field, " = ", Spell(value), ": ", why);
}

// The value of `key` in `obj`, or null.
const Json& Field(const Json& obj, const char* key) {
  static const Json kNull;
  auto it = obj.find(key);
  return it == obj.end() ? kNull : *it;
}

bool IsNullOrFalse(const Json& v) { return v.is_null() || (v.is_boolean() && !v.get<bool>()); }
bool IsEmpty(const Json& v) { return v.is_null() || ((v.is_object() || v.is_array()) && v.empty()); }

StatusOr<int64_t> IntField(const Json& obj, const std::string& path, const char* key) {
  const Json& v = Field(obj, key);
  if (!v.is_number_integer()) return Refuse(path + key, v, "expected an integer");
  return v.get<int64_t>();
}

StatusOr<bool> BoolField(const Json& obj, const std::string& path, const char* key, bool dflt) {
  const Json& v = Field(obj, key);
  if (v.is_null()) return dflt;
  if (!v.is_boolean()) return Refuse(path + key, v, "expected true or false");
  return v.get<bool>();
}

// compressed-tensors' input_activations: none (W4A16 / W8A16), or dynamic
// per-token symmetric int8 (W8A8), accepted with the activations kept fp32.
StatusOr<bool> CtInputActivations(const Json& a, const std::string& path) {
  if (a.is_null()) return false;
  const std::string p = path + "input_activations.";
  if (Field(a, "type") != "int") return Refuse(p + "type", Field(a, "type"), "only int activations are accepted");
  if (Field(a, "num_bits") != 8) return Refuse(p + "num_bits", Field(a, "num_bits"), "only 8-bit activations");
  if (Field(a, "strategy") != "token")
    return Refuse(p + "strategy", Field(a, "strategy"), "only dynamic per-token activation scales");
  if (Field(a, "dynamic") != true) return Refuse(p + "dynamic", Field(a, "dynamic"), "static activation scales");
  if (Field(a, "symmetric") == false) return Refuse(p + "symmetric", Field(a, "symmetric"), "asymmetric activations");
  return true;
}

// One config group's `weights`: int, 4 or 8 bits, group or channel.
Status CtWeights(const Json& w, const std::string& path, const std::string& format, QuantScheme* s) {
  const std::string p = path + "weights.";
  if (!w.is_object()) return Refuse(p.substr(0, p.size() - 1), w, "expected the weights' arguments");
  if (Field(w, "type") != "int") return Refuse(p + "type", Field(w, "type"), "only int weights are supported");
  MLARUN_ASSIGN_OR_RETURN(const int64_t bits, IntField(w, p, "num_bits"));
  const bool packed = format == "pack-quantized";
  if (!(bits == 4 && packed) && !(bits == 8 && !packed))
    return Refuse(
        p + "num_bits", Field(w, "num_bits"),
        "supported: 4 with format pack-quantized, 8 with int-quantized / naive-quantized (format '" + format + "')");
  MLARUN_ASSIGN_OR_RETURN(s->symmetric, BoolField(w, p, "symmetric", true));
  const Json& strategy = Field(w, "strategy");
  if (strategy == "group") {
    MLARUN_ASSIGN_OR_RETURN(s->group, IntField(w, p, "group_size"));
    if (s->group <= 0 || s->group % 2 != 0)
      return Refuse(p + "group_size", Field(w, "group_size"), "expected a positive even group size");
  } else if (strategy == "channel") {
    s->group = 0;
  } else {
    return Refuse(p + "strategy", strategy, "supported: group, channel");
  }
  if (!IsNullOrFalse(Field(w, "actorder")))
    return Refuse(p + "actorder", Field(w, "actorder"), "activation ordering is not supported");
  if (!IsNullOrFalse(Field(w, "dynamic"))) return Refuse(p + "dynamic", Field(w, "dynamic"), "dynamic weights");
  if (!Field(w, "block_structure").is_null())
    return Refuse(p + "block_structure", Field(w, "block_structure"), "block strategy is not supported");
  s->bits = static_cast<int>(bits);
  return Status::Ok();
}

bool IsIntFormat(const Json& f) { return f == "pack-quantized" || f == "int-quantized" || f == "naive-quantized"; }

// One config group into `one`: its targets (["Linear"], or ["lm_head"] for
// lm_head's own group: *head), format (`fmt`, or the group's own under
// "mixed-precision") and weights.
Status CtGroup(const Json& g, const std::string& name, const Json& format, QuantScheme* one, bool* head) {
  const std::string path = "config_groups." + name + ".";
  if (!g.is_object()) return Refuse(path.substr(0, path.size() - 1), g, "expected a scheme");
  const Json& targets = Field(g, "targets");
  *head = targets == Json::array({"lm_head"});
  if (!*head && targets != Json::array({"Linear"}))
    return Refuse(path + "targets", targets, "supported: [\"Linear\"], and [\"lm_head\"] under mixed-precision");
  const Json& gf = Field(g, "format");
  const bool mixed = format == "mixed-precision";
  if (mixed && !IsIntFormat(gf))
    return Refuse(path + "format", gf, "under mixed-precision each group names pack-quantized or int-quantized");
  if (!mixed && *head) return Refuse(path + "targets", targets, "a group of lm_head alone needs mixed-precision");
  if (!mixed && !gf.is_null() && gf != format)
    return Refuse(path + "format", gf, "differs from format " + Spell(format));
  if (!Field(g, "output_activations").is_null())
    return Refuse(path + "output_activations", Field(g, "output_activations"), "not supported");
  MLARUN_RETURN_IF_ERROR(CtWeights(Field(g, "weights"), path, (mixed ? gf : format).get<std::string>(), one));
  MLARUN_ASSIGN_OR_RETURN(one->int8_activations, CtInputActivations(Field(g, "input_activations"), path));
  one->format = QuantFormat::kCompressedTensors;
  return Status::Ok();
}

Status ReadCompressedTensors(const Json& q, QuantScheme* s) {
  const Json& format = Field(q, "format");
  if (!IsIntFormat(format) && format != "mixed-precision")
    return Refuse("format", format, "supported: pack-quantized, int-quantized, naive-quantized, mixed-precision");
  const Json& sparsity = Field(q, "sparsity_config");
  if (!IsEmpty(sparsity) && !(sparsity.is_object() && Field(sparsity, "format") == "dense"))
    return Refuse("sparsity_config", sparsity, "sparse weights (e.g. 2:4) are not supported");
  for (const char* key : {"kv_cache_scheme", "transform_config"})
    if (!IsEmpty(Field(q, key))) return Refuse(key, Field(q, key), "not supported");
  const Json& groups = Field(q, "config_groups");
  if (!groups.is_object() || groups.empty())
    return Refuse("config_groups", groups, "expected one or more config groups");
  bool first = true;
  for (const auto& [name, g] : groups.items()) {
    QuantScheme one;
    bool head = false;
    MLARUN_RETURN_IF_ERROR(CtGroup(g, name, format, &one, &head));
    s->int8_activations |= one.int8_activations;
    if (head) {
      if (s->lm_head != nullptr) return Refuse("config_groups." + name, g, "a second group for lm_head");
      s->lm_head = std::make_shared<const QuantScheme>(std::move(one));
      continue;
    }
    if (!first && (one.bits != s->bits || one.group != s->group || one.symmetric != s->symmetric))
      return Refuse("config_groups." + name + ".weights", Field(g, "weights"),
                    "config groups of Linear with different weight schemes");
    s->bits = one.bits, s->group = one.group, s->symmetric = one.symmetric;
    first = false;
  }
  if (first) return Refuse("config_groups", groups, "no group targets Linear");
  std::vector<std::string> ignore;
  const Json& ig = Field(q, "ignore");
  if (!ig.is_null()) {
    if (!ig.is_array()) return Refuse("ignore", ig, "expected a list of module names");
    for (const Json& n : ig) {
      if (!n.is_string()) return Refuse("ignore", ig, "expected a list of module names");
      ignore.push_back(n.get<std::string>());
    }
  }
  s->format = QuantFormat::kCompressedTensors;
  return s->SetIgnore(std::move(ignore));
}

Status ReadAwq(const Json& q, QuantScheme* s) {
  MLARUN_ASSIGN_OR_RETURN(const int64_t bits, IntField(q, "", q.contains("bits") ? "bits" : "w_bit"));
  if (bits != 4) return Refuse("bits", bits, "AWQ is read with 4 bits only");
  MLARUN_ASSIGN_OR_RETURN(s->group, IntField(q, "", q.contains("group_size") ? "group_size" : "q_group_size"));
  if (s->group <= 0 || s->group % 2 != 0) return Refuse("group_size", s->group, "expected a positive even group size");
  MLARUN_ASSIGN_OR_RETURN(const bool zero_point, BoolField(q, "", "zero_point", true));
  s->symmetric = !zero_point;
  const Json& version = Field(q, "version");
  std::string v = version.is_string() ? version.get<std::string>() : "gemm";
  for (char& ch : v) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  if (v != "gemm") return Refuse("version", version, "only the GEMM packing is supported (not gemv, exllama, ...)");
  std::vector<std::string> ignore;
  const Json& skip = Field(q, "modules_to_not_convert");
  if (skip.is_array())
    for (const Json& n : skip)
      if (n.is_string()) ignore.push_back(n.get<std::string>());
  s->bits = 4;
  s->format = QuantFormat::kAwq;
  return s->SetIgnore(std::move(ignore));
}

Status ReadGptq(const Json& q, QuantScheme* s) {
  MLARUN_ASSIGN_OR_RETURN(const int64_t bits, IntField(q, "", "bits"));
  if (bits != 4 && bits != 8) return Refuse("bits", bits, "GPTQ is read with 4 or 8 bits");
  MLARUN_ASSIGN_OR_RETURN(const int64_t group, IntField(q, "", "group_size"));
  if (group != -1 && (group <= 0 || group % 2 != 0))
    return Refuse("group_size", group, "expected -1 (per channel) or a positive even group size");
  MLARUN_ASSIGN_OR_RETURN(s->symmetric, BoolField(q, "", "sym", true));
  MLARUN_ASSIGN_OR_RETURN(s->desc_act, BoolField(q, "", "desc_act", false));
  const Json& cf = Field(q, "checkpoint_format");
  if (!cf.is_null() && cf != "gptq" && cf != "gptq_v2")
    return Refuse("checkpoint_format", cf, "supported: gptq, gptq_v2");
  s->gptq_v2 = cf == "gptq_v2";
  if (Field(q, "lm_head") == true) return Refuse("lm_head", true, "a quantized lm_head is not supported for GPTQ");
  s->bits = static_cast<int>(bits);
  s->group = group > 0 ? group : 0;
  s->format = QuantFormat::kGptq;
  return s->SetIgnore({});
}

}  // namespace

std::string_view QuantFormatName(QuantFormat f) {
  switch (f) {
    case QuantFormat::kNone:
      return "none";
    case QuantFormat::kCompressedTensors:
      return "compressed-tensors";
    case QuantFormat::kAwq:
      return "awq";
    case QuantFormat::kGptq:
      return "gptq";
  }
  return "invalid";
}

Status QuantScheme::SetIgnore(std::vector<std::string> names) {
  auto m = std::make_shared<IgnoreMatcher>();
  for (const std::string& n : names) {
    if (!n.starts_with("re:")) {
      m->names.push_back(n);
      continue;
    }
    try {
      m->patterns.emplace_back(n.substr(3), std::regex::ECMAScript | std::regex::optimize);
    } catch (const std::regex_error& e) {
      return InvalidArgumentError("quantization_config.ignore: pattern '", n, "' does not compile: ", e.what());
    }
  }
  ignore = std::move(names);
  ignore_matcher = std::move(m);
  return Status::Ok();
}

bool QuantScheme::Ignores(std::string_view module) const {
  if (ignore_matcher == nullptr) return false;
  for (const std::string& n : ignore_matcher->names)
    if (n == module) return true;
  for (const std::regex& re : ignore_matcher->patterns)
    if (std::regex_search(module.begin(), module.end(), re, std::regex_constants::match_continuous)) return true;
  return false;
}

bool QuantScheme::Quantizes(std::string_view module) const {
  if (format == QuantFormat::kNone || Ignores(module)) return false;
  return format == QuantFormat::kCompressedTensors || module != "lm_head";
}

bool QuantScheme::Covers(const Checkpoint& ckpt, std::string_view prefix) const {
  if (format == QuantFormat::kNone || Ignores(prefix)) return false;
  const std::string p(prefix);
  switch (format) {
    case QuantFormat::kCompressedTensors:
      // Either tensor names the module quantized (the reader then says
      // which one is missing).
      if (ckpt.Find(p + ".weight_scale") != nullptr) return true;
      if (For(prefix).bits == 4) return ckpt.Find(p + ".weight_packed") != nullptr;
      return ckpt.Find(p + ".weight") != nullptr && ckpt.Find(p + ".weight")->dtype == SafetensorsDType::kI8;
    case QuantFormat::kAwq:
    case QuantFormat::kGptq:
      return ckpt.Find(p + ".qweight") != nullptr;
    case QuantFormat::kNone:
      break;
  }
  return false;
}

StatusOr<QuantScheme> ReadQuantScheme(const std::string& dir) {
  const std::string path = dir + "/config.json";
  MLARUN_ASSIGN_OR_RETURN(const std::string text, ReadFileToString(path));
  const Json root = Json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded() || !root.is_object()) return InvalidArgumentError(path, ": not a JSON object");
  QuantScheme s;
  const Json& q = Field(root, "quantization_config");
  if (q.is_null()) return s;
  if (!q.is_object()) return InvalidArgumentError(path, ": quantization_config is not an object");
  const Json& method = Field(q, "quant_method");
  Status st = Status::Ok();
  if (method == "compressed-tensors") {
    st = ReadCompressedTensors(q, &s);
  } else if (method == "awq") {
    st = ReadAwq(q, &s);
  } else if (method == "gptq") {
    st = ReadGptq(q, &s);
  } else if (method != "fp8") {  // fp8: read by dtype (docs/fp8-weights.md)
    st = Refuse("quant_method", method, "supported: compressed-tensors, awq, gptq, fp8");
  }
  if (!st.ok()) return InvalidArgumentError(path, ": ", st.message());
  return s;
}

StatusOr<Linear> LoadQuantizedLinear(const Checkpoint& ckpt, const QuantScheme& s, const std::string& prefix,
                                     int64_t rows, int64_t cols, int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
  switch (s.format) {
    case QuantFormat::kCompressedTensors:
      return quant_internal::LoadCompressedTensors(ckpt, s, prefix, rows, cols, r0, r1, c0, c1);
    case QuantFormat::kAwq:
      return quant_internal::LoadAwq(ckpt, s, prefix, rows, cols, r0, r1, c0, c1);
    case QuantFormat::kGptq:
      return quant_internal::LoadGptq(ckpt, s, prefix, rows, cols, r0, r1, c0, c1);
    case QuantFormat::kNone:
      break;
  }
  return FailedPreconditionError("module ", prefix, " is not quantized");
}

bool QuantizedSliceAligned(const QuantScheme& s, int64_t cols, int64_t c0, int64_t c1) {
  if (s.group <= 0) return c0 % 2 == 0;  // per channel: any slice whose int4 rows start on a byte
  return c0 % s.group == 0 && (c1 % s.group == 0 || c1 == cols);
}

std::vector<std::string> QuantizedTensorNames(const QuantScheme& s, const std::string& prefix) {
  std::vector<const char*> suffixes;
  switch (s.format) {
    case QuantFormat::kCompressedTensors:
      suffixes = s.bits == 4 ? std::vector<const char*>{"weight_packed", "weight_scale", "weight_shape"}
                             : std::vector<const char*>{"weight", "weight_scale"};
      if (!s.symmetric) suffixes.push_back("weight_zero_point");
      break;
    case QuantFormat::kAwq:
      suffixes = {"qweight", "qzeros", "scales"};
      break;
    case QuantFormat::kGptq:
      suffixes = {"qweight", "qzeros", "scales", "g_idx"};
      break;
    case QuantFormat::kNone:
      break;
  }
  std::vector<std::string> names;
  for (const char* suffix : suffixes) names.push_back(prefix + "." + suffix);
  return names;
}

namespace quant_internal {

StatusOr<const TensorRef*> ModuleTensor(const Checkpoint& ckpt, std::string_view format, const std::string& prefix,
                                        std::string_view field, std::initializer_list<SafetensorsDType> dtypes,
                                        const std::vector<int64_t>& shape, std::string_view layout) {
  const std::string name = prefix + "." + std::string(field);
  const std::string where =
      "checkpoint " + ckpt.dir() + ": " + std::string(format) + " module " + prefix + ": tensor '" + name + "'";
  const std::string why = layout.empty() ? std::string() : " (" + std::string(layout) + ")";
  const TensorRef* t = ckpt.Find(name);
  if (t == nullptr) return NotFoundError(where, " is missing", why);
  std::string names;
  for (SafetensorsDType d : dtypes) names += (names.empty() ? "" : " / ") + std::string(SafetensorsDTypeName(d));
  if (std::find(dtypes.begin(), dtypes.end(), t->dtype) == dtypes.end())
    return InvalidArgumentError(where, " has dtype ", SafetensorsDTypeName(t->dtype), ", expected ", names);
  if (t->shape != shape)
    return InvalidArgumentError(where, " has shape ", ShapeString(t->shape), ", expected ", ShapeString(shape), why);
  return t;
}

}  // namespace quant_internal

}  // namespace mlarun
