// The gRPC side of the coordinator: the Mlarun and WorkerLink services on the
// callback API, one reactor per call, around the Dispatcher (dispatcher.h),
// which holds all the state.
//
// Threading: gRPC runs the handlers and reactions on its own callback
// threads; the only thread of ours is the dispatcher's deadline timer. No
// thread ever waits on a request: a Generate call is a reactor that writes
// when the dispatcher queues a message on it.
//
// Writes: each stream has one send queue (Outbound, serving/link/link_server.h)
// and at most one write in flight. The WorkerLink streams' reactor and the
// server are serving/link's, with the Dispatcher as their handler.
#include "serving/coordinator/coordinator.h"

#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <condition_variable>
#include <fstream>
#include <iostream>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "base/thread_annotations.h"
#include "mlarun.grpc.pb.h"
#include "serving/coordinator/dispatcher.h"
#include "serving/coordinator/server_log.h"
#include "serving/http/metrics.h"
#include "serving/http/openai_server.h"
#include "serving/link/link_server.h"
#include "text/chat_template.h"
#include "text/tokenizer.h"

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

// The caller of a client API call, as the service's tokens see it.
struct Caller {
  grpc::Status refusal;   // not OK: refuse the call with it
  std::string principal;  // "" when the API is open
  bool details = false;   // may see GetStats' hosts, paths and worker ids
};

// Whether a gRPC peer ("ipv4:127.0.0.1:5000", "ipv6:[::1]:5000",
// "unix:...") is on this machine's loopback.
bool IsLoopbackPeer(std::string_view peer) {
  if (peer.starts_with("unix:") || peer.starts_with("unix-abstract:")) return true;
  for (std::string_view prefix : {"ipv4:127.", "ipv6:[::1]:", "ipv6:[::ffff:127."})
    if (peer.starts_with(prefix)) return true;
  return false;
}

template <class Msg>
grpc::ByteBuffer Serialize(const Msg& msg) {
  grpc::Slice slice(msg.SerializeAsString());
  return grpc::ByteBuffer(&slice, 1);
}

