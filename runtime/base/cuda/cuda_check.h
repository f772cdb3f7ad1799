// CUDA error handling for .cu files: every runtime call goes through
// MLARUN_CUDA_RETURN_IF_ERROR, which turns a failure into a Status naming the
// expression, file and line. Include only from sources of CUDA builds (.cu, or
// .cc files that link the CUDA runtime): it needs cuda_runtime.h.
#pragma once

#include <cuda_runtime.h>

#include "runtime/base/status.h"

#define MLARUN_CUDA_RETURN_IF_ERROR(expr)                                                          \
  do {                                                                                              \
    const cudaError_t mlarun_cuda_err_ = (expr);                                                    \
    if (mlarun_cuda_err_ != cudaSuccess)                                                            \
      return ::mlarun::InternalError(#expr, " failed at ", __FILE__, ":", __LINE__, ": ",          \
                                     cudaGetErrorName(mlarun_cuda_err_), " (",                      \
                                     cudaGetErrorString(mlarun_cuda_err_), ")");                    \
  } while (0)
