// Device code of the CUDA MLA attention (included only by mla_cuda.cu).
//
// Both paths share one attention core, AttendRange: a tile of query rows kept
// in shared memory against successive tiles of keys, fp32 FMA products,
// online softmax in fp32 (lse_merge.h), the output accumulator in registers.
//
// Thread layout (config.h: kThreads = 256 = 8 warps). Warp w owns query rows
// [w kRowsPerWarp, (w + 1) kRowsPerWarp) of the tile: their scores, softmax
// state, probabilities and output accumulator, so within a key tile a warp
// only waits for itself (__syncwarp); the whole block synchronizes only
// around loading a key tile, which every warp then reads.
//  * scores: lane owns keys lane + 32 c (c < kKeysPerLane) of the tile and
//    loops over the d_qk columns one 32-bit word (one f32, two bf16) at a
//    time: the query word is a broadcast, the key rows have an odd stride in
//    words so the 32 lanes hit 32 different banks;
//  * values: lane owns the words lane + 32 j (j < kNJ) of the value columns
//    (contiguous across lanes: conflict-free), the probability of each key a
//    broadcast from the warp's slice of sP.
// Shared memory (all 32-bit words, rows padded to an odd count, the pad zero):
//   sQ [kQRows][ldq]  sK [kKeys][ldk]  (sV [kKeys][ldv] when values are not
//   the keys' first columns)  sP [kQRows][kKeys] f32.
// bf16 follows the CPU backend's rounding: operands in the cache dtype, the
// probabilities rounded to bf16 before the value product while the softmax
// sums the unrounded ones; every product accumulates in fp32.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "attention/cuda/config.h"
#include "attention/cuda/lse_merge.h"
#include "attention/cuda/split_plan.h"
#include "base/cuda/convert.cuh"

