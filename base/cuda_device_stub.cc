// Built when the CUDA backend is not: the same API, reporting its absence.
#include "base/cuda_device.h"
#include "base/device_memory.h"

namespace mlarun {

bool CudaBuilt() { return false; }

void SetCudaErrorLabel(std::string) {}

Status SelectCudaDevice(int) { return CudaDevices().status(); }

StatusOr<CudaMemoryInfo> CurrentCudaMemory() { return CudaDevices().status(); }

StatusOr<double> MeasureCudaCopyGBps(size_t) { return CudaDevices().status(); }

StatusOr<std::vector<CudaDevice>> CudaDevices() {
  return UnavailableError("this build has no CUDA backend (configure with nvcc available, or -DMLARUN_CUDA=ON)");
}

StatusOr<DeviceMemory*> CudaMemory() {
  return UnimplementedError("CUDA memory: this build has no CUDA backend (configure with nvcc available)");
}

}  // namespace mlarun
