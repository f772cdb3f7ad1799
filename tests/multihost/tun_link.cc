// A user-space network between the "hosts" of tests/multihost (network
// namespaces of one machine) that adds a fixed one-way delay and a line rate,
// for kernels without the netem qdisc (tc's tbf and htb shape the rate but
// cannot delay). One TUN device per host; every IPv4 packet a host sends into
// its device is handed to the device of the host that owns the destination
// address once the link model says it has arrived.
//
//   tun_link link [--delay-us D] [--rate-mbit R] [--dev NAME] [--ready FILE]
//                 [--queue-bytes Q] NETNS=ADDR...
//     Creates device NAME (default mltun0) in each namespace (a path such as
//     /run/netns/NS, or a name under /run/netns/) for the host whose address
//     is ADDR, writes FILE when all exist, and forwards until SIGTERM or
//     SIGINT; then prints per-link packets, bytes and drops to stderr. The
//     devices belong to this process: they disappear when it exits. The
//     caller gives them their addresses, MTU and the up state (ip -n NS ...).
//   tun_link serve ADDR PORT
//     A probe server on ADDR:PORT: per connection, echoes bytes (rtt) or
//     reads to EOF and answers the count and a hash (send).
//   tun_link rtt ADDR PORT COUNT
//     COUNT one-byte round trips on one TCP connection (TCP_NODELAY); prints
//     "rtt_us min=... median=... max=...".
//   tun_link send ADDR PORT BYTES
//     Sends BYTES of a pseudo-random pattern, checks the server's count and
//     hash; prints "send bytes=... seconds=... gbit_per_s=... intact". Exits
//     1 if the data did not arrive intact.
//
// The link model, per packet of S bytes from host a to host b at time t
// (rate R; an unlimited rate makes S/R zero):
//   leaves a:   tx_a = max(t, tx_a) + S/R     (a's NIC serializes its sends)
//   reaches b:  max(tx_a + delay, rx_b + S/R) (b's port takes one line rate
//                                              from all senders together)
// so one flow sees delay + S/R per packet and the rate as its throughput, and
// two hosts sending to a third share that host's line rate, as on a switch
// with one link per host. Arrival times at one host never decrease, so each
// destination's queue is a FIFO and there is no reordering. A destination
// queue holding more than --queue-bytes drops the packet (counted; TCP
// retransmits), which bounds memory when a sender outruns the rate.
//
// Single-threaded: ppoll over the devices with a nanosecond timeout until
// the earliest due packet, and a 1 ns timer slack so the kernel does not
// round the wake-ups up by its default 50 us.
#include <arpa/inet.h>
#include <fcntl.h>
#include <linux/if.h>
#include <linux/if_tun.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <string>
#include <vector>

namespace {

[[noreturn]] void Die(const std::string& what) {
  std::fprintf(stderr, "tun_link: %s%s%s\n", what.c_str(), errno ? ": " : "", errno ? std::strerror(errno) : "");
  std::exit(2);
}

int64_t NowNs() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t{ts.tv_sec} * 1000000000 + ts.tv_nsec;
}

int64_t ParseInt(const char* s, const char* what) {
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(s, &end, 10);
  if (errno || end == s || *end || v < 0) {
    errno = 0;
    Die(std::string("bad ") + what + " '" + s + "'");
  }
  return v;
}

in_addr ParseAddr(const std::string& s) {
  in_addr a;
  if (inet_pton(AF_INET, s.c_str(), &a) != 1) {
    errno = 0;
    Die("bad IPv4 address '" + s + "'");
  }
  return a;
}

// ---- link ----------------------------------------------------------------

struct Packet {
  int64_t due_ns;
  int src;
  std::vector<uint8_t> data;
};

struct Host {
  std::string netns;
  uint32_t addr;  // network order
  int fd = -1;
  int64_t tx_free_ns = 0;    // when its NIC has sent everything it was given
  int64_t rx_free_ns = 0;    // when its port has delivered the last arrival
  std::deque<Packet> queue;  // arriving here, in due order
  int64_t queued_bytes = 0;
};

