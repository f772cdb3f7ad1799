// The scalar kernel family: simd_kernels.inc compiled with this family's
// target flags (base/CMakeLists.txt). Call only through KernelsFor().
#define MLARUN_SIMD_SSE2 1
#define MLARUN_SIMD_NS sse2
#include "gemm/cpu/simd_kernels.inc"

namespace mlarun::cpu {
const CpuKernels& ScalarKernels() { return sse2::Table(); }
}  // namespace mlarun::cpu
