// The gRPC side of the coordinator: the Mlarun and WorkerLink services on the
// callback API, one reactor per call, around the Dispatcher (dispatcher.h),
// which holds all the state.
//
// Threading: gRPC runs the handlers and reactions on its own callback
// threads; the only thread of ours is the dispatcher's deadline timer. No
// thread ever waits on a request: a Generate call is a reactor that writes
// when the dispatcher queues a message on it.
//
// Writes: each stream has one send queue (Outbound, launcher/link/link_server.h)
// and at most one write in flight. The WorkerLink streams' reactor and the
// server are launcher/link's, with the Dispatcher as their handler.
#include "launcher/coordinator/coordinator.h"

#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <condition_variable>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "launcher/coordinator/dispatcher.h"
#include "launcher/link/link_server.h"
#include "mlarun.grpc.pb.h"
#include "runtime/base/thread_annotations.h"

namespace mlarun {
namespace coord {
namespace {

// Shutdown: calls still open this long after the dispatcher ended them are
// cancelled by gRPC.
constexpr auto kShutdownGrace = std::chrono::seconds(2);

// The Mlarun service's requests arrive as raw bytes and are parsed here, not
// by gRPC: a request that gRPC's generated code failed to parse would be
// answered UNIMPLEMENTED with no message before any handler ran. Parsed
// here, it gets INVALID_ARGUMENT saying what did not parse.
template <class Msg>
std::optional<grpc::Status> Parse(const grpc::ByteBuffer* in, Msg* out) {
  std::vector<grpc::Slice> slices;
  std::string bytes;
  if (in != nullptr && in->Dump(&slices).ok()) {
    for (const grpc::Slice& s : slices) bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  if (out->ParseFromString(bytes)) return std::nullopt;
  return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                      internal::StrCat("the request (", bytes.size(), " bytes) does not parse as ", out->GetTypeName(),
                                       ": truncated or malformed protobuf wire data, or a string field that is not "
                                       "valid UTF-8"));
}

template <class Msg>
grpc::ByteBuffer Serialize(const Msg& msg) {
  grpc::Slice slice(msg.SerializeAsString());
  return grpc::ByteBuffer(&slice, 1);
}

// One Generate call. Owns itself (self_) from creation until gRPC's OnDone;
// the dispatcher holds it as the request's ClientOutlet while it is live.
class GenerateCall final : public grpc::ServerWriteReactor<grpc::ByteBuffer>,
                           public Outbound<v1::GenerateResponse> {
 public:
  static GenerateCall* Start(std::shared_ptr<Dispatcher> dispatcher,
                             grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* bytes) {
    std::shared_ptr<GenerateCall> call(new GenerateCall(dispatcher));
    call->self_ = call;
    v1::GenerateRequest request;
    if (auto error = Parse(bytes, &request)) {
      call->Close(error->error_code(), error->error_message());
      call->Flush();
      return call.get();
    }
    // Set before the handler returns, so before any reaction can read them.
    if (auto accepted = dispatcher->Submit(call, request, ctx->deadline())) {
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
  void StartWriteNow(const v1::GenerateResponse* msg) override {
    // One write in flight at a time (Outbound), so one buffer suffices; gRPC
    // reads it until OnWriteDone.
    write_buffer_ = Serialize(*msg);
    StartWrite(&write_buffer_);
  }
  void FinishNow(grpc::Status status) override { Finish(std::move(status)); }

  const std::shared_ptr<Dispatcher> dispatcher_;
  std::shared_ptr<GenerateCall> self_;
  std::string id_;  // empty when the dispatcher rejected the call
  uint64_t serial_ = 0;
  grpc::ByteBuffer write_buffer_;
};

using RawMlarunService = v1::Mlarun::WithRawCallbackMethod_Generate<v1::Mlarun::WithRawCallbackMethod_Cancel<
    v1::Mlarun::WithRawCallbackMethod_GetStats<v1::Mlarun::WithRawCallbackMethod_Health<v1::Mlarun::Service>>>>;

class MlarunService final : public RawMlarunService {
 public:
  explicit MlarunService(std::shared_ptr<Dispatcher> dispatcher)
      : dispatcher_(std::move(dispatcher)) {}

  grpc::ServerWriteReactor<grpc::ByteBuffer>* Generate(grpc::CallbackServerContext* ctx,
                                                       const grpc::ByteBuffer* request) override {
    return GenerateCall::Start(dispatcher_, ctx, request);
  }
  grpc::ServerUnaryReactor* Cancel(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* bytes,
                                   grpc::ByteBuffer* out) override {
    v1::CancelRequest request;
    if (auto error = Parse(bytes, &request)) return Done(ctx, *error);
    v1::CancelResponse response;
    response.set_found(dispatcher_->Cancel(request.request_id()));
    *out = Serialize(response);
    return Done(ctx, grpc::Status::OK);
  }
  grpc::ServerUnaryReactor* GetStats(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* bytes,
                                     grpc::ByteBuffer* out) override {
    v1::GetStatsRequest request;
    if (auto error = Parse(bytes, &request)) return Done(ctx, *error);
    v1::GetStatsResponse response;
    dispatcher_->FillStats(&response);
    *out = Serialize(response);
    return Done(ctx, grpc::Status::OK);
  }
  grpc::ServerUnaryReactor* Health(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* bytes,
                                   grpc::ByteBuffer* out) override {
    v1::HealthRequest request;
    if (auto error = Parse(bytes, &request)) return Done(ctx, *error);
    v1::HealthResponse response;
    dispatcher_->FillHealth(&response);
    *out = Serialize(response);
    return Done(ctx, grpc::Status::OK);
  }

 private:
  static grpc::ServerUnaryReactor* Done(grpc::CallbackServerContext* ctx, grpc::Status status) {
    grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
    reactor->Finish(std::move(status));
    return reactor;
  }
  const std::shared_ptr<Dispatcher> dispatcher_;
};

class CoordinatorImpl final : public Coordinator {
 public:
  CoordinatorImpl(std::shared_ptr<Dispatcher> dispatcher, std::string worker_secret)
      : dispatcher_(dispatcher),
        mlarun_service_(dispatcher),
        link_service_(dispatcher.get(), std::move(worker_secret)) {}
  ~CoordinatorImpl() override { Shutdown(); }

  Status Bind(const std::string& listen) {
    auto server = GrpcServer::Start(listen, {&mlarun_service_, &link_service_});
    if (!server.ok()) return server.status().WithContext("coordinator");
    server_ = std::move(*server);
    return Status::Ok();
  }

  std::string address() const override { return server_->address(); }

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
    if (server_ != nullptr) server_->Shutdown(kShutdownGrace);
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
  std::unique_ptr<GrpcServer> server_;

  Mutex mu_;
  std::condition_variable cv_;
  bool stopping_ MLARUN_GUARDED_BY(mu_) = false;
  bool down_ MLARUN_GUARDED_BY(mu_) = false;
};

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

namespace {
constexpr size_t kMaxSecretBytes = 4096;
}  // namespace

bool IsLoopbackListenAddress(const std::string& listen) { return IsLoopbackListen(listen); }

StatusOr<std::string> ReadWorkerSecretFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return InvalidArgumentError("--worker-secret-file: cannot read '", path, "'");
  std::ostringstream content;
  content << in.rdbuf();
  if (in.bad()) return InvalidArgumentError("--worker-secret-file: cannot read '", path, "'");
  std::string s = content.str();
  if (s.size() > kMaxSecretBytes)
    return InvalidArgumentError("--worker-secret-file: '", path, "' is larger than ", kMaxSecretBytes, " bytes");
  const char* ws = " \t\r\n\v\f";
  const size_t first = s.find_first_not_of(ws);
  if (first == std::string::npos) return InvalidArgumentError("--worker-secret-file: '", path, "' is empty");
  s = s.substr(first, s.find_last_not_of(ws) - first + 1);
  for (const char c : s) {
    if (c < 0x20 || c > 0x7e)
      return InvalidArgumentError("--worker-secret-file: '", path,
                                  "' must hold printable ASCII only (it is sent as a gRPC metadata value)");
  }
  return s;
}

StatusOr<std::unique_ptr<Coordinator>> Coordinator::Start(const CoordinatorOptions& options) {
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
  if (!(options.queue_timeout_s > 0) || !std::isfinite(options.queue_timeout_s))
    return InvalidArgumentError("queue_timeout_s: must be > 0 and finite, got ", options.queue_timeout_s);
  if (!(options.stall_timeout_s > 0) || !std::isfinite(options.stall_timeout_s))
    return InvalidArgumentError("stall_timeout_s: must be > 0 and finite, got ", options.stall_timeout_s);
  if (!(options.lost_group_wait_s >= 0) || !std::isfinite(options.lost_group_wait_s))
    return InvalidArgumentError("lost_group_wait_s: must be >= 0 and finite, got ",
                                options.lost_group_wait_s);
  if (options.prefix_hashes_per_group < 0)
    return InvalidArgumentError("prefix_hashes_per_group: must be >= 0, got ",
                                options.prefix_hashes_per_group);

  if (options.worker_secret.empty() && !options.open_worker_link_off_loopback && !IsLoopbackListen(options.listen))
    return InvalidArgumentError("--worker-secret-file: required when --listen binds beyond loopback (got '",
                                options.listen,
                                "'): without it any process that reaches the port can register as a worker");

  auto dispatcher = std::make_shared<coord::Dispatcher>(options, coord::NewCoordinatorId());
  auto impl = std::make_unique<coord::CoordinatorImpl>(dispatcher, options.worker_secret);
  MLARUN_RETURN_IF_ERROR(impl->Bind(options.listen));
  return std::unique_ptr<Coordinator>(std::move(impl));
}

}  // namespace mlarun
