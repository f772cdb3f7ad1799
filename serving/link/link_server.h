// The coordinator's end of the WorkerLink stream, once: the stream reactor
// (registration first, then the group's messages, writes queued with at most
// one in flight), the server that hosts it, and LinkEndpoint, the same end
// without a coordinator behind it (the serving benchmark's direct path and
// the tests' fake coordinator). The coordinator puts its Dispatcher behind
// the reactor as the WorkerLinkHandler.
//
// Threading: gRPC runs the reactors' reactions on its callback threads; a
// handler's methods may be called concurrently for different streams, and
// for one stream never concurrently with each other except Detach.
//
// Internal to serving/ and what stands on it: includes gRPC and the generated messages.
#pragma once

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <initializer_list>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "base/status.h"
#include "base/thread_annotations.h"
#include "mlarun.grpc.pb.h"
#include "serving/security/security.h"

namespace mlarun {

// The sending half of one gRPC stream, as its owner's logic sees it.
template <class Msg>
class Outlet {
 public:
  virtual ~Outlet() = default;
  // Appends `msg` to the stream's send queue. Never blocks and never calls
  // back into the caller (the dispatcher calls it with its mutex held).
  // Ignored once Close() was called.
  virtual void Queue(Msg msg) = 0;
  // Ends the stream with this status once everything queued is written. Later
  // Queue/Close calls are ignored. Same constraints as Queue.
  virtual void Close(grpc::StatusCode code, std::string message) = 0;
  // Starts writing what is queued (one write in flight per stream). Never
  // blocks; must be called without the caller's own locks held.
  virtual void Flush() = 0;
};
using WorkerOutlet = Outlet<v1::CoordinatorMessage>;

// An Outlet over a server reactor: a queue with at most one write in flight
// (as gRPC requires; the next starts from OnWriteDone), and a Finish issued
// only once the queue is drained and no write is in flight. Thread-safe;
// Queue/Close never call into gRPC, Flush and WriteDone start gRPC operations
// outside any lock.
template <class Msg>
class Outbound : public Outlet<Msg> {
 public:
  void Queue(Msg msg) override {
    MutexLock lock(mu_);
    if (close_wanted_) return;
    queue_.push_back(std::move(msg));
  }
  void Close(grpc::StatusCode code, std::string message) override {
    MutexLock lock(mu_);
    if (close_wanted_) return;
    close_wanted_ = true;
    status_ = grpc::Status(code, std::move(message));
  }
  void Flush() override { Pump(); }

 protected:
  // From the reactor's OnWriteDone. A failed write means the stream is gone:
  // nothing more is written, but Finish is still due (gRPC requires it).
  void WriteDone(bool ok) {
    {
      MutexLock lock(mu_);
      writing_ = false;
      if (!ok) {
        broken_ = true;
        queue_.clear();
      }
    }
    Pump();
  }
  virtual void StartWriteNow(const Msg* msg) = 0;
  virtual void FinishNow(grpc::Status status) = 0;

 private:
  void Pump() {
    bool write = false;
    {
      MutexLock lock(mu_);
      if (writing_ || finished_) return;
      if (!queue_.empty() && !broken_) {
        current_ = std::move(queue_.front());
        queue_.pop_front();
        writing_ = true;
        write = true;
      } else if (close_wanted_) {
        finished_ = true;
      } else {
        return;
      }
    }
    // current_ and status_ are stable here: only the thread that set
    // writing_/finished_ touches them until OnWriteDone.
    if (write) {
      StartWriteNow(&current_);
    } else {
      FinishNow(status_);
    }
  }

  Mutex mu_;
  std::deque<Msg> queue_ MLARUN_GUARDED_BY(mu_);
  bool writing_ MLARUN_GUARDED_BY(mu_) = false;       // a StartWrite is in flight
  bool broken_ MLARUN_GUARDED_BY(mu_) = false;        // a write failed: drop everything
  bool close_wanted_ MLARUN_GUARDED_BY(mu_) = false;  // Close() was called; status_ is set
  bool finished_ MLARUN_GUARDED_BY(mu_) = false;      // Finish was issued
  grpc::Status status_;
  // Owned by the write in flight (gRPC reads it until OnWriteDone).
  Msg current_;
};

// What the coordinator's end does with each stream.
class WorkerLinkHandler {
 public:
  virtual ~WorkerLinkHandler() = default;
  // The stream's first message. True: the link is the group's (the handler
  // queues Registered on it); false: the handler has closed it with the
  // reason.
  virtual bool Attach(std::shared_ptr<WorkerOutlet> link, const v1::Register& reg) = 0;
  // A later message. False: the link is no longer attached (the handler has
  // closed it); the stream stops reading.
  virtual bool OnWorkerMessage(const WorkerOutlet* link, const v1::WorkerMessage& msg) = 0;
  // The stream ended or broke. Idempotent; may follow a false answer.
  virtual void Detach(const WorkerOutlet* link) = 0;
};

// The WorkerLink service: one reactor per stream around `handler`, which
// must outlive the server's calls (GrpcServer::Shutdown waits for them). A
// stream whose first message is not `register` ends with INVALID_ARGUMENT.
// With a `secret`, a call whose kWorkerSecretHeader (worker_link_client.h)
// is missing or differs ends with UNAUTHENTICATED before anything is read
// and the handler never sees it. With `client_certificates` (the server's TLS
// verifies client certificates against its --tls-ca), a call whose peer
// presented a verified certificate needs no secret; without a secret, it
// needs such a certificate. A message from a worker larger than
// kMaxWorkerMessageBytes ends its stream with RESOURCE_EXHAUSTED (the handler
// sees it as a Detach).
class WorkerLinkService : public v1::WorkerLink::CallbackService {
 public:
  static constexpr size_t kMaxWorkerMessageBytes = size_t{4} << 20;
  explicit WorkerLinkService(WorkerLinkHandler* handler, std::string secret = "", bool client_certificates = false)
      : handler_(handler), secret_(std::move(secret)), client_certificates_(client_certificates) {}
  grpc::ServerBidiReactor<v1::WorkerMessage, v1::CoordinatorMessage>* Connect(grpc::CallbackServerContext*) override;

