// `mlarun generate`: run requests through one process's engine and print the
// results, one per request, in input order.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <string>
#include <vector>

#include "runtime/engine/engine.h"
#include "runtime/rank/bootstrap.h"

namespace mlarun {

struct GenerateOptions {
  // The model, and with `parallel` set, the layout on the ranks of mpirun.
  DeploymentSpec deployment;
  std::vector<int64_t> prompt_ids;  // one request, or
  std::string prompts_path;         // JSON lines: {"prompt_ids": [...], sampling fields...}
  SamplingParams sampling;          // defaults for every request (JSON lines override per field)
  bool json = false;
  EngineConfig engine;
  int threads = 0;
};

// Prints one line per request: with `json`, {"tokens", "logprobs",
// "finish_reason"} (and the logprob fields the request asked for:
// AddLogprobFields) or {"error"}; otherwise a readable line. Progress goes to
// `log`. Returns the process exit code: 0 when every request completed, 1
// when any was rejected or failed, 2 when the model could not be loaded.
int RunGenerate(const GenerateOptions& o, std::ostream& out, std::ostream& log);

class MpiSession;
// The same under mpirun, on every rank: requests are spread over the DP groups
// (request i to group i % dp); rank 0 alone prints the results, in input order,
// in the format above, then a per-rank memory table on `log`. Every rank
// returns the same exit code. A rank that cannot start (bad layout, model or
// shard) ends the whole job with a message instead of leaving the others
// waiting.
int RunGenerateParallel(const GenerateOptions& o, MpiSession& session, std::ostream& out, std::ostream& log);

}  // namespace mlarun
