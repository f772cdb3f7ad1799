// fp32 <-> the element types kernels read and write (f32, bf16), on the
// device; bf16 rounds to nearest even, as the CPU's FloatToBf16 does.
#pragma once

#include <cuda_bf16.h>

namespace mlarun::cuda_convert {

__device__ inline float ToFloat(float x) { return x; }
__device__ inline float ToFloat(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ inline T FromFloat(float v);
template <>
__device__ inline float FromFloat<float>(float v) {
  return v;
}
template <>
__device__ inline __nv_bfloat16 FromFloat<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

}  // namespace mlarun::cuda_convert
