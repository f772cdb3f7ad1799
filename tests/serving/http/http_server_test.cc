// The HTTP transport (serving/http/http_server.h) against raw sockets: the
// limits hold for every transfer encoding and before a handler or the body
// is paid for, slow and idle clients take no handler thread, a busy server
// says 503 with Retry-After, pipelined requests are answered in order, and a
// half-closed client is answered while a gone one is noticed.
#include "serving/http/http_server.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace mlarun {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

// ---- A raw client ----------------------------------------------------------------

class RawClient {
 public:
  explicit RawClient(int port) {
    fd_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(port));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    connected_ = connect(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
    int one = 1;
    setsockopt(fd_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  }
  ~RawClient() { Close(); }
  bool connected() const { return connected_; }
  // False once the server closed or reset the connection.
  bool Send(const std::string& s) {
    size_t at = 0;
    while (at < s.size()) {
      const ssize_t n = send(fd_, s.data() + at, s.size() - at, MSG_NOSIGNAL);
      if (n <= 0) return false;
      at += static_cast<size_t>(n);
    }
    return true;
  }
  // Reads until `done(all)` holds, the peer closes, or the deadline passes.
  template <class Done>
  std::string ReadUntil(Done done, std::chrono::milliseconds limit = 5000ms) {
    const auto end = Clock::now() + limit;
    while (!done(in_) && Clock::now() < end) {
      pollfd p{.fd = fd_, .events = POLLIN, .revents = 0};
      const int left =
          static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(end - Clock::now()).count());
      if (poll(&p, 1, std::max(left, 1)) <= 0) continue;
      char buf[65536];
      const ssize_t n = recv(fd_, buf, sizeof buf, 0);
      if (n <= 0) {
        eof_ = true;
        break;
      }
      in_.append(buf, static_cast<size_t>(n));
    }
    return in_;
  }
  // One whole answer (its head and a Content-Length body), taken off the input.
  std::string ReadAnswer(std::chrono::milliseconds limit = 5000ms) {
    auto complete = [](const std::string& s) {
      size_t start = 0;
      while (s.compare(start, 12, "HTTP/1.1 100") == 0) {
        const size_t e = s.find("\r\n\r\n", start);
        if (e == std::string::npos) return size_t{0};
        start = e + 4;
      }
      const size_t head = s.find("\r\n\r\n", start);
      if (head == std::string::npos) return size_t{0};
      const size_t cl = s.find("Content-Length: ", start);
      if (cl == std::string::npos || cl > head) return head + 4;
      const size_t len = std::stoul(s.substr(cl + 16));
      return s.size() >= head + 4 + len ? head + 4 + len : size_t{0};
    };
    ReadUntil([&](const std::string& s) { return complete(s) != 0; }, limit);
    const size_t n = complete(in_);
    if (n == 0) return "";
    std::string answer = in_.substr(0, n);
    in_.erase(0, n);
    return answer;
  }
  bool eof() const { return eof_; }
  void ShutWrite() { shutdown(fd_, SHUT_WR); }
  void Close() {
    if (fd_ >= 0) close(fd_);
    fd_ = -1;
  }

 private:
  int fd_ = -1;
  bool connected_ = false, eof_ = false;
  std::string in_;
};

int StatusOf(const std::string& answer) {
  size_t at = 0;
  while (answer.compare(at, 12, "HTTP/1.1 100") == 0) at = answer.find("\r\n\r\n", at) + 4;
  return answer.size() >= at + 12 ? std::stoi(answer.substr(at + 9, 3)) : -1;
}
std::string BodyOf(const std::string& answer) {
  const size_t head = answer.rfind("\r\n\r\n");
  return head == std::string::npos ? "" : answer.substr(head + 4);
}

// ---- A server under test ------------------------------------------------------------

struct TestServer {
  explicit TestServer(HttpServerOptions o = {}, std::function<void(const HttpRequest&, HttpResponder&)> handler = {}) {
    o.listen = "127.0.0.1:0";
    HttpServer::Hooks hooks;
    hooks.check_head = [this](const HttpRequest& req) -> std::optional<HttpAnswer> {
      ++heads;
      if (req.Header("X-Refuse") != nullptr) return HttpAnswer{.status = 401, .body = "refused"};
      return std::nullopt;
    };
    hooks.quick = [](const HttpRequest& req) { return req.path == "/quick"; };
    hooks.handle = [this, handler](const HttpRequest& req, HttpResponder& res) {
      ++handled;
      if (handler && req.path != "/quick") return handler(req, res);
      res.Reply(HttpAnswer{.status = 200, .content_type = "text/plain", .body = req.path + ":" + req.body});
    };
    hooks.error = [](int status, std::string_view message) {
      return HttpAnswer{.status = status, .content_type = "text/plain", .body = std::string(message)};
    };
    auto started = HttpServer::Start(o, std::move(hooks));
    EXPECT_TRUE(started.ok()) << started.status().ToString();
    if (!started.ok()) return;
    server = std::move(*started);
    port = std::stoi(server->address().substr(server->address().rfind(':') + 1));
  }
  ~TestServer() {
    if (server) server->Shutdown();
  }
  std::unique_ptr<HttpServer> server;
  int port = 0;
  std::atomic<int> heads{0}, handled{0};
};