struct LinkCount {
  int64_t packets = 0, bytes = 0, drops = 0;
};

volatile sig_atomic_t g_stop = 0;
void OnSignal(int) { g_stop = 1; }

// A TUN device NAME in the network namespace at `netns`, created from inside
// it (a device belongs to the namespace /dev/net/tun was opened in); the
// process returns to its own namespace before the next.
int OpenTunIn(const std::string& netns, const std::string& name) {
  const int self = open("/proc/self/ns/net", O_RDONLY | O_CLOEXEC);
  if (self < 0) Die("open /proc/self/ns/net");
  const int ns = open(netns.c_str(), O_RDONLY | O_CLOEXEC);
  if (ns < 0) Die("open namespace " + netns);
  if (setns(ns, CLONE_NEWNET) != 0) Die("setns " + netns);
  const int fd = open("/dev/net/tun", O_RDWR | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) Die("open /dev/net/tun");
  ifreq ifr{};
  ifr.ifr_flags = IFF_TUN | IFF_NO_PI;
  std::snprintf(ifr.ifr_name, IFNAMSIZ, "%s", name.c_str());
  if (ioctl(fd, TUNSETIFF, &ifr) != 0) Die("create TUN device " + name + " in " + netns);
  if (setns(self, CLONE_NEWNET) != 0) Die("setns back to this process's namespace");
  close(ns);
  close(self);
  return fd;
}

