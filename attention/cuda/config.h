// The compile-time configuration of the CUDA MLA attention (as FlashMLA's
// csrc/sm90/decode/dense/config.h): the thread block of every kernel, the
// attention core's tile shapes, the limits of the decode's splits and the
// workspace's alignment. Plain C++ without CUDA headers: the host-only split
// plan (split_plan.h) reads it too.
#pragma once

#include <cstddef>
#include <cstdint>

namespace mlarun::cuda_mla {

// ---- Thread blocks ----------------------------------------------------------

// Warps per block of every kernel. In the attention core warp w owns query
// rows [w kRowsPerWarp, (w + 1) kRowsPerWarp) of the tile (mla_kernels.cuh).
inline constexpr int kWarps = 8;
// Threads per block of every kernel; the small ones loop over their elements.
inline constexpr int kThreads = 32 * kWarps;

// ---- Attention-core tiles ---------------------------------------------------

// The tile shapes of the attention core's variants (mla_cuda.cu, Variant):
// kRowsPerWarp query rows per warp (kWarps kRowsPerWarp rows per tile),
// 32 kKeysPerLane keys per tile, 32 kNJ 32-bit words of value columns per
// lane (the widest value the variant takes: 32 kNJ f32, 64 kNJ bf16). bf16
// keeps 64 x 64 tiles (the DeepSeek decode tile: 2 x 74 KB of rows and 16 KB
// of probabilities), or 16 x 64 when no sequence has more than 16 query rows;
// f32 rows are twice as wide, so 32 x 32.
struct Bf16NarrowTile {  // values up to 128 wide
  static constexpr int kRowsPerWarp = 8, kKeysPerLane = 2, kNJ = 2;
};
struct Bf16WideTile {  // up to 512
  static constexpr int kRowsPerWarp = 8, kKeysPerLane = 2, kNJ = 8;
};
// Up to 512, for batches whose sequences have at most 16 query rows (decode
// with h_q <= 16, e.g. DeepSeek-V3's 128 heads over 8 tensor-parallel
// ranks): 16-row tiles keep all 8 warps busy, and at 96 KB two blocks fit
// an SM.
struct Bf16FewTile {
  static constexpr int kRowsPerWarp = 2, kKeysPerLane = 2, kNJ = 8;
};
struct F32NarrowTile {  // up to 128
  static constexpr int kRowsPerWarp = 4, kKeysPerLane = 1, kNJ = 4;
};
struct F32WideTile {  // up to 512
  static constexpr int kRowsPerWarp = 4, kKeysPerLane = 1, kNJ = 16;
};
// The widest values (d_latent for the decode, d_v for the expanded path) any
// variant takes.
inline constexpr int64_t kMaxValueWidth = 512;

// ---- The decode's splits (split_plan.h) --------------------------------------

// Query rows one decode block serves where a SplitPlanConfig does not say:
// the 64-row bf16 tile.
inline constexpr int64_t kDefaultRowsPerBlock = kWarps * Bf16WideTile::kRowsPerWarp;
// Shortest split worth a partial result, in keys (rounded up to whole
// pages): each split writes, and the combine reads back, rows_per_block x
// d_latent floats, which must stay small next to the keys it attends to.
inline constexpr int64_t kMinSplitKeys = 128;
// Most splits of one sequence: bounds the partial buffer and the combine
// kernel's loop, and sizes its per-warp weight table in shared memory
// (kWarps x kMaxSplits floats).
inline constexpr int kMaxSplits = 64;
// Most split sequences one combine launch merges: its grid's y dimension
// (CUDA's limit).
inline constexpr int64_t kMaxCombineSeqs = 65535;

// ---- Workspace --------------------------------------------------------------

// Alignment of every workspace region and of every staged descriptor array
// within the plan's staging buffer.
inline constexpr size_t kRegionAlign = 256;

}  // namespace mlarun::cuda_mla