// One Generate call. Owns itself (self_) from creation until gRPC's OnDone;
// the dispatcher holds it as the request's ClientOutlet while it is live.
class GenerateCall final : public grpc::ServerWriteReactor<grpc::ByteBuffer>, public Outbound<v1::GenerateResponse> {
 public:
  static GenerateCall* Start(std::shared_ptr<Dispatcher> dispatcher, grpc::CallbackServerContext* ctx,
                             const grpc::ByteBuffer* bytes, const Caller& caller) {
    std::shared_ptr<GenerateCall> call(new GenerateCall(dispatcher));
    call->self_ = call;
    if (!caller.refusal.ok()) {
      call->Close(caller.refusal.error_code(), caller.refusal.error_message());
      call->Flush();
      return call.get();
    }
    v1::GenerateRequest request;
    if (auto error = Parse(bytes, &request)) {
      call->Close(error->error_code(), error->error_message());
      call->Flush();
      return call.get();
    }
    // Set before the handler returns, so before any reaction can read them.
    if (auto accepted = dispatcher->Submit(call, request, caller.principal, ctx->deadline())) {
      call->id_ = accepted->wire_id;
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
  explicit GenerateCall(std::shared_ptr<Dispatcher> dispatcher) : dispatcher_(std::move(dispatcher)) {}
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

using RawMlarunService = v1::Mlarun::WithRawCallbackMethod_Generate<
    v1::Mlarun::WithRawCallbackMethod_Cancel<v1::Mlarun::WithRawCallbackMethod_GetStats<
        v1::Mlarun::WithRawCallbackMethod_Health<v1::Mlarun::WithRawCallbackMethod_Migrate<v1::Mlarun::Service>>>>>;

class MlarunService final : public RawMlarunService {
 public:
  MlarunService(std::shared_ptr<Dispatcher> dispatcher, AuthTokens tokens)
      : dispatcher_(std::move(dispatcher)), tokens_(std::move(tokens)) {}

  grpc::ServerWriteReactor<grpc::ByteBuffer>* Generate(grpc::CallbackServerContext* ctx,
                                                       const grpc::ByteBuffer* request) override {
    const Caller caller = Identify(ctx);
    return GenerateCall::Start(dispatcher_, ctx, request, caller);
  }
  grpc::ServerUnaryReactor* Cancel(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* bytes,
                                   grpc::ByteBuffer* out) override {
    const Caller caller = Identify(ctx);
    return Unary<v1::CancelRequest, v1::CancelResponse>(ctx, bytes, out, caller, [&](const auto& request, auto* r) {
      r->set_found(dispatcher_->Cancel(caller.principal, request.request_id()));
    });
  }
  // Answered when the move ends (the dispatcher calls back exactly once).
  grpc::ServerUnaryReactor* Migrate(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* bytes,
                                    grpc::ByteBuffer* out) override {
    const Caller caller = Identify(ctx);
    if (!caller.refusal.ok()) return Done(ctx, caller.refusal);
    v1::MigrateRequest request;
    if (auto error = Parse(bytes, &request)) return Done(ctx, *error);
    grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
    dispatcher_->Migrate(caller.principal, request,
                         [reactor, out](const grpc::Status& status, const v1::MigrateResponse& response) {
                           if (status.ok()) *out = Serialize(response);
                           reactor->Finish(status);
                         });
    return reactor;
  }
  grpc::ServerUnaryReactor* GetStats(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* bytes,
                                     grpc::ByteBuffer* out) override {
    const Caller caller = Identify(ctx);
    return Unary<v1::GetStatsRequest, v1::GetStatsResponse>(
        ctx, bytes, out, caller, [&](const auto&, auto* r) { dispatcher_->FillStats(r, caller.details); });
  }
  grpc::ServerUnaryReactor* Health(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* bytes,
                                   grpc::ByteBuffer* out) override {
    // Open to every caller (probes).
    return Unary<v1::HealthRequest, v1::HealthResponse>(ctx, bytes, out, Caller{},
                                                        [&](const auto&, auto* r) { dispatcher_->FillHealth(r); });
  }

 private:
  static grpc::ServerUnaryReactor* Done(grpc::CallbackServerContext* ctx, grpc::Status status) {
    grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
    reactor->Finish(std::move(status));
    return reactor;
  }
  // A unary call: refused as the caller is, else its request parsed (or
  // INVALID_ARGUMENT), `fill` makes the response, and it is sent.
  template <class Request, class Response, class Fill>
  static grpc::ServerUnaryReactor* Unary(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* bytes,
                                         grpc::ByteBuffer* out, const Caller& caller, Fill fill) {
    if (!caller.refusal.ok()) return Done(ctx, caller.refusal);
    Request request;
    if (auto error = Parse(bytes, &request)) return Done(ctx, *error);
    Response response;
    fill(request, &response);
    *out = Serialize(response);
    return Done(ctx, grpc::Status::OK);
  }
  // Who calls: with tokens, the principal of the call's bearer token (or
  // the refusal); without, everyone is "" and only loopback callers see
  // GetStats' details.
  Caller Identify(grpc::CallbackServerContext* ctx) const {
    if (tokens_.empty()) return Caller{.details = IsLoopbackPeer(ctx->peer())};
    const auto& md = ctx->client_metadata();
    auto it = md.find(kAuthorizationHeader);
    if (it == md.end())
      return Caller{.refusal = grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                                            "this coordinator needs a token: send `authorization: Bearer TOKEN` "
                                            "with a token of its --auth-token-file (mlarun submit --auth-token-file)")};
    const Principal* p = tokens_.Authenticate(std::string_view(it->second.data(), it->second.size()));
    if (p == nullptr)
      return Caller{.refusal = grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                                            "the authorization header is not `Bearer TOKEN` with a token of the "
                                            "coordinator's --auth-token-file")};
    return Caller{.principal = p->name, .details = true};
  }

  const std::shared_ptr<Dispatcher> dispatcher_;
  const AuthTokens tokens_;
};

class CoordinatorImpl final : public Coordinator {
 public:
  CoordinatorImpl(std::shared_ptr<Dispatcher> dispatcher, const CoordinatorOptions& options)
      : dispatcher_(dispatcher),
        mlarun_service_(dispatcher, options.auth_tokens),
        link_service_(dispatcher.get(), options.worker_secret, !options.tls.ca.empty()) {}
  ~CoordinatorImpl() override { Shutdown(); }

