// Plain parameter structs for MLA attention. No CUDA, MPI or gRPC includes:
// every backend (cpu/, cuda/) consumes exactly these.
//
// Glossary (docs/design.md "Attention"): h_q heads N, d_latent = kv_lora_rank L,
// d_rope R, d_nope P, d_v V. A cache row is [kv_c (L) | k_pe (R)], kv_c after
// kv_a_layernorm and k_pe after RoPE.
#pragma once

#include <cstdint>
#include <ostream>

#include "base/dtype.h"
#include "base/tensor_view.h"

namespace mlarun {

struct MlaShape {
  int64_t h_q = 0;       // query heads on this rank (N)
  int64_t d_latent = 0;  // kv_lora_rank (L)
  int64_t d_rope = 0;    // qk_rope_head_dim (R)
  int64_t d_nope = 0;    // qk_nope_head_dim (P)
  int64_t d_v = 0;       // v_head_dim (V)

  int64_t d_qk() const { return d_nope + d_rope; }       // expanded key width, 192 in DeepSeek-V3
  int64_t d_cache() const { return d_latent + d_rope; }  // cache row width, 576 in DeepSeek-V3
  friend bool operator==(const MlaShape&, const MlaShape&) = default;
};
std::ostream& operator<<(std::ostream& os, const MlaShape& s);

// DeepSeek-V3's attention dimensions with `heads` query heads.
inline MlaShape DeepSeekV3MlaShape(int64_t heads = 128) {
  return MlaShape{.h_q = heads, .d_latent = 512, .d_rope = 64, .d_nope = 128, .d_v = 128};
}

// One MLA attention call over a batch of sequences (one layer).
//
// Sequence i owns query tokens [query_start[i], query_start[i+1]) and attends
// to seq_lens[i] keys: a cached prefix of seq_lens[i] - q_len_i rows followed by
// the rows of its own q_len_i new tokens, all of which the caller has already
// written into the cache. Query token j of the block (0-based) sits at position
// prefix + j and sees keys [0, prefix + j].
//
// Nothing here is owned; every pointer must stay valid for the call.
struct MlaParams {
  MlaShape shape;

  // Queries: [num_tokens, h_q, d_nope + d_rope] fp32; per head the nope part,
  // then the rope part already rotated. Element (t, h, c) at
  // q[t * q_stride_token + h * q_stride_head + c].
  const float* q = nullptr;
  int64_t num_tokens = 0;
  int64_t q_stride_token = 0;
  int64_t q_stride_head = 0;

  // Split kv_b_proj, contiguous, dtype w_dtype (must equal the cache dtype):
  //   w_uk_t [h_q, d_nope, d_latent]: per head W_UK^T (k_nope = kv_c @ W_UK)
  //   w_uv   [h_q, d_latent, d_v]:    per head W_UV   (v = kv_c @ W_UV)
  const void* w_uk_t = nullptr;
  const void* w_uv = nullptr;
  DType w_dtype = DType::kBF16;

  // One layer of the paged latent cache; rows of width d_latent + d_rope.
  PagedRowsView cache;

  // Batch description (host memory).
  int32_t num_seqs = 0;
  const int32_t* query_start = nullptr;  // [num_seqs + 1], 0 ... num_tokens, non-decreasing
  const int32_t* seq_lens = nullptr;     // [num_seqs]
  const int32_t* block_table = nullptr;  // [num_seqs, block_table_stride]; row i needs
  int64_t block_table_stride = 0;        //   ceil(seq_lens[i] / block_size) valid ids

  // 1/sqrt(d_nope + d_rope), times mscale^2 under YaRN (MlaSoftmaxScale).
  float softmax_scale = 0.f;

  // Output: [num_tokens, h_q, d_v] fp32, element (t, h, c) at
  // out[t * out_stride_token + h * out_stride_head + c].
  float* out = nullptr;
  int64_t out_stride_token = 0;
  int64_t out_stride_head = 0;
  // Optional (may be nullptr): [num_tokens, h_q] natural-log log-sum-exp of
  // each row's scaled scores, contiguous.
  float* lse = nullptr;
};

// Keys visible to query token `j` of a block over a cached prefix of `prefix`
// keys: [0, prefix + j]. Every backend's causal mask is this function.
inline int64_t CausalVisibleKeys(int64_t prefix, int64_t j) { return prefix + j + 1; }

}  // namespace mlarun
