// The event-driven HTTP/1.1 transport (http_server.h). Each connection is a
// coroutine on a strand of its own: it reads a request through the three
// gates, hands it to a handler (a thread of HandlerPool, or inline when
// quick), writes what the handler's Outbox collects, and goes on with the
// next request. A handler thread never touches the socket; an I/O thread
// never waits for a handler.
#include "serving/http/http_server.h"

#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <boost/asio/bind_executor.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/ip/v6_only.hpp>
#include <boost/asio/redirect_error.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/strand.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <boost/asio/write.hpp>
#include <boost/beast/core/flat_buffer.hpp>
#include <boost/beast/core/tcp_stream.hpp>
#include <boost/beast/http/error.hpp>
#include <boost/beast/http/parser.hpp>
#include <boost/beast/http/read.hpp>
#include <boost/beast/http/status.hpp>
#include <boost/beast/http/string_body.hpp>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <list>
#include <map>
#include <mutex>
#include <set>
#include <thread>

namespace mlarun {
namespace {

namespace net = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = net::ip::tcp;
using boost::system::error_code;
using Clock = std::chrono::steady_clock;

// A handler's pieces still unsent beyond which its Write waits.
constexpr size_t kMaxUnsent = size_t{1} << 20;
// How often a half-closed connection is polled for a reset.
constexpr auto kHangupPoll = std::chrono::milliseconds(50);
// A refused request's unread body is drained this long and this much at
// most (so that closing does not reset the answer away before it is read).
constexpr auto kLinger = std::chrono::seconds(1);
constexpr size_t kLingerBytes = size_t{256} << 10;

std::chrono::nanoseconds Seconds(double s) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::duration<double>(s));
}

std::string Head(int status, const std::string& content_type, const HttpHeaders& headers, bool keep_alive) {
  const auto reason = http::obsolete_reason(static_cast<http::status>(status));
  std::string out = "HTTP/1.1 " + std::to_string(status) + " " + std::string(reason.data(), reason.size()) + "\r\n";
  if (!content_type.empty()) out += "Content-Type: " + content_type + "\r\n";
  for (const auto& [name, value] : headers) out += name + ": " + value + "\r\n";
  out += keep_alive ? "Connection: keep-alive\r\n" : "Connection: close\r\n";
  return out;
}

std::string Serialize(const HttpAnswer& a, bool keep_alive) {
  std::string out = Head(a.status, a.content_type, a.headers, keep_alive);
  out += "Content-Length: " + std::to_string(a.body.size()) + "\r\n\r\n";
  return out + a.body;
}

class Session;

// What one request's handler sends back, collected for the connection's
// coroutine to write. Shared by the handler (any thread) and the coroutine.
class Outbox final : public HttpResponder {
 public:
  Outbox(std::weak_ptr<Session> session, bool keep_alive, HttpHeaders extra)
      : session_(std::move(session)), keep_alive_(keep_alive), extra_(std::move(extra)) {}

  void Reply(HttpAnswer answer) override {
    answer.headers.insert(answer.headers.end(), extra_.begin(), extra_.end());
    std::string bytes = Serialize(answer, keep_alive_);
    {
      std::lock_guard lock(mu_);
      if (started_) return;
      started_ = true;
      status_ = answer.status;
      Queue(std::move(bytes));
      finished_ = true;
    }
    Wake();
  }
  bool StartStream(int status, std::string content_type, HttpHeaders headers) override {
    headers.insert(headers.end(), extra_.begin(), extra_.end());
    std::string bytes = Head(status, content_type, headers, keep_alive_) + "Transfer-Encoding: chunked\r\n\r\n";
    {
      std::lock_guard lock(mu_);
      if (started_) return false;
      started_ = streaming_ = true;
      status_ = status;
      Queue(std::move(bytes));
    }
    Wake();
    return !Gone();
  }
  bool Write(std::string piece) override {
    if (piece.empty()) return !Gone();
    char size[24];
    std::snprintf(size, sizeof size, "%zx\r\n", piece.size());
    {
      std::unique_lock lock(mu_);
      if (!streaming_ || finished_) return false;
      cv_.wait(lock, [&] { return unsent_ <= kMaxUnsent || gone_.load(); });
      if (gone_) return false;
      Queue(size + std::move(piece) + "\r\n");
    }
    Wake();
    return true;
  }
  void End() override {
    {
      std::lock_guard lock(mu_);
      if (!streaming_ || finished_) return;
      Queue("0\r\n\r\n");
      finished_ = true;
    }
    Wake();
  }
  bool Gone() const override { return gone_.load(); }