int RunLink(int argc, char** argv) {
  int64_t delay_ns = 0, rate_mbit = 0, queue_bytes = int64_t{32} << 20;
  std::string dev = "mltun0", ready;
  std::vector<Host> hosts;
  for (int i = 0; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&](const char* flag) -> const char* {
      if (i + 1 >= argc) {
        errno = 0;
        Die(std::string(flag) + " needs a value");
      }
      return argv[++i];
    };
    if (a == "--delay-us") {
      delay_ns = ParseInt(value("--delay-us"), "--delay-us") * 1000;
    } else if (a == "--rate-mbit") {
      rate_mbit = ParseInt(value("--rate-mbit"), "--rate-mbit");
    } else if (a == "--queue-bytes") {
      queue_bytes = ParseInt(value("--queue-bytes"), "--queue-bytes");
    } else if (a == "--dev") {
      dev = value("--dev");
    } else if (a == "--ready") {
      ready = value("--ready");
    } else if (const size_t eq = a.find('='); a[0] != '-' && eq != std::string::npos) {
      Host h;
      h.netns = a.substr(0, eq);
      if (h.netns.find('/') == std::string::npos) h.netns = "/run/netns/" + h.netns;
      h.addr = ParseAddr(a.substr(eq + 1)).s_addr;
      hosts.push_back(std::move(h));
    } else {
      errno = 0;
      Die("unknown argument '" + a +
          "' (tun_link link [--delay-us D] [--rate-mbit R] [--dev NAME] "
          "[--ready FILE] [--queue-bytes Q] NETNS=ADDR...)");
    }
  }
  if (hosts.size() < 2) {
    errno = 0;
    Die("link needs at least two NETNS=ADDR hosts");
  }
  // Signals are blocked except inside ppoll, so a SIGTERM between two checks
  // of g_stop is not lost.
  sigset_t block, wait_mask;
  sigemptyset(&block);
  sigaddset(&block, SIGTERM);
  sigaddset(&block, SIGINT);
  sigprocmask(SIG_BLOCK, &block, &wait_mask);
  sigdelset(&wait_mask, SIGTERM);
  sigdelset(&wait_mask, SIGINT);
  struct sigaction sa {};
  sa.sa_handler = OnSignal;
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGINT, &sa, nullptr);
  prctl(PR_SET_TIMERSLACK, 1UL, 0, 0, 0);

  for (Host& h : hosts) h.fd = OpenTunIn(h.netns, dev);
  if (!ready.empty()) {
    FILE* f = std::fopen(ready.c_str(), "w");
    if (!f) Die("write " + ready);
    std::fprintf(f, "%d\n", static_cast<int>(getpid()));
    std::fclose(f);
  }

  const size_t n = hosts.size();
  std::vector<LinkCount> counts(n * n);
  int64_t unroutable = 0;
  // Nanoseconds to put S bytes on the line: S * 8 / (R * 1e6) s.
  auto wire_ns = [&](size_t bytes) -> int64_t {
    return rate_mbit > 0 ? static_cast<int64_t>(bytes) * 8000 / rate_mbit : 0;
  };
  std::vector<std::vector<uint8_t>> spare;  // buffers of delivered packets, reused
  std::vector<pollfd> fds(n);
  for (size_t i = 0; i < n; ++i) fds[i] = {hosts[i].fd, POLLIN, 0};

  while (!g_stop) {
    // Deliver what is due, then sleep until the next due packet or a read.
    int64_t now = NowNs(), next = -1;
    for (Host& h : hosts) {
      while (!h.queue.empty() && h.queue.front().due_ns <= now) {
        Packet& p = h.queue.front();
        // A TUN write hands the packet to the namespace's stack at once; an
        // error (the device went down) only loses this packet.
        if (write(h.fd, p.data.data(), p.data.size()) < 0 && errno != EAGAIN && errno != EIO) Die("write to TUN");
        h.queued_bytes -= static_cast<int64_t>(p.data.size());
        spare.push_back(std::move(p.data));
        h.queue.pop_front();
      }
      if (!h.queue.empty() && (next < 0 || h.queue.front().due_ns < next)) next = h.queue.front().due_ns;
    }
    timespec timeout{}, *tp = nullptr;
    if (next >= 0) {
      const int64_t wait = std::max<int64_t>(0, next - now);
      timeout = {static_cast<time_t>(wait / 1000000000), static_cast<long>(wait % 1000000000)};
      tp = &timeout;
    }
    const int ready_fds = ppoll(fds.data(), n, tp, &wait_mask);
    if (ready_fds < 0) {
      if (errno == EINTR) continue;
      Die("ppoll");
    }
    if (ready_fds == 0) continue;
    now = NowNs();
    for (size_t s = 0; s < n; ++s) {
      if (!(fds[s].revents & POLLIN)) continue;
      // A bounded number per wake, so one busy sender cannot starve delivery.
      for (int k = 0; k < 64; ++k) {
        std::vector<uint8_t> buf;
        if (!spare.empty()) {
          buf = std::move(spare.back());
          spare.pop_back();
        }
        buf.resize(65536);
        const ssize_t got = read(hosts[s].fd, buf.data(), buf.size());
        if (got < 0) {
          if (errno == EAGAIN) {
            spare.push_back(std::move(buf));
            break;
          }
          Die("read from TUN");
        }
        buf.resize(static_cast<size_t>(got));
        // IPv4 only (the devices also emit IPv6 router solicitations).
        if (got < 20 || (buf[0] >> 4) != 4) {
          ++unroutable;
          spare.push_back(std::move(buf));
          continue;
        }
        uint32_t dst_addr;
        std::memcpy(&dst_addr, buf.data() + 16, 4);
        size_t d = 0;
        while (d < n && hosts[d].addr != dst_addr) ++d;
        if (d == n || d == s) {
          ++unroutable;
          spare.push_back(std::move(buf));
          continue;
        }
        Host &src = hosts[s], &dst = hosts[d];
        LinkCount& c = counts[s * n + d];
        if (dst.queued_bytes + got > queue_bytes) {
          ++c.drops;
          spare.push_back(std::move(buf));
          continue;
        }
        const int64_t w = wire_ns(static_cast<size_t>(got));
        src.tx_free_ns = std::max(now, src.tx_free_ns) + w;
        const int64_t due = std::max(src.tx_free_ns + delay_ns, dst.rx_free_ns + w);
        dst.rx_free_ns = due;
        ++c.packets;
        c.bytes += got;
        dst.queued_bytes += got;
        dst.queue.push_back(Packet{due, static_cast<int>(s), std::move(buf)});
      }
    }
  }
  for (size_t s = 0; s < n; ++s)
    for (size_t d = 0; d < n; ++d) {
      const LinkCount& c = counts[s * n + d];
      if (s != d && (c.packets || c.drops))
        std::fprintf(stderr, "tun_link: %s -> %s: %" PRId64 " packets, %" PRId64 " bytes, %" PRId64 " dropped\n",
                     hosts[s].netns.c_str(), hosts[d].netns.c_str(), c.packets, c.bytes, c.drops);
    }
  std::fprintf(stderr, "tun_link: %" PRId64 " packets not forwarded (not IPv4 or no such host)\n", unroutable);
  return 0;
}

