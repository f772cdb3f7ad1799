// transfer/block_transfer: two pools in one process, each with its own UCX
// context and worker, on both paths: kAny (peer failure handling, which in
// UCX 1.13 means TCP on the loopback) and kSharedMemory; the source's worker
// answers from a thread. The
// destination starts poisoned (every byte 0xff: NaN rows), so a block
// written that was not asked for, or one not written, shows; the source
// holds random bytes. Refusals change nothing; a source that never answers
// ends a fetch at its deadline.
#include "transfer/block_transfer.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <future>
#include <random>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

namespace mlarun {
namespace {

LatentCacheConfig Config(int64_t blocks, DType dtype = DType::kBF16, int64_t rope_dim = 16) {
  LatentCacheConfig c;
  c.num_layers = 3;
  c.kv_lora_rank = 32;
  c.rope_dim = rope_dim;
  c.block_size = 4;
  c.dtype = dtype;
  c.budget_bytes = blocks * c.block_bytes();
  return c;
}

std::unique_ptr<LatentPool> Pool(const LatentCacheConfig& c, DeviceMemory& memory = HostMemory()) {
  auto p = LatentPool::Create(c, memory);
  EXPECT_TRUE(p.ok()) << p.status();
  return p.ok() ? std::move(p).value() : nullptr;
}

// Bytes of block b of `layer`.
std::span<const std::byte> Block(const LatentPool& p, int64_t layer, int64_t b) {
  const int64_t n = p.config().block_bytes() / p.config().num_layers;
  return {static_cast<const std::byte*>(p.LayerData(layer)) + b * n, static_cast<size_t>(n)};
}

void FillRandom(LatentPool& p, uint32_t seed) {
  std::mt19937 rng(seed);
  auto* bytes = static_cast<uint8_t*>(p.LayerData(0));
  for (int64_t i = 0; i < p.bytes(); ++i) bytes[i] = static_cast<uint8_t>(rng());
}
void Poison(LatentPool& p) { std::memset(p.LayerData(0), 0xff, static_cast<size_t>(p.bytes())); }

bool Poisoned(std::span<const std::byte> b) {
  for (std::byte x : b)
    if (x != std::byte{0xff}) return false;
  return true;
}

// Sets an environment variable for one scope.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = getenv(name)) old_ = old, had_ = true;
    setenv(name, value, 1);
  }
  ~ScopedEnv() { had_ ? setenv(name_, old_.c_str(), 1) : unsetenv(name_); }

 private:
  const char* name_;
  bool had_ = false;
  std::string old_;
};

// Answers the source's side of the gets from a thread while it lives:
// polling Progress, or (`wake`) sleeping between peers' messages
// (AnswerPeers), as a worker rank's agent does.
class Answering {
 public:
  explicit Answering(BlockTransfer& t, bool wake = false)
      : thread_([this, &t, wake] {
          while (!stop_.load()) {
            ++rounds_;
            if (wake) {
              t.AnswerPeers(std::chrono::milliseconds(50));
            } else {
              t.Progress();
            }
          }
        }) {}
  ~Answering() {
    stop_.store(true);
    thread_.join();
  }
  int64_t rounds() const { return rounds_.load(); }

 private:
  std::atomic<bool> stop_{false};
  std::atomic<int64_t> rounds_{0};
  std::thread thread_;
};

