// The avx512 kernel family: simd_kernels.inc compiled with this family's
// target flags (base/CMakeLists.txt). Call only through KernelsFor().
#define MLARUN_SIMD_AVX512 1
#define MLARUN_SIMD_NS avx512
#include "gemm/cpu/simd_kernels.inc"

namespace mlarun::cpu {
const CpuKernels& Avx512Kernels() { return avx512::Table(); }
}  // namespace mlarun::cpu
