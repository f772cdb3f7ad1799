#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>

#include "base/cuda/cuda_check.h"
#include "base/cuda_device.h"

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
    out.push_back(CudaDevice{.index = i,
                             .name = prop.name,
                             .sm_major = prop.major,
                             .sm_minor = prop.minor,
                             .total_bytes = static_cast<int64_t>(prop.totalGlobalMem)});
  }
  return out;
}

Status SelectCudaDevice(int index) {
  MLARUN_ASSIGN_OR_RETURN(const std::vector<CudaDevice> devices, CudaDevices());
  if (index < 0 || index >= static_cast<int>(devices.size()))
    return InvalidArgumentError("CUDA device ", index, " requested, ", devices.size(), " visible");
  MLARUN_CUDA_RETURN_IF_ERROR(cudaSetDevice(index));
  return Status::Ok();
}

StatusOr<CudaMemoryInfo> CurrentCudaMemory() {
  CudaMemoryInfo info;
  MLARUN_CUDA_RETURN_IF_ERROR(cudaGetDevice(&info.device));
  size_t free_bytes = 0, total_bytes = 0;
  MLARUN_CUDA_RETURN_IF_ERROR(cudaMemGetInfo(&free_bytes, &total_bytes));
  info.free_bytes = static_cast<int64_t>(free_bytes);
  info.total_bytes = static_cast<int64_t>(total_bytes);
  return info;
}

StatusOr<double> MeasureCudaCopyGBps(size_t bytes) {
  void *a = nullptr, *b = nullptr;
  cudaEvent_t start = nullptr, stop = nullptr;
  auto release = [&] {
    if (a) cudaFree(a);
    if (b) cudaFree(b);
    if (start) cudaEventDestroy(start);
    if (stop) cudaEventDestroy(stop);
  };
  auto run = [&]() -> StatusOr<double> {
    MLARUN_CUDA_RETURN_IF_ERROR(cudaMalloc(&a, bytes));
    MLARUN_CUDA_RETURN_IF_ERROR(cudaMalloc(&b, bytes));
    MLARUN_CUDA_RETURN_IF_ERROR(cudaMemset(a, 1, bytes));
    MLARUN_CUDA_RETURN_IF_ERROR(cudaEventCreate(&start));
    MLARUN_CUDA_RETURN_IF_ERROR(cudaEventCreate(&stop));
    MLARUN_CUDA_RETURN_IF_ERROR(cudaMemcpy(b, a, bytes, cudaMemcpyDeviceToDevice));  // warm-up
    std::vector<double> gbps;
    for (int i = 0; i < 5; ++i) {
      MLARUN_CUDA_RETURN_IF_ERROR(cudaEventRecord(start));
      MLARUN_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice));
      MLARUN_CUDA_RETURN_IF_ERROR(cudaEventRecord(stop));
      MLARUN_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(stop));
      float ms = 0;
      MLARUN_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, start, stop));
      gbps.push_back(2.0 * static_cast<double>(bytes) / (ms * 1e-3) * 1e-9);
    }
    std::sort(gbps.begin(), gbps.end());
    return gbps[gbps.size() / 2];
  };
  StatusOr<double> r = run();
  release();
  return r;
}

}  // namespace mlarun