// Fetches a set of blocks (runs and single blocks, out of order) from a
// 40-block pool into a 25-block one and checks every block of every layer:
// the named ones equal their source, the others still poisoned.
void FetchAndCheck(DType dtype, TransferPath path, bool ucx_memory = false, bool wake = false) {
  SCOPED_TRACE(std::string(DTypeName(dtype)) + (path == TransferPath::kAny ? " any" : " shared memory") +
               (ucx_memory ? ", pools in TransferMemory" : "") + (wake ? ", the source woken" : ""));
  std::unique_ptr<TransferMemory> src_mem, dst_mem;
  if (ucx_memory) {
    auto s = TransferMemory::Create({.path = path}), d = TransferMemory::Create({.path = path});
    ASSERT_TRUE(s.ok() && d.ok()) << s.status() << d.status();
    src_mem = std::move(s).value(), dst_mem = std::move(d).value();
  }
  auto src_pool = ucx_memory ? Pool(Config(40, dtype), *src_mem) : Pool(Config(40, dtype));
  auto dst_pool = ucx_memory ? Pool(Config(25, dtype), *dst_mem) : Pool(Config(25, dtype));
  ASSERT_TRUE(src_pool && dst_pool);
  FillRandom(*src_pool, 7);
  Poison(*dst_pool);
  auto src = BlockTransfer::Create(*src_pool, {.path = path}, src_mem.get());
  auto dst = BlockTransfer::Create(*dst_pool, {.path = path}, dst_mem.get());
  ASSERT_TRUE(src.ok()) << src.status();
  ASSERT_TRUE(dst.ok()) << dst.status();
  const std::vector<int32_t> from = {7, 8, 9, 3, 20, 21, 39}, to = {0, 1, 2, 10, 11, 12, 24};
  {
    Answering answer(**src, wake);
    auto peer = (*dst)->Connect((*src)->Descriptor());
    ASSERT_TRUE(peer.ok()) << peer.status();
    const Status st = (*dst)->Fetch(*peer, from, to);
    ASSERT_TRUE(st.ok()) << st;
    if (wake) {
      // Idle now: the source sleeps until its 50 ms waits run out, instead
      // of polling (which makes millions of rounds in the same time, as it
      // does where the transports cannot wake it).
      const int64_t before = answer.rounds();
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      EXPECT_LE(answer.rounds() - before, 20) << "the source polled while nothing came";
    }
  }
  for (int64_t layer = 0; layer < 3; ++layer)
    for (int64_t b = 0; b < 25; ++b) {
      const auto it = std::find(to.begin(), to.end(), b);
      const auto got = Block(*dst_pool, layer, b);
      if (it == to.end()) {
        EXPECT_TRUE(Poisoned(got)) << "layer " << layer << " block " << b << " was written";
      } else {
        const auto want = Block(*src_pool, layer, from[static_cast<size_t>(it - to.begin())]);
        EXPECT_EQ(std::memcmp(got.data(), want.data(), got.size()), 0) << "layer " << layer << " block " << b;
      }
    }
  const BlockTransferStats& s = (*dst)->stats();
  EXPECT_EQ(s.fetches, 1);
  EXPECT_EQ(s.blocks, 7);
  EXPECT_EQ(s.bytes, 7 * dst_pool->config().block_bytes());
  EXPECT_EQ(s.gets, 4 * 3);  // runs 7-9, 3, 20-21, 39; three layers
  EXPECT_EQ(s.failures, 0);
}

TEST(BlockTransfer, FetchCopiesEveryLayerOfTheNamedBlocks) {
  for (TransferPath path : {TransferPath::kAny, TransferPath::kSharedMemory}) {
    FetchAndCheck(DType::kBF16, path);
    FetchAndCheck(DType::kF32, path);
  }
}

// Pools whose memory UCX allocated (TransferMemory), on both paths.
TEST(BlockTransfer, PoolsInTransferMemory) {
  for (TransferPath path : {TransferPath::kAny, TransferPath::kSharedMemory}) FetchAndCheck(DType::kBF16, path, true);
}

// A BlockTransfer over a TransferMemory serves only that memory's pools, on
// its path.
TEST(BlockTransfer, TransferMemoryMustHoldThePool) {
  auto mem = TransferMemory::Create({.path = TransferPath::kSharedMemory});
  ASSERT_TRUE(mem.ok()) << mem.status();
  auto in_mem = Pool(Config(4), **mem), elsewhere = Pool(Config(4));
  ASSERT_TRUE(in_mem && elsewhere);
  const auto other = BlockTransfer::Create(*elsewhere, {.path = TransferPath::kSharedMemory}, mem->get());
  EXPECT_EQ(other.status().code(), StatusCode::kInvalidArgument) << other.status();
  EXPECT_NE(other.status().message().find("not an allocation of this TransferMemory"), std::string::npos);
  const auto path = BlockTransfer::Create(*in_mem, {.path = TransferPath::kAny}, mem->get());
  EXPECT_EQ(path.status().code(), StatusCode::kInvalidArgument) << path.status();
  EXPECT_TRUE(BlockTransfer::Create(*in_mem, {.path = TransferPath::kSharedMemory}, mem->get()).ok());
}

