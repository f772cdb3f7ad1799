// Work items [0, count) split among the threads of a parallel region so that
// each thread reads one long run of memory, yet none waits for a slow one.
//
// Thread t owns the contiguous run [count * t / threads, count * (t + 1) /
// threads) and takes it from the front, a chunk at a time, so a streaming
// kernel sees one sequential stream (the hardware prefetchers stay warm, as
// with a plain static split). A thread whose run is done takes half of what
// is left of another's run (at least a chunk), from its back: near the end of
// a region that splits the last stretch between the two, rather than one
// thread reading it cold while the other waits (streaming the weights of a
// decode step on a quiet machine, fixed chunks of 1/16 of a run measured
// slower than a static split, halves with chunks of 1/64 faster; figures:
// docs/cpu-kernels.md, 'Kernel choices'). A run whose owner has not started
// is taken whole, so a region with fewer threads than asked for still covers
// every item. When one thread is slowed (a core shared with another process,
// an interrupt), the others finish its run instead of waiting at the region's
// barrier for it. Items are handed out exactly once.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace mlarun {

class ContiguousShares {
 public:
  // Threads beyond this many run their static share without taking others'.
  static constexpr int kMaxThreads = 128;

  // `chunk`: items per take (at least 1). Counts up to 2^32 - 1.
  ContiguousShares(int64_t count, int threads, int64_t chunk)
      : count_(count), threads_(std::max(threads, 1)), chunk_(std::max<int64_t>(chunk, 1)) {
    for (int t = 0; t < std::min(threads_, kMaxThreads); ++t)
      runs_[t].v.store(Pack(Begin(t), Begin(t + 1)), std::memory_order_relaxed);
  }
  ContiguousShares(const ContiguousShares&) = delete;
  ContiguousShares& operator=(const ContiguousShares&) = delete;

  // Calls f(begin, end) for chunks of items: this thread's own run first,
  // then parts of the others'. Every thread of the region calls it once with
  // its own t.
  template <typename F>
  void Run(int t, F&& f) {
    if (t >= kMaxThreads) {  // beyond the table: the plain static share
      if (t < threads_ && Begin(t) < Begin(t + 1)) f(Begin(t), Begin(t + 1));
      return;
    }
    int64_t b = 0, e = 0;
    runs_[t].started.store(true, std::memory_order_release);
    while (TakeFront(t, &b, &e)) f(b, e);
    const int n = std::min(threads_, kMaxThreads);
    for (int i = 1; i < n; ++i) {
      const int v = (t + i) % n;
      while (TakeBack(v, &b, &e)) f(b, e);
    }
  }

 private:
  struct alignas(64) Run64 {
    std::atomic<uint64_t> v{0};        // front | back << 32: the run's items not yet taken
    std::atomic<bool> started{false};  // its owner has begun taking it
  };
  static uint64_t Pack(int64_t front, int64_t back) {
    return static_cast<uint64_t>(front) | static_cast<uint64_t>(back) << 32;
  }
  int64_t Begin(int t) const { return count_ * t / threads_; }

  bool TakeFront(int t, int64_t* b, int64_t* e) {
    uint64_t cur = runs_[t].v.load(std::memory_order_acquire);
    for (;;) {
      const int64_t front = static_cast<uint32_t>(cur), back = static_cast<int64_t>(cur >> 32);
      if (front >= back) return false;
      const int64_t end = std::min(back, front + chunk_);
      if (runs_[t].v.compare_exchange_weak(cur, Pack(end, back), std::memory_order_acq_rel)) {
        *b = front, *e = end;
        return true;
      }
    }
  }
  bool TakeBack(int t, int64_t* b, int64_t* e) {
    uint64_t cur = runs_[t].v.load(std::memory_order_acquire);
    for (;;) {
      const int64_t front = static_cast<uint32_t>(cur), back = static_cast<int64_t>(cur >> 32);
      if (front >= back) return false;
      int64_t begin = front;  // an owner that has not started: all of it
      if (runs_[t].started.load(std::memory_order_acquire)) {
        begin = std::max(front, back - std::max(chunk_, (back - front) / 2));
      }
      if (runs_[t].v.compare_exchange_weak(cur, Pack(front, begin), std::memory_order_acq_rel)) {
        *b = begin, *e = back;
        return true;
      }
    }
  }

  const int64_t count_;
  const int threads_;
  const int64_t chunk_;
  Run64 runs_[kMaxThreads];
};

}  // namespace mlarun