 private:
  WorkerLinkHandler* const handler_;
  const std::string secret_;
  const bool client_certificates_;
};

// gRPC services on host:port, with the coordinator's transport settings:
// keepalive pings (20 s, 10 s to answer; clients may ping every 5 s, also on
// idle streams), messages up to 64 MiB, and no SO_REUSEPORT (gRPC's default
// would let a second server bind a busy port and silently share its calls).
class GrpcServer {
 public:
  // Binds `listen` (host:port, IPv6 hosts in brackets; port 0 picks a free
  // one) and serves `services`, which must outlive the server; over TLS when
  // `tls` is enabled (LoadServerTls: its certificate and key; with its CA,
  // client certificates are asked for and verified when sent).
  // INVALID_ARGUMENT for a bad address, UNAVAILABLE if it cannot be bound.
  static StatusOr<std::unique_ptr<GrpcServer>> Start(const std::string& listen,
                                                     std::initializer_list<grpc::Service*> services,
                                                     const TlsPem& tls = {});
  ~GrpcServer() { Shutdown(std::chrono::milliseconds(0)); }

  // host:port with the bound port.
  const std::string& address() const { return address_; }
  int port() const { return port_; }
  // Stops accepting calls; those still open after `grace` are cancelled.
  // Returns once every call has ended. Idempotent.
  void Shutdown(std::chrono::milliseconds grace) {
    if (server_ != nullptr) server_->Shutdown(std::chrono::system_clock::now() + grace);
  }

 private:
  GrpcServer() = default;
  std::unique_ptr<grpc::Server> server_;
  std::string address_;
  int port_ = 0;
};

// Whether `listen` (host:port) binds only the loopback interface:
// 127.0.0.0/8, [::1] (or ::1) or localhost. False for anything else, 0.0.0.0 and [::]
// included, and for a malformed address.
bool IsLoopbackListen(const std::string& listen);

// One group's stream to a LinkEndpoint: what it registered, every message it
// sent (kept until the endpoint goes), and its sending half. Thread-safe.
class LinkPeer {
 public:
  LinkPeer(std::shared_ptr<WorkerOutlet> outlet, v1::Register registration)
      : outlet_(std::move(outlet)), registration_(std::move(registration)) {}

  const v1::Register& registration() const { return registration_; }
  const WorkerOutlet* outlet() const { return outlet_.get(); }
  // Writes `m` to the group (queued; never blocks). False once the stream ended.
  bool Send(v1::CoordinatorMessage m);
  // Message `index` of the stream (0: the first after the registration),
  // waiting up to `timeout` for it; nullopt when the stream ended without it
  // or the time passed.
  std::optional<v1::WorkerMessage> Read(size_t index, std::chrono::milliseconds timeout);
  bool ended();

  // The endpoint's side: a message arrived; the stream ended.
  void Add(const v1::WorkerMessage& m);
  void End();

 private:
  // Constant after construction.
  const std::shared_ptr<WorkerOutlet> outlet_;
  const v1::Register registration_;

  Mutex mu_;
  std::condition_variable changed_;
  std::vector<v1::WorkerMessage> received_ MLARUN_GUARDED_BY(mu_);
  bool ended_ MLARUN_GUARDED_BY(mu_) = false;
};

// The coordinator's end without a coordinator: every group that connects is
// registered (Registered with `coordinator_id`; nothing is checked, routed or
// answered) and kept as a LinkPeer for whoever drives it. Host it on a
// GrpcServer.
class LinkEndpoint : private WorkerLinkHandler, public WorkerLinkService {
 public:
  explicit LinkEndpoint(std::string coordinator_id, std::string secret = "")
      : WorkerLinkService(this, std::move(secret)), coordinator_id_(std::move(coordinator_id)) {}
  // The newest peer of `dp_group` whose stream is live, waiting up to
  // `timeout` for one to register; nullptr after that.
  std::shared_ptr<LinkPeer> WaitPeer(int dp_group, std::chrono::milliseconds timeout);

 private:
  bool Attach(std::shared_ptr<WorkerOutlet> link, const v1::Register& reg) override;
  bool OnWorkerMessage(const WorkerOutlet* link, const v1::WorkerMessage& msg) override;
  void Detach(const WorkerOutlet* link) override;
  std::shared_ptr<LinkPeer> Find(const WorkerOutlet* link);

  const std::string coordinator_id_;
  Mutex mu_;  // before a peer's own
  std::condition_variable changed_;
  std::vector<std::shared_ptr<LinkPeer>> peers_ MLARUN_GUARDED_BY(mu_);  // every stream that registered
};

}  // namespace mlarun