TEST(BlockTransfer, FetchOverTcp) {
  ScopedEnv tls("UCX_TLS", "tcp");
  FetchAndCheck(DType::kBF16, TransferPath::kAny);
}

// A source that sleeps on its worker's event fd between peers' messages
// (AnswerPeers) answers every get over TCP, and stays asleep while no peer
// sends anything.
TEST(BlockTransfer, ASourceWokenByItsPeersAnswersEveryGet) {
  ScopedEnv tls("UCX_TLS", "tcp");
  FetchAndCheck(DType::kBF16, TransferPath::kAny, /*ucx_memory=*/false, /*wake=*/true);
  FetchAndCheck(DType::kF32, TransferPath::kAny, /*ucx_memory=*/true, /*wake=*/true);
}

// kSharedMemory connects only once the source answers: a source that never
// progresses makes Connect fail at its timeout, and nothing hangs.
TEST(BlockTransfer, SharedMemoryConnectWaitsForTheSource) {
  auto src_pool = Pool(Config(4)), dst_pool = Pool(Config(4));
  ASSERT_TRUE(src_pool && dst_pool);
  auto src = BlockTransfer::Create(*src_pool, {.path = TransferPath::kSharedMemory});
  auto dst = BlockTransfer::Create(
      *dst_pool, {.path = TransferPath::kSharedMemory, .connect_timeout = std::chrono::milliseconds(200)});
  ASSERT_TRUE(src.ok() && dst.ok());
  auto peer = (*dst)->Connect((*src)->Descriptor());
  if (peer.ok()) GTEST_SKIP() << "this UCX connects shared memory without the source's worker";
  EXPECT_EQ(peer.status().code(), StatusCode::kDeadlineExceeded) << peer.status();
  EXPECT_NE(peer.status().message().find("did not answer within 200 ms"), std::string::npos) << peer.status();
}

TEST(BlockTransfer, RefusalsNameTheProblemAndWriteNothing) {
  auto src_pool = Pool(Config(10)), dst_pool = Pool(Config(6));
  auto other_rope = Pool(Config(10, DType::kBF16, 8)), other_dtype = Pool(Config(10, DType::kF32));
  ASSERT_TRUE(src_pool && dst_pool && other_rope && other_dtype);
  FillRandom(*src_pool, 9);
  Poison(*dst_pool);
  auto src = BlockTransfer::Create(*src_pool), dst = BlockTransfer::Create(*dst_pool);
  auto rope = BlockTransfer::Create(*other_rope), dtype = BlockTransfer::Create(*other_dtype);
  ASSERT_TRUE(src.ok() && dst.ok() && rope.ok() && dtype.ok());
  auto expect = [](const Status& st, StatusCode code, const std::string& text) {
    EXPECT_EQ(st.code(), code) << st;
    EXPECT_NE(st.message().find(text), std::string::npos) << st;
  };
  expect((*dst)->Connect((*rope)->Descriptor()).status(), StatusCode::kInvalidArgument, "rope_dim 8, this one 16");
  expect((*dst)->Connect((*dtype)->Descriptor()).status(), StatusCode::kInvalidArgument, "dtype");
  std::vector<std::byte> d = (*src)->Descriptor();
  expect((*dst)->Connect(std::span(d).first(10)).status(), StatusCode::kInvalidArgument, "shorter than its header");
  std::vector<std::byte> longer = d;
  longer.push_back(std::byte{0});
  expect((*dst)->Connect(longer).status(), StatusCode::kInvalidArgument, "its header says");
  std::vector<std::byte> garbage(d.size(), std::byte{0x5a});
  expect((*dst)->Connect(garbage).status(), StatusCode::kInvalidArgument, "not a block transfer descriptor");
  auto peer = (*dst)->Connect(d);
  ASSERT_TRUE(peer.ok()) << peer.status();
  const std::vector<int32_t> one = {1}, two = {1, 2}, out_src = {10}, out_dst = {6}, negative = {-1}, dup = {3, 3};
  expect((*dst)->Fetch(*peer, two, one), StatusCode::kInvalidArgument, "2 source blocks into 1");
  expect((*dst)->Fetch(*peer, out_src, one), StatusCode::kOutOfRange,
         "source block 10 (entry 0) outside the peer's 10");
  expect((*dst)->Fetch(*peer, one, out_dst), StatusCode::kOutOfRange, "destination block 6 (entry 0) outside this");
  expect((*dst)->Fetch(*peer, negative, one), StatusCode::kOutOfRange, "source block -1");
  expect((*dst)->Fetch(*peer, two, dup), StatusCode::kInvalidArgument, "destination block 3 named twice (entry 1)");
  expect((*dst)->Fetch(*peer + 1, one, one), StatusCode::kInvalidArgument, "no peer 1");
  EXPECT_TRUE(
      Poisoned({static_cast<const std::byte*>(dst_pool->LayerData(0)), static_cast<size_t>(dst_pool->bytes())}));
  EXPECT_EQ((*dst)->stats().gets, 0);
  // An empty fetch is no error and moves nothing.
  EXPECT_TRUE((*dst)->Fetch(*peer, {}, {}).ok());
}

