#include "runtime/request/request.h"

#include <algorithm>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>

namespace mlarun {
namespace {

using Json = nlohmann::json;

// Reads an integer field that must be an integer (not a float or a string).
template <typename T>
Status ReadInt(const Json& j, const char* field, T* out) {
  if (!j.contains(field)) return Status::Ok();
  const Json& v = j[field];
  if (!v.is_number_integer()) return InvalidArgumentError("field '", field, "' must be an integer, got ", v.dump());
  *out = v.get<T>();
  return Status::Ok();
}

Status ReadNumber(const Json& j, const char* field, double* out) {
  if (!j.contains(field)) return Status::Ok();
  const Json& v = j[field];
  if (!v.is_number()) return InvalidArgumentError("field '", field, "' must be a number, got ", v.dump());
  *out = v.get<double>();
  return Status::Ok();
}

Status ReadIntList(const Json& j, const char* field, std::vector<int64_t>* out) {
  if (!j.contains(field)) return Status::Ok();
  const Json& v = j[field];
  if (!v.is_array()) return InvalidArgumentError("field '", field, "' must be a list of integers");
  out->clear();
  for (const Json& e : v) {
    if (!e.is_number_integer())
      return InvalidArgumentError("field '", field, "' must be a list of integers, found ", e.dump());
    out->push_back(e.get<int64_t>());
  }
  return Status::Ok();
}

// Every id of `ids` in [0, vocab_size); errors name `field`[i].
Status CheckTokenIds(std::span<const int32_t> ids, const char* field, const RequestLimits& limits) {
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] >= 0 && ids[i] < limits.vocab_size) continue;
    if (limits.vocab_size == kLimitUnknown)
      return InvalidArgumentError(field, "[", i, "]: token id ", ids[i], " is negative");
    return InvalidArgumentError(field, "[", i, "]: token id ", ids[i], " is outside the vocabulary (", limits.whose,
                                " vocab_size ", limits.vocab_size, ")");
  }
  return Status::Ok();
}

}  // namespace

Status ValidateRequest(std::span<const int32_t> prompt, const SamplingParams& sampling, const RequestLimits& limits,
                       std::span<const int32_t> generated) {
  if (prompt.empty()) return InvalidArgumentError("prompt_ids: must not be empty");
  MLARUN_RETURN_IF_ERROR(CheckTokenIds(prompt, "prompt_ids", limits));
  if (Status st = ValidateSamplingParams(sampling, limits.vocab_size, limits.max_position_embeddings); !st.ok())
    return Status(st.code(), "sampling." + st.message());
  MLARUN_RETURN_IF_ERROR(CheckTokenIds(generated, "generated_ids", limits));
  // At least the next token is still to come.
  if (static_cast<int64_t>(generated.size()) >= sampling.max_tokens)
    return InvalidArgumentError("generated_ids: ", generated.size(), " tokens already generated, max_tokens is ",
                                sampling.max_tokens);
  // Saturated: max_tokens may be anything up to INT64_MAX when no limit is known.
  int64_t total = 0;
  if (__builtin_add_overflow(static_cast<int64_t>(prompt.size()), sampling.max_tokens, &total))
    total = std::numeric_limits<int64_t>::max();
  if (limits.max_position_embeddings != kLimitUnknown && total > limits.max_position_embeddings)
    return InvalidArgumentError("sampling.max_tokens: prompt_ids (", prompt.size(), " tokens) + max_tokens (",
                                sampling.max_tokens, ") = ", total, " exceeds ", limits.whose,
                                " max_position_embeddings ", limits.max_position_embeddings);
  if (limits.cache_blocks_total != kLimitUnknown) {
    const int64_t block_size = std::max<int64_t>(limits.block_size, 1);
    const int64_t blocks = total / block_size + (total % block_size != 0 ? 1 : 0);
    if (blocks > limits.cache_blocks_total)
      return InvalidArgumentError("sampling.max_tokens: prompt_ids + max_tokens need ", blocks,
                                  " cache blocks, the whole cache has ", limits.cache_blocks_total);
  }
  return Status::Ok();
}

