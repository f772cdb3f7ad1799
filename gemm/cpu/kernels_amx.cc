// The amx kernel family: simd_kernels.inc compiled with the avx512 family's
// target flags plus AVX512-BF16, AMX-TILE and AMX-BF16
// (base/CMakeLists.txt), with the tile products of amx_tiles.inc.
// Call only through KernelsFor().
#define MLARUN_SIMD_AVX512 1
#define MLARUN_SIMD_AMX 1
#define MLARUN_SIMD_NS amx
#include "gemm/cpu/simd_kernels.inc"

namespace mlarun::cpu {
const CpuKernels& AmxKernels() { return amx::Table(); }
}  // namespace mlarun::cpu