std::string Get(const std::string& path) { return "GET " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"; }
std::string Post(const std::string& path, const std::string& body, const std::string& extra = "") {
  return "POST " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\n" + extra +
         "Content-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body;
}
std::string RandomText(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::string s(n, 'a');
  for (char& c : s) c = static_cast<char>('a' + rng() % 26);
  return s;
}

// ---- Size limits ---------------------------------------------------------------------

TEST(HttpServer, ChunkedBodyBeyondTheLimitIs413WithoutReadingIt) {
  HttpServerOptions o;
  o.max_body_bytes = 64 << 10;
  TestServer s(o);
  RawClient c(s.port);
  ASSERT_TRUE(c.Send("POST /x HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\n"));
  // 64 MiB offered in 16 KiB chunks; the server answers after 64 KiB.
  const std::string chunk = RandomText(16 << 10, 1);
  size_t sent = 0;
  std::thread writer([&] {
    for (int i = 0; i < 4096; ++i) {
      char size[16];
      std::snprintf(size, sizeof size, "%zx\r\n", chunk.size());
      if (!c.Send(size + chunk + "\r\n")) break;
      sent += chunk.size();
    }
  });
  const std::string answer = c.ReadAnswer(10000ms);
  writer.join();
  EXPECT_EQ(StatusOf(answer), 413) << answer;
  EXPECT_NE(answer.find("Connection: close"), std::string::npos);
  EXPECT_LT(sent, size_t{32} << 20) << "the server read the whole body";
  EXPECT_EQ(s.handled.load(), 0);
}

TEST(HttpServer, AContentLengthBeyondTheLimitIs413BeforeTheBody) {
  HttpServerOptions o;
  o.max_body_bytes = 64 << 10;
  TestServer s(o);
  RawClient c(s.port);
  ASSERT_TRUE(c.Send("POST /x HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 300000000\r\n\r\nabc"));
  EXPECT_EQ(StatusOf(c.ReadAnswer(3000ms)), 413);
}

TEST(HttpServer, ARefusedHeadIsAnsweredBeforeItsBodyArrives) {
  TestServer s;
  RawClient c(s.port);
  // A 20 MB body announced (within the limit), 1 KiB sent: the refusal does
  // not wait for it.
  ASSERT_TRUE(c.Send("POST /x HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Refuse: 1\r\nContent-Length: 20000000\r\n\r\n" +
                     RandomText(1024, 2)));
  const auto start = Clock::now();
  const std::string answer = c.ReadAnswer(3000ms);
  EXPECT_EQ(StatusOf(answer), 401) << answer;
  EXPECT_LT(Clock::now() - start, 2s);
  EXPECT_EQ(s.handled.load(), 0);
}

TEST(HttpServer, ChunkedRefusedHeadIsAnsweredToo) {
  TestServer s;
  RawClient c(s.port);
  ASSERT_TRUE(c.Send("POST /x HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Refuse: 1\r\nTransfer-Encoding: chunked\r\n\r\n400\r\n" +
                     RandomText(1024, 3) + "\r\n"));
  EXPECT_EQ(StatusOf(c.ReadAnswer(3000ms)), 401);
}

TEST(HttpServer, HeadersBeyondTheLimitAre431) {
  HttpServerOptions o;
  o.max_header_bytes = 16 << 10;
  o.max_header_fields = 32;
  TestServer s(o);
  {  // one long line
    RawClient c(s.port);
    c.Send("GET /x HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Long: " + RandomText(200 << 10, 4) + "\r\n\r\n");
    EXPECT_EQ(StatusOf(c.ReadAnswer()), 431);
  }
  {  // many short fields, each small
    RawClient c(s.port);
    std::string req = "GET /x HTTP/1.1\r\nHost: 127.0.0.1\r\n";
    for (int i = 0; i < 40; ++i) req += "X-F" + std::to_string(i) + ": " + RandomText(8, 5 + i) + "\r\n";
    c.Send(req + "\r\n");
    EXPECT_EQ(StatusOf(c.ReadAnswer()), 431);
  }
  {  // within both: answered
    RawClient c(s.port);
    c.Send(Get("/fine"));
    EXPECT_EQ(StatusOf(c.ReadAnswer()), 200);
  }
  EXPECT_EQ(s.handled.load(), 1);
}

// ---- Deadlines and slow clients ----------------------------------------------------------

TEST(HttpServer, AHeaderTrickledByteByByteIs408AtItsDeadline) {
  HttpServerOptions o;
  o.header_timeout_s = 1;
  TestServer s(o);
  RawClient c(s.port);
  const std::string req = "GET /x HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + RandomText(200, 6) + "\r\n\r\n";
  const auto start = Clock::now();
  std::atomic<bool> stop{false};
  std::thread trickle([&] {
    for (char ch : req) {
      if (stop || !c.Send(std::string(1, ch))) return;
      std::this_thread::sleep_for(50ms);  // each byte well within any per-read timeout
    }
  });
  const std::string answer = c.ReadAnswer(5000ms);
  stop = true;
  trickle.join();
  EXPECT_EQ(StatusOf(answer), 408) << answer;
  EXPECT_LT(Clock::now() - start, 3s);
}

TEST(HttpServer, ASlowBodyIs408AtItsDeadline) {
  HttpServerOptions o;
  o.body_timeout_s = 1;
  TestServer s(o);
  RawClient c(s.port);
  ASSERT_TRUE(c.Send("POST /x HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 1000\r\n\r\nab"));
  EXPECT_EQ(StatusOf(c.ReadAnswer(4000ms)), 408);
}

TEST(HttpServer, SlowClientsTakeNoHandlerThread) {
  HttpServerOptions o;
  o.handler_threads = 4;
  o.header_timeout_s = 30;
  o.keep_alive_timeout_s = 30;
  TestServer s(o);
  // More slow clients than handler threads, each with half a header.
  std::vector<std::unique_ptr<RawClient>> slow;
  for (int i = 0; i < 200; ++i) {
    slow.push_back(std::make_unique<RawClient>(s.port));
    slow.back()->Send("POST /x HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Half: ");
  }
  for (const char* path : {"/quick", "/handled"}) {
    RawClient c(s.port);
    const auto start = Clock::now();
    c.Send(Get(path));
    const std::string answer = c.ReadAnswer(3000ms);
    EXPECT_EQ(StatusOf(answer), 200) << path;
    EXPECT_LT(Clock::now() - start, 1s) << path;
  }
  EXPECT_GE(s.server->open_connections(), 200);
}

TEST(HttpServer, BusyHandlersAre503WithRetryAfter) {
  HttpServerOptions o;
  o.handler_threads = 1;
  std::mutex mu;
  std::condition_variable cv;
  bool release = false;
  TestServer s(o, [&](const HttpRequest&, HttpResponder& res) {
    std::unique_lock lock(mu);
    cv.wait(lock, [&] { return release; });
    res.Reply(HttpAnswer{.status = 200, .body = "late"});
  });
  RawClient first(s.port);
  first.Send(Get("/slow"));
  while (s.handled.load() == 0) std::this_thread::sleep_for(5ms);
  RawClient second(s.port);
  second.Send(Get("/slow"));
  const std::string answer = second.ReadAnswer();
  EXPECT_EQ(StatusOf(answer), 503) << answer;
  EXPECT_NE(answer.find("Retry-After: 1"), std::string::npos) << answer;
  {
    std::lock_guard lock(mu);
    release = true;
  }
  cv.notify_all();
  EXPECT_EQ(BodyOf(first.ReadAnswer()), "late");
}

TEST(HttpServer, ConnectionsBeyondTheLimitAre503) {
  HttpServerOptions o;
  o.max_connections = 3;
  o.keep_alive_timeout_s = 30;
  TestServer s(o);
  std::vector<std::unique_ptr<RawClient>> held;
  for (int i = 0; i < 3; ++i) held.push_back(std::make_unique<RawClient>(s.port));
  while (s.server->open_connections() < 3) std::this_thread::sleep_for(5ms);
  RawClient extra(s.port);
  extra.Send(Get("/x"));
  const std::string answer = extra.ReadAnswer();
  EXPECT_EQ(StatusOf(answer), 503) << answer;
  EXPECT_NE(answer.find("Retry-After"), std::string::npos);
  held.clear();
  while (s.server->open_connections() > 0) std::this_thread::sleep_for(5ms);
  RawClient after(s.port);
  after.Send(Get("/x"));
  EXPECT_EQ(StatusOf(after.ReadAnswer()), 200);
}

// ---- Keep-alive, pipelining, closes ----------------------------------------------------

TEST(HttpServer, PipelinedRequestsAreAnsweredInOrder) {
  TestServer s;
  RawClient c(s.port);
  const std::string a = RandomText(100, 7), b = RandomText(3000, 8);
  ASSERT_TRUE(c.Send(Post("/one", a) + Post("/two", b) + Get("/quick")));
  const std::string first = c.ReadAnswer(), second = c.ReadAnswer(), third = c.ReadAnswer();
  EXPECT_EQ(BodyOf(first), "/one:" + a);
  EXPECT_EQ(BodyOf(second), "/two:" + b);
  EXPECT_EQ(BodyOf(third), "/quick:");
}

TEST(HttpServer, AHalfClosedClientIsAnswered) {
  std::atomic<bool> saw_gone{false};
  TestServer s({}, [&](const HttpRequest&, HttpResponder& res) {
    for (int i = 0; i < 20; ++i) {
      if (res.Gone()) saw_gone = true;
      std::this_thread::sleep_for(20ms);
    }
    res.Reply(HttpAnswer{.status = 200, .body = "still here"});
  });
  RawClient c(s.port);
  c.Send(Post("/x", "{}"));
  c.ShutWrite();
  const std::string answer = c.ReadAnswer();
  EXPECT_EQ(StatusOf(answer), 200) << answer;
  EXPECT_EQ(BodyOf(answer), "still here");
  EXPECT_FALSE(saw_gone.load());
}

TEST(HttpServer, AClientThatClosesIsGone) {
  std::atomic<bool> gone{false};
  std::atomic<bool> done{false};
  TestServer s({}, [&](const HttpRequest&, HttpResponder& res) {
    for (int i = 0; i < 300 && !res.Gone(); ++i) std::this_thread::sleep_for(10ms);
    gone = res.Gone();
    done = true;
    res.Reply(HttpAnswer{.status = 200, .body = "nobody"});
  });
  {
    RawClient c(s.port);
    c.Send(Post("/x", "{}"));
    while (s.handled.load() == 0) std::this_thread::sleep_for(5ms);
  }
  while (!done) std::this_thread::sleep_for(10ms);
  EXPECT_TRUE(gone.load());
}

TEST(HttpServer, AStreamArrivesChunked) {
  TestServer s({}, [&](const HttpRequest&, HttpResponder& res) {
    res.StartStream(200, "text/event-stream", {{"Cache-Control", "no-cache"}});
    for (int i = 0; i < 5; ++i) res.Write("data: " + std::to_string(i) + "\n\n");
    res.End();
  });
  RawClient c(s.port);
  c.Send(Get("/s"));
  const std::string all = c.ReadUntil([](const std::string& x) { return x.ends_with("0\r\n\r\n"); });
  EXPECT_NE(all.find("Transfer-Encoding: chunked"), std::string::npos);
  std::string body;
  for (size_t at = all.find("\r\n\r\n") + 4; at < all.size();) {
    const size_t eol = all.find("\r\n", at);
    const size_t n = std::stoul(all.substr(at, eol - at), nullptr, 16);
    if (n == 0) break;
    body += all.substr(eol + 2, n);
    at = eol + 2 + n + 2;
  }
  EXPECT_EQ(body, "data: 0\n\ndata: 1\n\ndata: 2\n\ndata: 3\n\ndata: 4\n\n");
}

TEST(HttpServer, APortInUseIsRefused) {
  TestServer first;
  HttpServerOptions o;
  o.listen = first.server->address();
  HttpServer::Hooks hooks;
  hooks.check_head = [](const HttpRequest&) { return std::optional<HttpAnswer>(); };
  hooks.quick = [](const HttpRequest&) { return true; };
  hooks.handle = [](const HttpRequest&, HttpResponder&) {};
  hooks.error = [](int status, std::string_view) { return HttpAnswer{.status = status}; };
  auto second = HttpServer::Start(o, std::move(hooks));
  EXPECT_FALSE(second.ok());
  if (!second.ok()) EXPECT_NE(second.status().message().find("cannot listen"), std::string::npos);
}

TEST(HttpServer, BadOptionsAreNamed) {
  HttpServer::Hooks hooks;
  hooks.check_head = [](const HttpRequest&) { return std::optional<HttpAnswer>(); };
  hooks.quick = [](const HttpRequest&) { return true; };
  hooks.handle = [](const HttpRequest&, HttpResponder&) {};
  hooks.error = [](int status, std::string_view) { return HttpAnswer{.status = status}; };
  HttpServerOptions o;
  o.listen = "127.0.0.1:0";
  o.header_timeout_s = 0;
  auto r = HttpServer::Start(o, hooks);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("http_header_timeout_s"), std::string::npos);
  o.header_timeout_s = 1;
  o.listen = "nohost";
  r = HttpServer::Start(o, hooks);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("HOST:PORT"), std::string::npos);
}

}  // namespace
}  // namespace mlarun