// Over TCP the source's worker must answer: one that never progresses makes
// the fetch end at its deadline, the peer closed; a later fetch from it is
// refused until it connects again, which then works.
TEST(BlockTransfer, UnansweredFetchEndsAtItsDeadline) {
  ScopedEnv tls("UCX_TLS", "tcp");
  auto src_pool = Pool(Config(8)), dst_pool = Pool(Config(8));
  ASSERT_TRUE(src_pool && dst_pool);
  FillRandom(*src_pool, 11);
  Poison(*dst_pool);
  auto src = BlockTransfer::Create(*src_pool), dst = BlockTransfer::Create(*dst_pool);
  ASSERT_TRUE(src.ok() && dst.ok());
  auto peer = (*dst)->Connect((*src)->Descriptor());
  ASSERT_TRUE(peer.ok()) << peer.status();
  const std::vector<int32_t> blocks = {0, 1, 2};
  const auto t0 = std::chrono::steady_clock::now();
  const Status st = (*dst)->Fetch(*peer, blocks, blocks, std::chrono::milliseconds(300));
  const auto waited = std::chrono::steady_clock::now() - t0;
  EXPECT_EQ(st.code(), StatusCode::kDeadlineExceeded) << st;
  EXPECT_NE(st.message().find("took more than 300 ms"), std::string::npos) << st;
  EXPECT_GE(waited, std::chrono::milliseconds(300));
  EXPECT_LT(waited, std::chrono::seconds(20));
  EXPECT_EQ((*dst)->stats().failures, 1);
  const Status again = (*dst)->Fetch(*peer, blocks, blocks);
  EXPECT_EQ(again.code(), StatusCode::kUnavailable) << again;
  auto reconnected = (*dst)->Connect((*src)->Descriptor());
  ASSERT_TRUE(reconnected.ok()) << reconnected.status();
  Answering answer(**src);
  const Status ok = (*dst)->Fetch(*reconnected, blocks, blocks);
  ASSERT_TRUE(ok.ok()) << ok;
  for (int32_t b : blocks)
    EXPECT_EQ(std::memcmp(Block(*dst_pool, 2, b).data(), Block(*src_pool, 2, b).data(), Block(*src_pool, 2, b).size()),
              0);
}

// The source of FaultASourceKilledMidFetchEndsIt, in a process of its own
// (this binary again, started with MLARUN_TEST_SOURCE_FD): a 40-block pool
// of random bytes (seed 7), its descriptor written to that fd, then its
// worker answering until it is killed (at most a minute).
TEST(BlockTransferChild, Source) {
  const char* fd_text = getenv("MLARUN_TEST_SOURCE_FD");
  if (fd_text == nullptr) GTEST_SKIP() << "the source process of FaultASourceKilledMidFetchEndsIt";
  const int fd = atoi(fd_text);
  auto pool = Pool(Config(40));
  ASSERT_TRUE(pool);
  FillRandom(*pool, 7);
  auto t = BlockTransfer::Create(*pool);
  ASSERT_TRUE(t.ok()) << t.status();
  const std::vector<std::byte> d = (*t)->Descriptor();
  const uint64_t n = d.size();
  ASSERT_EQ(write(fd, &n, sizeof(n)), static_cast<ssize_t>(sizeof(n)));
  ASSERT_EQ(write(fd, d.data(), d.size()), static_cast<ssize_t>(d.size()));
  close(fd);
  const auto end = std::chrono::steady_clock::now() + std::chrono::minutes(1);
  while (std::chrono::steady_clock::now() < end) (*t)->Progress();
}

