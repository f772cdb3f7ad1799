// `mlarun bench serve`: the serving path end to end (client -> coordinator ->
// DP group -> coordinator -> client) over gRPC on loopback.
//
// Sections (every request of every section is verified before its numbers
// count: it completed exactly once, OK, with max_tokens tokens in order, and
// against simulated groups with exactly the tokens SimWorkerToken predicts):
//  * load: N client threads issue streaming Generate calls back to back until
//    R requests are done; requests/s, tokens/s, time to first token and
//    inter-token latency (p50/p99), per simulated group count G and routing
//    policy, with the load imbalance (max/mean over groups of the router's
//    queued tokens, sampled from GetStats while every client has work);
//  * overhead: one client, one simulated group answering as fast as it can,
//    max_tokens 1: the latency through the coordinator minus the latency of the
//    same requests sent straight down a WorkerLink stream that the benchmark
//    serves itself (the group dials it as it would dial a coordinator) is the
//    coordinator's own cost per request;
//  * prefix: many requests sharing a few long "system prompts", G groups with
//    small simulated caches; the prefix-cache hit rate per policy (sum of
//    prefix_hit_tokens / sum of prompt tokens over the Finished messages).
// By default everything runs in this process (a Coordinator on 127.0.0.1:0 and
// RunSimWorker threads); with `coordinator` set the load, latency and prefix
// workloads drive that deployment instead (its groups dial the coordinator, so
// the direct comparison is not available there).
//
// Blocks until done. Not to be run concurrently with another benchmark in the
// same process (Google Benchmark's registry is global); every coordinator and
// simulated group it starts is stopped before it returns.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <span>
#include <string>
#include <vector>

#include "base/status.h"
#include "bench/workload.h"
#include "serving/security/security.h"

namespace mlarun {

struct ServeBenchOptions {
  int clients = 0;                    // 0: 64 (8 with quick). Load rows use max(clients, 4 per group).
  int64_t requests = 0;               // per load row; 0: 512 (64 with quick), at least 8 per client
  int64_t max_tokens = 0;             // per request; 0: 16 (8 with quick)
  std::vector<int> groups;            // simulated groups of the load rows; empty: 4, 64, 256 (4, 16 with quick)
  double tokens_per_s = 1000;         // per simulated group (0: as fast as possible)
  std::vector<std::string> policies;  // round_robin | least_loaded | prefix_affinity; empty or "all": all three
  std::string coordinator;            // host:port of a running deployment; empty: everything in-process
  bool quick = false;                 // small numbers (well under a minute)
  bool json = false;                  // one JSON document on `out`
  ClientSecurity security;            // with `coordinator`: its TLS and client token (--tls-ca, --auth-token-file)
  // Instead of the sections above: the HTTP API against gRPC on one
  // in-process coordinator (bench/http_bench.h), with clients,
  // requests, max_tokens, tokens_per_s and the first of `groups`.
  bool http = false;
};

// Runs the benchmark. The tables go to `table`; with o.json the JSON document
// goes to `out`. INVALID_ARGUMENT for bad options; INTERNAL (after printing
// what was measured) if any request failed verification; UNAVAILABLE if the
// target never came up.
Status RunServeBench(const ServeBenchOptions& o, std::ostream& out, std::ostream& table);

}  // namespace mlarun
