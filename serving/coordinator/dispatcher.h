// The coordinator's state machine, apart from the gRPC plumbing: the registry
// of DP groups, the table of live requests, the FIFO queue of requests waiting
// for a group, deadlines, routing, and the counters behind GetStats.
//
// Internal to serving/coordinator (it includes gRPC and the generated
// messages; coordinator.cc adds the Mlarun reactors around it, and the
// WorkerLink streams' reactor, serving/link/link_server.h, calls it as their
// WorkerLinkHandler).
//
// Threading. Every public method is thread-safe and never blocks on the
// network: each takes mu_, updates the tables, queues the messages it decides
// to send on the streams' Outlets, releases mu_ and only then Flush()es those
// outlets (a flush starts a gRPC write, and gRPC may run reactions inline, so it
// must never happen under mu_). Because messages are queued under mu_, the
// order in which the dispatcher decides them is the order in which each stream
// sends them. One internal thread sleeps on a condition variable until the
// earliest request deadline or group stall; there is no thread per request.
//
// Lock order: Dispatcher::mu_, then an outlet's own lock (Queue/Close). An
// outlet never calls into the dispatcher while holding its lock.
//
// Invariant (at every release of mu_): the wait queue is empty or no group is
// eligible (connected and below max_in_flight_per_group), so FIFO order holds.
//
// Every accepted request ends, deadline or not (CoordinatorOptions says each
// bound): routed, it ends with its group's answer, its own deadline, or its
// group's loss (the stream breaks, the group leaves, or it stalls: nothing
// from it for stall_timeout_s with work in flight); on that loss the request
// is re-queued at the head and re-routed, one with tokens with those tokens
// (Resume: the new group computes them again and goes on from there, so the
// client's stream has no gap and no repeat). Queued with no group
// connected, it waits at most queue_timeout_s from its arrival, or
// lost_group_wait_s from the loss of the last group, then ends UNAVAILABLE
// saying which group went away and why (or that none ever registered).
// Queued for room in connected groups, it waits for them.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "base/thread_annotations.h"
#include "mlarun.pb.h"
#include "runtime/request/sampling_params.h"
#include "serving/coordinator/coordinator.h"
#include "serving/coordinator/dispatcher_observer.h"
#include "serving/coordinator/router.h"
#include "serving/link/link_server.h"

namespace mlarun::coord {

using Clock = std::chrono::steady_clock;

using ClientOutlet = Outlet<v1::GenerateResponse>;

// What a DP group serves (Register.role).
enum class GroupRole : uint8_t { kMixed, kPrefill, kDecode };

class Dispatcher final : public WorkerLinkHandler {
 public:
  // Starts the deadline thread. `observer` (may be nullptr) hears of every
  // routing, token and end (dispatcher_observer.h), under mu_.
  Dispatcher(const CoordinatorOptions& options, std::string coordinator_id,
             std::shared_ptr<DispatcherObserver> observer = nullptr);
  // Calls Shutdown().
  ~Dispatcher() override;
  Dispatcher(const Dispatcher&) = delete;
  Dispatcher& operator=(const Dispatcher&) = delete;

