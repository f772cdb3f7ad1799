// glibc malloc settings for the long-running front-end processes (`mlarun
// coordinator`, `mlarun serve`): hundreds of threads, and request bodies of
// up to megabytes that live for one request.
#pragma once

namespace mlarun {

inline constexpr int kServerMallocArenas = 4;
inline constexpr int kServerMmapThresholdBytes = 1 << 20;

// Caps malloc's arenas at kServerMallocArenas (glibc otherwise gives threads
// up to 8 per core, each keeping what its threads freed) and fixes the mmap
// threshold at kServerMmapThresholdBytes: a block that large is mapped and
// unmapped on free. Left dynamic, glibc raises the threshold to the size of
// each large block freed (up to 32 MiB), after which such blocks come from
// the arenas and stay there. MALLOC_ARENA_MAX or MALLOC_MMAP_THRESHOLD_ in
// the environment keeps its own setting. Call before the process starts
// threads. Returns false when malloc refuses a setting (or is not glibc's):
// nothing else is wrong, the process only keeps more memory.
bool TuneMallocForServer();

}  // namespace mlarun
