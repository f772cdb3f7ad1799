// Linear layers over f8_e4m3 weights with 128 x 128 block scales on the GPU
// (linear.h, docs/fp8-weights.md): y[rows, n] (=|+=) x W_slice^T, W_slice the
// weight rows [col_begin, col_end), element (r, c) of W = e4m3(data[r * ld +
// c]) * scale[(r / 128) * scale_ld + c / 128].
//
// Every weight is decoded exactly as the CPU decodes it: the e4m3 bits moved
// into binary16 positions (E4M3PairToF16x2Bits / E4M3ToF16Bits, shared with
// the host tests), converted to fp32, times scale x 256; so each dequantized
// element is the fp32 rounding of e4m3 x scale. The activations stay fp32 (no
// rounding, as on the CPU); sums are fp32. Two kernels, on the legacy stream:
//
//  * Fp8GemvKernel, rows <= 4 (decode, where reading the weights is the whole
//    cost): one warp per weight row, each lane 16 bytes of it per step (the
//    warp reads 512 contiguous bytes), decoded in registers and dotted with
//    each x row (x from L1/L2: every warp of the grid reads the same rows);
//    a butterfly sum ends each row. 16-byte loads need the weight rows and x
//    rows 16-byte aligned (checked on the host); otherwise, and for the last
//    in % 16 columns, one element per lane per step.
//  * Fp8TileKernel, more rows: a block computes 16 x rows x 64 weight rows,
//    k in tiles of 128 (so one scale per weight row per tile): the tile's
//    e4m3 bytes are loaded (two 16-byte loads per thread where aligned),
//    dequantized into shared memory, the x tile staged beside them, and each
//    thread accumulates one output column over a quarter of the tile for all
//    16 rows; the four quarters are summed through shared memory at the end.
//    Simple, not tuned for prefill (each block of x rows rereads W, from L2).
#include <cuda_fp16.h>

#include <cstdint>

#include "base/float8.h"
#include "runtime/ops/backend.h"
#include "runtime/ops/cuda/common.cuh"

