// The gRPC side of the coordinator: the Mlarun and WorkerLink services on the
// callback API, one reactor per call, around the Dispatcher (dispatcher.h),
// which holds all the state.
//
// Threading: gRPC runs the handlers and reactions on its own callback
// threads; the only thread of ours is the dispatcher's deadline timer. No
// thread ever waits on a request: a Generate call is a reactor that writes
// when the dispatcher queues a message on it.
//
// Writes: each stream has one send queue (Outbound) and at most one write in
// flight, as gRPC requires; the next write starts from OnWriteDone. Finish is
// issued only once the queue is drained and no write is in flight.
#include "launcher/coordinator/coordinator.h"

#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <condition_variable>
#include <deque>
#include <mutex>

#include "launcher/coordinator/dispatcher.h"
#include "mlarun.grpc.pb.h"
#include "runtime/base/thread_annotations.h"

namespace mlarun {
namespace coord {
namespace {

// Keepalive: a worker host that vanishes without closing its TCP connection
// is detected by the coordinator's pings (20 s, 10 s to answer), so its
// group's requests do not hang until the OS gives up on the socket. Workers
// may ping as often as every 5 s, and pings keep going on idle streams.
constexpr int kKeepaliveTimeMs = 20000;
constexpr int kKeepaliveTimeoutMs = 10000;
constexpr int kMinClientPingIntervalMs = 5000;
// A long prompt is ~2-5 bytes per token id on the wire; 64 MiB leaves room
// for prompts far beyond any max_position_embeddings.
constexpr int kMaxMessageBytes = 64 << 20;
// Shutdown: calls still open this long after the dispatcher ended them are
// cancelled by gRPC.
constexpr auto kShutdownGrace = std::chrono::seconds(2);

// The send half of one stream: a queue with at most one write in flight, and
// a deferred Finish. Thread-safe; Queue/Close never block and never call into
// gRPC, so the dispatcher may call them with its mutex held; Flush and
// WriteDone start gRPC operations outside any lock.
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

// One Generate call. Owns itself (self_) from creation until gRPC's OnDone;
// the dispatcher holds it as the request's ClientOutlet while it is live.
class GenerateCall final : public grpc::ServerWriteReactor<v1::GenerateResponse>,
                           public Outbound<v1::GenerateResponse> {
 public:
  static GenerateCall* Start(std::shared_ptr<Dispatcher> dispatcher,
                             grpc::CallbackServerContext* ctx, const v1::GenerateRequest* request) {
    std::shared_ptr<GenerateCall> call(new GenerateCall(dispatcher));
    call->self_ = call;
    // Set before the handler returns, so before any reaction can read them.
    if (auto accepted = dispatcher->Submit(call, *request, ctx->deadline())) {
      call->id_ = accepted->id;
      call->serial_ = accepted->serial;
    }
    return call.get();
  }

  void OnWriteDone(bool ok) override {
    if (!ok) dispatcher_->ClientGone(id_, serial_);
    WriteDone(ok);
  }
  void OnCancel() override {
    dispatcher_->ClientGone(id_, serial_);
    Close(grpc::StatusCode::CANCELLED, "cancelled");
    Flush();
  }
  void OnDone() override { self_.reset(); }  // may delete this: nothing after it

 private:
  explicit GenerateCall(std::shared_ptr<Dispatcher> dispatcher)
      : dispatcher_(std::move(dispatcher)) {}
  void StartWriteNow(const v1::GenerateResponse* msg) override { StartWrite(msg); }
  void FinishNow(grpc::Status status) override { Finish(std::move(status)); }

  const std::shared_ptr<Dispatcher> dispatcher_;
  std::shared_ptr<GenerateCall> self_;
  std::string id_;  // empty when the dispatcher rejected the call
  uint64_t serial_ = 0;
};

// One WorkerLink stream (a DP group's leader). Reads one message at a time
// (reads are sequential, so registered_ needs no lock); owns itself until
// OnDone like GenerateCall.
class WorkerCall final : public grpc::ServerBidiReactor<v1::WorkerMessage, v1::CoordinatorMessage>,
                         public Outbound<v1::CoordinatorMessage> {
 public:
  static WorkerCall* Start(std::shared_ptr<Dispatcher> dispatcher) {
    std::shared_ptr<WorkerCall> call(new WorkerCall(std::move(dispatcher)));
    call->self_ = call;
    call->StartRead(&call->in_);
    return call.get();
  }

  void OnReadDone(bool ok) override {
    if (!ok) {  // the worker closed its side or the stream broke
      dispatcher_->Detach(this);
      Close(grpc::StatusCode::OK, "");
      Flush();
      return;
    }
    bool keep_reading;
    if (!registered_) {
      if (in_.msg_case() != v1::WorkerMessage::kRegister) {
        Close(grpc::StatusCode::INVALID_ARGUMENT, "the first WorkerMessage must be register");
        Flush();
        return;
      }
      registered_ = dispatcher_->Attach(self_, in_.register_());
      keep_reading = registered_;
    } else {
      keep_reading = dispatcher_->OnWorkerMessage(this, in_);
    }
    if (!keep_reading) {
      // The dispatcher closed the link with the reason; this is a fallback.
      Close(grpc::StatusCode::ABORTED, "the DP group's link is no longer attached");
      Flush();
      return;
    }
    StartRead(&in_);
  }
  void OnWriteDone(bool ok) override { WriteDone(ok); }
  void OnCancel() override {
    dispatcher_->Detach(this);
    Close(grpc::StatusCode::CANCELLED, "cancelled");
    Flush();
  }
  void OnDone() override {
    dispatcher_->Detach(this);
    self_.reset();  // may delete this: nothing after it
  }

 private:
  explicit WorkerCall(std::shared_ptr<Dispatcher> dispatcher)
      : dispatcher_(std::move(dispatcher)) {}
  void StartWriteNow(const v1::CoordinatorMessage* msg) override { StartWrite(msg); }
  void FinishNow(grpc::Status status) override { Finish(std::move(status)); }

  const std::shared_ptr<Dispatcher> dispatcher_;
  std::shared_ptr<WorkerCall> self_;
  v1::WorkerMessage in_;  // the read in flight
  bool registered_ = false;
};

class MlarunService final : public v1::Mlarun::CallbackService {
 public:
  explicit MlarunService(std::shared_ptr<Dispatcher> dispatcher)
      : dispatcher_(std::move(dispatcher)) {}

