#include "base/memory_tuning.h"

#include <cstdlib>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace mlarun {

bool TuneMallocForServer() {
#if defined(__GLIBC__)
  // mallopt returns 1 on success. Setting M_MMAP_THRESHOLD also turns off
  // glibc's dynamic threshold (and with it the dynamic trim threshold). What
  // the environment sets is left as it is.
  bool ok = true;
  if (std::getenv("MALLOC_ARENA_MAX") == nullptr) ok = mallopt(M_ARENA_MAX, kServerMallocArenas) == 1 && ok;
  if (std::getenv("MALLOC_MMAP_THRESHOLD_") == nullptr)
    ok = mallopt(M_MMAP_THRESHOLD, kServerMmapThresholdBytes) == 1 && ok;
  return ok;
#else
  return false;
#endif
}

}  // namespace mlarun