// ---- probes ----------------------------------------------------------------

sockaddr_in SockAddr(const char* addr, const char* port) {
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_addr = ParseAddr(addr);
  sa.sin_port = htons(static_cast<uint16_t>(ParseInt(port, "port")));
  return sa;
}

bool WriteAll(int fd, const void* p, size_t n) {
  const char* c = static_cast<const char*>(p);
  while (n > 0) {
    const ssize_t w = write(fd, c, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    c += w, n -= static_cast<size_t>(w);
  }
  return true;
}

bool ReadAll(int fd, void* p, size_t n) {
  char* c = static_cast<char*>(p);
  while (n > 0) {
    const ssize_t r = read(fd, c, n);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    c += r, n -= static_cast<size_t>(r);
  }
  return true;
}

// The check of a transfer: a multiply-xor hash over the stream's 8-byte
// words (the tail zero-padded), cheap enough not to be what limits a
// multi-Gbit/s probe. Reads end anywhere; a partial word waits for the next.
class StreamHash {
 public:
  void Add(const uint8_t* p, size_t n) {
    for (; n > 0 && fill_ > 0; --n) Take(*p++);
    for (; n >= 8; p += 8, n -= 8) Mix(p);
    for (; n > 0; --n) Take(*p++);
  }
  uint64_t Finish() {
    if (fill_ > 0) {
      std::memset(part_ + fill_, 0, 8 - fill_);
      Mix(part_);
      fill_ = 0;
    }
    return h_;
  }

 private:
  void Mix(const uint8_t* p) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    h_ = (h_ ^ w) * 0x9E3779B97F4A7C15ull;
    h_ ^= h_ >> 29;
  }
  void Take(uint8_t b) {
    part_[fill_ & 7] = b;
    if (++fill_ == 8) Mix(part_), fill_ = 0;
  }
  uint64_t h_ = 1469598103934665603ull;
  uint8_t part_[8] = {};
  size_t fill_ = 0;
};

int Connect(const char* addr, const char* port) {
  const sockaddr_in sa = SockAddr(addr, port);
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) Die("socket");
  if (connect(fd, reinterpret_cast<const sockaddr*>(&sa), sizeof sa) != 0)
    Die(std::string("connect to ") + addr + ":" + port);
  const int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  return fd;
}

