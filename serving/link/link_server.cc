#include "serving/link/link_server.h"

#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string_view>
#include <utility>

#include "serving/link/worker_link_client.h"

namespace mlarun {
namespace {

constexpr int kKeepaliveTimeMs = 20000;
constexpr int kKeepaliveTimeoutMs = 10000;
constexpr int kMinClientPingIntervalMs = 5000;
// A long prompt is ~2-5 bytes per token id on the wire; 64 MiB leaves room
// for prompts far beyond any max_position_embeddings.
constexpr int kMaxMessageBytes = 64 << 20;

// One WorkerLink stream. Reads one message at a time (reads are sequential,
// so registered_ needs no lock); owns itself (self_) from creation until
// gRPC's OnDone, and the handler holds it as the group's outlet while it is
// attached.
class WorkerCall final : public grpc::ServerBidiReactor<v1::WorkerMessage, v1::CoordinatorMessage>,
                         public Outbound<v1::CoordinatorMessage> {
 public:
  static WorkerCall* Start(WorkerLinkHandler* handler) {
    std::shared_ptr<WorkerCall> call(new WorkerCall(handler));
    call->self_ = call;
    call->StartRead(&call->in_);
    return call.get();
  }
  // A call refused before its first read: it ends with `status` at once.
  static WorkerCall* Refuse(WorkerLinkHandler* handler, grpc::StatusCode code, std::string message) {
    std::shared_ptr<WorkerCall> call(new WorkerCall(handler));
    call->self_ = call;
    call->Close(code, std::move(message));
    call->Flush();
    return call.get();
  }

  void OnReadDone(bool ok) override {
    if (!ok) {  // the worker closed its side or the stream broke
      handler_->Detach(this);
      Close(grpc::StatusCode::OK, "");
      Flush();
      return;
    }
    bool keep_reading;
    if (in_.ByteSizeLong() > WorkerLinkService::kMaxWorkerMessageBytes) {
      handler_->Detach(this);
      Close(grpc::StatusCode::RESOURCE_EXHAUSTED,
            internal::StrCat("a WorkerMessage may take at most ", WorkerLinkService::kMaxWorkerMessageBytes,
                             " bytes, got ", in_.ByteSizeLong()));
      Flush();
      return;
    }
    if (!registered_) {
      if (in_.msg_case() != v1::WorkerMessage::kRegister) {
        Close(grpc::StatusCode::INVALID_ARGUMENT, "the first WorkerMessage must be register");
        Flush();
        return;
      }
      registered_ = handler_->Attach(self_, in_.register_());
      keep_reading = registered_;
    } else {
      keep_reading = handler_->OnWorkerMessage(this, in_);
    }
    if (!keep_reading) {
      // The handler closed the link with the reason; this is a fallback.
      Close(grpc::StatusCode::ABORTED, "the DP group's link is no longer attached");
      Flush();
      return;
    }
    StartRead(&in_);
  }
  void OnWriteDone(bool ok) override { WriteDone(ok); }
  void OnCancel() override {
    handler_->Detach(this);
    Close(grpc::StatusCode::CANCELLED, "cancelled");
    Flush();
  }
  void OnDone() override {
    handler_->Detach(this);
    self_.reset();  // may delete this: nothing after it
  }

 private:
  explicit WorkerCall(WorkerLinkHandler* handler) : handler_(handler) {}
  void StartWriteNow(const v1::CoordinatorMessage* msg) override { StartWrite(msg); }
  void FinishNow(grpc::Status status) override { Finish(std::move(status)); }

  WorkerLinkHandler* const handler_;
  std::shared_ptr<WorkerCall> self_;
  v1::WorkerMessage in_;  // the read in flight
  bool registered_ = false;
};

// host:port with a numeric port (IPv6 hosts in brackets); returns the host.
StatusOr<std::string> SplitListen(const std::string& listen) {
  const size_t colon = listen.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == listen.size())
    return InvalidArgumentError("listen: expected host:port, got '", listen, "'");
  const std::string port = listen.substr(colon + 1);
  if (port.size() > 5 || port.find_first_not_of("0123456789") != std::string::npos || std::stoi(port) > 65535)
    return InvalidArgumentError("listen: port must be a number in [0, 65535], got '", port, "'");
  return listen.substr(0, colon);
}

// Why gRPC could not bind `listen`, as a bind of our own says (gRPC puts
// it only in its own log): ": Address already in use", or "".
std::string BindError(const std::string& listen, const std::string& host) {
  std::string h = host;
  if (h.size() >= 2 && h.front() == '[' && h.back() == ']') h = h.substr(1, h.size() - 2);
  addrinfo hints{.ai_flags = AI_PASSIVE, .ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM};
  addrinfo* found = nullptr;
  if (getaddrinfo(h.empty() ? nullptr : h.c_str(), listen.substr(listen.rfind(':') + 1).c_str(), &hints, &found) != 0)
    return "";
  std::string why;
  for (addrinfo* a = found; a != nullptr && why.empty(); a = a->ai_next) {
    const int fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    if (bind(fd, a->ai_addr, a->ai_addrlen) != 0) why = std::string(": ") + std::strerror(errno);
    close(fd);
  }
  freeaddrinfo(found);
  return why;
}

}  // namespace

