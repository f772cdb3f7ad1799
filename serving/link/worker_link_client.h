// The worker's end of the WorkerLink stream (serving/proto/mlarun.proto):
// the one client through which a DP group's leader (launcher/worker/), a
// simulated group (serving/sim/) and the coordinator test's fake groups
// register with the coordinator, receive routed requests and cancellations,
// and send tokens, completions and stats.
//
// Threads. The link runs one thread of its own: it connects, sends the
// registration, reads, and when the stream ends (or never came up) tries
// again after a back-off of 100 ms doubling to 2 s (100 ms again after a
// registration), until the link is destroyed or left. The group's own thread
// is the consumer: it takes what arrived with Drain() and sends with Send().
// Every method is thread-safe.
//
// Order. Events come as they happened, attempt by attempt: the attempt's
// Registered, its routes and cancels, then one `ended` event (every attempt
// ends with one, registered or not). Send() writes only on a stream whose
// Registered the consumer has drained, so nothing decided for the requests
// of a broken stream reaches the next one: the coordinator has already ended
// or re-routed those, and the group drops them when it drains the `ended`.
//
// Internal to serving/ and what stands on it: includes gRPC and the generated messages.
#pragma once

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <memory>
#include <string>
#include <thread>

#include "base/thread_annotations.h"
#include "mlarun.grpc.pb.h"
#include "serving/security/security.h"

namespace mlarun {

// The shared secret of the worker link (--worker-secret-file on the
// coordinator and the workers): sent by the worker as this metadata header of
// every Connect call, compared by the coordinator in constant time.
// (ReadSecretFile, serving/security/security.h, reads it.)
inline constexpr char kWorkerSecretHeader[] = "x-mlarun-worker-secret";

struct WorkerLinkEvent {
  // What the coordinator sent (registered, route or cancel); empty when
  // `ended`.
  v1::CoordinatorMessage message;
  // The end of one attempt: how the call ended, and whether it had
  // registered.
  bool ended = false;
  bool registered = false;
  grpc::Status status;
};

class WorkerLinkClient {
 public:
  struct Options {
    std::string coordinator;    // host:port
    v1::Register registration;  // the first message of every attempt
    // False: one attempt only (the coordinator test breaks and reconnects
    // its fake groups by hand).
    bool reconnect = true;
    // Sent as kWorkerSecretHeader when not empty (the coordinator's
    // --worker-secret-file). A coordinator that wants another answers
    // UNAUTHENTICATED; the link keeps trying with its back-off.
    std::string secret;
    // TLS to the coordinator when enabled (LoadClientTls: its CA, and the
    // worker's client certificate, which a coordinator with --tls-ca takes
    // in place of the secret).
    TlsPem tls;
  };
  using Clock = std::chrono::steady_clock;

  // Starts the link's thread, which connects at once; does not block.
  explicit WorkerLinkClient(Options options);
  // Cancels the live call (the coordinator sees the stream break), stops
  // trying and joins the thread.
  ~WorkerLinkClient();
  WorkerLinkClient(const WorkerLinkClient&) = delete;
  WorkerLinkClient& operator=(const WorkerLinkClient&) = delete;

  // Everything that arrived since the last call, oldest first. After an
  // attempt ended, the link tries again only once its end was drained: a
  // consumer that stopped draining (a step loop stuck in a collective) is
  // not registered again behind its back.
  std::deque<WorkerLinkEvent> Drain();
  // Blocks until there is something to drain, Wake() is called, or `until`.
  void WaitUntil(Clock::time_point until);
  // Makes the current or the next WaitUntil return at once.
  void Wake();
  // Writes `m` on the live stream. False when there is none (or its
  // Registered is not drained yet): the message is dropped, since the
  // coordinator ends that stream's requests itself.
  bool Send(const v1::WorkerMessage& m);
  // The ranks the next registration reports (the latest stats).
  void UpdateRanks(const google::protobuf::RepeatedPtrField<v1::RankStats>& ranks);
  // Ends the link from this side, for good: sends `leaving` with `reason`
  // (the group cannot continue), or with an empty reason half-closes the
  // stream (a clean stop); then waits at most `timeout_s` for the
  // coordinator to end the stream, so the message is not lost with the
  // process. False when there was no live stream or it did not end in time.
  bool Leave(const std::string& reason, double timeout_s);

 private:
  using Stream = grpc::ClientReaderWriter<v1::WorkerMessage, v1::CoordinatorMessage>;

  void Run();
  // Writes `m` (nullptr: half-closes) on the live stream, drained or not when
  // `any`.
  bool Write(const v1::WorkerMessage* m, bool any);
  void Push(WorkerLinkEvent e) MLARUN_REQUIRES(mu_);

  // Constant after construction.
  const std::string coordinator_;
  const bool reconnect_;
  const std::string secret_;
  const TlsPem tls_;

  Mutex write_mu_;  // one writer at a time on the stream; taken before mu_
  Mutex mu_;
  std::condition_variable changed_;  // an event, Wake(), an attempt's end, stopping_
  v1::Register registration_ MLARUN_GUARDED_BY(mu_);
  std::deque<WorkerLinkEvent> inbox_ MLARUN_GUARDED_BY(mu_);
  std::shared_ptr<Stream> stream_ MLARUN_GUARDED_BY(mu_);                // the registered stream, while it lasts
  std::shared_ptr<grpc::ClientContext> context_ MLARUN_GUARDED_BY(mu_);  // the attempt's, for cancelling
  bool drained_ MLARUN_GUARDED_BY(mu_) = false;  // the consumer has drained stream_'s Registered
  bool woken_ MLARUN_GUARDED_BY(mu_) = false;
  bool stopping_ MLARUN_GUARDED_BY(mu_) = false;  // being destroyed
  bool leaving_ MLARUN_GUARDED_BY(mu_) = false;   // Leave() was called: no new attempt
  std::thread thread_;                            // last: started once everything above is set
};

}  // namespace mlarun
