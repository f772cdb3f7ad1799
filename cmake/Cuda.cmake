# Optional CUDA backend. AUTO builds it when nvcc is found; no GPU is needed to
# build, and the tests that need one skip when none is present.
set(MLARUN_HAVE_CUDA OFF)
if(NOT MLARUN_CUDA STREQUAL "OFF")
  include(CheckLanguage)
  if(NOT CMAKE_CUDA_COMPILER AND EXISTS /usr/local/cuda/bin/nvcc)
    set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
  endif()
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    # sm_80 (A100; its PTX too, so later GPUs can JIT it) and sm_90a (H100/H200,
    # where the Hopper-only instructions are allowed). "native" fails on
    # machines without a GPU; scripts/gpu-check builds for the local GPU.
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      set(CMAKE_CUDA_ARCHITECTURES 80 90a-real)
    endif()
    # CMake 3.25 does not know the CUDA 20 dialect flags yet.
    set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION -std=c++20)
    set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION -std=c++20)
    enable_language(CUDA)
    set(CMAKE_CUDA_STANDARD 20)
    set(CMAKE_CUDA_STANDARD_REQUIRED ON)
    find_package(CUDAToolkit REQUIRED)
    set(MLARUN_HAVE_CUDA ON)
  elseif(MLARUN_CUDA STREQUAL "ON")
    message(FATAL_ERROR "MLARUN_CUDA=ON but no CUDA compiler was found")
  endif()
endif()
message(STATUS "mlarun CUDA backend: ${MLARUN_HAVE_CUDA}")

# NCCL ships with the CUDA toolkit here but has no CMake config.
if(MLARUN_HAVE_CUDA)
  find_path(NCCL_INCLUDE_DIR nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS} /usr/local/cuda/include)
  find_library(NCCL_LIBRARY nccl HINTS ${CUDAToolkit_LIBRARY_DIR} /usr/local/cuda/lib64)
  message(STATUS "mlarun NCCL: ${NCCL_LIBRARY}")
endif()
