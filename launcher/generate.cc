#include "launcher/generate.h"

#include <unistd.h>

#include <chrono>
#include <fstream>
#include <iostream>
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
    if (!e.is_number_integer()) return InvalidArgumentError("field '", field, "' must be a list of integers, found ", e.dump());
    out->push_back(e.get<int64_t>());
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
  return r;
}

int RunGenerate(const GenerateOptions& o, std::ostream& out, std::ostream& log) {
  // Requests first: a bad file is reported before spending time on the model.
  std::vector<StatusOr<GenerationRequest>> parsed;
  if (!o.prompts_path.empty()) {
    std::ifstream f(o.prompts_path);
    if (!f) {
      log << "mlarun generate: cannot read " << o.prompts_path << "\n";
      return 2;
    }
    std::string line;
    int64_t line_no = 0;
    while (std::getline(f, line)) {
      ++line_no;
      if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
      auto r = ParseRequestLine(line, o.sampling);
      parsed.push_back(r.ok() ? r : StatusOr<GenerationRequest>(r.status().WithContext(o.prompts_path + ":" + std::to_string(line_no))));
    }
  } else {
    GenerationRequest r;
    r.sampling = o.sampling;
    for (int64_t id : o.prompt_ids) r.prompt.push_back(static_cast<int32_t>(std::clamp<int64_t>(id, INT32_MIN, INT32_MAX)));
    parsed.push_back(std::move(r));
  }

  ModelOverrides ov;
  if (!o.kv_dtype.empty()) {
    auto dt = ParseDType(o.kv_dtype);
    if (!dt.ok() || (*dt != DType::kBF16 && *dt != DType::kF32)) {
      log << "mlarun generate: --kv-dtype must be bf16 or fp32, got '" << o.kv_dtype << "'\n";
      return 2;
    }
    ov.kv_dtype = *dt;
  }
  if (o.num_layers > 0) ov.num_layers = o.num_layers;
  ModelOptions mo;
  // Loading progress rewrites one line on a terminal; logs get only the summary.
  const bool tty = &log == &std::cerr && isatty(STDERR_FILENO);
  if (tty) mo.progress = [&log](const std::string& s) { log << "\r" << s << std::flush; };
  const auto t0 = std::chrono::steady_clock::now();
  auto model = Model::Load(o.model, ov, mo);
  if (tty) log << "\n";
  if (!model.ok()) {
    log << "mlarun generate: " << model.status() << "\n";
    return 2;
  }
  log << "loaded " << o.model << " (" << static_cast<double>((*model)->weight_bytes().total()) / (1 << 20)
      << " MiB of weights) in "
      << std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() << " s\n";
  auto engine = Engine::Create(**model, o.engine);
  if (!engine.ok()) {
    log << "mlarun generate: " << engine.status() << "\n";
    return 2;
  }

  // Queue every valid request; remember where each result goes.
  std::vector<StatusOr<GenerationOutput>> results(parsed.size(), StatusOr<GenerationOutput>(InternalError("not run")));
  std::vector<std::pair<size_t, int64_t>> queued;
  for (size_t i = 0; i < parsed.size(); ++i) {
    if (!parsed[i].ok()) {
      results[i] = parsed[i].status();
      continue;
    }
    auto id = (*engine)->Add(std::move(*parsed[i]));
    if (!id.ok()) {
      results[i] = id.status();
      continue;
    }
    queued.emplace_back(i, *id);
  }
  auto last_report = std::chrono::steady_clock::now();
  Status failure;
  while ((*engine)->HasWork()) {
    auto step = (*engine)->Step();
    if (!step.ok()) {
      failure = step.status();
      break;
    }
    if (std::chrono::steady_clock::now() - last_report > std::chrono::seconds(2)) {
      const EngineStats& s = (*engine)->stats();
      log << "step " << s.steps << ": " << s.prefill_tokens << " prompt and " << s.decode_tokens
          << " generated tokens so far\n";
      last_report = std::chrono::steady_clock::now();
    }
  }
  for (const auto& [i, id] : queued) {
    const GenerationOutput* g = (*engine)->Output(id);
    if (g->finish_reason == FinishReason::kNone) {
      results[i] = failure.ok() ? InternalError("request did not finish") : failure;
    } else {
      results[i] = *g;
    }
  }

  int code = 0;
  for (const auto& r : results) {
    if (!r.ok()) {
      code = 1;
      if (o.json) {
        out << Json{{"error", r.status().ToString()}}.dump() << "\n";
      } else {
        out << "error: " << r.status() << "\n";
      }
      continue;
    }
    if (o.json) {
      out << Json{{"tokens", r->tokens}, {"logprobs", r->logprobs},
                  {"finish_reason", std::string(FinishReasonName(r->finish_reason))}}.dump() << "\n";
    } else {
      out << "tokens:";
      for (int64_t t : r->tokens) out << " " << t;
      out << "  (finish: " << FinishReasonName(r->finish_reason) << ")\n";
    }
  }
  const EngineStats& s = (*engine)->stats();
  log << "done: " << s.steps << " steps, " << s.prefill_tokens << " prompt tokens, " << s.decode_tokens
      << " generated tokens, " << s.preemptions << " preemptions, " << s.forward_seconds << " s in the model\n";
  return code;
}

}  // namespace mlarun
