// TuneMallocForServer, in a process of its own (malloc's settings and arenas
// are per process): threads share a few arenas, and a large block freed goes
// back to the system instead of staying in an arena.
#include "base/memory_tuning.h"

#include <gtest/gtest.h>
#include <malloc.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace mlarun {
namespace {

// The arenas glibc has made so far: malloc_info's <heap nr=...> elements.
int ArenaCount() {
  char* buf = nullptr;
  size_t size = 0;
  FILE* f = open_memstream(&buf, &size);
  malloc_info(0, f);
  std::fclose(f);
  const std::string xml(buf, size);
  std::free(buf);
  int n = 0;
  for (size_t at = xml.find("<heap nr="); at != std::string::npos; at = xml.find("<heap nr=", at + 1)) ++n;
  return n;
}

// Where the allocations escape to: the compiler may not drop a malloc/free
// pair whose pointer is stored here.
void* volatile g_escape = nullptr;

void* Touched(size_t bytes) {
  void* p = std::malloc(bytes);
  std::memset(p, 1, bytes);
  g_escape = p;
  return p;
}

TEST(MemoryTuning, ThreadsShareAFewArenas) {
  ASSERT_TRUE(TuneMallocForServer());
  // Each new thread that allocates gets an arena of its own while there are
  // fewer than the limit (8 per core untuned).
  std::vector<std::thread> threads;
  for (int t = 0; t < 24; ++t)
    threads.emplace_back([t] {
      std::mt19937 rng(t);
      std::vector<void*> blocks;
      for (int i = 0; i < 2000; ++i) blocks.push_back(Touched(16 + rng() % 4096));
      for (void* p : blocks) std::free(p);
    });
  for (std::thread& th : threads) th.join();
  EXPECT_LE(ArenaCount(), kServerMallocArenas);
}

TEST(MemoryTuning, LargeBlockGoesBackWhenFreed) {
  ASSERT_TRUE(TuneMallocForServer());
  constexpr size_t kBody = size_t{10} << 20;  // a large request body
  // The first one freed is what raises glibc's dynamic threshold.
  std::free(Touched(kBody));
  const size_t free_before = mallinfo2().fordblks;
  void* body = Touched(kBody);
  void* pin = Touched(100000);  // after the body in the heap: no trimming past it
  std::free(body);
  const size_t free_after = mallinfo2().fordblks;
  const size_t kept = free_after > free_before ? free_after - free_before : 0;
  std::free(pin);
  EXPECT_LT(kept, size_t{1} << 20) << "malloc kept " << kept << " bytes of a freed " << kBody << "-byte block";
}

}  // namespace
}  // namespace mlarun
