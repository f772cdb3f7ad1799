// Client-side commands of mlarun: `submit`, `stats`, and a simulated worker
// that speaks the WorkerLink protocol without a model (for tests, examples
// and the serving benchmark). No gRPC header is visible here.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <string>
#include <vector>

#include "runtime/base/status.h"
#include "runtime/engine/sampler.h"

namespace mlarun {

// A deployment file (configs/deploy/*.yaml): what `coordinator`, `worker`,
// `submit` and `stats` share. Flags given on the command line override it.
//   model: configs/models/tiny.yaml
//   parallel: dp=4,attn_tp=1
//   coordinator: 127.0.0.1:50051     # where workers and clients connect
//   listen: 127.0.0.1:50051          # where the coordinator binds
//   policy: prefix_affinity
//   cache_bytes: 1073741824
//   kv_dtype: bf16
//   max_batched_tokens: 512
// Unknown keys and wrong types are errors naming the file and key.
struct DeploymentConfig {
  std::string model, parallel, coordinator, listen, policy, kv_dtype;
  int64_t cache_bytes = 0;          // 0: not set
  int64_t max_batched_tokens = 0;   // 0: not set
};
StatusOr<DeploymentConfig> LoadDeploymentConfig(const std::string& path);

struct SubmitOptions {
  std::string coordinator = "127.0.0.1:50051";
  std::vector<int64_t> prompt_ids;
  SamplingParams sampling;
  std::string request_id;  // empty: the coordinator generates one
  bool stream = false;     // print each token as it arrives
  bool json = false;       // the same object as `mlarun generate`, plus "dp_group"
  double timeout_s = 60;   // the call's deadline
};
// Exit code: 0 done, 1 the request failed (the gRPC status is printed on `err`), 2 bad usage.
int RunSubmit(const SubmitOptions& o, std::ostream& out, std::ostream& err);

struct StatsOptions {
  std::string coordinator = "127.0.0.1:50051";
  bool json = false;
  double timeout_s = 10;
};
int RunStats(const StatsOptions& o, std::ostream& out, std::ostream& err);

// Simulated DP groups: one process opens `groups` WorkerLink streams and
// answers every routed request with deterministic tokens (a function of the
// prompt, the seed and the token index, so equal requests get equal tokens)
// at `tokens_per_s` per group, keeping a simulated prefix cache (hash chain of
// full blocks, LRU) so prefix hits are reported as a real group would.
// Reconnects when the coordinator restarts. Runs until `stop` is set.
struct SimWorkerOptions {
  std::string coordinator = "127.0.0.1:50051";
  std::string worker_id = "sim";
  int groups = 1;
  double tokens_per_s = 1000;  // per group; 0: as fast as possible
  int64_t vocab_size = 512;
  int64_t max_position_embeddings = 4096;
  int64_t block_size = 64;
  int64_t cache_blocks = 1024;   // per group
  int64_t eos_token_id = -1;     // -1: never stops early
};
int RunSimWorker(const SimWorkerOptions& o, const volatile bool* stop, std::ostream& log);

}  // namespace mlarun
