// The GPU's memory behind DeviceMemory: cudaMalloc'd buffers on the current
// device, synchronous copies. Every call is checked (cuda_check.h).
#include <cuda_runtime.h>

#include <mutex>
#include <unordered_map>

#include "base/cuda/cuda_check.h"
#include "base/device_memory.h"

namespace mlarun {
namespace {

class Cuda final : public DeviceMemory {
 public:
  Backend backend() const override { return Backend::kCuda; }
  bool host_accessible() const override { return false; }
  void* Allocate(size_t bytes) override {
    void* p = nullptr;
    // cudaMalloc's buffers are 256-byte aligned.
    if (cudaMalloc(&p, bytes == 0 ? 1 : bytes) != cudaSuccess) {
      cudaGetLastError();  // clear it: out of memory is reported by the caller's Status
      return nullptr;
    }
    std::lock_guard<std::mutex> lock(mu_);
    sizes_[p] = bytes;
    live_ += static_cast<int64_t>(bytes);
    return p;
  }
  void Free(void* p) override {
    if (p == nullptr) return;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (auto it = sizes_.find(p); it != sizes_.end()) {
        live_ -= static_cast<int64_t>(it->second);
        sizes_.erase(it);
      }
    }
    cudaFree(p);
  }
  int64_t live_bytes() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return live_;
  }
  Status CopyIn(void* dst, const void* src, size_t bytes) override {
    MLARUN_CUDA_RETURN_IF_ERROR(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
    return Status::Ok();
  }
  Status CopyOut(void* dst, const void* src, size_t bytes) override {
    MLARUN_CUDA_RETURN_IF_ERROR(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost));
    return Status::Ok();
  }
  Status Zero(void* dst, size_t bytes) override {
    MLARUN_CUDA_RETURN_IF_ERROR(cudaMemset(dst, 0, bytes));
    return Status::Ok();
  }

 private:
  mutable std::mutex mu_;
  std::unordered_map<void*, size_t> sizes_;  // live allocations, for live_bytes()
  int64_t live_ = 0;
};

}  // namespace

StatusOr<DeviceMemory*> CudaMemory() {
  int count = 0;
  if (const cudaError_t err = cudaGetDeviceCount(&count); err != cudaSuccess || count == 0) {
    cudaGetLastError();
    return UnavailableError("CUDA memory: no usable device (",
                            err != cudaSuccess ? cudaGetErrorString(err) : "none visible", ")");
  }
  static Cuda cuda;
  return &cuda;
}

}  // namespace mlarun