  // ---- The connection's side ----
  void MarkGone() {
    gone_ = true;
    std::lock_guard lock(mu_);
    cv_.notify_all();
  }
  // Everything queued (into *bytes); true once the answer is complete.
  bool Take(std::string* bytes) {
    std::lock_guard lock(mu_);
    for (std::string& p : pieces_) *bytes += p;
    pieces_.clear();
    return finished_;
  }
  void Sent(size_t n) {
    std::lock_guard lock(mu_);
    unsent_ -= std::min(unsent_, n);
    cv_.notify_all();
  }
  // A 100 Continue when nothing of the answer is out yet: to a whole close
  // it provokes a reset, a half-closed client skips it. False when the
  // answer has started.
  bool Probe() {
    std::lock_guard lock(mu_);
    if (started_ || probed_) return false;
    probed_ = true;
    pieces_.emplace_front("HTTP/1.1 100 Continue\r\n\r\n");
    unsent_ += pieces_.front().size();
    return true;
  }
  // For a handler that returned without an answer.
  void EnsureAnswered(const HttpAnswer& fallback) {
    bool started;
    {
      std::lock_guard lock(mu_);
      started = started_;
      if (streaming_ && !finished_) {
        finished_ = true;  // a cut stream: the connection is closed after it
        keep_alive_ = false;
        Queue("0\r\n\r\n");
      }
    }
    if (!started) Reply(fallback);
    Wake();
  }
  bool keep_alive() const {
    std::lock_guard lock(mu_);
    return keep_alive_ && !gone_;
  }
  int status() const {
    std::lock_guard lock(mu_);
    return status_;
  }

 private:
  void Queue(std::string bytes) {
    unsent_ += bytes.size();
    pieces_.push_back(std::move(bytes));
  }
  void Wake();

  const std::weak_ptr<Session> session_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::string> pieces_;
  size_t unsent_ = 0;
  bool keep_alive_;
  const HttpHeaders extra_;  // on every answer (CORS)
  bool started_ = false, streaming_ = false, finished_ = false, probed_ = false;
  int status_ = 0;
  std::atomic<bool> gone_{false};
};

// Threads for the handlers: started when a request finds none idle, up to
// a bound; an idle one ends after a while, so that a burst leaves nothing.
class HandlerPool {
 public:
  explicit HandlerPool(int max) : max_(max) {}
  ~HandlerPool() { Join(); }
  bool TryPost(std::function<void()> task) {
    std::lock_guard lock(mu_);
    if (stopping_ || busy_ >= max_) return false;
    ++busy_;
    tasks_.push_back(std::move(task));
    if (idle_ > static_cast<int>(tasks_.size()) - 1) {
      cv_.notify_one();
    } else {
      ++live_;
      std::thread([this] { Loop(); }).detach();
    }
    return true;
  }
  void Join() {
    std::unique_lock lock(mu_);
    stopping_ = true;
    cv_.notify_all();
    done_.wait(lock, [&] { return live_ == 0; });
  }

 private:
  void Loop() {
    std::unique_lock lock(mu_);
    for (;;) {
      if (tasks_.empty()) {
        ++idle_;
        const bool woken = cv_.wait_for(lock, std::chrono::seconds(20), [&] { return !tasks_.empty() || stopping_; });
        --idle_;
        if (!woken || tasks_.empty()) break;
      }
      std::function<void()> task = std::move(tasks_.front());
      tasks_.pop_front();
      lock.unlock();
      task();
      task = nullptr;
      lock.lock();
      --busy_;
    }
    if (--live_ == 0) done_.notify_all();
  }