  grpc::ServerWriteReactor<v1::GenerateResponse>* Generate(
      grpc::CallbackServerContext* ctx, const v1::GenerateRequest* request) override {
    return GenerateCall::Start(dispatcher_, ctx, request);
  }
  grpc::ServerUnaryReactor* Cancel(grpc::CallbackServerContext* ctx,
                                   const v1::CancelRequest* request,
                                   v1::CancelResponse* response) override {
    response->set_found(dispatcher_->Cancel(request->request_id()));
    return Done(ctx);
  }
  grpc::ServerUnaryReactor* GetStats(grpc::CallbackServerContext* ctx, const v1::GetStatsRequest*,
                                     v1::GetStatsResponse* response) override {
    dispatcher_->FillStats(response);
    return Done(ctx);
  }
  grpc::ServerUnaryReactor* Health(grpc::CallbackServerContext* ctx, const v1::HealthRequest*,
                                   v1::HealthResponse* response) override {
    dispatcher_->FillHealth(response);
    return Done(ctx);
  }

 private:
  static grpc::ServerUnaryReactor* Done(grpc::CallbackServerContext* ctx) {
    grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }
  const std::shared_ptr<Dispatcher> dispatcher_;
};

class WorkerLinkService final : public v1::WorkerLink::CallbackService {
 public:
  explicit WorkerLinkService(std::shared_ptr<Dispatcher> dispatcher)
      : dispatcher_(std::move(dispatcher)) {}
  grpc::ServerBidiReactor<v1::WorkerMessage, v1::CoordinatorMessage>* Connect(
      grpc::CallbackServerContext*) override {
    return WorkerCall::Start(dispatcher_);
  }

 private:
  const std::shared_ptr<Dispatcher> dispatcher_;
};

class CoordinatorImpl final : public Coordinator {
 public:
  CoordinatorImpl(std::shared_ptr<Dispatcher> dispatcher)
      : dispatcher_(dispatcher), mlarun_service_(dispatcher), link_service_(dispatcher) {}
  ~CoordinatorImpl() override { Shutdown(); }

  Status Bind(const std::string& listen, const std::string& host) {
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort(listen, grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(&mlarun_service_);
    builder.RegisterService(&link_service_);
    builder.SetMaxReceiveMessageSize(kMaxMessageBytes);
    builder.SetMaxSendMessageSize(kMaxMessageBytes);
    // gRPC sets SO_REUSEPORT by default: a second coordinator on a busy port
    // would bind and silently share its clients. Fail instead.
    builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
    builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, kKeepaliveTimeMs);
    builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, kKeepaliveTimeoutMs);
    builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
    builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS,
                               kMinClientPingIntervalMs);
    server_ = builder.BuildAndStart();
    if (server_ == nullptr || port == 0) {
      server_.reset();
      return UnavailableError("coordinator: cannot listen on '", listen, "'");
    }
    address_ = host + ":" + std::to_string(port);
    return Status::Ok();
  }