grpc::ServerBidiReactor<v1::WorkerMessage, v1::CoordinatorMessage>* WorkerLinkService::Connect(
    grpc::CallbackServerContext* ctx) {
  if (secret_.empty() && !client_certificates_) return WorkerCall::Start(handler_);
  // A client certificate the server's TLS verified against --tls-ca (gRPC
  // sets the peer identity only for a verified one).
  if (client_certificates_ && ctx->auth_context() != nullptr && ctx->auth_context()->IsPeerAuthenticated())
    return WorkerCall::Start(handler_);
  if (secret_.empty())
    return WorkerCall::Refuse(handler_, grpc::StatusCode::UNAUTHENTICATED,
                              "this coordinator needs a worker client certificate signed by its --tls-ca: start "
                              "the worker with --tls-cert and --tls-key");
  const auto& md = ctx->client_metadata();
  auto it = md.find(kWorkerSecretHeader);
  if (it == md.end())
    return WorkerCall::Refuse(handler_, grpc::StatusCode::UNAUTHENTICATED,
                              client_certificates_
                                  ? "this coordinator needs the worker secret (--worker-secret-file) or a client "
                                    "certificate signed by its --tls-ca (--tls-cert, --tls-key)"
                                  : "this coordinator needs the worker secret: start the worker with "
                                    "--worker-secret-file holding the coordinator's secret");
  if (!ConstantTimeEqual(std::string_view(it->second.data(), it->second.size()), secret_))
    return WorkerCall::Refuse(handler_, grpc::StatusCode::UNAUTHENTICATED,
                              "the worker secret does not match the coordinator's --worker-secret-file");
  return WorkerCall::Start(handler_);
}

static std::shared_ptr<grpc::ServerCredentials> ServerCredentials(const TlsPem& tls) {
  if (!tls.enabled()) return grpc::InsecureServerCredentials();
  grpc::SslServerCredentialsOptions options(
      // A worker's certificate is asked for and, when sent, verified against
      // the CA; clients of the Mlarun API send none.
      tls.ca.empty() ? GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE : GRPC_SSL_REQUEST_CLIENT_CERTIFICATE_AND_VERIFY);
  options.pem_root_certs = tls.ca;
  options.pem_key_cert_pairs.push_back({tls.key, tls.cert});
  return grpc::SslServerCredentials(options);
}

bool IsLoopbackListen(const std::string& listen) {
  StatusOr<std::string> host = SplitListen(listen);
  if (!host.ok()) return false;
  const std::string& h = *host;
  if (h == "localhost" || h == "[::1]" || h == "::1") return true;
  if (h.rfind("127.", 0) != 0) return false;
  return h.find_first_not_of("0123456789.") == std::string::npos;
}