Status CheckBlockTable(std::span<const int32_t> blocks, int64_t rows, int64_t block_size, std::string_view field) {
  if (block_size > 0 && block_size != kLimitUnknown) {
    const int64_t want = (rows + block_size - 1) / block_size;
    if (std::ssize(blocks) != want)
      return InvalidArgumentError(field, ": ", blocks.size(), " blocks for ", rows, " rows, want ", want,
                                  " (block_size ", block_size, ")");
  } else if (blocks.empty() != (rows == 0)) {
    return InvalidArgumentError(field, ": ", blocks.size(), " blocks for ", rows, " rows");
  }
  for (size_t i = 0; i < blocks.size(); ++i)
    if (blocks[i] < 0) return InvalidArgumentError(field, "[", i, "]: block id ", blocks[i], " is negative");
  return Status::Ok();
}

Status ValidateImportSource(const ImportSource& import, int64_t tokens, const RequestLimits& limits) {
  if (import.rows < 1 || import.rows > tokens - 1)
    return InvalidArgumentError("import.rows: ", import.rows, " is outside [1, ", tokens - 1,
                                "] (prompt + generated tokens, less the one still to compute)");
  MLARUN_RETURN_IF_ERROR(CheckBlockTable(import.blocks, import.rows, limits.block_size, "import.blocks"));
  if (import.descriptors.empty()) return InvalidArgumentError("import.descriptors: must not be empty");
  return Status::Ok();
}

Status ValidateGenerationRequest(const GenerationRequest& request, const RequestLimits& limits) {
  MLARUN_RETURN_IF_ERROR(ValidateRequest(request.prompt, request.sampling, limits, request.generated));
  if (!request.import) return Status::Ok();
  return ValidateImportSource(*request.import, std::ssize(request.prompt) + std::ssize(request.generated), limits);
}

namespace {

// "structured": {"kind": "json_object" | "json_schema" | "regex" | "choice"
// | "grammar", "spec": the schema (an object or its text), the regex or the
// grammar, "choices": [...], "any_whitespace": bool}.
Status ReadStructured(const Json& j, const std::string& line, StructuredOutput* out) {
  using Kind = StructuredOutput::Kind;
  if (!j.is_object() || !j.contains("kind") || !j["kind"].is_string())
    return InvalidArgumentError("field 'structured' must be an object with a string 'kind'");
  static const std::map<std::string, Kind> kKinds = {{"json_object", Kind::kJsonObject},
                                                     {"json_schema", Kind::kJsonSchema},
                                                     {"regex", Kind::kRegex},
                                                     {"choice", Kind::kChoice},
                                                     {"grammar", Kind::kGrammar}};
  const auto kind = kKinds.find(j["kind"].get<std::string>());
  if (kind == kKinds.end())
    return InvalidArgumentError("field 'structured.kind' must be json_object, json_schema, regex, choice or grammar");
  out->kind = kind->second;
  if (j.contains("spec")) {
    if (j["spec"].is_string()) {
      out->spec = j["spec"].get<std::string>();
    } else if (j["spec"].is_object() && out->kind == Kind::kJsonSchema) {
      // Read again keeping the keys' order: a schema's properties come
      // out in the order it lists them.
      const auto ordered = nlohmann::ordered_json::parse(line, nullptr, /*allow_exceptions=*/false);
      out->spec = ordered.is_object() && ordered.contains("structured") && ordered["structured"].is_object() &&
                          ordered["structured"].contains("spec")
                      ? ordered["structured"]["spec"].dump()
                      : j["spec"].dump();
    } else {
      return InvalidArgumentError("field 'structured.spec' must be a string (or, for json_schema, an object)");
    }
  }
  if (j.contains("choices")) {
    if (!j["choices"].is_array()) return InvalidArgumentError("field 'structured.choices' must be a list of strings");
    for (const Json& c : j["choices"]) {
      if (!c.is_string()) return InvalidArgumentError("field 'structured.choices' must be a list of strings");
      out->choices.push_back(c.get<std::string>());
    }
  }
  if (j.contains("any_whitespace")) {
    if (!j["any_whitespace"].is_boolean())
      return InvalidArgumentError("field 'structured.any_whitespace' must be true or false");
    out->any_whitespace = j["any_whitespace"].get<bool>();
  }
  return Status::Ok();
}

}  // namespace