  const int max_;
  std::mutex mu_;
  std::condition_variable cv_, done_;
  std::deque<std::function<void()>> tasks_;
  int busy_ = 0, idle_ = 0, live_ = 0;
  bool stopping_ = false;
};

struct Shared {
  HttpServerOptions options;
  HttpServer::Hooks hooks;
  HandlerPool pool;
  std::mutex mu;
  std::map<std::string, int> per_peer;
  std::set<std::weak_ptr<Session>, std::owner_less<std::weak_ptr<Session>>> sessions;
  std::atomic<int64_t> open{0};
  std::atomic<bool> stopping{false};
  Shared(HttpServerOptions o, HttpServer::Hooks h)
      : options(std::move(o)), hooks(std::move(h)), pool(options.handler_threads) {}
};

// Why a request could not be read: the status to refuse it with (0: say
// nothing, the client is gone).
int ReadFailure(const error_code& ec, bool timed_out) {
  if (ec == http::error::header_limit) return 431;
  if (ec == http::error::body_limit) return 413;
  if (timed_out || ec == beast::error::timeout) return 408;
  if (ec == http::error::end_of_stream || ec == net::error::eof || ec == net::error::connection_reset ||
      ec == net::error::operation_aborted || ec == net::error::broken_pipe)
    return 0;
  return 400;
}

std::string FailureMessage(int status, const HttpServerOptions& o) {
  switch (status) {
    case 431:
      return "the request's header is larger than the server's limit (" + std::to_string(o.max_header_bytes) +
             " bytes, " + std::to_string(o.max_header_fields) + " fields)";
    case 413:
      return "the request body is larger than the server's limit (" + std::to_string(o.max_body_bytes) + " bytes)";
    case 408:
      return "the request was not received in time";
    default:
      return "the request is not valid HTTP/1.1";
  }
}

class Session final : public std::enable_shared_from_this<Session> {
 public:
  Session(tcp::socket socket, std::shared_ptr<Shared> shared, std::string peer, bool count_peer)
      : stream_(std::move(socket)),
        shared_(std::move(shared)),
        peer_(std::move(peer)),
        count_peer_(count_peer),
        wake_(stream_.get_executor()),
        hangup_(stream_.get_executor()),
        deadline_(stream_.get_executor()) {}
  ~Session() {
    std::lock_guard lock(shared_->mu);
    if (count_peer_ && --shared_->per_peer[peer_] == 0) shared_->per_peer.erase(peer_);
    --shared_->open;
  }

  net::awaitable<void> Run();
  net::any_io_executor executor() { return stream_.get_executor(); }

  // From any thread: the current answer has news.
  void Wake() {
    net::post(stream_.get_executor(), [self = shared_from_this()] { self->WakeHere(); });
  }
  // From any thread: close the connection (the server stops).
  void Close() {
    net::post(stream_.get_executor(), [self = shared_from_this()] {
      self->closing_ = true;
      if (self->box_) self->box_->MarkGone();
      error_code ec;
      self->stream_.socket().shutdown(tcp::socket::shutdown_both, ec);
      self->stream_.socket().cancel(ec);
      self->WakeHere();
    });
  }

 private:
  const HttpServerOptions& options() const { return shared_->options; }
  void WakeHere() {
    wake_pending_ = true;
    wake_.cancel();
  }
  net::awaitable<void> Sleep() {
    if (!wake_pending_) {
      wake_.expires_at(net::steady_timer::time_point::max());
      error_code ec;
      co_await wake_.async_wait(net::redirect_error(net::use_awaitable, ec));
    }
    wake_pending_ = false;
  }