int RunServe(const char* addr, const char* port) {
  const sockaddr_in sa = SockAddr(addr, port);
  const int ls = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  const int one = 1;
  setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (bind(ls, reinterpret_cast<const sockaddr*>(&sa), sizeof sa) != 0 || listen(ls, 8) != 0)
    Die(std::string("listen on ") + addr + ":" + port);
  std::vector<uint8_t> buf(1 << 20);
  for (;;) {
    const int fd = accept4(ls, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    char mode = 0;
    if (ReadAll(fd, &mode, 1)) {
      if (mode == 'e') {
        for (ssize_t r; (r = read(fd, buf.data(), buf.size())) > 0;)
          if (!WriteAll(fd, buf.data(), static_cast<size_t>(r))) break;
      } else if (mode == 's') {
        StreamHash hash;
        uint64_t count = 0;
        for (ssize_t r; (r = read(fd, buf.data(), buf.size())) > 0;) {
          hash.Add(buf.data(), static_cast<size_t>(r));
          count += static_cast<uint64_t>(r);
        }
        const uint64_t answer[2] = {count, hash.Finish()};
        WriteAll(fd, answer, sizeof answer);
      }
    }
    close(fd);
  }
}

int RunRtt(const char* addr, const char* port, const char* count_s) {
  const int64_t count = ParseInt(count_s, "COUNT");
  if (count < 1) {
    errno = 0;
    Die("COUNT must be at least 1");
  }
  const int fd = Connect(addr, port);
  if (!WriteAll(fd, "e", 1)) Die("write");
  std::vector<double> us;
  for (int64_t i = 0; i < count; ++i) {
    const char b = 'x';
    char back = 0;
    const int64_t t0 = NowNs();
    if (!WriteAll(fd, &b, 1) || !ReadAll(fd, &back, 1) || back != b) Die("echo");
    us.push_back(static_cast<double>(NowNs() - t0) / 1e3);
  }
  close(fd);
  std::sort(us.begin(), us.end());
  std::printf("rtt_us min=%.1f median=%.1f max=%.1f count=%" PRId64 "\n", us.front(), us[us.size() / 2], us.back(),
              count);
  return 0;
}

int RunSend(const char* addr, const char* port, const char* bytes_s) {
  const int64_t bytes = ParseInt(bytes_s, "BYTES");
  const int64_t t0 = NowNs();
  const int fd = Connect(addr, port);
  if (!WriteAll(fd, "s", 1)) Die("write");
  std::vector<uint8_t> buf(1 << 20);
  StreamHash hash;
  // xorshift64 words, a new one for every 8 bytes sent: data no link could
  // compress or fake, made at several GB/s.
  uint64_t x = 88172645463325252ull;
  for (int64_t left = bytes; left > 0;) {
    const size_t n = static_cast<size_t>(std::min<int64_t>(left, static_cast<int64_t>(buf.size())));
    for (size_t i = 0; i < n; i += 8) {
      x ^= x << 13, x ^= x >> 7, x ^= x << 17;
      std::memcpy(buf.data() + i, &x, std::min<size_t>(8, n - i));
    }
    hash.Add(buf.data(), n);
    if (!WriteAll(fd, buf.data(), n)) Die("send");
    left -= static_cast<int64_t>(n);
  }
  shutdown(fd, SHUT_WR);
  uint64_t answer[2];
  if (!ReadAll(fd, answer, sizeof answer)) Die("no answer from the server");
  const double s = static_cast<double>(NowNs() - t0) / 1e9;
  close(fd);
  const uint64_t sent_hash = hash.Finish();
  const bool intact = answer[0] == static_cast<uint64_t>(bytes) && answer[1] == sent_hash;
  std::printf("send bytes=%" PRId64 " seconds=%.4f gbit_per_s=%.3f %s\n", bytes, s,
              static_cast<double>(bytes) * 8 / s / 1e9, intact ? "intact" : "CORRUPTED");
  if (!intact)
    std::fprintf(stderr, "tun_link: the server received %" PRIu64 " bytes (sent %" PRId64 "), hash %s\n", answer[0],
                 bytes, answer[1] == sent_hash ? "equal" : "different");
  return intact ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string cmd = argc > 1 ? argv[1] : "";
  if (cmd == "link") return RunLink(argc - 2, argv + 2);
  if (cmd == "serve" && argc == 4) return RunServe(argv[2], argv[3]);
  if (cmd == "rtt" && argc == 5) return RunRtt(argv[2], argv[3], argv[4]);
  if (cmd == "send" && argc == 5) return RunSend(argv[2], argv[3], argv[4]);
  std::fprintf(stderr,
               "usage: tun_link link [--delay-us D] [--rate-mbit R] [--dev NAME] [--ready FILE] [--queue-bytes Q] "
               "NETNS=ADDR...\n"
               "       tun_link serve ADDR PORT | rtt ADDR PORT COUNT | send ADDR PORT BYTES\n");
  return 2;
}