  Status Bind(const std::string& listen, const TlsPem& tls) {
    auto server = GrpcServer::Start(listen, {&mlarun_service_, &link_service_}, tls);
    if (!server.ok()) return server.status().WithContext("coordinator");
    server_ = std::move(*server);
    return Status::Ok();
  }

  std::string address() const override { return server_->address(); }
  std::string http_address() const override { return http_ != nullptr ? http_->address() : ""; }

  void SetHttp(std::unique_ptr<HttpApi> http) { http_ = std::move(http); }
  void SetServerLog(std::shared_ptr<ServerLog> log) { server_log_ = std::move(log); }

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
    // The HTTP exchanges have their answers now (UNAVAILABLE): its handlers return.
    if (http_ != nullptr) http_->Shutdown();
    if (server_ != nullptr) server_->Shutdown(kShutdownGrace);
    if (server_log_ != nullptr) server_log_->Stop();  // after the last request's line
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
  std::unique_ptr<HttpApi> http_;          // nullptr when off
  std::shared_ptr<ServerLog> server_log_;  // nullptr when off; its thread reads dispatcher_

  Mutex mu_;
  std::condition_variable cv_;
  bool stopping_ MLARUN_GUARDED_BY(mu_) = false;
  bool down_ MLARUN_GUARDED_BY(mu_) = false;
};

// The stats line's figures: the metrics' token counters, the groups'
// reported batches and caches (a group's attention-TP ranks hold the same
// blocks: its first rank counts), and the coordinator's queue.
ServerSample SampleServer(const Dispatcher& dispatcher, const Metrics& metrics) {
  v1::GetStatsResponse stats;
  dispatcher.FillStats(&stats, /*details=*/false);
  const Metrics::Totals t = metrics.totals();
  ServerSample s{.at_s = std::chrono::duration<double>(Clock::now().time_since_epoch()).count(),
                 .prompt_tokens = t.prompt_tokens,
                 .generation_tokens = t.generation_tokens,
                 .prefix_queries = t.prefix_queries,
                 .prefix_hits = t.prefix_hits,
                 .waiting = stats.coordinator().requests_queued()};
  for (const v1::GroupStats& g : stats.groups()) {
    if (!g.connected()) continue;
    for (const v1::RankStats& r : stats.ranks()) {
      if (r.worker_id() != g.worker_id() || r.dp_group() != g.dp_group() || r.attn_tp_rank() != 0) continue;
      s.running += r.requests_running();
      s.waiting += r.requests_waiting();
      s.cache_blocks_used += r.cache_blocks_used();
      s.cache_blocks_total += r.cache_blocks_total();
    }
  }
  return s;
}

std::string NewCoordinatorId() {
  // Distinct per process start, so a worker can tell that the coordinator
  // restarted (and its routing state is gone).
  const auto now_ms =
      std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
          .count();
  return "coordinator-" + std::to_string(getpid()) + "-" + std::to_string(now_ms);
}

}  // namespace
}  // namespace coord

bool IsLoopbackListenAddress(const std::string& listen) { return IsLoopbackListen(listen); }

