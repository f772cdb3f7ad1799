// What the Dispatcher tells an observer about every request it handles,
// whichever API (gRPC or HTTP) submitted it: routing decisions, tokens as
// they leave for the client, and each request's end. The metrics of
// serving/http/metrics.h are one such observer.
//
// Threading: every method is called with the dispatcher's mutex held, on
// whatever thread holds it (gRPC callback threads, HTTP handler threads, the
// deadline timer). An implementation must be cheap (counters, histogram
// observations), must never block on anything but its own short locks, and
// must never call back into the dispatcher. No gRPC type appears here.
#pragma once

#include <cstdint>
#include <string_view>

namespace mlarun::coord {

struct RequestEnd {
  // The client's name for the request (its own, or the one given to it).
  std::string_view request_id;
  // The request's final status as a gRPC code number (0 = OK: it finished).
  int status_code = 0;
  // "length" or "stop" when finished; "" otherwise.
  std::string_view finish_reason;
  // The prompt as routed, and the tokens the client got.
  int64_t prompt_tokens = 0;
  int64_t completion_tokens = 0;
  // Prompt tokens whose latent cache the group reused (finished requests only).
  int64_t prefix_hit_tokens = 0;
  // Seconds from arrival at the coordinator: to routing (< 0: never routed),
  // to the first token (< 0: none), to the end.
  double queued_s = -1;
  double first_token_s = -1;
  double total_s = 0;
};

class DispatcherObserver {
 public:
  virtual ~DispatcherObserver() = default;
  // A request was routed to DP group `dp_group` of worker `worker_id`
  // (re-routings after a group's loss included).
  virtual void OnRouted(std::string_view worker_id, int32_t dp_group) = 0;
  // A token left for the client: the first of its request (`since_s` counts
  // from the request's arrival), or a later one (`since_s` counts from the
  // previous token of the same request).
  virtual void OnToken(bool first, double since_s) = 0;
  // A request that the dispatcher accepted ended (rejections at Submit are
  // ends too, never routed).
  virtual void OnEnd(const RequestEnd& end) = 0;
  // A request moved to another group (Migrate) and its first token from
  // there left for the client `pause_s` after its last one from the old
  // group (or the Migrate call, when it had none).
  virtual void OnMigrated(double pause_s) {}
};

}  // namespace mlarun::coord