  std::string address() const override { return address_; }

  void Shutdown() override {
    {
      MutexLock lock(mu_);
      if (stopping_) {
        lock.Wait(cv_, [this]() MLARUN_REQUIRES(mu_) { return down_; });
        return;
      }
      stopping_ = true;
    }
    // End every stream with a status first, so clients see UNAVAILABLE rather
    // than a cancellation, then let gRPC drain and stop.
    dispatcher_->Shutdown();
    if (server_ != nullptr) server_->Shutdown(std::chrono::system_clock::now() + kShutdownGrace);
    {
      MutexLock lock(mu_);
      down_ = true;
    }
    cv_.notify_all();
  }

  void Wait() override {
    MutexLock lock(mu_);
    lock.Wait(cv_, [this]() MLARUN_REQUIRES(mu_) { return down_; });
  }

 private:
  // Declared before server_: the server must be destroyed first.
  const std::shared_ptr<Dispatcher> dispatcher_;
  MlarunService mlarun_service_;
  WorkerLinkService link_service_;
  std::unique_ptr<grpc::Server> server_;
  std::string address_;

  Mutex mu_;
  std::condition_variable cv_;
  bool stopping_ MLARUN_GUARDED_BY(mu_) = false;
  bool down_ MLARUN_GUARDED_BY(mu_) = false;
};

// host:port with a numeric port (IPv6 hosts in brackets); returns the host.
StatusOr<std::string> SplitListen(const std::string& listen) {
  const size_t colon = listen.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == listen.size())
    return InvalidArgumentError("listen: expected host:port, got '", listen, "'");
  const std::string port = listen.substr(colon + 1);
  if (port.size() > 5 || port.find_first_not_of("0123456789") != std::string::npos ||
      std::stoi(port) > 65535)
    return InvalidArgumentError("listen: port must be a number in [0, 65535], got '", port, "'");
  return listen.substr(0, colon);
}

std::string NewCoordinatorId() {
  // Distinct per process start, so a worker can tell that the coordinator
  // restarted (and its routing state is gone).
  const auto now_ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                          std::chrono::system_clock::now().time_since_epoch())
                          .count();
  return "coordinator-" + std::to_string(getpid()) + "-" + std::to_string(now_ms);
}

}  // namespace
}  // namespace coord

StatusOr<std::unique_ptr<Coordinator>> Coordinator::Start(const CoordinatorOptions& options) {
  MLARUN_ASSIGN_OR_RETURN(const std::string host, coord::SplitListen(options.listen));
  if (options.max_queued < 0)
    return InvalidArgumentError("max_queued: must be >= 0, got ", options.max_queued);
  if (options.max_in_flight_per_group < 1)
    return InvalidArgumentError("max_in_flight_per_group: must be >= 1, got ",
                                options.max_in_flight_per_group);
  if (options.balance_abs_tokens < 0)
    return InvalidArgumentError("balance_abs_tokens: must be >= 0, got ",
                                options.balance_abs_tokens);
  if (!(options.balance_rel >= 0))
    return InvalidArgumentError("balance_rel: must be >= 0, got ", options.balance_rel);
  if (!(options.default_deadline_s > 0))
    return InvalidArgumentError("default_deadline_s: must be > 0, got ",
                                options.default_deadline_s);
  if (!(options.lost_group_wait_s >= 0) || !std::isfinite(options.lost_group_wait_s))
    return InvalidArgumentError("lost_group_wait_s: must be >= 0 and finite, got ",
                                options.lost_group_wait_s);
  if (options.prefix_hashes_per_group < 0)
    return InvalidArgumentError("prefix_hashes_per_group: must be >= 0, got ",
                                options.prefix_hashes_per_group);

  auto dispatcher = std::make_shared<coord::Dispatcher>(options, coord::NewCoordinatorId());
  auto impl = std::make_unique<coord::CoordinatorImpl>(dispatcher);
  MLARUN_RETURN_IF_ERROR(impl->Bind(options.listen, host));
  return std::unique_ptr<Coordinator>(std::move(impl));
}

}  // namespace mlarun
