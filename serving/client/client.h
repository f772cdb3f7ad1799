// Client-side commands of mlarun: `submit`, `stats` and `migrate`, and the deployment
// file they share with `coordinator` and `worker`. No gRPC header is visible
// here.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"
#include "runtime/request/sampling_params.h"
#include "serving/security/security.h"

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
  int64_t cache_bytes = 0;         // 0: not set
  double memory_gib = 0;           // 0: not set (excludes cache_bytes)
  int64_t max_batched_tokens = 0;  // 0: not set
};
StatusOr<DeploymentConfig> LoadDeploymentConfig(const std::string& path);
// The same from the file's text; `path` names it in messages.
StatusOr<DeploymentConfig> ParseDeploymentConfig(std::string_view yaml_text, const std::string& path);

struct SubmitOptions {
  std::string coordinator = "127.0.0.1:50051";
  std::vector<int64_t> prompt_ids;
  // Batch mode instead of prompt_ids: JSON lines as `mlarun generate
  // --prompts` reads them (sampling flags are every line's defaults), sent
  // `concurrency` at a time; results print in input order, one line each
  // (`{"error": ...}` for a failed one), with a progress line on `err`.
  std::string prompts_path;
  int concurrency = 16;
  SamplingParams sampling;
  std::string request_id;   // empty: the coordinator generates one
  bool stream = false;      // print each token as it arrives
  bool json = false;        // the same object as `mlarun generate`, plus "dp_group"
  double timeout_s = 60;    // the call's deadline
  ClientSecurity security;  // TLS and the bearer token (--tls-ca, --auth-token-file)
};
// Exit code: 0 done, 1 a request failed (its gRPC status is printed), 2 bad usage.
int RunSubmit(const SubmitOptions& o, std::ostream& out, std::ostream& err);

struct StatsOptions {
  std::string coordinator = "127.0.0.1:50051";
  bool json = false;
  double timeout_s = 10;
  ClientSecurity security;
};
int RunStats(const StatsOptions& o, std::ostream& out, std::ostream& err);

// `mlarun migrate`: moves a running request to another DP group (the
// Migrate RPC) and returns once it runs there. Exit code: 0 moved, 1 the
// coordinator refused or the request ended first (its gRPC status is
// printed), 2 bad usage.
struct MigrateOptions {
  std::string coordinator = "127.0.0.1:50051";
  std::string request_id;
  int to_group = -1;         // -1: the coordinator picks
  std::string to_worker_id;  // where several jobs have DP group to_group
  double timeout_s = 60;
  ClientSecurity security;
};
int RunMigrate(const MigrateOptions& o, std::ostream& out, std::ostream& err);

}  // namespace mlarun