  // A deadline for a whole read (many reads of the socket): when it passes,
  // the read ends with timed_out_ set and the socket still open for a 408.
  void Arm(double seconds) {
    const uint64_t generation = ++deadline_generation_;
    timed_out_ = false;
    deadline_.expires_after(Seconds(seconds));
    deadline_.async_wait(
        net::bind_executor(stream_.get_executor(), [self = shared_from_this(), generation](error_code ec) {
          if (ec || generation != self->deadline_generation_) return;
          self->timed_out_ = true;
          self->stream_.socket().cancel(ec);
        }));
  }
  void Disarm() {
    ++deadline_generation_;
    deadline_.cancel();
  }
  net::awaitable<int> ReadHead(http::request_parser<http::string_body>& parser);
  net::awaitable<int> ReadBody(http::request_parser<http::string_body>& parser, const HttpRequest& req);
  net::awaitable<void> Refuse(std::string_view path, HttpAnswer answer, bool drain);
  net::awaitable<bool> Answer(HttpRequest req, bool keep_alive);
  net::awaitable<bool> WriteOut(std::shared_ptr<Outbox> box);
  void Watch();
  void OnEof();
  void PollHangup();
  HttpRequest FromParser(const http::request<http::string_body>& m) const;

  beast::tcp_stream stream_;
  const std::shared_ptr<Shared> shared_;
  const std::string peer_;
  const bool count_peer_;
  beast::flat_buffer buffer_;
  net::steady_timer wake_, hangup_, deadline_;
  uint64_t deadline_generation_ = 0;
  bool timed_out_ = false;
  bool wake_pending_ = false;
  bool closing_ = false;
  // While an answer is made: the watch on the socket.
  std::shared_ptr<Outbox> box_;
  int version_ = 11;
  bool watching_ = false, eof_ = false;
};

void Outbox::Wake() {
  if (auto s = session_.lock()) s->Wake();
}

HttpRequest Session::FromParser(const http::request<http::string_body>& m) const {
  HttpRequest r;
  r.method = std::string(m.method_string());
  r.target = std::string(m.target());
  r.path = r.target.substr(0, r.target.find('?'));
  r.version = m.version();
  for (const auto& f : m) r.headers.emplace_back(std::string(f.name_string()), std::string(f.value()));
  r.peer = peer_;
  r.peer_loopback = !count_peer_;  // only loopback peers go uncounted
  return r;
}

net::awaitable<int> Session::ReadHead(http::request_parser<http::string_body>& parser) {
  error_code ec;
  if (buffer_.size() == 0) {
    // Idle keep-alive: wait for the next request's first bytes.
    stream_.expires_after(Seconds(options().keep_alive_timeout_s));
    const size_t n =
        co_await stream_.async_read_some(buffer_.prepare(4096), net::redirect_error(net::use_awaitable, ec));
    if (ec) co_return -1;
    buffer_.commit(n);
  }
  stream_.expires_never();
  Arm(options().header_timeout_s);
  co_await http::async_read_header(stream_, buffer_, parser, net::redirect_error(net::use_awaitable, ec));
  Disarm();
  if (ec) co_return ReadFailure(ec, timed_out_);
  const auto& m = parser.get();
  if (std::distance(m.begin(), m.end()) > options().max_header_fields) co_return 431;
  co_return 200;
}

net::awaitable<int> Session::ReadBody(http::request_parser<http::string_body>& parser, const HttpRequest& req) {
  if (parser.is_done()) co_return 200;
  error_code ec;
  const std::string* expect = req.Header("Expect");
  if (expect != nullptr && LowerAscii(*expect) == "100-continue" && req.version == 11) {
    static const std::string kContinue = "HTTP/1.1 100 Continue\r\n\r\n";
    stream_.expires_after(Seconds(options().write_timeout_s));
    co_await net::async_write(stream_, net::buffer(kContinue), net::redirect_error(net::use_awaitable, ec));
    if (ec) co_return 0;
    stream_.expires_never();
  }
  Arm(options().body_timeout_s);
  co_await http::async_read(stream_, buffer_, parser, net::redirect_error(net::use_awaitable, ec));
  Disarm();
  co_return ec ? ReadFailure(ec, timed_out_) : 200;
}

