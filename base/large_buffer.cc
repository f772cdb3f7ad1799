#include "base/large_buffer.h"

#include <sys/mman.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>

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

HugePageUse ProcessHugePageUse() {
  HugePageUse use;
  std::ifstream in("/proc/self/smaps_rollup");
  std::string key;
  int64_t kib = 0;
  while (in >> key) {
    if (key == "FilePmdMapped:" || key == "AnonHugePages:") {
      if (!(in >> kib)) break;
      (key[0] == 'F' ? use.file_bytes : use.anon_bytes) = kib << 10;
    }
    in.ignore(1 << 12, '\n');
  }
  return use;
}

}  // namespace mlarun
