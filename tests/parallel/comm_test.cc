// Collectives and process groups, run by ctest under `mpirun -np 1..4`.
//
// Every rank runs every test, in the same order, so the collectives inside
// them match up. Values are integers stored in floats (and small integers in
// bf16), so sums are exact and compared with ==. Random counts come from a
// fixed seed, so every rank draws the same ones. Only rank 0 prints the
// gtest report; other ranks print their failures only, and all ranks agree
// on the exit code at the end.
//
// A failed ASSERT on one rank skips the rest of that test on that rank only:
// assertions that could differ between ranks are EXPECTs, so the collectives
// stay matched.
#include <gtest/gtest.h>
#include <time.h>

#include <chrono>
#include <cstdio>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "base/dtype.h"
#include "parallel/communicator.h"
#include "parallel/layout.h"
#include "parallel/mpi/mpi_world.h"
#include "parallel/nccl/nccl_communicator.h"
#include "tests/parallel/mpi_gtest_main.h"

#ifdef MLARUN_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace mlarun {
namespace {

MpiSession* g_session = nullptr;
Communicator* g_world = nullptr;
// --expect-job=APPNUM:SIZE: this rank's application context under an MPMD launch.
int g_expect_appnum = -1, g_expect_size = 0;

int Rank() { return g_world->rank(); }
int Size() { return g_world->size(); }

// The value rank r contributes at index i: exact in fp32 for every sum here.
float Value(int r, int64_t i) { return static_cast<float>(r * 1000 + i); }
// Small integers, exact in bf16 (8 significant bits) even summed over 4 ranks.
float SmallValue(int r, int64_t i) { return static_cast<float>((r + 1) + i % 13); }

// Per-rank counts in [0, max], with some ranks idle (0). Same on every rank
// for the same generator state.
std::vector<int64_t> RandomCounts(std::mt19937& rng, int n, int64_t max) {
  std::uniform_int_distribution<int64_t> count(0, max);
  std::bernoulli_distribution idle(0.3);
  std::vector<int64_t> counts(n);
  for (auto& c : counts) c = idle(rng) ? 0 : count(rng);
  return counts;
}

int64_t Offset(const std::vector<int64_t>& counts, int r) {
  return std::accumulate(counts.begin(), counts.begin() + r, int64_t{0});
}

double ProcessCpuSeconds() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

TEST(MpiWorld, SessionAndWorld) {
  EXPECT_EQ(g_world->backend(), "mpi");
  EXPECT_EQ(g_world->rank(), g_session->rank());
  EXPECT_EQ(g_world->size(), g_session->size());
  EXPECT_FALSE(g_session->host().empty());
  EXPECT_GE(Size(), 1);
  // A second session in the same process is refused, not a crash.
  int argc = 0;
  char** argv = nullptr;
  const auto again = MpiSession::Init(&argc, &argv);
  EXPECT_EQ(again.status().code(), StatusCode::kFailedPrecondition);
  // A second World() is an independent communicator.
  auto world2 = g_session->World();
  ASSERT_TRUE(world2.ok()) << world2.status();
  EXPECT_EQ((*world2)->rank(), Rank());
  EXPECT_TRUE((*world2)->Barrier().ok());
}

// Under an MPMD launch (`mpirun -np 1 comm_test --expect-job=0:1 : -np 2
// comm_test --expect-job=1:2`) each application context is its own job: its
// rank and size, and a world whose collectives span its ranks only (the sum
// of 1 over the world is the context's size, not the launch's).
TEST(MpiWorld, ApplicationContextIsTheJob) {
  if (g_expect_appnum < 0) GTEST_SKIP() << "not under an MPMD launch (--expect-job=APPNUM:SIZE)";
  EXPECT_EQ(g_session->appnum(), g_expect_appnum);
  EXPECT_EQ(g_session->size(), g_expect_size);
  EXPECT_EQ(g_world->size(), g_expect_size);
  int32_t one = 1;
  ASSERT_TRUE(g_world->AllReduceSum(&one, 1, CommType::kI32).ok());
  EXPECT_EQ(one, g_expect_size);
  auto groups = g_session->Groups(ParallelLayout{.dp = g_expect_size, .attn_tp = 1});
  ASSERT_TRUE(groups.ok()) << groups.status();
  EXPECT_EQ(groups->dp_peers->size(), g_expect_size);
}

TEST(MpiComm, AllReduceSumF32) {
  for (const int64_t n : {int64_t{0}, int64_t{1}, int64_t{7}, int64_t{1000}, int64_t{100'000}}) {
    std::vector<float> buf(n);
    for (int64_t i = 0; i < n; ++i) buf[i] = Value(Rank(), i);
    ASSERT_TRUE(g_world->AllReduceSum(buf.data(), n, CommType::kF32).ok());
    int bad = 0;
    for (int64_t i = 0; i < n; ++i) {
      float want = 0;
      for (int r = 0; r < Size(); ++r) want += Value(r, i);
      bad += buf[i] != want;
    }
    EXPECT_EQ(bad, 0) << "n=" << n;
  }
}

TEST(MpiComm, AllReduceSumBf16) {
  for (const int64_t n : {int64_t{0}, int64_t{5}, int64_t{4097}}) {
    std::vector<bf16_t> buf(n);
    for (int64_t i = 0; i < n; ++i) buf[i] = FloatToBf16(SmallValue(Rank(), i));
    ASSERT_TRUE(g_world->AllReduceSum(buf.data(), n, CommType::kBF16).ok());
    int bad = 0;
    for (int64_t i = 0; i < n; ++i) {
      float want = 0;
      for (int r = 0; r < Size(); ++r) want += SmallValue(r, i);
      bad += Bf16ToFloat(buf[i]) != want;
    }
    EXPECT_EQ(bad, 0) << "n=" << n;
  }
}

TEST(MpiComm, AllReduceSumIntegers) {
  int32_t a[3] = {Rank(), 1, -Rank()};
  ASSERT_TRUE(g_world->AllReduceSum(a, 3, CommType::kI32).ok());
  const int s = Size();
  EXPECT_EQ(a[0], s * (s - 1) / 2);
  EXPECT_EQ(a[1], s);
  EXPECT_EQ(a[2], -s * (s - 1) / 2);
  int64_t b = (int64_t{1} << 40) + Rank();
  ASSERT_TRUE(g_world->AllReduceSum(&b, 1, CommType::kI64).ok());
  EXPECT_EQ(b, s * (int64_t{1} << 40) + s * (s - 1) / 2);
}

TEST(MpiComm, AllGather) {
  for (const int64_t n : {int64_t{0}, int64_t{1}, int64_t{333}}) {
    std::vector<float> send(n), recv(n * Size(), -1.0f);
    for (int64_t i = 0; i < n; ++i) send[i] = Value(Rank(), i);
    ASSERT_TRUE(g_world->AllGather(send.data(), n, recv.data(), CommType::kF32).ok());
    int bad = 0;
    for (int r = 0; r < Size(); ++r)
      for (int64_t i = 0; i < n; ++i) bad += recv[r * n + i] != Value(r, i);
    EXPECT_EQ(bad, 0) << "n=" << n;
  }
  // The other element types, 2 elements each.
  std::vector<bf16_t> hsend = {FloatToBf16(SmallValue(Rank(), 0)), FloatToBf16(-SmallValue(Rank(), 1))};
  std::vector<bf16_t> hrecv(2 * Size());
  ASSERT_TRUE(g_world->AllGather(hsend.data(), 2, hrecv.data(), CommType::kBF16).ok());
  std::vector<int64_t> lsend = {Rank() * (int64_t{1} << 35), -Rank()}, lrecv(2 * Size());
  ASSERT_TRUE(g_world->AllGather(lsend.data(), 2, lrecv.data(), CommType::kI64).ok());
  std::vector<uint8_t> bsend = {static_cast<uint8_t>(Rank()), 0xAB}, brecv(2 * Size());
  ASSERT_TRUE(g_world->AllGather(bsend.data(), 2, brecv.data(), CommType::kU8).ok());
  std::vector<int32_t> isend = {Rank(), 7}, irecv(2 * Size());
  ASSERT_TRUE(g_world->AllGather(isend.data(), 2, irecv.data(), CommType::kI32).ok());
  for (int r = 0; r < Size(); ++r) {
    EXPECT_EQ(Bf16ToFloat(hrecv[2 * r]), SmallValue(r, 0));
    EXPECT_EQ(Bf16ToFloat(hrecv[2 * r + 1]), -SmallValue(r, 1));
    EXPECT_EQ(lrecv[2 * r], r * (int64_t{1} << 35));
    EXPECT_EQ(lrecv[2 * r + 1], -r);
    EXPECT_EQ(brecv[2 * r], r);
    EXPECT_EQ(brecv[2 * r + 1], 0xAB);
    EXPECT_EQ(irecv[2 * r], r);
    EXPECT_EQ(irecv[2 * r + 1], 7);
  }
}

// Runs AllGatherV with `counts` (f32 and bf16) and checks every element.
void CheckAllGatherV(const std::vector<int64_t>& counts) {
  const int64_t total = std::accumulate(counts.begin(), counts.end(), int64_t{0});
  const int64_t mine = counts[Rank()];
  std::vector<float> send(mine), recv(total, -1.0f);
  std::vector<bf16_t> hsend(mine), hrecv(total);
  for (int64_t i = 0; i < mine; ++i) {
    send[i] = Value(Rank(), i);
    hsend[i] = FloatToBf16(SmallValue(Rank(), i));
  }
  ASSERT_TRUE(g_world->AllGatherV(send.data(), counts, recv.data(), CommType::kF32).ok());
  ASSERT_TRUE(g_world->AllGatherV(hsend.data(), counts, hrecv.data(), CommType::kBF16).ok());
  int bad = 0;
  for (int r = 0; r < Size(); ++r) {
    const int64_t off = Offset(counts, r);
    for (int64_t i = 0; i < counts[r]; ++i) {
      bad += recv[off + i] != Value(r, i);
      bad += Bf16ToFloat(hrecv[off + i]) != SmallValue(r, i);
    }
  }
  EXPECT_EQ(bad, 0) << "counts " << ::testing::PrintToString(counts);
}

TEST(MpiComm, AllGatherVRandomCounts) {
  std::mt19937 rng(1234);
  for (int round = 0; round < 30; ++round) CheckAllGatherV(RandomCounts(rng, Size(), 50));
  CheckAllGatherV(std::vector<int64_t>(Size(), 0));   // everybody idle
  CheckAllGatherV(std::vector<int64_t>(Size(), 17));  // equal counts
}

// Runs ReduceScatterSumV with `counts` (f32 and bf16) and checks every element.
void CheckReduceScatterV(const std::vector<int64_t>& counts) {
  const int64_t total = std::accumulate(counts.begin(), counts.end(), int64_t{0});
  const int64_t mine = counts[Rank()], off = Offset(counts, Rank());
  std::vector<float> send(total), recv(mine, -1.0f);
  std::vector<bf16_t> hsend(total), hrecv(mine);
  for (int64_t j = 0; j < total; ++j) {
    send[j] = Value(Rank(), j);
    hsend[j] = FloatToBf16(SmallValue(Rank(), j));
  }
  ASSERT_TRUE(g_world->ReduceScatterSumV(send.data(), counts, recv.data(), CommType::kF32).ok());
  ASSERT_TRUE(g_world->ReduceScatterSumV(hsend.data(), counts, hrecv.data(), CommType::kBF16).ok());
  int bad = 0;
  for (int64_t k = 0; k < mine; ++k) {
    float want = 0, want_small = 0;
    for (int r = 0; r < Size(); ++r) {
      want += Value(r, off + k);
      want_small += SmallValue(r, off + k);
    }
    bad += recv[k] != want;
    bad += Bf16ToFloat(hrecv[k]) != want_small;
  }
  EXPECT_EQ(bad, 0) << "counts " << ::testing::PrintToString(counts);
}

TEST(MpiComm, ReduceScatterSumVRandomCounts) {
  std::mt19937 rng(99);
  for (int round = 0; round < 30; ++round) CheckReduceScatterV(RandomCounts(rng, Size(), 40));
  CheckReduceScatterV(std::vector<int64_t>(Size(), 0));
  CheckReduceScatterV(std::vector<int64_t>(Size(), 9));
}

// Idle ranks: only one rank contributes (or receives), the others pass 0.
TEST(MpiComm, IdleRanks) {
  for (int busy = 0; busy < Size(); ++busy) {
    std::vector<int64_t> counts(Size(), 0);
    counts[busy] = 25;
    CheckAllGatherV(counts);
    CheckReduceScatterV(counts);
  }
  // The last rank idle, the others busy.
  std::vector<int64_t> counts(Size(), 11);
  counts.back() = 0;
  CheckAllGatherV(counts);
  CheckReduceScatterV(counts);
}

TEST(MpiComm, BroadcastFromEachRoot) {
  for (int root = 0; root < Size(); ++root) {
    std::vector<float> buf(100);
    for (int i = 0; i < 100; ++i) buf[i] = Rank() == root ? Value(root, i) : -1.0f;
    ASSERT_TRUE(g_world->Broadcast(buf.data(), 100, CommType::kF32, root).ok());
    int bad = 0;
    for (int i = 0; i < 100; ++i) bad += buf[i] != Value(root, i);
    EXPECT_EQ(bad, 0) << "root " << root;
    bf16_t h = FloatToBf16(Rank() == root ? SmallValue(root, 3) : 0.0f);
    ASSERT_TRUE(g_world->Broadcast(&h, 1, CommType::kBF16, root).ok());
    EXPECT_EQ(Bf16ToFloat(h), SmallValue(root, 3));
    int64_t l = Rank() == root ? 1000 + root : 0;
    ASSERT_TRUE(g_world->Broadcast(&l, 1, CommType::kI64, root).ok());
    EXPECT_EQ(l, 1000 + root);
    ASSERT_TRUE(g_world->Broadcast(nullptr, 0, CommType::kU8, root).ok());
  }
}

// A rank waiting in a collective for a late peer sleeps: its CPU time while
// waiting stays far below the wall time. The bound is set by what a spin
// costs, not by what sleeping costs on a quiet machine: a spinning waiter
// burns ~100% of a core when it has one to itself, and still 20-30% on 2
// cores shared by 4 ranks (Open MPI yields when oversubscribed). Sleeping was
// measured at ~1% on a quiet machine and 6.4% with other jobs on the other
// core (its wake-ups cost more when caches are cold, but it never needs more
// than those wake-ups), so 15% of the wall time holds under load and still
// fails for any waiter that spins.
constexpr double kSpinFreeCpuFraction = 0.15;

TEST(MpiComm, BarrierWaitsWithoutSpinning) {
  constexpr double kLateSeconds = 0.3;
  const auto start = std::chrono::steady_clock::now();
  const double cpu_start = ProcessCpuSeconds();
  if (Rank() == 0) std::this_thread::sleep_for(std::chrono::duration<double>(kLateSeconds));
  ASSERT_TRUE(g_world->Barrier().ok());
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const double cpu = ProcessCpuSeconds() - cpu_start;
  // Nobody leaves before the late rank arrives.
  EXPECT_GE(wall, kLateSeconds * 0.95);
  if (Rank() != 0) {
    EXPECT_LT(cpu, kSpinFreeCpuFraction * wall) << "cpu " << cpu << " s in a " << wall << " s wait";
  }
  // Same for a data collective.
  const double cpu_start2 = ProcessCpuSeconds();
  const auto start2 = std::chrono::steady_clock::now();
  if (Rank() == Size() - 1) std::this_thread::sleep_for(std::chrono::duration<double>(kLateSeconds));
  float x = 1.0f;
  ASSERT_TRUE(g_world->AllReduceSum(&x, 1, CommType::kF32).ok());
  EXPECT_EQ(x, Size());
  const double wall2 = std::chrono::duration<double>(std::chrono::steady_clock::now() - start2).count();
  const double cpu2 = ProcessCpuSeconds() - cpu_start2;
  EXPECT_GE(wall2, kLateSeconds * 0.95);
  if (Rank() != Size() - 1) {
    EXPECT_LT(cpu2, kSpinFreeCpuFraction * wall2) << "cpu " << cpu2 << " s in a " << wall2 << " s wait";
  }
}

TEST(MpiComm, Stats) {
  auto owned = g_session->World();
  ASSERT_TRUE(owned.ok()) << owned.status();
  Communicator& c = **owned;
  EXPECT_EQ(c.stats().all_reduce.calls, 0);
  std::vector<float> f(10, 1.0f), g(10 * Size());
  std::vector<bf16_t> h(6, FloatToBf16(1.0f));
  ASSERT_TRUE(c.AllReduceSum(f.data(), 10, CommType::kF32).ok());
  ASSERT_TRUE(c.AllReduceSum(h.data(), 6, CommType::kBF16).ok());
  ASSERT_TRUE(c.AllGather(f.data(), 10, g.data(), CommType::kF32).ok());
  std::vector<int64_t> counts(Size());
  for (int r = 0; r < Size(); ++r) counts[r] = r + 1;
  const int64_t total = Size() * (Size() + 1) / 2;
  std::vector<float> vsend(total, 1.0f), vrecv(total);
  ASSERT_TRUE(c.AllGatherV(vsend.data(), counts, vrecv.data(), CommType::kF32).ok());
  ASSERT_TRUE(c.ReduceScatterSumV(vsend.data(), counts, vrecv.data(), CommType::kF32).ok());
  ASSERT_TRUE(c.Broadcast(f.data(), 10, CommType::kF32, 0).ok());
  ASSERT_TRUE(c.Barrier().ok());
  ASSERT_TRUE(c.Barrier().ok());
  const CommStats& s = c.stats();
  EXPECT_EQ(s.all_reduce.calls, 2);
  EXPECT_EQ(s.all_reduce.bytes, 10 * 4 + 6 * 2);
  EXPECT_EQ(s.all_gather.calls, 2);
  EXPECT_EQ(s.all_gather.bytes, 10 * 4 + (Rank() + 1) * 4);
  EXPECT_EQ(s.reduce_scatter.calls, 1);
  EXPECT_EQ(s.reduce_scatter.bytes, total * 4);
  EXPECT_EQ(s.broadcast.calls, 1);
  EXPECT_EQ(s.broadcast.bytes, Rank() == 0 ? 40 : 0);
  EXPECT_EQ(s.barrier.calls, 2);
  EXPECT_EQ(s.barrier.bytes, 0);
  // A refused call never reached the other ranks and is not counted.
  EXPECT_FALSE(c.AllReduceSum(f.data(), -1, CommType::kF32).ok());
  EXPECT_EQ(c.stats().all_reduce.calls, 2);
  c.mutable_stats().Clear();
  EXPECT_EQ(c.stats().barrier.calls, 0);
  EXPECT_EQ(c.stats().all_gather.bytes, 0);
}

// Bad arguments are refused locally, before any collective, so every rank
// returns the same error and nobody hangs.
TEST(MpiComm, RejectsBadArguments) {
  float x = 0;
  const int64_t too_many = int64_t{1} << 31;
  EXPECT_EQ(g_world->AllReduceSum(&x, too_many, CommType::kF32).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(g_world->AllReduceSum(&x, -1, CommType::kF32).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(g_world->AllGather(&x, too_many, &x, CommType::kU8).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(g_world->Broadcast(&x, too_many, CommType::kU8, 0).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(g_world->Broadcast(&x, 1, CommType::kF32, Size()).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(g_world->Broadcast(&x, 1, CommType::kF32, -1).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(g_world->AllReduceSum(&x, 1, static_cast<CommType>(9)).code(), StatusCode::kInvalidArgument);
  std::vector<int64_t> wrong_size(Size() + 1, 1);
  const Status st = g_world->AllGatherV(&x, wrong_size, &x, CommType::kF32);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("counts for a group of"), std::string::npos) << st;
  EXPECT_EQ(g_world->ReduceScatterSumV(&x, wrong_size, &x, CommType::kF32).code(), StatusCode::kInvalidArgument);
  std::vector<int64_t> huge(Size(), 0);
  huge[0] = too_many;
  EXPECT_EQ(g_world->AllGatherV(&x, huge, &x, CommType::kF32).code(), StatusCode::kInvalidArgument);
  // Counts that fit one by one but whose offsets overflow an int.
  if (Size() >= 2) {
    std::vector<int64_t> big(Size(), int64_t{1} << 30);
    EXPECT_EQ(g_world->ReduceScatterSumV(&x, big, &x, CommType::kF32).code(), StatusCode::kInvalidArgument);
  }
  std::vector<int64_t> negative(Size(), 0);
  negative.back() = -3;
  EXPECT_EQ(g_world->ReduceScatterSumV(&x, negative, &x, CommType::kF32).code(), StatusCode::kInvalidArgument);
  // The communicator still works afterwards.
  EXPECT_TRUE(g_world->Barrier().ok());
}

TEST(CommType, Sizes) {
  EXPECT_EQ(CommTypeSize(CommType::kF32), 4u);
  EXPECT_EQ(CommTypeSize(CommType::kBF16), 2u);
  EXPECT_EQ(CommTypeSize(CommType::kI32), 4u);
  EXPECT_EQ(CommTypeSize(CommType::kI64), 8u);
  EXPECT_EQ(CommTypeSize(CommType::kU8), 1u);
}

// The world rank of every member of `c`, in c's rank order.
std::vector<int32_t> Members(Communicator& c) {
  int32_t me = Rank();
  std::vector<int32_t> all(c.size(), -1);
  EXPECT_TRUE(c.AllGather(&me, 1, all.data(), CommType::kI32).ok());
  return all;
}

TEST(ProcessGroups, EveryLayoutOfThisWorld) {
  const int w = Size();
  for (int attn_tp = 1; attn_tp <= w; ++attn_tp) {
    if (w % attn_tp != 0) continue;
    for (const MoeSharding moe : {MoeSharding::kByExpert, MoeSharding::kByIntermediate}) {
      const ParallelLayout layout{.dp = w / attn_tp, .attn_tp = attn_tp, .moe = moe};
      SCOPED_TRACE(::testing::PrintToString(layout));
      auto groups_or = g_session->Groups(layout);
      ASSERT_TRUE(groups_or.ok()) << groups_or.status();
      ProcessGroups& g = *groups_or;
      EXPECT_EQ(g.layout, layout);
      EXPECT_EQ(g.rank, Rank());
      ASSERT_NE(g.world, nullptr);
      ASSERT_NE(g.attn_tp, nullptr);
      ASSERT_NE(g.dp_peers, nullptr);
      EXPECT_EQ(g.world->size(), w);
      EXPECT_EQ(g.world->rank(), Rank());
      EXPECT_EQ(g.attn_tp->size(), layout.attn_tp);
      EXPECT_EQ(g.attn_tp->rank(), layout.attn_tp_rank(Rank()));
      EXPECT_EQ(g.dp_peers->size(), layout.dp);
      EXPECT_EQ(g.dp_peers->rank(), layout.dp_rank(Rank()));
      EXPECT_EQ(g.is_leader(), Rank() == layout.leader_of(layout.dp_rank(Rank())));
      // The attn-TP group: this DP group's ranks, in order.
      std::vector<int32_t> want_tp(layout.attn_tp);
      for (int t = 0; t < layout.attn_tp; ++t) want_tp[t] = layout.dp_rank(Rank()) * layout.attn_tp + t;
      EXPECT_EQ(Members(*g.attn_tp), want_tp);
      // The DP peers: one rank per DP group with this attn_tp_rank, in DP order.
      std::vector<int32_t> want_dp(layout.dp);
      for (int d = 0; d < layout.dp; ++d) want_dp[d] = d * layout.attn_tp + layout.attn_tp_rank(Rank());
      EXPECT_EQ(Members(*g.dp_peers), want_dp);
      std::vector<int32_t> want_world(w);
      std::iota(want_world.begin(), want_world.end(), 0);
      EXPECT_EQ(Members(*g.world), want_world);
    }
  }
}

TEST(ProcessGroups, WrongWorldSizeIsRefusedOnEveryRank) {
  const ParallelLayout layout{.dp = Size(), .attn_tp = 2};
  const auto groups = g_session->Groups(layout);
  ASSERT_FALSE(groups.ok());
  EXPECT_EQ(groups.status().code(), StatusCode::kInvalidArgument);
  const std::string want = "layout dp=" + std::to_string(Size()) + " x attn_tp=2 needs " + std::to_string(2 * Size()) +
                           " ranks, mpirun started " + std::to_string(Size());
  EXPECT_EQ(groups.status().message(), want);
  // Nobody is stuck in a collective: the world still works.
  EXPECT_TRUE(g_world->Barrier().ok());
}

// On a machine without a GPU every rank gets UNAVAILABLE (or UNIMPLEMENTED in
// a build without NCCL) and the test skips; with one GPU per rank it checks
// the device collectives.
TEST(NcclComm, DeviceCollectives) {
#ifndef MLARUN_HAVE_CUDA
  GTEST_SKIP() << "this build has no CUDA backend";
#else
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess) {
    cudaGetLastError();
    devices = 0;
  }
  // Every rank must take the same branch. NCCL needs a distinct GPU per rank
  // (ranks of one host share the count): [ranks with enough GPUs, ranks with any].
  int32_t votes[2] = {devices >= Size() ? 1 : 0, devices > 0 ? 1 : 0};
  ASSERT_TRUE(g_world->AllReduceSum(votes, 2, CommType::kI32).ok());
  if (votes[0] != Size() && votes[1] != 0) GTEST_SKIP() << "fewer GPUs than ranks on some host";
  auto nccl_or = CreateNcclCommunicator(*g_world, devices > 0 ? Rank() % devices : 0);
  if (votes[1] == 0) {
    // No GPU anywhere: every rank must get UNAVAILABLE, not hang.
    ASSERT_FALSE(nccl_or.ok());
    EXPECT_EQ(nccl_or.status().code(), StatusCode::kUnavailable) << nccl_or.status();
    GTEST_SKIP() << nccl_or.status();
  }
  ASSERT_TRUE(nccl_or.ok()) << nccl_or.status();
  Communicator& nccl = **nccl_or;
  EXPECT_EQ(nccl.backend(), "nccl");
  EXPECT_EQ(nccl.rank(), Rank());
  EXPECT_EQ(nccl.size(), Size());

  constexpr int64_t kN = 4099;
  const int64_t max_total = kN * Size();
  float* d_a = nullptr;
  float* d_b = nullptr;
  ASSERT_EQ(cudaMalloc(&d_a, max_total * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&d_b, max_total * sizeof(float)), cudaSuccess);
  std::vector<float> host(max_total);

  // All-reduce f32.
  for (int64_t i = 0; i < kN; ++i) host[i] = Value(Rank(), i);
  ASSERT_EQ(cudaMemcpy(d_a, host.data(), kN * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_TRUE(nccl.AllReduceSum(d_a, kN, CommType::kF32).ok());
  ASSERT_EQ(cudaMemcpy(host.data(), d_a, kN * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
  int bad = 0;
  for (int64_t i = 0; i < kN; ++i) {
    float want = 0;
    for (int r = 0; r < Size(); ++r) want += Value(r, i);
    bad += host[i] != want;
  }
  EXPECT_EQ(bad, 0) << "AllReduceSum f32";

  // All-reduce bf16.
  std::vector<bf16_t> hb(kN);
  for (int64_t i = 0; i < kN; ++i) hb[i] = FloatToBf16(SmallValue(Rank(), i));
  ASSERT_EQ(cudaMemcpy(d_a, hb.data(), kN * sizeof(bf16_t), cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_TRUE(nccl.AllReduceSum(d_a, kN, CommType::kBF16).ok());
  ASSERT_EQ(cudaMemcpy(hb.data(), d_a, kN * sizeof(bf16_t), cudaMemcpyDeviceToHost), cudaSuccess);
  bad = 0;
  for (int64_t i = 0; i < kN; ++i) {
    float want = 0;
    for (int r = 0; r < Size(); ++r) want += SmallValue(r, i);
    bad += Bf16ToFloat(hb[i]) != want;
  }
  EXPECT_EQ(bad, 0) << "AllReduceSum bf16";

  // AllGatherV and ReduceScatterSumV, equal and unequal counts (idle ranks).
  std::mt19937 rng(7);
  std::vector<std::vector<int64_t> > count_sets = {std::vector<int64_t>(Size(), 100)};
  for (int i = 0; i < 5; ++i) count_sets.push_back(RandomCounts(rng, Size(), kN));
  for (const auto& counts : count_sets) {
    const int64_t total = std::accumulate(counts.begin(), counts.end(), int64_t{0});
    const int64_t mine = counts[Rank()], off = Offset(counts, Rank());
    for (int64_t i = 0; i < mine; ++i) host[i] = Value(Rank(), i);
    ASSERT_EQ(cudaMemcpy(d_a, host.data(), mine * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_TRUE(nccl.AllGatherV(d_a, counts, d_b, CommType::kF32).ok());
    ASSERT_EQ(cudaMemcpy(host.data(), d_b, total * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
    bad = 0;
    for (int r = 0; r < Size(); ++r)
      for (int64_t i = 0; i < counts[r]; ++i) bad += host[Offset(counts, r) + i] != Value(r, i);
    EXPECT_EQ(bad, 0) << "AllGatherV " << ::testing::PrintToString(counts);

    for (int64_t j = 0; j < total; ++j) host[j] = Value(Rank(), j);
    ASSERT_EQ(cudaMemcpy(d_a, host.data(), total * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_TRUE(nccl.ReduceScatterSumV(d_a, counts, d_b, CommType::kF32).ok());
    ASSERT_EQ(cudaMemcpy(host.data(), d_b, mine * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
    bad = 0;
    for (int64_t k = 0; k < mine; ++k) {
      float want = 0;
      for (int r = 0; r < Size(); ++r) want += Value(r, off + k);
      bad += host[k] != want;
    }
    EXPECT_EQ(bad, 0) << "ReduceScatterSumV " << ::testing::PrintToString(counts);
  }

  // Broadcast from each root, then a barrier.
  for (int root = 0; root < Size(); ++root) {
    for (int64_t i = 0; i < kN; ++i) host[i] = Rank() == root ? Value(root, i) : -1.0f;
    ASSERT_EQ(cudaMemcpy(d_a, host.data(), kN * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_TRUE(nccl.Broadcast(d_a, kN, CommType::kF32, root).ok());
    ASSERT_EQ(cudaMemcpy(host.data(), d_a, kN * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
    bad = 0;
    for (int64_t i = 0; i < kN; ++i) bad += host[i] != Value(root, i);
    EXPECT_EQ(bad, 0) << "Broadcast root " << root;
  }
  EXPECT_TRUE(nccl.Barrier().ok());
  EXPECT_EQ(nccl.stats().barrier.calls, 1);
  EXPECT_EQ(nccl.stats().all_reduce.calls, 2);
  cudaFree(d_a);
  cudaFree(d_b);
#endif
}

}  // namespace
}  // namespace mlarun

int main(int argc, char** argv) {
  // --expect-job asks for one job per application context.
  bool job_per_context = false;
  for (int i = 1; i < argc; ++i) job_per_context |= std::string(argv[i]).starts_with("--expect-job=");
  auto session = mlarun::MpiSession::Init(&argc, &argv, job_per_context);
  if (!session.ok()) {
    std::fprintf(stderr, "comm_test: %s\n", session.status().ToString().c_str());
    return 1;
  }
  auto world = (*session)->World();
  if (!world.ok()) {
    std::fprintf(stderr, "comm_test: %s\n", world.status().ToString().c_str());
    return 1;
  }
  mlarun::g_session = session->get();
  mlarun::g_world = world->get();

  ::testing::InitGoogleTest(&argc, argv);
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.starts_with("--expect-job=") &&
        std::sscanf(a.c_str(), "--expect-job=%d:%d", &mlarun::g_expect_appnum, &mlarun::g_expect_size) != 2) {
      std::fprintf(stderr, "comm_test: --expect-job=APPNUM:SIZE, got %s\n", a.c_str());
      return 2;
    }
  }
  const int result = mlarun::mpi_test::RunAllTestsOnEveryRank(**session, **world, "comm_test");
  world->reset();    // frees the communicator before MPI_Finalize
  session->reset();  // MPI_Finalize
  return result;
}
