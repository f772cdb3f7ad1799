#include "runtime/base/large_buffer.h"

#include <sys/mman.h>

#include <cstdlib>
#include <cstring>

namespace mlarun {

void* AllocateLarge(size_t bytes, bool zero) {
  constexpr size_t kHuge = size_t{2} << 20;
  const size_t align = bytes >= kHuge ? kHuge : 64;
  const size_t rounded = (bytes == 0 ? 1 : bytes + align - 1) / align * align;
  void* p = std::aligned_alloc(align, rounded);
  if (p == nullptr) return nullptr;
  // Advice only: without THP support the pages are simply 4 KiB.
  if (align == kHuge) (void)madvise(p, rounded, MADV_HUGEPAGE);
  if (zero) std::memset(p, 0, rounded);
  return p;
}

}  // namespace mlarun