  // ---- Client API ----------------------------------------------------------
  struct Accepted {
    std::string wire_id;  // the request's key here and its id on the worker link
    uint64_t serial;      // unique per accepted request, even when ids are reused
  };
  // A Generate call from `principal` (AuthTokens' name; "" when the client
  // API is open). Request ids are per principal: a client's own id, or a
  // random one ("req-" and 32 hex digits); ALREADY_EXISTS only for an id the
  // same principal has live. On acceptance the request owns `client` and
  // ends it exactly once (Finished then OK, or an error status); on
  // rejection `client` is closed with the error and nullopt is returned.
  // `grpc_deadline` is the call's deadline (time_point::max() when the
  // client set none).
  std::optional<Accepted> Submit(std::shared_ptr<ClientOutlet> client, const v1::GenerateRequest& request,
                                 const std::string& principal, std::chrono::system_clock::time_point grpc_deadline);
  // The client cancelled the call, disconnected, or its deadline passed inside
  // gRPC. Ends the request (if still live) and sends CancelRoute to its group.
  void ClientGone(const std::string& wire_id, uint64_t serial);
  // The client has what it wants before the group finished (the HTTP API's
  // stop strings): the request (if still live) ends as finished with
  // `finish_reason`, counted as completed, its Finished queued on its outlet
  // with the tokens sent so far, and CancelRoute goes to its group.
  void EndEarly(const std::string& wire_id, uint64_t serial, const std::string& finish_reason);
  // The Cancel RPC of `principal`: false if it has no live request with this
  // id (another principal's is not even looked at).
  bool Cancel(const std::string& principal, const std::string& id);
  // The Migrate RPC of `principal` (mlarun.proto says what it does and its
  // errors). `done` is called exactly once, outside the dispatcher's lock:
  // with OK and the response once the request runs on its new group (its
  // first token or its end there), or with the error.
  using MigrateDone = std::function<void(const grpc::Status&, const v1::MigrateResponse&)>;
  void Migrate(const std::string& principal, const v1::MigrateRequest& request, MigrateDone done);
  // GetStats. Without `details` (a caller that is not authenticated) the
  // ranks' hosts and model paths are left out and worker ids are replaced by
  // "worker-<k>".
  void FillStats(v1::GetStatsResponse* out, bool details) const;
  void FillHealth(v1::HealthResponse* out) const;
  // Requests accepted and not ended yet (queued or routed).
  int64_t live_requests() const;
  // The model limits of the groups connected (of those known when none is),
  // as Submit checks them; 0 when no group ever registered.
  struct ModelLimits {
    int64_t vocab_size = 0;
    int64_t max_position_embeddings = 0;
  };
  ModelLimits model_limits() const;

  // ---- Worker link ---------------------------------------------------------
  // The first message of a WorkerLink stream. On success the link is the
  // group's: Registered is queued on it, then any requests routed there; on a
  // bad Register (or after Shutdown) the link is closed and false is returned.
  // Refused (closed with the status, false returned): INVALID_ARGUMENT for
  // a field out of range (named in the message), ALREADY_EXISTS for a group
  // (worker_id, dp_group) still connected through another link: its owner
  // keeps it until that link ends.
  bool Attach(std::shared_ptr<WorkerOutlet> link, const v1::Register& reg) override;
  // A later message of an attached link. False if `link` is not (or no
  // longer) attached; the caller stops reading.
  bool OnWorkerMessage(const WorkerOutlet* link, const v1::WorkerMessage& msg) override;
  // The link's stream ended or broke: the group is disconnected, its requests
  // are re-routed (those with tokens resume from them).
  // Idempotent; a no-op for a link that is not attached. (A `leaving`
  // message does the same through OnWorkerMessage, with the group's reason,
  // and closes the link.)
  void Detach(const WorkerOutlet* link) override;

  // Ends every live request and every link with UNAVAILABLE, refuses new ones,
  // and joins the deadline thread. Idempotent. Blocks only for that join.
  void Shutdown();

 private:
  struct Request;
  struct Group;
  class Pending;  // outlets to flush once mu_ is released

