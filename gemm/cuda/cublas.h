// The cuBLAS handle of the current device, made on first use and kept for the
// process (cuBLAS handles are per device and not cheap to create), and the
// error check for cuBLAS calls. Include only from CUDA builds.
#pragma once

#include <cublas_v2.h>

#include "base/cuda/cuda_check.h"

namespace mlarun::cuda {

// The handle for the current device, on the legacy default stream (every op
// of this backend runs there, so its order is the host's call order).
StatusOr<cublasHandle_t> CublasHandle();

const char* CublasStatusName(cublasStatus_t s);

}  // namespace mlarun::cuda

#define MLARUN_CUBLAS_RETURN_IF_ERROR(expr)                                                                        \
  do {                                                                                                             \
    const cublasStatus_t mlarun_cublas_st_ = (expr);                                                               \
    if (mlarun_cublas_st_ != CUBLAS_STATUS_SUCCESS)                                                                \
      return ::mlarun::InternalError(#expr, " failed at ", __FILE__, ":", __LINE__, ::mlarun::cuda_check::Where(), \
                                     ": ", ::mlarun::cuda::CublasStatusName(mlarun_cublas_st_));                   \
  } while (0)