StatusOr<GenerationRequest> ParseRequestLine(const std::string& line, const SamplingParams& defaults) {
  Json j = Json::parse(line, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return InvalidArgumentError("not a JSON object: ", line.substr(0, 80));
  GenerationRequest r;
  r.sampling = defaults;
  if (!j.contains("prompt_ids")) return InvalidArgumentError("field 'prompt_ids' is missing");
  std::vector<int64_t> ids;
  MLARUN_RETURN_IF_ERROR(ReadIntList(j, "prompt_ids", &ids));
  for (int64_t id : ids) {
    if (id < INT32_MIN || id > INT32_MAX) return InvalidArgumentError("field 'prompt_ids' has an out-of-range id ", id);
    r.prompt.push_back(static_cast<int32_t>(id));
  }
  MLARUN_RETURN_IF_ERROR(ReadInt(j, "max_tokens", &r.sampling.max_tokens));
  MLARUN_RETURN_IF_ERROR(ReadNumber(j, "temperature", &r.sampling.temperature));
  MLARUN_RETURN_IF_ERROR(ReadNumber(j, "top_p", &r.sampling.top_p));
  MLARUN_RETURN_IF_ERROR(ReadInt(j, "top_k", &r.sampling.top_k));
  MLARUN_RETURN_IF_ERROR(ReadInt(j, "logprobs", &r.sampling.logprobs));
  MLARUN_RETURN_IF_ERROR(ReadInt(j, "prompt_logprobs", &r.sampling.prompt_logprobs));
  if (j.contains("seed")) {
    int64_t seed = 0;
    MLARUN_RETURN_IF_ERROR(ReadInt(j, "seed", &seed));
    if (seed < 0) return InvalidArgumentError("field 'seed' must be >= 0, got ", seed);
    r.sampling.seed = static_cast<uint64_t>(seed);
  }
  MLARUN_RETURN_IF_ERROR(ReadIntList(j, "stop_token_ids", &r.sampling.stop_token_ids));
  if (j.contains("ignore_eos")) {
    if (!j["ignore_eos"].is_boolean()) return InvalidArgumentError("field 'ignore_eos' must be true or false");
    r.sampling.ignore_eos = j["ignore_eos"].get<bool>();
  }
  if (j.contains("structured")) MLARUN_RETURN_IF_ERROR(ReadStructured(j["structured"], line, &r.sampling.structured));
  return r;
}

void AddLogprobFields(Json& line, const std::vector<std::vector<TokenLogprob>>& top,
                      const std::vector<LogprobEntry>& prompt) {
  auto pairs = [](const std::vector<TokenLogprob>& list) {
    Json out = Json::array();
    for (const TokenLogprob& t : list) out.push_back(Json::array({t.token, t.logprob}));
    return out;
  };
  if (!top.empty()) {
    Json steps = Json::array();
    for (const std::vector<TokenLogprob>& step : top) steps.push_back(pairs(step));
    line["top_logprobs"] = std::move(steps);
  }
  if (!prompt.empty()) {
    Json tokens = Json::array(), tops = Json::array();
    for (const LogprobEntry& p : prompt) {
      tokens.push_back(Json::array({p.token.token, p.token.logprob}));
      tops.push_back(pairs(p.top));
    }
    line["prompt_logprobs"] = std::move(tokens);
    line["prompt_top_logprobs"] = std::move(tops);
  }
}

}  // namespace mlarun
