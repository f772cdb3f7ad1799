// What the CUDA runtime sees, when the build has one. Plain C++: no CUDA
// headers, so every folder may include it. Never crashes on a machine without
// a GPU or driver: it reports none and says why.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "base/status.h"

namespace mlarun {

struct CudaDevice {
  int index = 0;
  std::string name;
  int sm_major = 0, sm_minor = 0;
  int64_t total_bytes = 0;
};

// True when this build compiled the CUDA backend.
bool CudaBuilt();

// Visible devices; UNAVAILABLE with the reason (no CUDA in the build, no
// driver, no device) when there are none.
StatusOr<std::vector<CudaDevice>> CudaDevices();

// Makes device `index` current for this process (cudaSetDevice), after
// checking it exists. UNAVAILABLE naming the reason when there is no usable
// GPU (or no CUDA in the build), INVALID_ARGUMENT for an index not visible.
Status SelectCudaDevice(int index);

// This process's rank on its node, for choosing its GPU (one rank per GPU on
// each node): Open MPI's OMPI_COMM_WORLD_LOCAL_RANK, else Slurm's
// SLURM_LOCALID, else `fallback`.
inline int NodeLocalRank(int fallback) {
  for (const char* name : {"OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID"}) {
    const char* v = std::getenv(name);
    if (v == nullptr || *v == '\0') continue;
    char* end = nullptr;
    const long r = std::strtol(v, &end, 10);
    if (*end == '\0' && r >= 0 && r < (1 << 20)) return static_cast<int>(r);
  }
  return fallback;
}

// The current device's memory as the driver sees it (cudaMemGetInfo).
struct CudaMemoryInfo {
  int device = 0;
  int64_t free_bytes = 0;
  int64_t total_bytes = 0;
};
StatusOr<CudaMemoryInfo> CurrentCudaMemory();

// The current device's copy bandwidth: a device-to-device cudaMemcpy of
// `bytes`, median of 5 after a warm-up, as bytes read plus bytes written per
// second (what a kernel streaming memory can at best reach), in GB/s.
StatusOr<double> MeasureCudaCopyGBps(size_t bytes = size_t{1} << 30);

// A label for CUDA error messages of this process (e.g. "rank 3 of 8"), set
// once a rank knows who it is. No-op in builds without CUDA.
void SetCudaErrorLabel(std::string label);

}  // namespace mlarun
