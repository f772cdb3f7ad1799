// `mlarun generate`: run requests through one process's engine and print the
// results, one per request, in input order.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <string>
#include <vector>

#include "runtime/engine/engine.h"

namespace mlarun {

struct GenerateOptions {
  std::string model;                  // checkpoint directory or configs/models/*.yaml
  std::vector<int64_t> prompt_ids;    // one request, or
  std::string prompts_path;           // JSON lines: {"prompt_ids": [...], sampling fields...}
  SamplingParams sampling;            // defaults for every request (JSON lines override per field)
  bool json = false;
  std::string kv_dtype;               // "" keeps the model's; bf16 | fp32
  int64_t num_layers = 0;             // 0 keeps the model's (YAML only)
  EngineConfig engine;
  int threads = 0;
};

// Parses one JSON line into a request; `defaults` fill absent fields. Errors
// name the field.
StatusOr<GenerationRequest> ParseRequestLine(const std::string& line, const SamplingParams& defaults);

// Prints one line per request: with `json`, {"tokens", "logprobs",
// "finish_reason"} or {"error"}; otherwise a readable line. Progress goes to
// `log`. Returns the process exit code: 0 when every request completed, 1
// when any was rejected or failed, 2 when the model could not be loaded.
int RunGenerate(const GenerateOptions& o, std::ostream& out, std::ostream& log);

}  // namespace mlarun
