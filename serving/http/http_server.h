// The HTTP/1.1 transport under the OpenAI API (openai_server.cc): an
// event-driven server on Boost.Beast and Asio that owns connections, limits
// and deadlines, and hands complete requests to the API.
//
// Why not a thread per connection: a connection costs a coroutine frame and
// its buffer while it sends its request, never a thread, so slow or idle
// clients cannot take the handler threads from the others, and /health is
// answered on the I/O threads whatever the handlers are doing.
//
// A request goes through three gates before any handler sees it, each with a
// bound that holds for every transfer encoding:
//   1. its header block: at most max_header_bytes and max_header_fields,
//      complete within header_timeout_s of its first byte (431, 408);
//   2. Hooks::check_head, on the header alone, before a byte of the body is
//      read or a handler thread is taken: authentication, Host, Origin,
//      Content-Type (the API's answer: 401, 403, 415, ...);
//   3. its body: at most max_body_bytes, chunked or not, complete within
//      body_timeout_s (413, 408).
// A refused request's connection is closed after its answer (its unread body
// is drained for at most a second, so that the answer is not lost to a
// reset). A handler then runs on a handler thread (at most handler_threads
// at once; a request that finds none free gets 503 with Retry-After), or on
// the I/O thread when Hooks::quick says it is cheap.
//
// While a handler runs, the connection is watched: a reset, or an orderly
// close that a probe shows to be a whole close, makes the responder Gone().
// A client that only shut its sending side (a half close) is still answered:
// the probe (a 100 Continue before the answer starts; the answer's own
// chunks after) provokes a reset only from a peer that is gone. Requests a
// client pipelines are answered in order.
//
// No Boost header is visible here.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "base/status.h"

namespace mlarun {

using HttpHeaders = std::vector<std::pair<std::string, std::string>>;

struct HttpServerOptions {
  // host:port (IPv6 hosts in brackets); port 0 picks a free one.
  std::string listen = "127.0.0.1:8000";
  // Handlers running at once (each holds a thread while it runs; a stream
  // holds one for its whole length). Threads start when needed and end when
  // idle.
  int handler_threads = 512;
  // Threads running the connections' I/O.
  int io_threads = 2;
  // A request's body, decoded (chunked or not): beyond it, 413.
  int64_t max_body_bytes = int64_t{32} << 20;
  // A request's header block (request line and fields): beyond it, 431.
  int64_t max_header_bytes = int64_t{64} << 10;
  int max_header_fields = 128;
  // The header block must be complete within this long of its first byte,
  // and the body within body_timeout_s of the header's end (408).
  double header_timeout_s = 10;
  double body_timeout_s = 60;
  // One write of an answer (a slow reader is closed after it).
  double write_timeout_s = 30;
  // An idle keep-alive connection is closed after this long.
  double keep_alive_timeout_s = 5;
  // Open connections in all and per peer address (loopback peers are
  // exempt from the latter: a proxy in front is one peer). Beyond either,
  // a connection gets 503 and is closed.
  int max_connections = 8192;
  int max_connections_per_peer = 256;
};

struct HttpRequest {
  std::string method;
  std::string target;  // as sent: path and query
  std::string path;    // target without the query
  int version = 11;    // 10 or 11
  HttpHeaders headers;
  std::string body;
  std::string peer;            // the client's address, numeric (IPv4-mapped IPv6 as IPv4)
  bool peer_loopback = false;  // ... in 127.0.0.0/8 or ::1
  // The first field of that name (case-insensitive), or nullptr.
  const std::string* Header(std::string_view name) const;
};

struct HttpAnswer {
  int status = 200;
  std::string content_type = "application/json";
  std::string body;
  HttpHeaders headers;  // extra fields (Retry-After, ...)
};

// A handler's way back to its client. Thread-safe; valid for the handler's
// whole run.
class HttpResponder {
 public:
  virtual ~HttpResponder() = default;
  // The whole answer. Once per request, instead of a stream.
  virtual void Reply(HttpAnswer answer) = 0;
  // A chunked answer: its head, then Write() its pieces, then End(). Write
  // waits while more than a bound of earlier pieces is still unsent (a slow
  // reader slows its handler, not the server's memory); false once the
  // client is gone.
  virtual bool StartStream(int status, std::string content_type, HttpHeaders headers) = 0;
  virtual bool Write(std::string piece) = 0;
  virtual void End() = 0;
  // The client closed or reset the connection, or a write failed.
  virtual bool Gone() const = 0;
};

class HttpServer {
 public:
  struct Hooks {
    // On the header alone (HttpRequest::body empty): an answer refuses the
    // request before its body is read. Runs on an I/O thread: cheap.
    std::function<std::optional<HttpAnswer>(const HttpRequest&)> check_head;
    // True: handle() runs on the I/O thread (cheap, never waits).
    std::function<bool(const HttpRequest&)> quick;
    // Answers the request through the responder (once, before it returns;
    // a handler that returns without answering gets a 500).
    std::function<void(const HttpRequest&, HttpResponder&)> handle;
    // The server's own refusals (400, 408, 413, 431, 503, 500) as answers.
    std::function<HttpAnswer(int status, std::string_view message)> error;
    // Fields added to every answer to the request (may be null): CORS.
    std::function<HttpHeaders(const HttpRequest&)> extra_headers;
    // Every answered request (may be null).
    std::function<void(std::string_view path, int status)> answered;
  };

  // Binds and starts serving. INVALID_ARGUMENT for bad options or address,
  // UNAVAILABLE when the address cannot be bound (in use included: the port
  // is never shared with another server).
  static StatusOr<std::unique_ptr<HttpServer>> Start(const HttpServerOptions& options, Hooks hooks);
  virtual ~HttpServer() = default;
  // host:port with the bound port.
  virtual std::string address() const = 0;
  // Connections open now (for tests and metrics).
  virtual int64_t open_connections() const = 0;
  // Stops accepting, closes every connection and returns once every
  // handler has returned. Idempotent.
  virtual void Shutdown() = 0;
};

// ASCII letters lowered (header names, media types, host names).
std::string LowerAscii(std::string_view s);

// host:port -> host (brackets removed) and port; false when malformed.
bool ParseHostPort(const std::string& listen, std::string* host, int* port);

}  // namespace mlarun
