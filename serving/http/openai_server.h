// The coordinator's OpenAI-compatible HTTP API (docs/http-api.md): POST
// /v1/completions and /v1/chat/completions (streamed as server-sent events
// or whole), GET /v1/models, /health and /metrics (metrics.h), on the
// event-driven transport of http_server.h. Text becomes token ids with the model's tokenizer (and chat
// template), each choice goes through Dispatcher::Submit as a request of its
// own, exactly as a gRPC Generate call does, and its tokens come back as text
// deltas that never split a UTF-8 character.
//
// Threading: a generation request runs on a handler thread of its own (at
// most HttpApiOptions::threads), waiting on a condition variable that the
// exchange's outlets signal; the dispatcher never waits for it. Other paths
// are answered on the transport's I/O threads. A client that goes away
// (mid-stream or while waiting) cancels its requests at their groups
// (Dispatcher::ClientGone). Thread-safe.
//
// Internal to the coordinator (Coordinator::Start runs it when
// CoordinatorOptions::http_listen is set). No gRPC or Boost header is
// visible here.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "base/status.h"
#include "serving/http/http_server.h"
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
  // Address, handler threads, size and time limits, connection limits:
  // the transport's (http_server.h), defaults and meaning alike.
  HttpServerOptions transport;
  // The `model` requests must name (when they name one) and /v1/models lists.
  std::string served_model_name;
  // Text to ids and back; its chat_template() serves /v1/chat/completions.
  // Required unless skip_tokenizer_init.
  std::shared_ptr<const text::Tokenizer> tokenizer;
  // No tokenizer (vLLM's --skip-tokenizer-init): completions take prompts of
  // token ids only and answer token_ids without text; chat, text prompts,
  // stop strings, bad_words and /tokenize get 400.
  bool skip_tokenizer_init = false;
  // The client API's tokens: set, every path but /health needs
  // `Authorization: Bearer TOKEN` (401 otherwise), with the gRPC API's
  // principals (a principal's request ids are its own).
  AuthTokens auth_tokens;
  // Each request's deadline from its arrival (504 when it passes); 0: none.
  double request_timeout_s = 0;
  // Origins whose web pages may call the API (CORS; "*": any). Requests
  // with another Origin get 403. Default none.
  std::vector<std::string> allowed_origins;
  // Without auth_tokens, the Host names answered besides IP addresses and
  // localhost ("*": any), against DNS rebinding. Default none.
  std::vector<std::string> allowed_hosts;
  // "deepseek_r1": chat answers give the text up to `</think>` as
  // reasoning_content, the rest as content. Empty: all is content.
  std::string reasoning_parser;
  // "deepseek_v3": with enable_auto_tool_choice, chat requests with tools
  // (tool_choice "auto") get the answer's calls as message.tool_calls.
  std::string tool_call_parser;
  bool enable_auto_tool_choice = false;
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
  // within transport.keep_alive_timeout_s. Idempotent.
  virtual void Shutdown() = 0;
};

}  // namespace mlarun