StatusOr<std::unique_ptr<GrpcServer>> GrpcServer::Start(const std::string& listen,
                                                        std::initializer_list<grpc::Service*> services,
                                                        const TlsPem& tls) {
  MLARUN_ASSIGN_OR_RETURN(const std::string host, SplitListen(listen));
  std::unique_ptr<GrpcServer> s(new GrpcServer());
  grpc::ServerBuilder builder;
  builder.AddListeningPort(listen, ServerCredentials(tls), &s->port_);
  for (grpc::Service* service : services) builder.RegisterService(service);
  builder.SetMaxReceiveMessageSize(kMaxMessageBytes);
  builder.SetMaxSendMessageSize(kMaxMessageBytes);
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, kKeepaliveTimeMs);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, kKeepaliveTimeoutMs);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, kMinClientPingIntervalMs);
  s->server_ = builder.BuildAndStart();
  if (s->server_ == nullptr || s->port_ == 0)
    return UnavailableError("cannot listen on '", listen, "'", BindError(listen, host),
                            tls.enabled() ? " (or the TLS certificate and key do not load: see gRPC's log above)" : "");
  s->address_ = host + ":" + std::to_string(s->port_);
  return s;
}

// ---- LinkEndpoint --------------------------------------------------------------

bool LinkPeer::Send(v1::CoordinatorMessage m) {
  {
    MutexLock lock(mu_);
    if (ended_) return false;
  }
  outlet_->Queue(std::move(m));
  outlet_->Flush();
  return true;
}

std::optional<v1::WorkerMessage> LinkPeer::Read(size_t index, std::chrono::milliseconds timeout) {
  MutexLock lock(mu_);
  if (!lock.WaitFor(changed_, timeout, [&]() MLARUN_REQUIRES(mu_) { return received_.size() > index || ended_; }) ||
      received_.size() <= index)
    return std::nullopt;
  return received_[index];
}

bool LinkPeer::ended() {
  MutexLock lock(mu_);
  return ended_;
}

void LinkPeer::Add(const v1::WorkerMessage& m) {
  MutexLock lock(mu_);
  received_.push_back(m);
  changed_.notify_all();
}

void LinkPeer::End() {
  MutexLock lock(mu_);
  ended_ = true;
  changed_.notify_all();
}

bool LinkEndpoint::Attach(std::shared_ptr<WorkerOutlet> link, const v1::Register& reg) {
  v1::CoordinatorMessage registered;
  registered.mutable_registered()->set_coordinator_id(coordinator_id_);
  link->Queue(std::move(registered));
  link->Flush();
  MutexLock lock(mu_);
  peers_.push_back(std::make_shared<LinkPeer>(std::move(link), reg));
  changed_.notify_all();
  return true;
}

bool LinkEndpoint::OnWorkerMessage(const WorkerOutlet* link, const v1::WorkerMessage& msg) {
  std::shared_ptr<LinkPeer> peer = Find(link);
  if (peer != nullptr) peer->Add(msg);
  return peer != nullptr;
}

void LinkEndpoint::Detach(const WorkerOutlet* link) {
  if (std::shared_ptr<LinkPeer> peer = Find(link)) peer->End();
}

std::shared_ptr<LinkPeer> LinkEndpoint::Find(const WorkerOutlet* link) {
  MutexLock lock(mu_);
  for (const auto& p : peers_)
    if (p->outlet() == link) return p;
  return nullptr;
}

std::shared_ptr<LinkPeer> LinkEndpoint::WaitPeer(int dp_group, std::chrono::milliseconds timeout) {
  MutexLock lock(mu_);
  std::shared_ptr<LinkPeer> found;
  lock.WaitFor(changed_, timeout, [&]() MLARUN_REQUIRES(mu_) {
    for (auto it = peers_.rbegin(); it != peers_.rend() && found == nullptr; ++it)
      if ((*it)->registration().dp_group() == dp_group && !(*it)->ended()) found = *it;
    return found != nullptr;
  });
  return found;
}

}  // namespace mlarun
