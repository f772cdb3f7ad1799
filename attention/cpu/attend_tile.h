// The CPU attention tile: a block of query rows against one contiguous span
// of key/value rows, with a per-row causal limit, returning the normalized
// partial output and its log-sum-exp. Both MLA paths are built from it:
//   absorbed: rows are (token, head) pairs of the absorbed query [L + R], the
//             keys are gathered latent-cache rows and the values their first L
//             columns (MQA-shaped);
//   expanded: rows are one head's query tokens [P + R], keys and values that
//             head's up-projected K [P + R] and V [V] (MHA-shaped).
// Partial results over different key spans combine exactly with MergeLse.
#pragma once

#include <cstdint>

#include "base/dtype.h"
#include "base/status.h"
#include "gemm/cpu_gemm.h"

namespace mlarun::cpu {

// Keys are padded to a multiple of this, so tile shapes (and prepared GEMMs)
// come from a small set.
inline constexpr int64_t kKeyPad = 64;
inline int64_t PadKeys(int64_t n) { return (n + kKeyPad - 1) / kKeyPad * kKeyPad; }

// GEMM shapes of one tile: scores = Q K^T and out = P V.
GemmDesc TileScoresDesc(DType dtype, int64_t rows, int64_t n_pad, int64_t d_qk, int64_t ldq, int64_t ldk);
GemmDesc TilePvDesc(DType dtype, int64_t rows, int64_t n_pad, int64_t d_v, int64_t ldv, int64_t ldo);

struct TileArgs {
  DType dtype = DType::kF32;  // of q, k, v (f32 or bf16)
  const void* q = nullptr;    // [rows, d_qk], row stride ldq
  const void* k = nullptr;    // [n_pad, d_qk], row stride ldk; rows >= n_keys finite (never read by the result)
  const void* v = nullptr;    // [n_pad, d_v], row stride ldv; rows >= n_keys finite
  int64_t rows = 0;
  int64_t d_v = 0;
  int64_t n_keys = 0;  // real keys in the span
  int64_t n_pad = 0;   // PadKeys(n_keys)
  // Row i sees keys [0, clamp(vis_offset + (row_base + i) / rows_per_token, 0, n_keys)).
  int64_t vis_offset = 0;
  int64_t row_base = 0;
  int64_t rows_per_token = 1;
  float scale = 1.f;                     // softmax scale
  const CpuGemm* scores_gemm = nullptr;  // TileScoresDesc(...)
  const CpuGemm* pv_gemm = nullptr;      // TilePvDesc(..., ldo)
  // Per-thread scratch.
  float* scores = nullptr;     // [rows, n_pad] f32
  void* probs = nullptr;       // [rows, n_pad] of dtype (unused for f32)
  float* row_scale = nullptr;  // [rows]
  void* gemm_scratch = nullptr;
  // Results: out [rows, d_v] f32 (row stride ldo), normalized; lse [rows].
  // A row that sees no key gets out = 0 and lse = -inf.
  float* out = nullptr;
  int64_t ldo = 0;
  float* lse = nullptr;
};

Status AttendTile(const TileArgs& a);

// acc <- merge(acc, part): rows x d, both normalized with their lse. Exact:
// lse = log(e^lse_acc + e^lse_part), acc = acc w_acc + part w_part.
void MergeLse(float* acc, int64_t ld_acc, float* acc_lse, const float* part, int64_t ld_part, const float* part_lse,
              int64_t rows, int64_t d);

}  // namespace mlarun::cpu