namespace mlarun::cuda_mla {

template <typename T>
struct Elem;
template <>
struct Elem<float> {
  static constexpr int kVec = 1;  // elements per 32-bit word
};
template <>
struct Elem<__nv_bfloat16> {
  static constexpr int kVec = 2;
};

// CausalVisibleKeys (mla_params.h) for device code: keys [0, prefix + j]
// are visible to query token j of a block over `prefix` cached keys.
__host__ __device__ inline int64_t CausalVisibleKeysDev(int64_t prefix, int64_t j) { return prefix + j + 1; }

// Words per shared-memory row of n elements: rounded up, then odd.
template <typename T>
__host__ __device__ inline int LdWords(int n) {
  const int w = (n + Elem<T>::kVec - 1) / Elem<T>::kVec;
  return w | 1;
}

using cuda_convert::FromFloat;
using cuda_convert::ToFloat;
// What the CPU multiplies the values with: the probability in the cache dtype.
template <typename T>
__device__ inline float RoundLikeCache(float v) {
  return ToFloat(FromFloat<T>(v));
}

// The kVec elements of a word, as floats.
template <typename T>
__device__ inline void Unpack(uint32_t w, float* out);
template <>
__device__ inline void Unpack<float>(uint32_t w, float* out) {
  out[0] = __uint_as_float(w);
}
template <>
__device__ inline void Unpack<__nv_bfloat16>(uint32_t w, float* out) {
  out[0] = __uint_as_float(w << 16);
  out[1] = __uint_as_float(w & 0xffff0000u);
}

// acc + a . b over the kVec elements of two words.
template <typename T>
__device__ inline float WordDot(uint32_t a, uint32_t b, float acc) {
  float fa[Elem<T>::kVec], fb[Elem<T>::kVec];
  Unpack<T>(a, fa);
  Unpack<T>(b, fb);
#pragma unroll
  for (int e = 0; e < Elem<T>::kVec; ++e) acc = fmaf(fa[e], fb[e], acc);
  return acc;
}

__device__ inline float WarpMax(float v) {
#pragma unroll
  for (int o = 16; o > 0; o /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ inline float WarpSum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// One warp copies a row of n elements into ldw shared words (the words past
// the row zeroed); src == nullptr writes a zero row. vec16: src and n * sizeof(T)
// are 16-byte aligned, so the row moves in 16-byte loads.
template <typename T>
__device__ inline void CopyRowToSmem(uint32_t* dst, int ldw, const T* src, int n, bool vec16, int lane) {
  if (src == nullptr) {
    for (int w = lane; w < ldw; w += 32) dst[w] = 0u;
    return;
  }
  if (vec16) {
    const int chunks = n * static_cast<int>(sizeof(T)) / 16;
    const uint4* s4 = reinterpret_cast<const uint4*>(src);
    for (int ch = lane; ch < chunks; ch += 32) {
      const uint4 v = s4[ch];
      dst[4 * ch] = v.x;
      dst[4 * ch + 1] = v.y;
      dst[4 * ch + 2] = v.z;
      dst[4 * ch + 3] = v.w;
    }
    for (int w = 4 * chunks + lane; w < ldw; w += 32) dst[w] = 0u;
    return;
  }
  T* de = reinterpret_cast<T*>(dst);
  for (int c = lane; c < n; c += 32) de[c] = src[c];
  const T zero = FromFloat<T>(0.f);
  for (int c = n + lane; c < ldw * Elem<T>::kVec; c += 32) de[c] = zero;
}

// A warp's query rows: softmax state and output accumulator (registers).
template <int kRowsPerWarp, int kCols>
struct RowState {
  float m[kRowsPerWarp];
  float l[kRowsPerWarp];
  float acc[kRowsPerWarp][kCols];
};

// The attention core: keys [k_begin, k_end) in tiles of kKeys, for the rows
// of this thread's warp. Called by every thread of the block (it contains
// __syncthreads). load_tile(kb, n) must fill sK (and sV) rows [0, kKeys) with
// keys kb .. kb + n - 1 and zero rows past n; it is called by every thread.
//   vis[i]: keys [0, vis[i]) (absolute) are visible to the warp's row i; 0 for
//           a row past the tile;
//   warp_active: the warp has at least one row (else it only helps loading).
template <typename T, int kRowsPerWarp, int kKeysPerLane, int kNJ, typename LoadTile>
__device__ __forceinline__ void AttendRange(const uint32_t* sQ, int ldq, const uint32_t* sK, int ldk,
                                            const uint32_t* sV, int ldv, float* sP, int qk_words, int v_words,
                                            int64_t k_begin, int64_t k_end, const int64_t* vis, bool warp_active,
                                            float scale, LoadTile&& load_tile,
                                            RowState<kRowsPerWarp, kNJ * Elem<T>::kVec>& st) {
  constexpr int kKeys = 32 * kKeysPerLane;
  constexpr int kVec = Elem<T>::kVec;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const uint32_t* q_rows = sQ + warp * kRowsPerWarp * ldq;
  float* p_rows = sP + warp * kRowsPerWarp * kKeys;
  for (int64_t kb = k_begin; kb < k_end; kb += kKeys) {
    const int n_keys = static_cast<int>(k_end - kb < kKeys ? k_end - kb : kKeys);
    __syncthreads();  // every warp is done with the previous tile
    load_tile(kb, n_keys);
    __syncthreads();
    if (!warp_active) continue;

    float s[kRowsPerWarp][kKeysPerLane];
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i)
#pragma unroll
      for (int c = 0; c < kKeysPerLane; ++c) s[i][c] = 0.f;
    for (int w = 0; w < qk_words; ++w) {
      uint32_t kw[kKeysPerLane];
#pragma unroll
      for (int c = 0; c < kKeysPerLane; ++c) kw[c] = sK[(lane + 32 * c) * ldk + w];
#pragma unroll
      for (int i = 0; i < kRowsPerWarp; ++i) {
        const uint32_t qw = q_rows[i * ldq + w];
#pragma unroll
        for (int c = 0; c < kKeysPerLane; ++c) s[i][c] = WordDot<T>(qw, kw[c], s[i][c]);
      }
    }

#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i) {
      float x[kKeysPerLane];
      float tile_max = kLseNegInf;
#pragma unroll
      for (int c = 0; c < kKeysPerLane; ++c) {
        const int k = lane + 32 * c;
        x[c] = (k < n_keys && kb + k < vis[i]) ? s[i][c] * scale : kLseNegInf;
        tile_max = fmaxf(tile_max, x[c]);
      }
      tile_max = WarpMax(tile_max);
      const float m_new = fmaxf(st.m[i], tile_max);
      const float alpha = SoftmaxRescale(st.m[i], m_new);
      float sum = 0.f;
#pragma unroll
      for (int c = 0; c < kKeysPerLane; ++c) {
        const float pr = SoftmaxProb(x[c], m_new);
        sum += pr;
        p_rows[i * kKeys + lane + 32 * c] = RoundLikeCache<T>(pr);
      }
      sum = WarpSum(sum);
      st.l[i] = st.l[i] * alpha + sum;
      st.m[i] = m_new;
#pragma unroll
      for (int j = 0; j < kNJ * kVec; ++j) st.acc[i][j] *= alpha;
    }
    __syncwarp();

    for (int k = 0; k < n_keys; ++k) {
      float v[kNJ * kVec];
#pragma unroll
      for (int j = 0; j < kNJ; ++j) {
        const int w = lane + 32 * j;
        const uint32_t vw = w < v_words ? sV[k * ldv + w] : 0u;
        Unpack<T>(vw, v + j * kVec);
      }
#pragma unroll
      for (int i = 0; i < kRowsPerWarp; ++i) {
        const float pr = p_rows[i * kKeys + k];
#pragma unroll
        for (int j = 0; j < kNJ * kVec; ++j) st.acc[i][j] = fmaf(pr, v[j], st.acc[i][j]);
      }
    }
    // sP is rewritten only after the next tile's __syncthreads.
  }
}

// ---- Absorbed path ------------------------------------------------------

// Per absorbed sequence (device copy of the plan's).
struct DecodeSeq {
  int32_t tok_offset;  // its first absorbed token: rows tok_offset * h_q + r of qa / olat
  int32_t token0;      // its first token in the batch: rows token0 * h_q + r of lse
  int32_t prefix;      // cached keys before its query block
  int32_t q_len;
  int64_t table_offset;    // its block-table row in the compacted table
  int64_t partial_offset;  // first partial row (split s, row r at + s * q_len * h_q + r), -1 if not split
  int32_t num_splits;
  int32_t pad_;
};

struct DecodeParams {
  const void* qa;  // [t_abs, h_q, d_cache] T: absorbed queries
  const void* cache;
  int64_t stride_block, stride_token;  // elements
  int32_t block_size;
  bool cache_vec16;  // cache rows 16-byte aligned (see CopyRowToSmem)
  bool q_vec16;
  const int32_t* block_table;  // compacted rows, table_offset per sequence
  const DecodeSeq* seqs;
  const SplitWorkItem* items;
  int32_t h_q, d_latent, d_cache;
  float scale;
  void* olat;          // [t_abs, h_q, d_latent] T (unsplit sequences)
  float* lse;          // [num_tokens, h_q] or nullptr
  float* partial;      // [partial_rows, d_latent]
  float* partial_lse;  // [partial_rows]
};

// MlaSplitDecodeKernel: one thread block per SplitWorkItem (a tile of up to
// kQRows (token x head) query rows of one sequence, one split of its keys).
// Loads the tile's absorbed queries [d_cache] once, then for each key tile
// gathers kKeys latent rows [kv_c | k_pe] from the paged cache into shared
// memory (each cache row read once per block, for all its query rows; rows
// past the range zero, never read from the cache) and runs AttendRange with
// values = the rows' first d_latent columns. Causal: row r of token j sees
// keys [0, prefix + j]. Writes the normalized output (into olat, cache dtype,
// and lse) or, for a split sequence, the partial (o, lse) in fp32.
// Constraints: d_latent <= 32 kNJ kVec; shared memory by the host's check.
template <typename T, int kRowsPerWarp, int kKeysPerLane, int kNJ>
__global__ void __launch_bounds__(kThreads, 1) MlaSplitDecodeKernel(DecodeParams p) {
  constexpr int kQRows = kWarps * kRowsPerWarp, kKeys = 32 * kKeysPerLane, kVec = Elem<T>::kVec;
  constexpr int kCols = kNJ * kVec;
  const SplitWorkItem it = p.items[blockIdx.x];
  const DecodeSeq sd = p.seqs[it.seq];
  const int Dk = p.d_cache, L = p.d_latent, H = p.h_q;
  const int ld = LdWords<T>(Dk);
  extern __shared__ __align__(16) unsigned char smem[];
  uint32_t* sQ = reinterpret_cast<uint32_t*>(smem);
  uint32_t* sK = sQ + kQRows * ld;
  float* sP = reinterpret_cast<float*>(sK + kKeys * ld);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  const T* qa = static_cast<const T*>(p.qa) + (static_cast<int64_t>(sd.tok_offset) * H + it.row0) * Dk;
  for (int r = warp; r < kQRows; r += kWarps)
    CopyRowToSmem<T>(sQ + r * ld, ld, r < it.rows ? qa + static_cast<int64_t>(r) * Dk : nullptr, Dk, p.q_vec16, lane);

  RowState<kRowsPerWarp, kCols> st;
  int64_t vis[kRowsPerWarp];
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    const int r = warp * kRowsPerWarp + i;
    vis[i] = r < it.rows ? CausalVisibleKeysDev(sd.prefix, (it.row0 + r) / H) : 0;
    st.m[i] = kLseNegInf;
    st.l[i] = 0.f;
#pragma unroll
    for (int j = 0; j < kCols; ++j) st.acc[i][j] = 0.f;
  }
  const bool warp_active = warp * kRowsPerWarp < it.rows;