namespace {

// The HTTP API's tokenizer: the one given, --tokenizer's, --model's, none
// with --skip-tokenizer-init; with --chat-template's in place of its own
// (checked here, so that a template that does not parse fails the start).
StatusOr<std::shared_ptr<const text::Tokenizer>> HttpTokenizer(const CoordinatorOptions& o) {
  if (o.http_skip_tokenizer_init) {
    if (!o.http_tokenizer_path.empty() || !o.http_chat_template.empty())
      return InvalidArgumentError("--skip-tokenizer-init: no --tokenizer or --chat-template with it");
    return std::shared_ptr<const text::Tokenizer>();
  }
  std::shared_ptr<const text::Tokenizer> tokenizer = o.http_tokenizer;
  if (tokenizer == nullptr) {
    const std::string& path = o.http_tokenizer_path.empty() ? o.http_model : o.http_tokenizer_path;
    if (path.empty())
      return InvalidArgumentError("--http needs --model: the model whose tokenizer and name the HTTP API uses");
    auto loaded = text::Tokenizer::Load(path);
    if (!loaded.ok()) return loaded.status().WithContext(o.http_tokenizer_path.empty() ? "--model" : "--tokenizer");
    tokenizer = std::move(*loaded);
  }
  if (o.http_chat_template.empty()) return tokenizer;
  if (auto parsed = text::ChatTemplate::Parse(o.http_chat_template); !parsed.ok())
    return parsed.status().WithContext("--chat-template");
  return text::WithChatTemplate(std::move(tokenizer), o.http_chat_template);
}

}  // namespace

std::string DefaultServedModelName(const std::string& model_path) {
  std::string name = model_path;
  while (name.size() > 1 && name.back() == '/') name.pop_back();
  if (const size_t slash = name.rfind('/'); slash != std::string::npos) name = name.substr(slash + 1);
  for (std::string_view ext : {".yaml", ".yml"}) {
    if (name.size() > ext.size() && name.ends_with(ext)) name.resize(name.size() - ext.size());
  }
  return name.empty() ? "model" : name;
}