namespace mlarun::cuda {
namespace {

// 16 e4m3 (one 16-byte load, element 0 in the lowest byte) times `s` (the
// block scale x 256) into out[0 .. 16).
__device__ __forceinline__ void Dequant16(const uint4& q, float s, float* out) {
  const uint32_t words[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint32_t bits = E4M3PairToF16x2Bits(words[i] >> (16 * h));
      __half2_raw raw;
      raw.x = static_cast<unsigned short>(bits & 0xffffu);
      raw.y = static_cast<unsigned short>(bits >> 16);
      const float2 f = __half22float2(__half2(raw));
      out[4 * i + 2 * h] = f.x * s;
      out[4 * i + 2 * h + 1] = f.y * s;
    }
  }
}

// One e4m3 / 256 (the same route, one element).
__device__ __forceinline__ float DecodeOne(uint8_t b) {
  __half_raw raw;
  raw.x = E4M3ToF16Bits(b);
  return __half2float(__half(raw));
}

constexpr int kGemvWarps = 8;  // weight rows per block
constexpr int kGemvThreads = 32 * kGemvWarps;

// w: the slice's row 0 (row row0 of the weight), rows ld bytes apart; n
// rows; scale: the weight's scales (row0 picks the block row). y[m][j] for
// m < MR, j < n.
template <int MR, bool kVec>
__global__ void __launch_bounds__(kGemvThreads)
    Fp8GemvKernel(const uint8_t* __restrict__ w, int64_t ld, const float* __restrict__ scale, int64_t scale_ld,
                  int64_t row0, int64_t n, int64_t in, const float* __restrict__ x, int64_t ldx, float* __restrict__ y,
                  int64_t ldy, bool accumulate) {
  const int lane = threadIdx.x & 31;
  const int64_t j = static_cast<int64_t>(blockIdx.x) * kGemvWarps + (threadIdx.x >> 5);
  if (j >= n) return;  // j is the warp's: whole warps leave, the shuffles below see all 32 lanes
  const uint8_t* wr = w + j * ld;
  const float* srow = scale + ((row0 + j) / kFp8Block) * scale_ld;
  float acc[MR];
#pragma unroll
  for (int m = 0; m < MR; ++m) acc[m] = 0.f;
  int64_t k_vec = 0;  // columns the 16-byte path covered
  if constexpr (kVec) {
    const int64_t chunks = in / 16;
    const uint4* wq = reinterpret_cast<const uint4*>(wr);
#pragma unroll 2
    for (int64_t c = lane; c < chunks; c += 32) {
      const uint4 q = __ldg(wq + c);
      const int64_t k = c * 16;  // 16 columns of one 128-column block
      float wf[16];
      Dequant16(q, __ldg(srow + k / kFp8Block) * kE4M3HalfScale, wf);
#pragma unroll
      for (int m = 0; m < MR; ++m) {
        const float4* xr = reinterpret_cast<const float4*>(x + m * ldx + k);
        float a = acc[m];
#pragma unroll
        for (int v = 0; v < 4; ++v) {
          const float4 xv = __ldg(xr + v);
          a = fmaf(xv.x, wf[4 * v], a);
          a = fmaf(xv.y, wf[4 * v + 1], a);
          a = fmaf(xv.z, wf[4 * v + 2], a);
          a = fmaf(xv.w, wf[4 * v + 3], a);
        }
        acc[m] = a;
      }
    }
    k_vec = chunks * 16;
  }
  for (int64_t k = k_vec + lane; k < in; k += 32) {
    const float wv = DecodeOne(wr[k]) * (srow[k / kFp8Block] * kE4M3HalfScale);
#pragma unroll
    for (int m = 0; m < MR; ++m) acc[m] = fmaf(x[m * ldx + k], wv, acc[m]);
  }
#pragma unroll
  for (int m = 0; m < MR; ++m) {
    const float s = WarpReduce(acc[m], [](float a, float b) { return a + b; });
    if (lane == 0) {
      float* out = y + m * ldy + j;
      *out = accumulate ? *out + s : s;
    }
  }
}

constexpr int kTileN = 64;   // weight rows (output columns) per block
constexpr int kTileM = 16;   // x rows per block
constexpr int kTileK = 128;  // k per tile: one block column of scales
constexpr int kTileThreads = 256;
// Each thread: one of the 64 columns, one quarter (32) of the tile's k.
constexpr int kKGroups = kTileThreads / kTileN;
static_assert(kKGroups * 32 == kTileK, "four quarters of 32 cover a tile");
// Loading W: 4 threads per weight row, 32 bytes each.
static_assert(kTileN * kTileK / 32 == kTileThreads, "one 32-byte piece of the W tile per thread");
static_assert(kTileM * kKGroups * kTileN <= kTileN * (kTileK + 1), "the final sums fit where the W tile was");

__global__ void __launch_bounds__(kTileThreads)
    Fp8TileKernel(const uint8_t* __restrict__ w, int64_t ld, const float* __restrict__ scale, int64_t scale_ld,
                  int64_t row0, int64_t n, int64_t in, const float* __restrict__ x, int64_t ldx, int64_t rows,
                  float* __restrict__ y, int64_t ldy, bool accumulate, bool vec) {
  // +1: column c's k run starts in bank (c + k) % 32, so the 32 columns a
  // warp reads at one k hit 32 banks.
  __shared__ float ws[kTileN][kTileK + 1];  // 33,024 B
  __shared__ float xs[kTileM][kTileK + 1];  //  8,256 B
  const int t = threadIdx.x;
  const int64_t j0 = static_cast<int64_t>(blockIdx.x) * kTileN, m0 = static_cast<int64_t>(blockIdx.y) * kTileM;
  const int c = t % kTileN, kg = t / kTileN;  // compute role
  const int lr = t / 4, ls = t % 4;           // load role: weight row lr of the tile, bytes [32 ls, 32 ls + 32)
  const int64_t wj = j0 + lr;
  const bool w_row_ok = wj < n;
  const uint8_t* wrow = w + wj * ld;  // read only when w_row_ok
  const float* srow = scale + ((row0 + wj) / kFp8Block) * scale_ld;
  float acc[kTileM];
#pragma unroll
  for (int mi = 0; mi < kTileM; ++mi) acc[mi] = 0.f;

  for (int64_t k0 = 0; k0 < in; k0 += kTileK) {
    // The W tile, dequantized: ws[lr][32 ls + e] = W[j0 + lr][k0 + 32 ls + e].
    float* dst = &ws[lr][ls * 32];
    const int64_t kb = k0 + ls * 32;
    if (w_row_ok) {
      const float s = srow[k0 / kTileK] * kE4M3HalfScale;
      if (vec && kb + 32 <= in) {
        const uint4* src = reinterpret_cast<const uint4*>(wrow + kb);
        const uint4 q0 = __ldg(src), q1 = __ldg(src + 1);
        float f[16];
        Dequant16(q0, s, f);
#pragma unroll
        for (int e = 0; e < 16; ++e) dst[e] = f[e];
        Dequant16(q1, s, f);
#pragma unroll
        for (int e = 0; e < 16; ++e) dst[16 + e] = f[e];
      } else {
        for (int e = 0; e < 32; ++e) dst[e] = kb + e < in ? DecodeOne(wrow[kb + e]) * s : 0.f;
      }
    } else {
      for (int e = 0; e < 32; ++e) dst[e] = 0.f;
    }
    // The x tile: xs[mi][ki] = x[m0 + mi][k0 + ki], zero outside.
    for (int e = t; e < kTileM * kTileK; e += kTileThreads) {
      const int mi = e / kTileK, ki = e % kTileK;
      const int64_t m = m0 + mi, k = k0 + ki;
      xs[mi][ki] = m < rows && k < in ? x[m * ldx + k] : 0.f;
    }
    __syncthreads();
#pragma unroll 4
    for (int kk = kg * 32; kk < kg * 32 + 32; ++kk) {
      const float wv = ws[c][kk];
#pragma unroll
      for (int mi = 0; mi < kTileM; ++mi) acc[mi] = fmaf(xs[mi][kk], wv, acc[mi]);
    }
    __syncthreads();  // before the next tile overwrites ws and xs
  }

  // The four quarters' sums, [kg][mi][c], where the W tile was (the loop's
  // last barrier keeps every read of it before these writes).
  float* red = &ws[0][0];
#pragma unroll
  for (int mi = 0; mi < kTileM; ++mi) red[(kg * kTileM + mi) * kTileN + c] = acc[mi];
  __syncthreads();
  for (int e = t; e < kTileM * kTileN; e += kTileThreads) {
    const int mi = e / kTileN, cc = e % kTileN;
    const int64_t m = m0 + mi, j = j0 + cc;
    if (m >= rows || j >= n) continue;
    float v = 0.f;
#pragma unroll
    for (int g = 0; g < kKGroups; ++g) v += red[(g * kTileM + mi) * kTileN + cc];
    float* out = y + m * ldy + j;
    *out = accumulate ? *out + v : v;
  }
}

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

template <int MR>
Status LaunchGemv(const LinearParams& p, const uint8_t* base, int64_t n, bool vec) {
  const Linear& w = *p.w;
  const unsigned blocks = static_cast<unsigned>((n + kGemvWarps - 1) / kGemvWarps);
  if (vec) {
    Fp8GemvKernel<MR, true><<<blocks, kGemvThreads>>>(base, w.ld, w.scale, w.scale_ld, p.col_begin, n, w.in, p.x, p.ldx,
                                                      p.y, p.ldy, p.accumulate);
  } else {
    Fp8GemvKernel<MR, false><<<blocks, kGemvThreads>>>(base, w.ld, w.scale, w.scale_ld, p.col_begin, n, w.in, p.x,
                                                       p.ldx, p.y, p.ldy, p.accumulate);
  }
  MLARUN_CUDA_RETURN_IF_LAUNCH_FAILED("Fp8GemvKernel");
  return Status::Ok();
}

}  // namespace