  const T* cache = static_cast<const T*>(p.cache);
  const int32_t* table = p.block_table + sd.table_offset;
  auto load_tile = [&](int64_t kb, int n_keys) {
    for (int r = warp; r < kKeys; r += kWarps) {
      const T* src = nullptr;
      if (r < n_keys) {
        const int64_t key = kb + r;
        src = cache + static_cast<int64_t>(table[key / p.block_size]) * p.stride_block +
              (key % p.block_size) * p.stride_token;
      }
      CopyRowToSmem<T>(sK + r * ld, ld, src, Dk, p.cache_vec16, lane);
    }
  };
  AttendRange<T, kRowsPerWarp, kKeysPerLane, kNJ>(sQ, ld, sK, ld, sK, ld, sP, (Dk + kVec - 1) / kVec,
                                                  (L + kVec - 1) / kVec, it.key_begin, it.key_end, vis, warp_active,
                                                  p.scale, load_tile, st);
  if (!warp_active) return;

#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    const int r = warp * kRowsPerWarp + i;
    if (r >= it.rows) continue;
    const float lse = SoftmaxLse(st.m[i], st.l[i]);
    const float inv = SoftmaxInvSum(st.l[i]);
    if (it.partial_row < 0) {
      T* o = static_cast<T*>(p.olat) + (static_cast<int64_t>(sd.tok_offset) * H + it.row0 + r) * L;
#pragma unroll
      for (int j = 0; j < kCols; ++j) {
        const int col = (lane + 32 * (j / kVec)) * kVec + j % kVec;
        if (col < L) o[col] = FromFloat<T>(st.acc[i][j] * inv);
      }
      if (lane == 0 && p.lse != nullptr) p.lse[static_cast<int64_t>(sd.token0) * H + it.row0 + r] = lse;
    } else {
      float* o = p.partial + (it.partial_row + r) * L;
#pragma unroll
      for (int j = 0; j < kCols; ++j) {
        const int col = (lane + 32 * (j / kVec)) * kVec + j % kVec;
        if (col < L) o[col] = st.acc[i][j] * inv;
      }
      if (lane == 0) p.partial_lse[it.partial_row + r] = lse;
    }
  }
}

