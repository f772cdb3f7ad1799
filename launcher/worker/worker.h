// `mpirun -np W mlarun worker --coordinator HOST:PORT --model ... --parallel dp=D,attn_tp=T`
//
// Every rank loads its shard and joins the lockstep loop (RankRunner). Each DP
// group's leader also holds a WorkerLink stream to the coordinator, on a
// thread of its own: it registers the group, receives routed requests and
// cancellations, and sends tokens after every step, completions, and stats
// every stats_period_s. If the coordinator is not up yet, or goes away, the
// leader keeps retrying (back-off up to 2 s) and re-registers; requests of a
// broken stream are cancelled locally (the coordinator has already ended or
// re-routed them). When no rank has work the loop sleeps instead of spinning.
// SIGINT/SIGTERM on any rank stops every rank at the same step.
//
// Failures. A step whose computation fails on any rank fails the requests of
// that step (RequestDone with the step's code, INTERNAL or RESOURCE_EXHAUSTED,
// and a message naming the rank and why) and the job keeps serving. An error
// a rank cannot recover from (a collective's, the engine's bookkeeping) ends
// the job: a leader that sees it first tells the coordinator why (a
// `leaving` message), then every rank is stopped through MPI_Abort.
//
// Each rank prints its CPU (base/cpu_isa.h CpuSummary) once at
// start-up, prefixed with its rank and host, and reports it in GetStats.
#pragma once

#include <string>
#include <string_view>

#include "base/status.h"
#include "runtime/engine/engine.h"
#include "runtime/rank/bootstrap.h"
#include "serving/security/security.h"

namespace mlarun {

class MpiSession;

struct WorkerOptions {
  std::string coordinator = "127.0.0.1:50051";
  // The model and layout every rank must agree on (fault injection included).
  DeploymentSpec deployment{.parallel = "dp=1"};
  // Memory per rank (GiB). When set, the cache gets what this leaves after
  // the rank's weights and its prefill workspace (runtime/model/memory_plan.h,
  // as `mlarun memory` predicts it), instead of engine.cache_budget_bytes.
  double memory_gib = 0;
  EngineConfig engine;
  double stats_period_s = 0.5;
  // The worker link's shared secret (--worker-secret-file); empty: none.
  std::string worker_secret;
  // TLS to the coordinator (--tls-ca; --tls-cert and --tls-key: the worker's
  // client certificate, which a coordinator with --tls-ca takes instead of
  // the secret).
  TlsPem tls;
  // The transfer plane for cache blocks (--transfer): "off" (a request that
  // moves here is computed again from its tokens), "shm" (UCX shared
  // memory: ranks of one host) or "any" (any transport UCX finds: TCP,
  // verbs). Groups that both have it move a request's blocks instead.
  std::string transfer = "off";
  // What the job's groups serve (--role): "mixed" (new requests and moved
  // ones), "prefill" (new requests, each handed to a decode group after its
  // first token) or "decode" (requests handed over by prefill groups).
  std::string role = "mixed";
};

// Runs until a signal; returns the process exit code (0 on a clean stop).
int RunWorker(const WorkerOptions& o, MpiSession& session);

}  // namespace mlarun