Status ApplyLinearFp8(const LinearParams& p) {
  if (p.w == nullptr) return InvalidArgumentError("linear (f8_e4m3): w is null");
  const Linear& w = *p.w;
  const int64_t col_end = p.col_end < 0 ? w.out : p.col_end;
  const int64_t rows = p.rows, n = col_end - p.col_begin;
  if (w.dtype != DType::kF8E4M3)
    return InvalidArgumentError("linear (f8_e4m3): weight dtype is ", DTypeName(w.dtype), ", not f8_e4m3");
  if (p.col_begin < 0 || n < 0 || col_end > w.out)
    return InvalidArgumentError("linear (f8_e4m3): columns [", p.col_begin, ", ", col_end, ") outside [0, ", w.out,
                                ")");
  if (rows == 0 || n == 0) return Status::Ok();
  if (w.data == nullptr || w.scale == nullptr)
    return FailedPreconditionError("linear (f8_e4m3): weight [", w.out, ", ", w.in, "] has no data or no scales");
  if (w.ld < w.in || w.scale_ld < Fp8Blocks(w.in))
    return InvalidArgumentError("linear (f8_e4m3): ld (", w.ld, ") < in (", w.in, ") or scale_ld (", w.scale_ld,
                                ") < ceil(in / 128) (", Fp8Blocks(w.in), ")");
  if (p.x == nullptr || p.y == nullptr || p.ldx < w.in || p.ldy < n)
    return InvalidArgumentError("linear (f8_e4m3): x and y must be set, ldx >= in, ldy >= col_end - col_begin");
  const uint8_t* base = reinterpret_cast<const uint8_t*>(w.row(p.col_begin));
  const bool w_vec = Aligned16(base) && w.ld % 16 == 0;
  if (rows <= 4) {
    const bool vec = w_vec && Aligned16(p.x) && p.ldx % 4 == 0;
    switch (rows) {
      case 1:
        return LaunchGemv<1>(p, base, n, vec);
      case 2:
        return LaunchGemv<2>(p, base, n, vec);
      case 3:
        return LaunchGemv<3>(p, base, n, vec);
      default:
        return LaunchGemv<4>(p, base, n, vec);
    }
  }
  const int64_t row_tiles = (rows + kTileM - 1) / kTileM;
  if (row_tiles > 65535)
    return InvalidArgumentError("linear (f8_e4m3): ", rows, " rows exceed the grid (", 65535 * kTileM, " at most)");
  const int64_t col_tiles = (n + kTileN - 1) / kTileN;
  MLARUN_RETURN_IF_ERROR(CheckInt("linear (f8_e4m3)", "column tiles", col_tiles));
  const dim3 grid(static_cast<unsigned>(col_tiles), static_cast<unsigned>(row_tiles));
  Fp8TileKernel<<<grid, kTileThreads>>>(base, w.ld, w.scale, w.scale_ld, p.col_begin, n, w.in, p.x, p.ldx, rows, p.y,
                                        p.ldy, p.accumulate, w_vec);
  MLARUN_CUDA_RETURN_IF_LAUNCH_FAILED("Fp8TileKernel");
  return Status::Ok();
}

}  // namespace mlarun::cuda
