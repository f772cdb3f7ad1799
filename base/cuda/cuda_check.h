// CUDA error handling for .cu files: every runtime call goes through
// MLARUN_CUDA_RETURN_IF_ERROR, every cuBLAS call through
// MLARUN_CUBLAS_RETURN_IF_ERROR, and every kernel launch is followed by
// MLARUN_CUDA_RETURN_IF_LAUNCH_FAILED. Each turns a failure into a Status
// naming the expression, file and line, the device and the rank label set at
// start-up (SetCudaErrorLabel in base/cuda_device.h). Include only
// from sources of CUDA builds (.cu, or .cc files that link the CUDA runtime).
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "base/status.h"

namespace mlarun::cuda_check {

// " on device D (rank label)": where a failure happened, for its message.
std::string Where();
// MLARUN_CUDA_SYNC=1 in the environment: every launch check also waits for
// the kernel, so an asynchronous fault is reported at the launch that caused
// it (slow; for debugging and scripts/gpu-check).
bool SyncAfterLaunch();
// The kernel launch check's body; `what` names the kernel.
Status LaunchStatus(const char* what, const char* file, int line);

}  // namespace mlarun::cuda_check

#define MLARUN_CUDA_RETURN_IF_ERROR(expr)                                                                          \
  do {                                                                                                             \
    const cudaError_t mlarun_cuda_err_ = (expr);                                                                   \
    if (mlarun_cuda_err_ != cudaSuccess)                                                                           \
      return ::mlarun::InternalError(#expr, " failed at ", __FILE__, ":", __LINE__, ::mlarun::cuda_check::Where(), \
                                     ": ", cudaGetErrorName(mlarun_cuda_err_), " (",                               \
                                     cudaGetErrorString(mlarun_cuda_err_), ")");                                   \
  } while (0)

// After a <<<...>>> launch: the launch's own error (bad configuration, no
// kernel image for this GPU) and, under MLARUN_CUDA_SYNC=1, the kernel's.
#define MLARUN_CUDA_RETURN_IF_LAUNCH_FAILED(what) \
  MLARUN_RETURN_IF_ERROR(::mlarun::cuda_check::LaunchStatus(what, __FILE__, __LINE__))
