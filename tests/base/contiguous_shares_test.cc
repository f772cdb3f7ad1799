#include "base/contiguous_shares.h"

#include <gtest/gtest.h>

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

namespace mlarun {
namespace {

// Runs `callers` threads (ids 0..callers-1) over shares of `count` items made
// for `threads` threads; returns how often each item was handed out, and
// which thread took it.
struct Result {
  std::vector<int> times;
  std::vector<int> taker;
};
Result RunAll(int64_t count, int threads, int callers, int64_t chunk) {
  ContiguousShares shares(count, threads, chunk);
  std::vector<std::atomic<int>> times(static_cast<size_t>(count));
  std::vector<std::atomic<int>> taker(static_cast<size_t>(count));
  std::vector<std::thread> ts;
  for (int t = 0; t < callers; ++t)
    ts.emplace_back([&, t] {
      shares.Run(t, [&](int64_t b, int64_t e) {
        EXPECT_LT(b, e);
        for (int64_t i = b; i < e; ++i) {
          times[static_cast<size_t>(i)].fetch_add(1);
          taker[static_cast<size_t>(i)].store(t);
        }
      });
    });
  for (std::thread& t : ts) t.join();
  Result r;
  for (size_t i = 0; i < times.size(); ++i) r.times.push_back(times[i].load()), r.taker.push_back(taker[i].load());
  return r;
}

TEST(ContiguousShares, EveryItemExactlyOnce) {
  for (const int64_t count : {0, 1, 3, 7, 64, 1000, 4099})
    for (const int threads : {1, 2, 3, 8})
      for (const int64_t chunk : {1, 5, 64}) {
        const Result r = RunAll(count, threads, threads, chunk);
        for (int64_t i = 0; i < count; ++i)
          ASSERT_EQ(r.times[static_cast<size_t>(i)], 1)
              << "item " << i << " of " << count << ", " << threads << " threads, chunks of " << chunk;
      }
}

// A region may get fewer threads than asked for: the missing threads' runs
// are taken by the others.
TEST(ContiguousShares, FewerCallersThanThreadsStillCoverEverything) {
  const Result r = RunAll(1000, 4, 2, 7);
  for (size_t i = 0; i < r.times.size(); ++i) ASSERT_EQ(r.times[i], 1) << "item " << i;
}

// With threads at one speed and nothing to take, each runs exactly its own
// contiguous share, front to back (what keeps a streaming kernel's reads one
// sequential run). Checked with one caller at a time, so none can take.
TEST(ContiguousShares, EachThreadsOwnRunIsItsStaticShare) {
  const int64_t count = 1001;
  const int threads = 3;
  ContiguousShares shares(count, threads, 10);
  for (int t = 0; t < threads; ++t) {
    std::vector<std::pair<int64_t, int64_t>> chunks;
    // Thread t alone, before the others ran: it drains its own run, then
    // takes the others' from their backs; its first chunks are its own share.
    shares.Run(t, [&](int64_t b, int64_t e) { chunks.emplace_back(b, e); });
    if (t > 0) EXPECT_TRUE(chunks.empty()) << "thread 0 took everything, so thread " << t << " finds nothing";
    // (The other runs' owners had not started, so thread 0 took them whole.)
    if (t == 0) {
      const int64_t own_end = count / threads;
      int64_t next = 0;
      size_t i = 0;
      for (; i < chunks.size() && chunks[i].first < own_end; ++i) {
        EXPECT_EQ(chunks[i].first, next) << "own run taken front to back";
        next = chunks[i].second;
      }
      EXPECT_EQ(next, own_end);
      int64_t covered = next;
      for (; i < chunks.size(); ++i) covered += chunks[i].second - chunks[i].first;
      EXPECT_EQ(covered, count) << "then the others' runs";
    }
  }
}

// A slow thread's run is finished by the others: thread 0 takes one chunk
// (before the others start) and then waits until every other thread has
// returned from Run; by then they
// must have taken the rest of its run (no timing involved).
TEST(ContiguousShares, ASlowThreadsRunIsTakenByTheOthers) {
  const int64_t count = 400, chunk = 4;
  const int threads = 4;
  ContiguousShares shares(count, threads, chunk);
  std::vector<std::atomic<int>> times(static_cast<size_t>(count));
  std::mutex mu;
  std::condition_variable cv;
  int others_done = 0;
  bool slow_started = false;  // the others start once thread 0 holds its first chunk
  int64_t slow_items = 0;
  std::vector<std::thread> ts;
  for (int t = 0; t < threads; ++t)
    ts.emplace_back([&, t] {
      if (t != 0) {
        std::unique_lock<std::mutex> lock(mu);
        cv.wait(lock, [&] { return slow_started; });
      }
      shares.Run(t, [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) times[static_cast<size_t>(i)].fetch_add(1);
        if (t == 0) {
          slow_items += e - b;
          std::unique_lock<std::mutex> lock(mu);
          slow_started = true;
          cv.notify_all();
          cv.wait(lock, [&] { return others_done == threads - 1; });
        }
      });
      if (t != 0) {
        std::lock_guard<std::mutex> lock(mu);
        ++others_done;
        cv.notify_all();
      }
    });
  for (std::thread& t : ts) t.join();
  for (size_t i = 0; i < times.size(); ++i) ASSERT_EQ(times[i].load(), 1) << "item " << i;
  EXPECT_EQ(slow_items, chunk) << "the slow thread's run, but for its first chunk, went to the others";
}

}  // namespace
}  // namespace mlarun