StatusOr<std::unique_ptr<Coordinator>> Coordinator::Start(const CoordinatorOptions& options) {
  if (options.max_queued < 0) return InvalidArgumentError("max_queued: must be >= 0, got ", options.max_queued);
  if (options.max_in_flight_per_group < 1)
    return InvalidArgumentError("max_in_flight_per_group: must be >= 1, got ", options.max_in_flight_per_group);
  if (options.balance_abs_tokens < 0)
    return InvalidArgumentError("balance_abs_tokens: must be >= 0, got ", options.balance_abs_tokens);
  if (!(options.balance_rel >= 0)) return InvalidArgumentError("balance_rel: must be >= 0, got ", options.balance_rel);
  if (!(options.queue_timeout_s > 0) || !std::isfinite(options.queue_timeout_s))
    return InvalidArgumentError("queue_timeout_s: must be > 0 and finite, got ", options.queue_timeout_s);
  if (!(options.stall_timeout_s > 0) || !std::isfinite(options.stall_timeout_s))
    return InvalidArgumentError("stall_timeout_s: must be > 0 and finite, got ", options.stall_timeout_s);
  if (!(options.lost_group_wait_s >= 0) || !std::isfinite(options.lost_group_wait_s))
    return InvalidArgumentError("lost_group_wait_s: must be >= 0 and finite, got ", options.lost_group_wait_s);
  if (options.max_known_groups < 1 || options.max_known_groups > (int64_t{1} << 20))
    return InvalidArgumentError("max_known_groups: must be in [1, 2^20], got ", options.max_known_groups);
  if (options.prefix_hashes_per_group < 0)
    return InvalidArgumentError("prefix_hashes_per_group: must be >= 0, got ", options.prefix_hashes_per_group);

  if (!options.tls.ca.empty() && options.tls.cert.empty())
    return InvalidArgumentError(
        "--tls-ca needs --tls-cert and --tls-key: client certificates are verified only over TLS");
  if (options.worker_secret.empty() && options.tls.ca.empty() && !options.open_worker_link_off_loopback &&
      !IsLoopbackListen(options.listen))
    return InvalidArgumentError(
        "--worker-secret-file (or --tls-ca, for workers' client certificates): required when "
        "--listen binds beyond loopback (got '",
        options.listen, "'): without it any process that reaches the port can register as a worker");

  if (!options.http_listen.empty() && options.auth_tokens.empty() && !options.allow_unauthenticated_http &&
      !IsLoopbackListen(options.http_listen))
    return InvalidArgumentError("--http binds beyond loopback (got '", options.http_listen,
                                "') without --auth-token-file: anyone who reaches the port could use the model. "
                                "Give client tokens, or --allow-unauthenticated to serve it open");

  // The HTTP API's tokenizer and metrics come first: a model path that
  // does not load fails the start before any port is bound.
  std::shared_ptr<const text::Tokenizer> tokenizer;
  std::shared_ptr<Metrics> metrics;
  std::string served_model_name = options.served_model_name;
  if (!options.http_listen.empty()) {
    MLARUN_ASSIGN_OR_RETURN(tokenizer, HttpTokenizer(options));
    if (served_model_name.empty())
      served_model_name =
          DefaultServedModelName(options.http_model.empty() ? options.http_tokenizer_path : options.http_model);
  }
  const bool server_log_on = options.log_requests || options.log_stats_interval_s > 0;
  if (!options.http_listen.empty() || server_log_on)
    metrics = std::make_shared<Metrics>(std::string(RoutingPolicyName(options.policy)));
  std::shared_ptr<coord::DispatcherObserver> observer = metrics;
  std::shared_ptr<coord::ServerLog> server_log;
  if (server_log_on) {
    server_log = std::make_shared<coord::ServerLog>(
        metrics, coord::ServerLog::Options{
                     .log_requests = options.log_requests,
                     .stats_interval_s = options.log_stats_interval_s,
                     .write = [](const std::string& line) { std::cerr << "mlarun coordinator: " + line + "\n"; }});
    observer = server_log;
  }

  auto dispatcher = std::make_shared<coord::Dispatcher>(options, coord::NewCoordinatorId(), observer);
  auto impl = std::make_unique<coord::CoordinatorImpl>(dispatcher, options);
  MLARUN_RETURN_IF_ERROR(impl->Bind(options.listen, options.tls));
  if (!options.http_listen.empty()) {
    const HttpServerOptions transport{.listen = options.http_listen,
                                      .handler_threads = options.http_threads,
                                      .max_body_bytes = options.http_max_body_bytes,
                                      .max_header_bytes = options.http_max_header_bytes,
                                      .header_timeout_s = options.http_header_timeout_s,
                                      .body_timeout_s = options.http_body_timeout_s,
                                      .max_connections = options.http_max_connections,
                                      .max_connections_per_peer = options.http_max_connections_per_peer};
    auto http = HttpApi::Start(HttpApiOptions{.transport = transport,
                                              .served_model_name = served_model_name,
                                              .tokenizer = tokenizer,
                                              .skip_tokenizer_init = options.http_skip_tokenizer_init,
                                              .auth_tokens = options.auth_tokens,
                                              .request_timeout_s = options.http_request_timeout_s,
                                              .allowed_origins = options.http_allowed_origins,
                                              .allowed_hosts = options.http_allowed_hosts,
                                              .reasoning_parser = options.http_reasoning_parser,
                                              .tool_call_parser = options.http_tool_call_parser,
                                              .enable_auto_tool_choice = options.http_enable_auto_tool_choice},
                               dispatcher, metrics);
    if (!http.ok()) return http.status().WithContext("coordinator --http");
    impl->SetHttp(std::move(*http));
  }
  if (server_log != nullptr) {
    server_log->Start([d = dispatcher.get(), m = metrics.get()] { return coord::SampleServer(*d, *m); });
    impl->SetServerLog(std::move(server_log));
  }
  return std::unique_ptr<Coordinator>(std::move(impl));
}

}  // namespace mlarun
