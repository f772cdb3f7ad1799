// The coordinator's log of its traffic, as vLLM users expect it: a line
// per ended request (its id, token counts and timings; never the prompt)
// and, every interval, a stats line (throughput, running and waiting
// requests, cache use, prefix-cache hit rate) when something happened.
//
// ServerLog is the dispatcher's observer in front of the metrics: it passes
// every call on, and its stats line reads the same counters /metrics shows
// (Metrics::totals) and the groups' reported stats, so nothing is counted
// twice. Its lines are written by a thread of its own: the observer's calls
// come under the dispatcher's mutex and must not wait for a slow stderr.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>

#include "serving/coordinator/dispatcher_observer.h"

namespace mlarun::coord {

// What a stats line is made of, read at one instant: the token counters
// are cumulative, the rest is the state at that instant.
struct ServerSample {
  double at_s = 0;  // steady-clock seconds
  int64_t prompt_tokens = 0, generation_tokens = 0;
  int64_t prefix_queries = 0, prefix_hits = 0;
  int64_t running = 0, waiting = 0;  // in the groups' batches; queued in a group or the coordinator
  int64_t cache_blocks_used = 0, cache_blocks_total = 0;
};

// "request ID finished: prompt_tokens=... output_tokens=... ttft=...s
// duration=...s finish_reason=..." (or "ended: status=CODE" for a request
// that did not finish).
std::string FormatRequestLine(const RequestEnd& end);

// The stats line for the interval from `prev` to `now`; "" when there is
// nothing to say: no token went through, no request runs or waits, and the
// running, waiting and cache figures are those `last_said` showed.
std::string FormatStatsLine(const ServerSample& prev, const ServerSample& now, const ServerSample& last_said);

class ServerLog final : public DispatcherObserver {
 public:
  struct Options {
    bool log_requests = true;
    double stats_interval_s = 10;  // 0: no stats line
    // Where each line goes (without a newline).
    std::function<void(const std::string&)> write;
  };
  // `next` (may be nullptr) gets every call too.
  ServerLog(std::shared_ptr<DispatcherObserver> next, Options options);
  ~ServerLog() override;
  ServerLog(const ServerLog&) = delete;
  ServerLog& operator=(const ServerLog&) = delete;

  // Starts the writer thread; `sample` is read at every stats tick (from
  // that thread, never under the dispatcher's mutex).
  void Start(std::function<ServerSample()> sample);
  // Writes what is queued and ends the thread (idempotent).
  void Stop();

  void OnRouted(std::string_view worker_id, int32_t dp_group) override;
  void OnToken(bool first, double since_s) override;
  void OnEnd(const RequestEnd& end) override;

 private:
  void Loop();

  const std::shared_ptr<DispatcherObserver> next_;
  const Options options_;
  std::function<ServerSample()> sample_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::string> lines_;  // guarded by mu_
  int64_t dropped_ = 0;            // lines beyond kMaxQueued, guarded by mu_
  bool stop_ = false;              // guarded by mu_
  std::thread thread_;
  static constexpr size_t kMaxQueued = 10000;
};

}  // namespace mlarun::coord