struct CombineParams {
  const DecodeSeq* seqs;
  const int32_t* split_seqs;  // indices into seqs of the split sequences
  int32_t h_q, d_latent;
  const float* partial;
  const float* partial_lse;
  void* olat;  // [t_abs, h_q, d_latent] T
  float* lse;  // [num_tokens, h_q] or nullptr
};

// MlaCombineKernel: merges the splits of each query row of the split
// sequences by log-sum-exp into olat (cache dtype) and lse. Grid:
// (ceil(max rows / kWarps), split sequences); one warp per row: the weights of its
// splits into shared memory, then lanes over the d_latent columns.
// Constraint: num_splits <= kMaxSplits (the plan's max_splits).
template <typename T>
__global__ void __launch_bounds__(kThreads) MlaCombineKernel(CombineParams p) {
  __shared__ float weights[kWarps][kMaxSplits];
  const DecodeSeq sd = p.seqs[p.split_seqs[blockIdx.y]];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int rows = sd.q_len * p.h_q;
  const int r = blockIdx.x * kWarps + warp;
  if (r >= rows) return;
  const int L = p.d_latent, ns = sd.num_splits;
  const float* part_lse = p.partial_lse + sd.partial_offset + r;
  const float total = LseOfParts(part_lse, ns, rows);
  for (int s = lane; s < ns; s += 32) weights[warp][s] = LseWeight(part_lse[static_cast<int64_t>(s) * rows], total);
  __syncwarp();
  T* o = static_cast<T*>(p.olat) + (static_cast<int64_t>(sd.tok_offset) * p.h_q + r) * L;
  const float* part = p.partial + (sd.partial_offset + r) * L;
  for (int c = lane; c < L; c += 32) {
    float acc = 0.f;
    for (int s = 0; s < ns; ++s) {
      const float w = weights[warp][s];
      if (w != 0.f) acc = fmaf(w, part[static_cast<int64_t>(s) * rows * L + c], acc);
    }
    o[c] = FromFloat<T>(acc);
  }
  if (lane == 0 && p.lse != nullptr) p.lse[static_cast<int64_t>(sd.token0) * p.h_q + r] = total;
}

