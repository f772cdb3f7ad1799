// Lock annotations for clang's thread-safety analysis (-Wthread-safety),
// and a mutex that carries them. Under other compilers the annotations are
// empty; the analysis runs in the `thread_safety` test (tests/CMakeLists.txt),
// which compiles the annotated sources with clang.
#pragma once

#include <condition_variable>
#include <mutex>

#if defined(__clang__)
#define MLARUN_THREAD_ANNOTATION(x) __attribute__((x))
#else
#define MLARUN_THREAD_ANNOTATION(x)
#endif

#define MLARUN_CAPABILITY(x) MLARUN_THREAD_ANNOTATION(capability(x))
#define MLARUN_SCOPED_CAPABILITY MLARUN_THREAD_ANNOTATION(scoped_lockable)
#define MLARUN_GUARDED_BY(x) MLARUN_THREAD_ANNOTATION(guarded_by(x))
#define MLARUN_PT_GUARDED_BY(x) MLARUN_THREAD_ANNOTATION(pt_guarded_by(x))
#define MLARUN_REQUIRES(...) MLARUN_THREAD_ANNOTATION(requires_capability(__VA_ARGS__))
#define MLARUN_EXCLUDES(...) MLARUN_THREAD_ANNOTATION(locks_excluded(__VA_ARGS__))
#define MLARUN_ACQUIRE(...) MLARUN_THREAD_ANNOTATION(acquire_capability(__VA_ARGS__))
#define MLARUN_RELEASE(...) MLARUN_THREAD_ANNOTATION(release_capability(__VA_ARGS__))

namespace mlarun {

// std::mutex with the capability annotation.
class MLARUN_CAPABILITY("mutex") Mutex {
 public:
  void Lock() MLARUN_ACQUIRE() { m_.lock(); }
  void Unlock() MLARUN_RELEASE() { m_.unlock(); }
  std::mutex& native() { return m_; }

 private:
  std::mutex m_;
};

// Holds a Mutex for its scope. Wait() and WaitUntil() release it while
// waiting on `cv`, as std::condition_variable does, and hold it again after.
class MLARUN_SCOPED_CAPABILITY MutexLock {
 public:
  explicit MutexLock(Mutex& mu) MLARUN_ACQUIRE(mu) : lock_(mu.native()) {}
  ~MutexLock() MLARUN_RELEASE() = default;
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

  // Lets go for a while (the flush of outlets after a batch of timers).
  void Unlock() MLARUN_RELEASE() { lock_.unlock(); }
  void Lock() MLARUN_ACQUIRE() { lock_.lock(); }

  void Wait(std::condition_variable& cv) { cv.wait(lock_); }
  // Until `done()` (a lambda annotated REQUIRES on the mutex) holds.
  template <typename Pred>
  void Wait(std::condition_variable& cv, Pred done) {
    cv.wait(lock_, done);
  }
  // As long as `d` at most; false when `done()` still does not hold.
  template <typename Duration, typename Pred>
  bool WaitFor(std::condition_variable& cv, const Duration& d, Pred done) {
    return cv.wait_for(lock_, d, done);
  }
  template <typename TimePoint>
  void WaitUntil(std::condition_variable& cv, const TimePoint& t) {
    cv.wait_until(lock_, t);
  }

 private:
  std::unique_lock<std::mutex> lock_;
};

}  // namespace mlarun
