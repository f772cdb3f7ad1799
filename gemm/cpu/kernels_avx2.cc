// The avx2 kernel family: simd_kernels.inc compiled with this family's
// target flags (base/CMakeLists.txt). Call only through KernelsFor().
#define MLARUN_SIMD_AVX2 1
#define MLARUN_SIMD_NS avx2
#include "gemm/cpu/simd_kernels.inc"

namespace mlarun::cpu {
const CpuKernels& Avx2Kernels() { return avx2::Table(); }
}  // namespace mlarun::cpu