// Answers and closes; with `drain`, reads what the client still sends for
// a moment, so that closing does not reset the answer away.
net::awaitable<void> Session::Refuse(std::string_view path, HttpAnswer answer, bool drain) {
  if (shared_->hooks.answered) shared_->hooks.answered(path, answer.status);
  const std::string bytes = Serialize(answer, false);
  error_code ec;
  stream_.expires_after(Seconds(std::min(options().write_timeout_s, 5.0)));
  co_await net::async_write(stream_, net::buffer(bytes), net::redirect_error(net::use_awaitable, ec));
  if (ec) co_return;
  stream_.socket().shutdown(tcp::socket::shutdown_send, ec);
  if (!drain) co_return;
  stream_.expires_after(kLinger);
  char sink[16384];
  for (size_t drained = 0; !ec && drained < kLingerBytes;)
    drained += co_await stream_.async_read_some(net::buffer(sink), net::redirect_error(net::use_awaitable, ec));
}

net::awaitable<void> Session::Run() {
  const Shared& s = *shared_;
  for (;;) {
    http::request_parser<http::string_body> parser;
    parser.header_limit(static_cast<std::uint32_t>(std::min<int64_t>(s.options.max_header_bytes, UINT32_MAX)));
    parser.body_limit(static_cast<std::uint64_t>(s.options.max_body_bytes));
    int status = co_await ReadHead(parser);
    if (status < 0 || closing_) co_return;
    if (status != 200) {
      if (status > 0) co_await Refuse("", s.hooks.error(status, FailureMessage(status, s.options)), true);
      co_return;
    }
    HttpRequest req = FromParser(parser.get());
    if (auto refusal = s.hooks.check_head(req)) {
      co_await Refuse(req.path, std::move(*refusal), !parser.is_done());
      co_return;
    }
    status = co_await ReadBody(parser, req);
    if (status != 200) {
      if (status > 0) co_await Refuse(req.path, s.hooks.error(status, FailureMessage(status, s.options)), true);
      co_return;
    }
    stream_.expires_never();
    const bool keep_alive = parser.get().keep_alive();
    req.body = std::move(parser.get().body());
    if (!co_await Answer(std::move(req), keep_alive) || closing_) co_return;
  }
}

// One request from handler to last byte; true when the connection can take
// the next one.
net::awaitable<bool> Session::Answer(HttpRequest req, bool keep_alive) {
  const Shared& s = *shared_;
  const std::string path = req.path;
  version_ = req.version;
  auto box = std::make_shared<Outbox>(weak_from_this(), keep_alive,
                                      s.hooks.extra_headers ? s.hooks.extra_headers(req) : HttpHeaders{});
  box_ = box;
  eof_ = false;
  Watch();
  if (s.hooks.quick(req)) {
    try {
      s.hooks.handle(req, *box);
    } catch (const std::exception& e) {
      box->EnsureAnswered(s.hooks.error(500, e.what()));
    }
    box->EnsureAnswered(s.hooks.error(500, "the request was not answered"));
  } else {
    auto shared = shared_;
    auto task = [shared, box, req = std::move(req)] {
      try {
        shared->hooks.handle(req, *box);
      } catch (const std::exception& e) {
        box->EnsureAnswered(shared->hooks.error(500, e.what()));
      }
      box->EnsureAnswered(shared->hooks.error(500, "the request was not answered"));
    };
    if (!shared->pool.TryPost(std::move(task))) {
      HttpAnswer busy = s.hooks.error(503, "every handler of this server is busy; retry shortly");
      busy.headers.emplace_back("Retry-After", "1");
      box->Reply(std::move(busy));
    }
  }
  const bool ok = co_await WriteOut(box);
  if (s.hooks.answered) s.hooks.answered(path, box->status());
  // Stop watching before the parser reads again.
  box_ = nullptr;
  hangup_.cancel();
  if (watching_) {
    error_code ec;
    stream_.socket().cancel(ec);
    while (watching_) co_await Sleep();
  }
  co_return ok && !eof_ && box->keep_alive();
}

