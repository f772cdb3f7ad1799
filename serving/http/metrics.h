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
