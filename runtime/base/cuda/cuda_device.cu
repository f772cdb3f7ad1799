#include "runtime/base/cuda_device.h"

#include <cuda_runtime.h>

namespace mlarun {

bool CudaBuilt() { return true; }

StatusOr<std::vector<CudaDevice>> CudaDevices() {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    cudaGetLastError();  // clear the sticky error so later calls start clean
    return UnavailableError("no usable CUDA device: ", cudaGetErrorName(err), " (", cudaGetErrorString(err), ")");
  }
  if (count == 0) return UnavailableError("no CUDA device visible");
  std::vector<CudaDevice> out;
  for (int i = 0; i < count; ++i) {
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, i) != cudaSuccess) continue;
    out.push_back(CudaDevice{.index = i, .name = prop.name, .sm_major = prop.major, .sm_minor = prop.minor,
                             .total_bytes = static_cast<int64_t>(prop.totalGlobalMem)});
  }
  return out;
}

}  // namespace mlarun
