// What the CUDA runtime sees, when the build has one. Plain C++: no CUDA
// headers, so every folder may include it. Never crashes on a machine without
// a GPU or driver: it reports none and says why.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "runtime/base/status.h"

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

// A label for CUDA error messages of this process (e.g. "rank 3 of 8"), set
// once a rank knows who it is. No-op in builds without CUDA.
void SetCudaErrorLabel(std::string label);

}  // namespace mlarun
