// Memory for big, long-lived buffers: weights of our own, the latent cache.
//
// Buffers of 2 MiB or more are 2 MiB aligned and marked for transparent huge
// pages (madvise; Linux's default THP mode only backs regions that ask).
// Streaming hundreds of MB through 4 KiB pages costs a page walk every 4 KiB,
// far dearer in a virtual machine (two-level translation): on this project's
// machines it halved the measured read bandwidth of an anonymous buffer, while
// a mapped file (the page cache's large folios) and a huge-page buffer both
// read at full speed.
#pragma once

#include <cstddef>
#include <cstdint>

namespace mlarun {

// `bytes` (rounded up to the alignment) of zero-filled memory when `zero`,
// else untouched; nullptr when it cannot be had. Release with std::free.
void* AllocateLarge(size_t bytes, bool zero);

// How much of this process's memory is mapped with 2 MiB pages
// (/proc/self/smaps_rollup): file pages (a mapped checkpoint whose page cache
// holds 2 MiB folios) and anonymous memory (AllocateLarge's buffers). Both 0
// where the kernel does not report them.
struct HugePageUse {
  int64_t file_bytes = 0;
  int64_t anon_bytes = 0;
};
HugePageUse ProcessHugePageUse();

}  // namespace mlarun