net::awaitable<bool> Session::WriteOut(std::shared_ptr<Outbox> box) {
  for (;;) {
    std::string bytes;
    const bool finished = box->Take(&bytes);
    if (!bytes.empty()) {
      error_code ec;
      stream_.expires_after(Seconds(options().write_timeout_s));
      co_await net::async_write(stream_, net::buffer(bytes), net::redirect_error(net::use_awaitable, ec));
      stream_.expires_never();
      if (ec) {
        box->MarkGone();
        co_return false;
      }
      box->Sent(bytes.size());
      continue;
    }
    if (finished) co_return true;
    if (box->Gone() || closing_) co_return false;
    co_await Sleep();
  }
}

// Reads on while an answer is made: pipelined requests wait in the buffer;
// an end or a reset tells about the client.
void Session::Watch() {
  if (watching_ || eof_ || !box_ || buffer_.size() > static_cast<size_t>(options().max_header_bytes)) return;
  watching_ = true;
  stream_.socket().async_read_some(
      buffer_.prepare(4096),
      net::bind_executor(stream_.get_executor(), [self = shared_from_this()](error_code ec, size_t n) {
        self->watching_ = false;
        if (!ec) {
          self->buffer_.commit(n);
          self->Watch();
        } else if (ec == net::error::eof) {
          self->OnEof();
        } else if (ec != net::error::operation_aborted && self->box_) {
          self->box_->MarkGone();
        }
        self->WakeHere();
      }));
}

// The client sent its end: a half close, or gone. An HTTP/1.0 client cannot
// be probed (no 1xx) and counts as gone.
void Session::OnEof() {
  eof_ = true;
  if (!box_) return;
  if (version_ < 11) {
    box_->MarkGone();
    return;
  }
  box_->Probe();
  PollHangup();
}

void Session::PollHangup() {
  hangup_.expires_after(kHangupPoll);
  hangup_.async_wait(net::bind_executor(stream_.get_executor(), [self = shared_from_this()](error_code ec) {
    if (ec || !self->box_) return;
    pollfd p{.fd = self->stream_.socket().native_handle(), .events = POLLRDHUP, .revents = 0};
    if (::poll(&p, 1, 0) > 0 && (p.revents & (POLLHUP | POLLERR)) != 0) {
      self->box_->MarkGone();
      self->WakeHere();
      return;
    }
    self->PollHangup();
  }));
}

class HttpServerImpl final : public HttpServer {
 public:
  HttpServerImpl(const HttpServerOptions& options, Hooks hooks)
      : shared_(std::make_shared<Shared>(options, std::move(hooks))), acceptor_(ioc_) {}
  ~HttpServerImpl() override { Shutdown(); }

  Status Bind() {
    std::string host;
    int port = 0;
    if (!ParseHostPort(shared_->options.listen, &host, &port))
      return InvalidArgumentError("http_listen: expected HOST:PORT, got '", shared_->options.listen, "'");
    error_code ec;
    const auto address = net::ip::make_address(host == "localhost" ? "127.0.0.1" : host, ec);
    if (ec) return InvalidArgumentError("http_listen: '", host, "' is not an IP address");
    const tcp::endpoint endpoint(address, static_cast<unsigned short>(port));
    acceptor_.open(endpoint.protocol(), ec);
    // SO_REUSEADDR (a restart binds at once) but never SO_REUSEPORT: a
    // second server on the same port fails here instead of sharing it.
    if (!ec) acceptor_.set_option(tcp::acceptor::reuse_address(true), ec);
    if (!ec && address.is_v6()) acceptor_.set_option(net::ip::v6_only(true), ec);
    if (!ec) acceptor_.bind(endpoint, ec);
    if (!ec) acceptor_.listen(1024, ec);
    if (ec) return UnavailableError("http_listen: cannot listen on ", shared_->options.listen, ": ", ec.message());
    const int bound = acceptor_.local_endpoint().port();
    address_ = (address.is_v6() ? "[" + address.to_string() + "]" : address.to_string()) + ":" + std::to_string(bound);
    RaiseDescriptorLimit(shared_->options.max_connections);
    net::co_spawn(ioc_, Accept(), net::detached);
    for (int i = 0; i < shared_->options.io_threads; ++i) threads_.emplace_back([this] { ioc_.run(); });
    return Status::Ok();
  }

