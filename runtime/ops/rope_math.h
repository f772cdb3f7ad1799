// RoPE's pairing and rotation (rope.h, attention/rope.h RopeLayout), shared by
// the CPU op (runtime/ops/cpu/rope.cc) and the CUDA one
// (runtime/ops/cuda/rope.cu): given the same cos/sin, both write the same bits.
#pragma once

#include <cstdint>

#include "attention/rope.h"
#include "base/host_device.h"

namespace mlarun {

// Pair j of a rope slice of dim = 2 * half elements: the inputs it reads and
// the outputs it writes,
//   out[out_a] = in[in_a] cos_j - in[in_b] sin_j,
//   out[out_b] = in[in_b] cos_j + in[in_a] sin_j.
// The outputs of all pairs cover [0, dim) once. Under kInterleavedToHalf they
// are not the inputs, so a rotation in place reads the whole slice first.
struct RopePair {
  int64_t in_a, in_b, out_a, out_b;
};

MLARUN_HD inline RopePair RopePairOf(RopeLayout layout, int64_t j, int64_t half) {
  switch (layout) {
    case RopeLayout::kInterleavedToHalf:
      return {2 * j, 2 * j + 1, j, j + half};
    case RopeLayout::kInterleaved:
      return {2 * j, 2 * j + 1, 2 * j, 2 * j + 1};
    case RopeLayout::kHalf:
      break;
  }
  return {j, j + half, j, j + half};
}

// The rotation of one pair (a, b) by (c, s), each product rounded on its own:
// nvcc would otherwise fuse a product and the difference into an FMA, which
// the host's baseline x86-64 build does not have.
MLARUN_HD inline void RopeRotate(float a, float b, float c, float s, float& out_a, float& out_b) {
#if defined(__CUDA_ARCH__)
  out_a = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
  out_b = __fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s));
#else
  out_a = a * c - b * s;
  out_b = b * c + a * s;
#endif
}

}  // namespace mlarun
