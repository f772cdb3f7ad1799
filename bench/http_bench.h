// `mlarun bench serve --http`: the same workloads over the HTTP API and over
// gRPC, on one in-process coordinator with simulated DP groups, in the same
// run, so that the difference is what HTTP (JSON, detokenization, SSE) adds.
//
// Sections (every request is verified before its numbers count: over gRPC
// exactly the tokens SimWorkerToken predicts, over HTTP exactly their decode
// as text and max_tokens completion tokens in its usage):
//  * overhead: one client, one group answering as fast as it can, max_tokens
//    1, one request at a time, alternating gRPC / HTTP whole / HTTP streamed
//    in rounds; latency p50/p99 each and HTTP minus gRPC at p50;
//  * load: N concurrent streaming clients, R requests of max_tokens tokens,
//    G groups at tokens_per_s each; time to first token and inter-token (over
//    HTTP: inter-chunk) latency p50/p99 and requests/s, gRPC then HTTP.
// The tokenizer is a byte-level one made here (the two DeepSeek specials and
// 256 byte tokens); the groups' vocabulary is its first 130 ids (the
// specials and the ASCII bytes), so that every token has text of its own.
//
// Blocks until done; everything it starts is stopped before it returns.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <nlohmann/json.hpp>

#include "base/status.h"

namespace mlarun {

struct HttpBenchOptions {
  int clients = 64;
  int64_t requests = 512;
  int64_t max_tokens = 16;
  int groups = 4;
  double tokens_per_s = 1000;  // per simulated group; 0: as fast as possible
  int64_t overhead_requests = 512;
};

// The tables go to `table`; the returned JSON holds the same numbers.
// `verified` is set to whether every request passed.
StatusOr<nlohmann::json> RunHttpBench(const HttpBenchOptions& o, std::ostream& table, bool* verified);

}  // namespace mlarun