  std::string address() const override { return address_; }
  int64_t open_connections() const override { return shared_->open.load(); }

  void Shutdown() override {
    std::lock_guard lock(shutdown_mu_);
    if (threads_.empty()) return;
    shared_->stopping = true;
    net::post(ioc_, [this] {
      error_code ec;
      acceptor_.close(ec);
    });
    std::vector<std::shared_ptr<Session>> live;
    {
      std::lock_guard l(shared_->mu);
      for (const auto& w : shared_->sessions)
        if (auto s = w.lock()) live.push_back(std::move(s));
    }
    for (auto& s : live) s->Close();
    live.clear();
    // Handlers see their clients gone and return; then the I/O ends.
    shared_->pool.Join();
    ioc_.stop();
    for (std::thread& t : threads_) t.join();
    threads_.clear();
  }

 private:
  static void RaiseDescriptorLimit(int connections) {
    rlimit r{};
    if (getrlimit(RLIMIT_NOFILE, &r) != 0) return;
    const rlim_t want = std::min<rlim_t>(r.rlim_max, static_cast<rlim_t>(connections) + 1024);
    if (r.rlim_cur < want) {
      r.rlim_cur = want;
      setrlimit(RLIMIT_NOFILE, &r);
    }
  }

  net::awaitable<void> Accept() {
    net::steady_timer backoff(ioc_);
    while (!shared_->stopping) {
      error_code ec;
      tcp::socket socket =
          co_await acceptor_.async_accept(net::make_strand(ioc_), net::redirect_error(net::use_awaitable, ec));
      if (ec == net::error::operation_aborted || shared_->stopping) co_return;
      if (ec) {  // out of descriptors, most likely: let some close
        backoff.expires_after(std::chrono::milliseconds(50));
        co_await backoff.async_wait(net::redirect_error(net::use_awaitable, ec));
        continue;
      }
      Admit(std::move(socket));
    }
  }

  void Admit(tcp::socket socket) {
    error_code ec;
    socket.set_option(tcp::no_delay(true), ec);
    auto remote = socket.remote_endpoint(ec).address();
    if (remote.is_v6() && remote.to_v6().is_v4_mapped())
      remote = net::ip::make_address_v4(net::ip::v4_mapped, remote.to_v6());
    const std::string peer = remote.to_string();
    const bool count_peer = !remote.is_loopback();
    const HttpServerOptions& o = shared_->options;
    std::shared_ptr<Session> session;
    int refuse = 0;
    {
      std::lock_guard lock(shared_->mu);
      if (shared_->open >= o.max_connections) {
        refuse = 1;
      } else if (count_peer && shared_->per_peer[peer] >= o.max_connections_per_peer) {
        refuse = 2;
        if (shared_->per_peer[peer] == 0) shared_->per_peer.erase(peer);
      } else {
        ++shared_->open;
        if (count_peer) ++shared_->per_peer[peer];
        session = std::make_shared<Session>(std::move(socket), shared_, peer, count_peer);
        for (auto it = shared_->sessions.begin(); it != shared_->sessions.end();)
          it = it->expired() ? shared_->sessions.erase(it) : std::next(it);
        shared_->sessions.insert(session);
      }
    }
    if (session) {
      net::co_spawn(
          session->executor(), [session]() -> net::awaitable<void> { co_await session->Run(); }, net::detached);
      return;
    }
    // Over a limit: a short 503 and close, written without waiting.
    HttpAnswer busy = shared_->hooks.error(
        503, refuse == 1 ? "the server has as many connections as it takes; retry shortly"
                         : "this address has as many connections open as the server takes from one client");
    busy.headers.emplace_back("Retry-After", "1");
    const std::string bytes = Serialize(busy, false);
    socket.non_blocking(true, ec);
    socket.send(net::buffer(bytes), 0, ec);
    socket.shutdown(tcp::socket::shutdown_both, ec);
    socket.close(ec);
    if (shared_->hooks.answered) shared_->hooks.answered("", 503);
  }