// ---- Expanded path ------------------------------------------------------

struct ExpandParams {
  const void* q;  // [h_q, q_len, d_qk] T
  const void* k;  // [h_q, kv_head_rows, d_qk] T: the chunk's keys, row 0 = key c0
  const void* v;  // [h_q, kv_head_rows, d_v] T
  int64_t kv_head_rows;
  int32_t q_len, d_qk, d_v;
  int64_t prefix;
  int64_t c0, c1;  // the chunk's keys (absolute)
  bool q_vec16, k_vec16, v_vec16;
  float scale;
  float* acc;      // [h_q, q_len, d_v] running normalized output
  float* acc_lse;  // [h_q, q_len]
};

// MlaExpandedAttentionKernel: causal MHA of one head's query tile (kQRows
// tokens, grid.x) against one context chunk's up-projected keys and values
// (grid.y = head), merged by log-sum-exp into the running (acc, acc_lse)
// that earlier chunks left (each row belongs to one block per launch, and
// chunks are launched in order, so the read-modify-write is race-free).
// Query token j sees keys [0, prefix + j].
template <typename T, int kRowsPerWarp, int kKeysPerLane, int kNJ>
__global__ void __launch_bounds__(kThreads, 1) MlaExpandedAttentionKernel(ExpandParams p) {
  constexpr int kQRows = kWarps * kRowsPerWarp, kKeys = 32 * kKeysPerLane, kVec = Elem<T>::kVec;
  constexpr int kCols = kNJ * kVec;
  const int h = blockIdx.y;
  const int j0 = blockIdx.x * kQRows;
  const int rows = p.q_len - j0 < kQRows ? p.q_len - j0 : kQRows;
  const int64_t visible = CausalVisibleKeysDev(p.prefix, j0 + rows - 1);
  const int64_t k_end = p.c1 < visible ? p.c1 : visible;
  if (k_end <= p.c0) return;  // the whole tile sees none of this chunk (uniform: before any barrier)

  const int ldq = LdWords<T>(p.d_qk), ldv = LdWords<T>(p.d_v);
  extern __shared__ __align__(16) unsigned char smem[];
  uint32_t* sQ = reinterpret_cast<uint32_t*>(smem);
  uint32_t* sK = sQ + kQRows * ldq;
  uint32_t* sV = sK + kKeys * ldq;
  float* sP = reinterpret_cast<float*>(sV + kKeys * ldv);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  const T* q = static_cast<const T*>(p.q) + (static_cast<int64_t>(h) * p.q_len + j0) * p.d_qk;
  for (int r = warp; r < kQRows; r += kWarps)
    CopyRowToSmem<T>(sQ + r * ldq, ldq, r < rows ? q + static_cast<int64_t>(r) * p.d_qk : nullptr, p.d_qk, p.q_vec16,
                     lane);

  RowState<kRowsPerWarp, kCols> st;
  int64_t vis[kRowsPerWarp];
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    const int r = warp * kRowsPerWarp + i;
    vis[i] = r < rows ? CausalVisibleKeysDev(p.prefix, j0 + r) : 0;
    st.m[i] = kLseNegInf;
    st.l[i] = 0.f;
#pragma unroll
    for (int j = 0; j < kCols; ++j) st.acc[i][j] = 0.f;
  }
  const bool warp_active = warp * kRowsPerWarp < rows;

  const T* kh = static_cast<const T*>(p.k) + static_cast<int64_t>(h) * p.kv_head_rows * p.d_qk;
  const T* vh = static_cast<const T*>(p.v) + static_cast<int64_t>(h) * p.kv_head_rows * p.d_v;
  auto load_tile = [&](int64_t kb, int n_keys) {
    for (int r = warp; r < kKeys; r += kWarps) {
      const int64_t row = kb - p.c0 + r;
      CopyRowToSmem<T>(sK + r * ldq, ldq, r < n_keys ? kh + row * p.d_qk : nullptr, p.d_qk, p.k_vec16, lane);
      CopyRowToSmem<T>(sV + r * ldv, ldv, r < n_keys ? vh + row * p.d_v : nullptr, p.d_v, p.v_vec16, lane);
    }
  };
  AttendRange<T, kRowsPerWarp, kKeysPerLane, kNJ>(sQ, ldq, sK, ldq, sV, ldv, sP, (p.d_qk + kVec - 1) / kVec,
                                                  (p.d_v + kVec - 1) / kVec, p.c0, k_end, vis, warp_active, p.scale,
                                                  load_tile, st);
  if (!warp_active) return;

#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    const int r = warp * kRowsPerWarp + i;
    if (r >= rows) continue;
    const int64_t row = static_cast<int64_t>(h) * p.q_len + j0 + r;
    const float part_lse = SoftmaxLse(st.m[i], st.l[i]);
    const float inv = SoftmaxInvSum(st.l[i]);
    float wa, wp;
    const float lse = LseMergeWeights(p.acc_lse[row], part_lse, &wa, &wp);
    __syncwarp();  // every lane has read acc_lse[row] before lane 0 rewrites it
    float* a = p.acc + row * p.d_v;
#pragma unroll
    for (int j = 0; j < kCols; ++j) {
      const int col = (lane + 32 * (j / kVec)) * kVec + j % kVec;
      if (col < p.d_v) a[col] = LseMix(a[col], wa, st.acc[i][j] * inv, wp);
    }
    if (lane == 0) p.acc_lse[row] = lse;
  }
}

}  // namespace mlarun::cuda_mla