// A source rank killed while a fetch from it is under way, over TCP: the
// source process is stopped (SIGSTOP) with the fetch's gets sent, then
// killed. The fetch ends UNAVAILABLE (UCX's peer failure), long before its
// 20 s deadline, and returns only once no get can write into the pool;
// the peer is refused from then on. Blocks fetched before the kill are
// the source's.
TEST(BlockTransfer, FaultASourceKilledMidFetchEndsIt) {
  ScopedEnv tls("UCX_TLS", "tcp");
  int pipe_fds[2];
  ASSERT_EQ(pipe(pipe_fds), 0);
  const std::string fd_env = "MLARUN_TEST_SOURCE_FD=" + std::to_string(pipe_fds[1]);
  std::vector<char*> env;
  for (char** e = environ; *e != nullptr; ++e) env.push_back(*e);
  env.push_back(const_cast<char*>(fd_env.c_str()));
  env.push_back(nullptr);
  char self[] = "/proc/self/exe", filter[] = "--gtest_filter=BlockTransferChild.Source";
  char* argv[] = {self, filter, nullptr};
  pid_t child = -1;
  ASSERT_EQ(posix_spawn(&child, "/proc/self/exe", nullptr, nullptr, argv, env.data()), 0);
  close(pipe_fds[1]);
  uint64_t n = 0;
  ASSERT_EQ(read(pipe_fds[0], &n, sizeof(n)), static_cast<ssize_t>(sizeof(n)));
  std::vector<std::byte> descriptor(n);
  for (size_t got = 0; got < n;) {
    const ssize_t r = read(pipe_fds[0], descriptor.data() + got, n - got);
    ASSERT_GT(r, 0);
    got += static_cast<size_t>(r);
  }
  close(pipe_fds[0]);

  auto dst_pool = Pool(Config(40)), want = Pool(Config(40));
  ASSERT_TRUE(dst_pool && want);
  FillRandom(*want, 7);  // the source's bytes
  Poison(*dst_pool);
  auto dst = BlockTransfer::Create(*dst_pool);
  ASSERT_TRUE(dst.ok()) << dst.status();
  auto peer = (*dst)->Connect(descriptor);
  ASSERT_TRUE(peer.ok()) << peer.status();
  const std::vector<int32_t> first = {0, 1, 2};
  ASSERT_TRUE((*dst)->Fetch(*peer, first, first).ok());
  for (int32_t b : first)
    EXPECT_EQ(std::memcmp(Block(*dst_pool, 1, b).data(), Block(*want, 1, b).data(), Block(*want, 1, b).size()), 0);

  ASSERT_EQ(kill(child, SIGSTOP), 0);
  std::vector<int32_t> rest(37);
  for (int32_t i = 0; i < 37; ++i) rest[static_cast<size_t>(i)] = 3 + i;
  auto fetch =
      std::async(std::launch::async, [&] { return (*dst)->Fetch(*peer, rest, rest, std::chrono::seconds(20)); });
  EXPECT_EQ(fetch.wait_for(std::chrono::milliseconds(300)), std::future_status::timeout)
      << "the fetch ended while its source was stopped";
  const auto killed = std::chrono::steady_clock::now();
  ASSERT_EQ(kill(child, SIGKILL), 0);
  int wstatus = 0;
  ASSERT_EQ(waitpid(child, &wstatus, 0), child);
  const Status st = fetch.get();
  EXPECT_EQ(st.code(), StatusCode::kUnavailable) << st;
  EXPECT_LT(std::chrono::steady_clock::now() - killed, std::chrono::seconds(15))
      << "ended by its deadline, not the failure";
  EXPECT_EQ((*dst)->stats().failures, 1);
  EXPECT_EQ((*dst)->Fetch(*peer, first, first).code(), StatusCode::kUnavailable);
}

}  // namespace
}  // namespace mlarun