  net::io_context ioc_;
  const std::shared_ptr<Shared> shared_;
  tcp::acceptor acceptor_;
  std::string address_;
  std::mutex shutdown_mu_;
  std::vector<std::thread> threads_;
};

}  // namespace

std::string LowerAscii(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

const std::string* HttpRequest::Header(std::string_view name) const {
  for (const auto& [k, v] : headers)
    if (k.size() == name.size() && LowerAscii(k) == LowerAscii(name)) return &v;
  return nullptr;
}

bool ParseHostPort(const std::string& listen, std::string* host, int* port) {
  const size_t colon = listen.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == listen.size()) return false;
  *host = listen.substr(0, colon);
  if (host->front() == '[') {
    if (host->back() != ']') return false;
    *host = host->substr(1, host->size() - 2);
  }
  const std::string p = listen.substr(colon + 1);
  if (p.size() > 5 || p.find_first_not_of("0123456789") != std::string::npos) return false;
  *port = std::atoi(p.c_str());
  return *port <= 65535;
}

StatusOr<std::unique_ptr<HttpServer>> HttpServer::Start(const HttpServerOptions& options, Hooks hooks) {
  const HttpServerOptions& o = options;
  if (o.handler_threads < 1 || o.handler_threads > 65536)
    return InvalidArgumentError("http_threads: must be in [1, 65536], got ", o.handler_threads);
  if (o.io_threads < 1 || o.io_threads > 64)
    return InvalidArgumentError("http_io_threads: must be in [1, 64], got ", o.io_threads);
  if (o.max_body_bytes < 1024)
    return InvalidArgumentError("http_max_body_bytes: must be >= 1024, got ", o.max_body_bytes);
  if (o.max_header_bytes < 1024 || o.max_header_bytes > (int64_t{1} << 30))
    return InvalidArgumentError("http_max_header_bytes: must be in [1024, 2^30], got ", o.max_header_bytes);
  if (o.max_header_fields < 8)
    return InvalidArgumentError("http_max_header_fields: must be >= 8, got ", o.max_header_fields);
  for (const auto& [name, v] : {std::pair{"http_header_timeout_s", o.header_timeout_s},
                                {"http_body_timeout_s", o.body_timeout_s},
                                {"http_write_timeout_s", o.write_timeout_s},
                                {"http_keep_alive_timeout_s", o.keep_alive_timeout_s}}) {
    if (!(v > 0) || !(v <= 86400)) return InvalidArgumentError(name, ": must be in (0, 86400] seconds, got ", v);
  }
  if (o.max_connections < 1) return InvalidArgumentError("http_max_connections: must be >= 1, got ", o.max_connections);
  if (o.max_connections_per_peer < 1)
    return InvalidArgumentError("http_max_connections_per_peer: must be >= 1, got ", o.max_connections_per_peer);
  if (!hooks.check_head || !hooks.quick || !hooks.handle || !hooks.error)
    return InvalidArgumentError("http: check_head, quick, handle and error are required");
  auto impl = std::make_unique<HttpServerImpl>(options, std::move(hooks));
  MLARUN_RETURN_IF_ERROR(impl->Bind());
  return std::unique_ptr<HttpServer>(std::move(impl));
}

}  // namespace mlarun
