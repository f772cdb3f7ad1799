// The coordinator's OpenAI-compatible HTTP API (docs/http-api.md): POST
// /v1/completions and /v1/chat/completions (streamed as server-sent events
// or whole), GET /v1/models, /health and /metrics (metrics.h), on
// cpp-httplib. Text becomes token ids with the model's tokenizer (and chat
// template), each choice goes through Dispatcher::Submit as a request of its
// own, exactly as a gRPC Generate call does, and its tokens come back as text
// deltas that never split a UTF-8 character.
//
// Threading: one HTTP handler thread per exchange (a pool of
// HttpApiOptions::threads). The handler waits on a condition variable of
// its own that the exchange's outlets signal; the dispatcher never waits
// for it. A client that goes away (mid-stream or while waiting) cancels its
// requests at their groups (Dispatcher::ClientGone). Thread-safe.
//
// Internal to the coordinator (Coordinator::Start runs it when
// CoordinatorOptions::http_listen is set). No gRPC or httplib header is
// visible here.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "base/status.h"
#include "serving/security/security.h"

namespace mlarun {
namespace coord {
class Dispatcher;
}
namespace text {
class Tokenizer;
}
class Metrics;

struct HttpApiOptions {
  // host:port (IPv6 hosts in brackets); port 0 picks a free one.
  std::string listen = "127.0.0.1:8000";
  // The `model` requests must name (when they name one) and /v1/models lists.
  std::string served_model_name;
  // Text to ids and back; its chat_template() serves /v1/chat/completions.
  // Required.
  std::shared_ptr<const text::Tokenizer> tokenizer;
  // The client API's tokens: set, every path but /health needs
  // `Authorization: Bearer TOKEN` (401 otherwise), with the gRPC API's
  // principals (a principal's request ids are its own).
  AuthTokens auth_tokens;
  // Handler threads: each open connection holds one (a stream for its whole
  // length, a keep-alive connection while it waits for its next request).
  // Default 512.
  int threads = 512;
  // Request bodies beyond this get 413. Default 32 MiB.
  int64_t max_body_bytes = int64_t{32} << 20;
  // Each request's deadline from its arrival (504 when it passes); 0: none.
  double request_timeout_s = 0;
  // An idle keep-alive connection is closed after this long. Default 5 s.
  int keep_alive_timeout_s = 5;
};

class HttpApi {
 public:
  // Binds and starts serving. INVALID_ARGUMENT for a bad address or options,
  // UNAVAILABLE when the port cannot be bound. `metrics` may be nullptr
  // (/metrics then answers 404).
  static StatusOr<std::unique_ptr<HttpApi>> Start(const HttpApiOptions& options,
                                                  std::shared_ptr<coord::Dispatcher> dispatcher,
                                                  std::shared_ptr<Metrics> metrics);
  virtual ~HttpApi() = default;
  // host:port with the bound port.
  virtual std::string address() const = 0;
  // Stops accepting and returns once every handler has returned. Exchanges
  // still waiting on the dispatcher end when it ends their requests (its own
  // Shutdown), so call that first; an idle keep-alive connection is let go
  // within keep_alive_timeout_s. Idempotent.
  virtual void Shutdown() = 0;
};

}  // namespace mlarun