  // All of these REQUIRE mu_.
  // The request's checks, `sampling` being its SamplingParams with absent
  // fields filled in; the error names the field.
  std::optional<std::string> Validate(const v1::GenerateRequest& request, const SamplingParams& sampling) const
      MLARUN_REQUIRES(mu_);
  int64_t ConnectedGroups() const MLARUN_REQUIRES(mu_);
  bool Eligible(const Group& g) const MLARUN_REQUIRES(mu_);
  bool TryRoute(Request* r, Pending& pending) MLARUN_REQUIRES(mu_);
  // What the router weighs of groups_[index].
  Candidate CandidateOf(int index) const MLARUN_REQUIRES(mu_);
  // Whether `g`'s role takes `r`: a new request a prefill or mixed group, a
  // resumed one (it has tokens) a decode or mixed group.
  static bool Suits(const Group& g, const Request& r);
  // Routes `r` (not routed now) to groups_[index], which is connected: the
  // route goes now, or once the group AskForPrefix asked has answered.
  void RouteTo(Request* r, int index, Pending& pending) MLARUN_REQUIRES(mu_);
  // Sends `r`'s RouteRequest to its group, with `prefix` (may be nullptr)
  // as its move source.
  void SendRoute(Request* r, const v1::MoveSource* prefix, Pending& pending) MLARUN_REQUIRES(mu_);
  // Whether `g`'s prefix index is kept: for prefix_affinity routing, and
  // for fetching prefixes from the groups that export them.
  bool IndexesPrefixes(const Group& g) const MLARUN_REQUIRES(mu_);
  // Prefix fetch (CoordinatorOptions::prefix_fetch_min_tokens): when another
  // group's prefix index holds at least that many more leading prompt
  // tokens of `r` than groups_[target]'s, asks the one holding the most for
  // them (ExportPrefix) and returns true: the route waits for its answer
  // (OnPrefixExported). False: route now.
  bool AskForPrefix(Request* r, int target, Pending& pending) MLARUN_REQUIRES(mu_);
  // Ends `r`'s prefix fetch: an ask not answered yet is forgotten (its
  // answer is then released), held blocks are released (ReleasePrefix).
  void DropPrefix(Request* r, Pending& pending) MLARUN_REQUIRES(mu_);
  // ReleasePrefix of `export_id` to `source`, if its link is up.
  void ReleasePrefix(Group& source, uint64_t export_id, Pending& pending) MLARUN_REQUIRES(mu_);
  // `r` left its group with the tokens its client has (it moved, or the
  // group went away): routed anew with them as RouteRequest.generated_ids,
  // to its move's target while that is connected, else as the router picks;
  // queued at the head when no group can take it.
  void Resume(Request* r, Pending& pending) MLARUN_REQUIRES(mu_);
  // Migrate's destination for `r`: the group `m` names, or the router's
  // pick among the other connected groups; -1 with `error` set otherwise.
  int MoveTarget(const Request& r, const v1::MigrateRequest& m, grpc::Status* error) MLARUN_REQUIRES(mu_);
  // Starts moving `r` (routed, not moving) to groups_[to]: MigrateOut to
  // its group, which answers Exported.
  void StartMove(Request* r, int to, Pending& pending) MLARUN_REQUIRES(mu_);
  // `r` has its first token from a prefill group: it moves to a decode group
  // the router picks (none connected: it stays).
  void HandOff(Request* r, Pending& pending) MLARUN_REQUIRES(mu_);
  // Rebalancing (CoordinatorOptions::rebalance_threshold and
  // rebalance_cache_fraction): at most once per period and with no other
  // rebalancing move in flight, moves one running request from the busiest
  // group to the least busy one, by requests in flight first, then by cache
  // use (MoveOne).
  void MaybeRebalance(Clock::time_point now, Pending& pending) MLARUN_REQUIRES(mu_);
  // Starts moving one running request of groups_[source] (not moved within
  // the cooldown) to groups_[target]: by requests in flight the one with
  // the most tokens left, by cache (`by_cache`) the one holding the most
  // rows; false when none qualifies.
  bool MoveOne(int source, int target, bool by_cache, Clock::time_point now, Pending& pending) MLARUN_REQUIRES(mu_);
  // Fraction of `g`'s cache blocks in use, as it last reported (free and
  // evictable blocks count as unused).
  static double CacheUse(const Group& g);
  // Of the connected groups that take moved requests (mixed or decode),
  // those with the most and the least `load`; -1, -1 when there are none.
  std::pair<int, int> Extremes(double (*load)(const Group&)) const MLARUN_REQUIRES(mu_);
  // The move of `r` is over: its callers get `status` (OK: it runs on its
  // new group) and the counters count it.
  void EndMove(Request* r, const grpc::Status& status, Pending& pending) MLARUN_REQUIRES(mu_);
  void DrainQueue(Pending& pending) MLARUN_REQUIRES(mu_);
  void ArmTimer(Request* r, Clock::time_point at) MLARUN_REQUIRES(mu_);
  // A timer of `r` fired: DEADLINE_EXCEEDED at its deadline, UNAVAILABLE
  // when its wait with no group connected is over, else re-armed (ArmNext).
  void OnTimer(Request* r, Clock::time_point now, Pending& pending) MLARUN_REQUIRES(mu_);
  // Arms `r`'s timer for its next timed fate (its deadline; while queued with
  // no group connected, the end of that wait), or disarms it when nothing
  // timed is due: routed, or queued for room in a connected group, without a
  // deadline (the group's progress or the stall watch decides).
  void ArmNext(Request* r, Clock::time_point now) MLARUN_REQUIRES(mu_);
  // The stall watch: when the earliest connected group with requests in
  // flight reaches stall_timeout_s of silence (nullopt: none can), and the
  // check that disconnects every group that has.
  std::optional<Clock::time_point> NextStall() const MLARUN_REQUIRES(mu_);
  void CheckStalls(Clock::time_point now, Pending& pending) MLARUN_REQUIRES(mu_);
  void ReleaseFromGroup(Request* r) MLARUN_REQUIRES(mu_);
  // The disconnected group (with nothing in flight) that went away first:
  // the one a full registry forgets for a new group; -1 when every group is
  // connected. Replace forgets the group at `index` (its key, its rank
  // stats, the requests' memory of losing it) and puts `fresh` there.
  int OldestGone() const MLARUN_REQUIRES(mu_);
  void Replace(int index, std::unique_ptr<Group> fresh) MLARUN_REQUIRES(mu_);
  // Whether the stall watch covers the group: connected, and with work in
  // flight or a stream that has carried stats (a step loop that reports).
  static bool Watched(const Group& g);
  // Adds one ended request to the counter of its final status: OK completed;
  // INVALID_ARGUMENT, ALREADY_EXISTS, RESOURCE_EXHAUSTED rejected; CANCELLED
  // cancelled; anything else failed.
  void Count(grpc::StatusCode code) MLARUN_REQUIRES(mu_);
  // Tells the group `r` is routed to (r.group >= 0) to drop it, if its link
  // is up.
  void CancelRoute(const Request& r, Pending& pending) MLARUN_REQUIRES(mu_);
  // Ends `r` with an error status (destroys it), counted by Count. CancelRoute
  // goes to its group when `cancel_route` and it is routed.
  void Fail(Request* r, grpc::StatusCode code, std::string message, bool cancel_route, Pending& pending)
      MLARUN_REQUIRES(mu_);
  void Complete(Request* r, const v1::RequestDone& done, Pending& pending) MLARUN_REQUIRES(mu_);
  void Forget(Request* r, Pending& pending) MLARUN_REQUIRES(mu_);  // unlinks and destroys r
  // The group went away (`reason` says how, for messages and GetStats): its
  // requests are re-queued at the head (Resume for those with tokens). When no
  // group is connected any more, everything queued waits at most
  // lost_group_wait_s more (or until its own deadline) for one.
  void Disconnect(int group, std::string reason, Pending& pending) MLARUN_REQUIRES(mu_);
  // The UNAVAILABLE message of a request that waited for a group in vain:
  // what happened to the group it lost, or to the groups registered before,
  // or that none ever registered.
  std::string NoGroupMessage(const Request& r, Clock::time_point now) const MLARUN_REQUIRES(mu_);
  // What a group sent that it must not: `what` names the field and the value;
  // `request_id` is the request it concerned (empty if none).
  struct Violation {
    std::string request_id;
    std::string what;
  };
  // A group's tokens and completions, checked before a client sees them (ids
  // in its vocabulary, finite logprobs <= 0, at most max_tokens, a known
  // finish reason); the first violation stops the batch and is returned.
  std::optional<Violation> OnTokens(Group& g, int group, const v1::TokenBatch& batch, Pending& pending)
      MLARUN_REQUIRES(mu_);
  std::optional<Violation> OnDone(int group, const v1::RequestDone& done, Pending& pending) MLARUN_REQUIRES(mu_);
  // A group's answer to MigrateOut: the request resumes on its target.
  std::optional<Violation> OnExported(int group, const v1::Exported& exported, Pending& pending) MLARUN_REQUIRES(mu_);
  // A group's answer to ExportPrefix: the waiting route goes to its group,
  // with the blocks as its move source when there are any.
  std::optional<Violation> OnPrefixExported(int group, const v1::PrefixExported& x, Pending& pending)
      MLARUN_REQUIRES(mu_);
  // The group broke the protocol: the request concerned fails (INTERNAL,
  // naming the group and the violation), the group is disconnected as on a
  // loss (`reason` says what it did) and its stream closed with
  // FAILED_PRECONDITION.
  void ProtocolViolation(int group, Violation v, Pending& pending) MLARUN_REQUIRES(mu_);
  void TimerLoop() MLARUN_EXCLUDES(mu_);

