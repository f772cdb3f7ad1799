// `mlarun serve`: one machine, one command. Starts the coordinator in this
// process and the workers as one `mpirun ... mlarun worker` child job, waits
// until every DP group of the job has registered (and says so), supervises
// the job (a job that dies after it was ready is reported and started again,
// with back-off), and on SIGINT/SIGTERM stops the job and the coordinator,
// leaving no process behind. Multi-node deployments stay `mlarun
// coordinator` + `mpirun ... mlarun worker` (docs/multi-node.md).
//
// The worker link is closed with a fresh random secret (a 0600 file in a
// private temporary directory, given to the workers by path), so no other
// process on the machine can register as a DP group. The directory holds
// serve's pid too: a serve that was killed leaves it, and the next serve
// removes it.
//
// The job ends with serve, however serve ends (SIGKILL and the OOM killer
// included): the launcher gets SIGTERM when serve dies (PR_SET_PDEATHSIG),
// and each rank leaves once serve is no longer among its ancestors
// (kServePidVariable, WatchServeProcess).
#pragma once

#include <atomic>
#include <iosfwd>
#include <string>
#include <vector>

#include "serving/coordinator/coordinator.h"

namespace mlarun {

struct ServeOptions {
  // The coordinator, with its client APIs (listen: the gRPC address;
  // http_listen: the OpenAI-compatible HTTP API, its http_model defaulting to
  // `model`). Its worker_secret is replaced by the generated one.
  CoordinatorOptions coordinator;
  std::string model;                     // checkpoint directory or configs/models/*.yaml
  std::string parallel = "dp=1";         // the worker job's layout: dp x attn_tp ranks
  std::vector<std::string> worker_args;  // more `mlarun worker` flags (--kv-dtype, --memory-gib, ...)
  // Non-empty: prefill/decode disaggregation. The job is then one MPMD
  // mpirun of two worker jobs, this layout's with `--role prefill` and
  // `parallel`'s with `--role decode`, both with `--transfer any` unless
  // worker_args name a --transfer.
  std::string prefill_parallel;
  std::string mpirun = "mpirun";         // the launcher, found on PATH
  std::vector<std::string> mpirun_args;  // before -np; --oversubscribe is added when ranks exceed cores
  std::string self_exe;                  // the mlarun binary the ranks run (default: /proc/self/exe)
  double ready_timeout_s = 600;          // the first start: every group registered within this
  double restart_backoff_s = 1;          // the first restart's delay; doubles per restart ...
  double restart_backoff_max_s = 30;     // ... up to this; back to the first after a job ran 60 s
  double stop_grace_s = 10;              // SIGTERM to the job, then SIGKILL after this
};

// Runs until `*stop` becomes true (a signal handler sets it), then stops
// everything. Progress and problems go to `log`; a failure's cause is its
// last line ("mlarun serve: failed: ..."). Exit code: 0 after a clean stop,
// 1 when the coordinator cannot start or the first worker job fails before
// it is ready, 2 bad options. SIGPIPE is ignored from here on: `log` may be
// a pipe whose reader left, which must not keep serve from stopping its job
// and removing its secret directory.
// Call it from a thread that lives until it returns (the main thread): the
// job's launcher is told to stop when that thread ends.
int RunServe(const ServeOptions& o, std::atomic<bool>* stop, std::ostream& log);

// The environment variable serve gives its job: serve's pid.
inline constexpr char kServePidVariable[] = "MLARUN_SERVE_PID";

// The environment variable serve gives its job: the file where a rank that
// cannot start writes why (ReportStartFailure), for serve's last line.
inline constexpr char kServeFailureFileVariable[] = "MLARUN_SERVE_FAILURE_FILE";

// For a rank of serve's job (kServeFailureFileVariable set; otherwise
// nothing): writes `cause` (one line) where serve reads it when the job ends
// before it was ready, so that serve's last line says why rather than
// pointing into the launcher's output. The first cause written stays.
void ReportStartFailure(const std::string& cause);

// For a rank of serve's job (kServePidVariable set; otherwise nothing):
// starts a thread that ends this process (exit code 1, a line on stderr)
// within a second of the serve process no longer being among its
// ancestors, which happens when serve died and when its launcher died,
// whoever killed them. INVALID_ARGUMENT when the variable is not a pid.
Status WatchServeProcess();

}  // namespace mlarun
