// The coordinator's Prometheus metrics (docs/metrics.md lists every one):
// counters and histograms fed by the Dispatcher as its observer, so that
// requests of the gRPC and the HTTP API count alike, and gauges read from
// the dispatcher's stats at scrape time. Serialized in the Prometheus text
// format by prometheus-cpp's TextSerializer on the HTTP API's /metrics.
//
// Worker jobs appear as `worker="worker-<k>"` (k in order of first sight),
// never as their ids (the leader's host:pid); Render adds mlarun:worker_info
// mapping the two when the caller may see them.
//
// Threading: thread-safe. The observer methods are cheap (a counter or
// histogram update, a short lock of its own) as DispatcherObserver requires.
// No gRPC or prometheus header is visible here.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "serving/coordinator/dispatcher_observer.h"

namespace mlarun {
namespace v1 {
class GetStatsResponse;
}

class Metrics final : public coord::DispatcherObserver {
 public:
  // `policy`: the routing policy's name (a label of the routing counter).
  explicit Metrics(std::string policy);
  ~Metrics() override;
  Metrics(const Metrics&) = delete;
  Metrics& operator=(const Metrics&) = delete;

  void OnRouted(std::string_view worker_id, int32_t dp_group) override;
  void OnToken(bool first, double since_s) override;
  void OnEnd(const coord::RequestEnd& end) override;
  void OnMigrated(double pause_s) override;

  // The token counters so far (the stats line of serving/coordinator/
  // server_log.h reads them, so the log and /metrics count once).
  struct Totals {
    int64_t prompt_tokens = 0;      // mlarun:prompt_tokens_total
    int64_t generation_tokens = 0;  // mlarun:generation_tokens_total
    int64_t prefix_queries = 0;     // mlarun:prefix_cache_queries_total
    int64_t prefix_hits = 0;        // mlarun:prefix_cache_hits_total
  };
  Totals totals() const;

  // One HTTP exchange answered with `status` on `path` (one of the API's
  // paths, or anything else counted as "other").
  void OnHttp(std::string_view path, int status);

  // The exposition: every counter and histogram, then the gauges of
  // `stats` (as FillStats(details = true) gives them) and `live_requests`.
  // `details`: add mlarun:worker_info with the worker ids.
  std::string Render(const v1::GetStatsResponse& stats, int64_t live_requests, bool details);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace mlarun