  ModelLimits Limits() const MLARUN_REQUIRES(mu_);
  // Tells the observer (if any) that `r` ended with `code`.
  void Observe(const Request& r, grpc::StatusCode code, std::string_view finish_reason, int64_t prefix_hit_tokens,
               Clock::time_point now) MLARUN_REQUIRES(mu_);

  // Constant after construction.
  const CoordinatorOptions options_;
  const std::string coordinator_id_;
  const std::shared_ptr<DispatcherObserver> observer_;  // may be nullptr

  // mu_ guards everything below: the group registry, the request table, the
  // wait queue, the deadline timers, the router (round-robin cursor, prefix
  // indexes) and the counters.
  mutable Mutex mu_;
  std::condition_variable timer_cv_;  // wakes TimerLoop for an earlier deadline, a stall watch, or stop
  bool shutting_down_ MLARUN_GUARDED_BY(mu_) = false;
  bool stop_timer_ MLARUN_GUARDED_BY(mu_) = false;
  Router router_ MLARUN_GUARDED_BY(mu_);
  std::vector<std::unique_ptr<Group>> groups_ MLARUN_GUARDED_BY(mu_);  // index = group id; a slot is reused only
                                                                       // when the registry is full (Replace)
  std::map<std::pair<std::string, int32_t>, int> group_index_ MLARUN_GUARDED_BY(mu_);  // (worker_id, dp_group) -> index
  std::unordered_map<const WorkerOutlet*, int> link_group_ MLARUN_GUARDED_BY(mu_);     // attached links
  std::unordered_map<std::string, std::unique_ptr<Request>> requests_ MLARUN_GUARDED_BY(mu_);  // live, by wire id
  std::map<std::pair<std::string, std::string>, Request*> client_ids_ MLARUN_GUARDED_BY(mu_);  // (principal, id)
  std::list<Request*> queue_ MLARUN_GUARDED_BY(mu_);                          // waiting for a group, FIFO
  std::multimap<Clock::time_point, Request*> timers_ MLARUN_GUARDED_BY(mu_);  // one entry per live request
  int64_t rank_stats_bytes_ MLARUN_GUARDED_BY(mu_) = 0;  // wire size of every group's rank stats, kept
  uint64_t next_serial_ MLARUN_GUARDED_BY(mu_) = 0;
  Clock::time_point last_rebalance_ MLARUN_GUARDED_BY(mu_);
  bool rebalancing_ MLARUN_GUARDED_BY(mu_) = false;  // a rebalancing move is in flight
  uint64_t next_export_id_ MLARUN_GUARDED_BY(mu_) = 1;
  std::unordered_map<uint64_t, Request*> prefix_asks_ MLARUN_GUARDED_BY(mu_);  // ExportPrefix not answered yet
  struct Counters {
    int64_t received = 0, completed = 0, rejected = 0, failed = 0, cancelled = 0, rerouted = 0;
    int64_t migrated = 0, migrations_failed = 0, rebalance_moves = 0;
    int64_t prefix_fetches = 0, prefix_fetch_tokens = 0;
  } counters_ MLARUN_GUARDED_BY(mu_);

  std::thread timer_thread_;  // started in the constructor, joined by Shutdown
};

}  // namespace mlarun::coord
