// CUDA backend of MLA attention (attention/mla.h): the plan, its workspace
// and the launches. Kernels: attention/cuda/mla_kernels.cuh.
//
// Absorbed path (sequences MlaPathFor sends there; decode):
//   1. AbsorbedQueryKernel: q_nope -> qn [t_abs, h_q, P] and q_pe -> columns
//      [L, L + R) of qa [t_abs, h_q, L + R], both in the cache dtype;
//   2. fold 1 (cuBLAS strided-batched over heads, fp32 compute):
//      qa[:, h, :L] = qn[:, h] x W_UK^T[h], rounded to the cache dtype;
//   3. MlaSplitDecodeKernel over the split plan's work items
//      (attention/cuda/split_plan.h): unsplit sequences write olat
//      [t_abs, h_q, L] (cache dtype) and lse, split ones fp32 partials;
//   4. MlaCombineKernel merges the partials by log-sum-exp into olat and lse;
//   5. fold 2 (cuBLAS): out[:, h] = olat[:, h] x W_UV[h] in fp32, straight
//      into out when every token of the batch is absorbed, else into oabs
//      and scattered to out by ScatterOutKernel.
// Expanded path (prefill), per sequence as the CPU backend:
//   ExpandedQueryKernel (q -> qe [h_q, Q, P + R] cache dtype; acc = 0,
//   acc_lse = -inf), then per chunk of at most expand_chunk_rows context
//   rows: GatherChunkKernel (latent rows -> lat [n, L + R], k_pe into every
//   head's keys), cuBLAS up-projections K_nope = lat W_UK, V = lat W_UV (fp32
//   compute, cache dtype), MlaExpandedAttentionKernel merging into acc by
//   LSE; FinishExpandedKernel writes out and lse.
//
// Workspace layout (each region 256-byte aligned, in this order; empty
// regions take no room): meta (the staged descriptors below), qn, qa, olat,
// partial [partial_rows, L] f32, partial_lse [partial_rows] f32, oabs
// [t_abs, h_q, V] f32 (only when out is not written directly), qe
// [h_q, q_max, P + R], lat [cap, L + R], kx [h_q, cap, P + R], vx
// [h_q, cap, V] (cache dtype), acc [h_q, q_max, V] f32, acc_lse [h_q, q_max]
// f32; q_max: the longest expanded query block, cap: min(expand_chunk_rows,
// longest expanded sequence).
// meta: DecodeSeq[absorbed sequences], SplitWorkItem[items], int32
// split_seqs[], int32 abs_tokens[t_abs] (batch token of each absorbed token),
// int32 block table (the valid entries of each planned sequence's row,
// concatenated), each 256-byte aligned. The plan keeps them in a host
// staging buffer, copied in by one synchronous cudaMemcpy per run (the
// block-table part refreshed from the params first).
//
// Everything runs on the legacy default stream; RunMla waits for it before
// returning (MlaRun's contract: blocks until done).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "attention/backend.h"
#include "attention/cuda/config.h"
#include "attention/cuda/mla_cuda.h"
#include "attention/cuda/mla_kernels.cuh"
#include "attention/cuda/split_plan.h"
#include "base/cuda/cuda_check.h"
#include "gemm/cuda/cublas.h"

namespace mlarun {
namespace {

using cuda_mla::DecodeSeq;
using cuda_mla::Elem;
using cuda_mla::kMaxValueWidth;
using cuda_mla::kRegionAlign;
using cuda_mla::kThreads;
using cuda_mla::kWarps;
using cuda_mla::LdWords;

static_assert(std::is_trivially_copyable_v<SplitWorkItem> && std::is_trivially_copyable_v<DecodeSeq>);
static_assert(sizeof(SplitWorkItem) == 40 && sizeof(DecodeSeq) == 40, "host and device layouts of the descriptors");

size_t AlignUp(size_t n) { return (n + kRegionAlign - 1) / kRegionAlign * kRegionAlign; }

// ---- Small kernels --------------------------------------------------------

// One block per absorbed token: its heads' q_nope into qn, q_pe into qa's
// rope columns, converted to the cache dtype.
template <typename T>
__global__ void AbsorbedQueryKernel(const float* q, int64_t q_stride_token, int64_t q_stride_head,
                                    const int32_t* abs_tokens, int H, int P, int R, int L, T* qn, T* qa) {
  const int64_t ta = blockIdx.x;
  const int64_t t = abs_tokens[ta];
  const int W = P + R, Dk = L + R;
  for (int idx = threadIdx.x; idx < H * W; idx += blockDim.x) {
    const int h = idx / W, c = idx - h * W;
    const T v = cuda_mla::FromFloat<T>(q[t * q_stride_token + h * q_stride_head + c]);
    if (c < P) {
      qn[(ta * H + h) * P + c] = v;
    } else {
      qa[(ta * H + h) * Dk + L + (c - P)] = v;
    }
  }
}

// One block per absorbed token: oabs [t_abs, H, V] -> out (strided).
__global__ void ScatterOutKernel(const float* oabs, const int32_t* abs_tokens, int H, int V, float* out,
                                 int64_t out_stride_token, int64_t out_stride_head) {
  const int64_t ta = blockIdx.x;
  const int64_t t = abs_tokens[ta];
  for (int idx = threadIdx.x; idx < H * V; idx += blockDim.x) {
    const int h = idx / V, c = idx - h * V;
    out[t * out_stride_token + h * out_stride_head + c] = oabs[(ta * H + h) * V + c];
  }
}

// One block per query token j of an expanded sequence: q -> qe [H, Q, Dq]
// in the cache dtype, and the running result emptied (acc 0, lse -inf).
template <typename T>
__global__ void ExpandedQueryKernel(const float* q, int64_t q_stride_token, int64_t q_stride_head, int64_t t0, int Q,
                                    int H, int Dq, int V, T* qe, float* acc, float* acc_lse) {
  const int64_t j = blockIdx.x;
  for (int idx = threadIdx.x; idx < H * Dq; idx += blockDim.x) {
    const int h = idx / Dq, c = idx - h * Dq;
    qe[(h * static_cast<int64_t>(Q) + j) * Dq + c] =
        cuda_mla::FromFloat<T>(q[(t0 + j) * q_stride_token + h * q_stride_head + c]);
  }
  for (int idx = threadIdx.x; idx < H * V; idx += blockDim.x) {
    const int h = idx / V, c = idx - h * V;
    acc[(h * static_cast<int64_t>(Q) + j) * V + c] = 0.f;
  }
  for (int h = threadIdx.x; h < H; h += blockDim.x) acc_lse[h * static_cast<int64_t>(Q) + j] = kLseNegInf;
}

// One block per row r of a context chunk (key c0 + r): the latent row into
// lat [n, Dk] and its k_pe into the rope columns of every head's keys
// kx [H, cap, Dq].
template <typename T>
__global__ void GatherChunkKernel(const T* cache, int64_t stride_block, int64_t stride_token, int block_size,
                                  const int32_t* table, int64_t c0, int H, int L, int R, int P, int64_t cap, T* lat,
                                  T* kx) {
  const int64_t r = blockIdx.x;
  const int64_t key = c0 + r;
  const int Dk = L + R, Dq = P + R;
  const T* src =
      cache + static_cast<int64_t>(table[key / block_size]) * stride_block + (key % block_size) * stride_token;
  for (int c = threadIdx.x; c < Dk; c += blockDim.x) lat[r * Dk + c] = src[c];
  for (int idx = threadIdx.x; idx < H * R; idx += blockDim.x) {
    const int h = idx / R, c = idx - h * R;
    kx[(h * cap + r) * Dq + P + c] = src[L + c];
  }
}

// One block per query token j of an expanded sequence: acc -> out, acc_lse -> lse.
__global__ void FinishExpandedKernel(const float* acc, const float* acc_lse, int64_t t0, int Q, int H, int V,
                                     float* out, int64_t out_stride_token, int64_t out_stride_head, float* lse) {
  const int64_t j = blockIdx.x;
  for (int idx = threadIdx.x; idx < H * V; idx += blockDim.x) {
    const int h = idx / V, c = idx - h * V;
    out[(t0 + j) * out_stride_token + h * out_stride_head + c] = acc[(h * static_cast<int64_t>(Q) + j) * V + c];
  }
  if (lse != nullptr)
    for (int h = threadIdx.x; h < H; h += blockDim.x) lse[(t0 + j) * H + h] = acc_lse[h * static_cast<int64_t>(Q) + j];
}

// ---- Kernel variants --------------------------------------------------------

// One variant of the attention core: its element type and tile shape
// (config.h: kRowsPerWarp query rows per warp, 32 kKeysPerLane keys per
// tile, 32 kNJ words of value columns per lane), the shared memory its
// kernels take, and the kernels.
template <typename T, int kRowsPerWarp, int kKeysPerLane, int kNJ>
struct Variant {
  using Elem_t = T;
  static constexpr int kRows = kWarps * kRowsPerWarp;
  static constexpr int kKeys = 32 * kKeysPerLane;
  static constexpr int kMaxValueWords = 32 * kNJ;
  static size_t DecodeSmem(int d_cache) {
    return static_cast<size_t>(kRows + kKeys) * LdWords<T>(d_cache) * 4 + static_cast<size_t>(kRows) * kKeys * 4;
  }
  static size_t ExpandSmem(int d_qk, int d_v) {
    return static_cast<size_t>(kRows + kKeys) * LdWords<T>(d_qk) * 4 +
           static_cast<size_t>(kKeys) * LdWords<T>(d_v) * 4 + static_cast<size_t>(kRows) * kKeys * 4;
  }
  static auto DecodeKernel() { return cuda_mla::MlaSplitDecodeKernel<T, kRowsPerWarp, kKeysPerLane, kNJ>; }
  static auto ExpandKernel() { return cuda_mla::MlaExpandedAttentionKernel<T, kRowsPerWarp, kKeysPerLane, kNJ>; }
};

enum class VariantId : uint8_t { kNone, kBf16Narrow, kBf16Wide, kBf16Few, kF32Narrow, kF32Wide };

template <typename T, typename Tile>
using VariantOf = Variant<T, Tile::kRowsPerWarp, Tile::kKeysPerLane, Tile::kNJ>;
using Bf16Narrow = VariantOf<__nv_bfloat16, cuda_mla::Bf16NarrowTile>;
using Bf16Wide = VariantOf<__nv_bfloat16, cuda_mla::Bf16WideTile>;
using Bf16Few = VariantOf<__nv_bfloat16, cuda_mla::Bf16FewTile>;
using F32Narrow = VariantOf<float, cuda_mla::F32NarrowTile>;
using F32Wide = VariantOf<float, cuda_mla::F32WideTile>;
static_assert(2 * Bf16Wide::kMaxValueWords == kMaxValueWidth && F32Wide::kMaxValueWords == kMaxValueWidth,
              "kMaxValueWidth is the widest variant's");

// The variant for values of width d_v in dtype dt, for sequences of at most
// max_rows query rows each; kNone when wider than any.
VariantId PickVariant(DType dt, int64_t d_v, int64_t max_rows) {
  if (dt == DType::kBF16) {
    const int64_t words = (d_v + 1) / 2;
    if (words <= Bf16Few::kMaxValueWords && max_rows <= Bf16Few::kRows) return VariantId::kBf16Few;
    if (words <= Bf16Narrow::kMaxValueWords) return VariantId::kBf16Narrow;
    if (words <= Bf16Wide::kMaxValueWords) return VariantId::kBf16Wide;
  } else {
    if (d_v <= F32Narrow::kMaxValueWords) return VariantId::kF32Narrow;
    if (d_v <= F32Wide::kMaxValueWords) return VariantId::kF32Wide;
  }
  return VariantId::kNone;
}

// Calls f(Variant{}) for the variant `id`.
template <typename F>
Status WithVariant(VariantId id, F&& f) {
  switch (id) {
    case VariantId::kBf16Narrow:
      return f(Bf16Narrow{});
    case VariantId::kBf16Wide:
      return f(Bf16Wide{});
    case VariantId::kBf16Few:
      return f(Bf16Few{});
    case VariantId::kF32Narrow:
      return f(F32Narrow{});
    case VariantId::kF32Wide:
      return f(F32Wide{});
    case VariantId::kNone:
      break;
  }
  return InternalError("mla cuda: no kernel variant chosen");
}

// ---- The plan -------------------------------------------------------------

struct ExpSeq {
  int32_t seq;
  int64_t q_len, seq_len, prefix, token0;
  int64_t table_offset;
};

struct Layout {
  size_t meta = 0, qn = 0, qa = 0, olat = 0, partial = 0, partial_lse = 0, oabs = 0;
  size_t qe = 0, lat = 0, kx = 0, vx = 0, acc = 0, acc_lse = 0;
  size_t total = 0;
};

struct CudaMlaPlan final : MlaPlanImpl {
  MlaShape shape;
  DType dtype = DType::kBF16;
  int64_t num_tokens = 0, chunk_rows = 0;
  int64_t block_size = 0;  // the cache's page rows: the staged tables and the split boundaries follow it
  std::vector<int32_t> query_start, seq_lens;
  int device = 0, num_sms = 0;
  int64_t smem_optin = 0;

  // Absorbed.
  VariantId decode_variant = VariantId::kNone;
  size_t decode_smem = 0;
  int blocks_per_sm = 0;
  std::vector<int32_t> abs_seq;  // batch index of each absorbed sequence
  std::vector<DecodeSeq> abs;
  std::vector<int32_t> abs_tokens;
  std::vector<SplitSeq> split_in;
  SplitPlan split;
  std::vector<int32_t> split_seqs;
  int64_t t_abs = 0, combine_rows_max = 0, max_splits = 0;
  bool out_direct = false;

  // Expanded.
  VariantId expand_variant = VariantId::kNone;
  size_t expand_smem = 0;
  std::vector<ExpSeq> exp;
  int64_t exp_q_max = 0, exp_cap = 0;

  // Staging (see the layout above); the block-table part is refreshed by
  // each run from the params, hence mutable. A plan is not shared between
  // threads (MlaPlan is not thread-safe).
  int64_t table_entries = 0;
  size_t off_seqs = 0, off_items = 0, off_split_seqs = 0, off_tokens = 0, off_table = 0;
  mutable std::vector<std::byte> staging;

  Layout layout;
};

size_t Es(DType t) { return DTypeSize(t); }

Layout MakeLayout(const CudaMlaPlan& pl) {
  Layout l;
  size_t off = 0;
  auto take = [&](size_t bytes) {
    const size_t o = off;
    off = AlignUp(off + bytes);
    return o;
  };
  const MlaShape& s = pl.shape;
  const size_t es = Es(pl.dtype), H = static_cast<size_t>(s.h_q), ta = static_cast<size_t>(pl.t_abs);
  l.meta = take(pl.staging.size());
  l.qn = take(ta * H * static_cast<size_t>(s.d_nope) * es);
  l.qa = take(ta * H * static_cast<size_t>(s.d_cache()) * es);
  l.olat = take(ta * H * static_cast<size_t>(s.d_latent) * es);
  l.partial = take(static_cast<size_t>(pl.split.partial_rows) * static_cast<size_t>(s.d_latent) * 4);
  l.partial_lse = take(static_cast<size_t>(pl.split.partial_rows) * 4);
  l.oabs = take(pl.out_direct ? 0 : ta * H * static_cast<size_t>(s.d_v) * 4);
  const size_t qm = static_cast<size_t>(pl.exp_q_max), cap = static_cast<size_t>(pl.exp_cap);
  l.qe = take(H * qm * static_cast<size_t>(s.d_qk()) * es);
  l.lat = take(cap * static_cast<size_t>(s.d_cache()) * es);
  l.kx = take(H * cap * static_cast<size_t>(s.d_qk()) * es);
  l.vx = take(H * cap * static_cast<size_t>(s.d_v) * es);
  l.acc = take(H * qm * static_cast<size_t>(s.d_v) * 4);
  l.acc_lse = take(H * qm * 4);
  l.total = off;
  return l;
}

// The valid block-table entries of every planned sequence, in plan order.
void StageTables(const CudaMlaPlan& pl, const MlaParams& p) {
  int32_t* dst = reinterpret_cast<int32_t*>(pl.staging.data() + pl.off_table);
  const int64_t bs = p.cache.block_size;
  auto copy = [&](int32_t seq, int64_t offset) {
    const int64_t blocks = (int64_t{p.seq_lens[seq]} + bs - 1) / bs;
    std::memcpy(dst + offset, p.block_table + seq * p.block_table_stride, static_cast<size_t>(blocks) * 4);
  };
  for (size_t a = 0; a < pl.abs.size(); ++a) copy(pl.abs_seq[a], pl.abs[a].table_offset);
  for (const ExpSeq& e : pl.exp) copy(e.seq, e.table_offset);
}

Status CheckIntRange(int64_t v, const char* what) {
  if (v > std::numeric_limits<int32_t>::max())
    return InvalidArgumentError("mla cuda: ", what, " = ", v,
                                " does not fit the int32 sizes of cuBLAS and the kernels");
  return Status::Ok();
}

// Step 1 of FillPlan: the batch's sizes copied in, what the last plan
// derived from its batch emptied (the vectors keep their memory).
void ResetPlan(const MlaParams& p, const MlaConfig& c, CudaMlaPlan& pl) {
  pl.shape = p.shape;
  pl.dtype = p.cache.dtype;
  pl.num_tokens = p.num_tokens;
  pl.chunk_rows = c.expand_chunk_rows;
  pl.block_size = p.cache.block_size;
  pl.query_start.assign(p.query_start, p.query_start + p.num_seqs + 1);
  pl.seq_lens.assign(p.seq_lens, p.seq_lens + p.num_seqs);
  pl.abs_seq.clear();
  pl.abs.clear();
  pl.abs_tokens.clear();
  pl.split_in.clear();
  pl.split_seqs.clear();
  pl.exp.clear();
  pl.t_abs = pl.combine_rows_max = pl.max_splits = pl.exp_q_max = pl.exp_cap = pl.table_entries = 0;
  pl.decode_variant = pl.expand_variant = VariantId::kNone;
  pl.split.items.clear();
  pl.split.partial_rows = 0;
}

// Step 2: the current device, its SM count and its opt-in shared memory.
Status QueryDevice(CudaMlaPlan& pl) {
  // No driver or no device: UNAVAILABLE (as CudaDevices says it), not an
  // INTERNAL failure of the first CUDA call. cudaGetDeviceCount is cheap
  // enough for every step's plan.
  int device_count = 0;
  if (const cudaError_t err = cudaGetDeviceCount(&device_count); err != cudaSuccess || device_count == 0) {
    cudaGetLastError();  // clear the sticky error
    return UnavailableError("mla cuda: no usable CUDA device: ",
                            err != cudaSuccess ? cudaGetErrorString(err) : "none visible");
  }
  MLARUN_CUDA_RETURN_IF_ERROR(cudaGetDevice(&pl.device));
  MLARUN_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&pl.num_sms, cudaDevAttrMultiProcessorCount, pl.device));
  int optin = 0;
  MLARUN_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, pl.device));
  pl.smem_optin = optin;
  return Status::Ok();
}

// Step 3: each sequence with query tokens to the absorbed or the expanded
// path (MlaPathFor), with its place in the staged block tables.
void AssignPaths(const MlaParams& p, const MlaConfig& c, CudaMlaPlan& pl) {
  const int64_t bs = p.cache.block_size;
  for (int32_t i = 0; i < p.num_seqs; ++i) {
    const int64_t q_len = int64_t{p.query_start[i + 1]} - p.query_start[i], seq_len = p.seq_lens[i];
    if (q_len == 0) continue;  // nothing to compute for this sequence
    const int64_t prefix = seq_len - q_len;
    const int64_t blocks = (seq_len + bs - 1) / bs;
    if (MlaPathFor(c, q_len, prefix) == MlaPath::kAbsorbed) {
      DecodeSeq d{};
      d.tok_offset = static_cast<int32_t>(pl.t_abs);
      d.token0 = p.query_start[i];
      d.prefix = static_cast<int32_t>(prefix);
      d.q_len = static_cast<int32_t>(q_len);
      d.table_offset = pl.table_entries;
      d.partial_offset = -1;
      d.num_splits = 1;
      pl.abs.push_back(d);
      pl.abs_seq.push_back(i);
      pl.split_in.push_back(SplitSeq{.q_len = q_len, .seq_len = seq_len});
      for (int64_t j = 0; j < q_len; ++j) pl.abs_tokens.push_back(static_cast<int32_t>(p.query_start[i] + j));
      pl.t_abs += q_len;
    } else {
      pl.exp.push_back(ExpSeq{.seq = i,
                              .q_len = q_len,
                              .seq_len = seq_len,
                              .prefix = prefix,
                              .token0 = p.query_start[i],
                              .table_offset = pl.table_entries});
      pl.exp_q_max = std::max(pl.exp_q_max, q_len);
      pl.exp_cap = std::max(pl.exp_cap, std::min(seq_len, c.expand_chunk_rows));
    }
    pl.table_entries += blocks;
  }
}

// Step 4a, for the decode variant V: its shared memory and occupancy on
// this device, and the split plan of the absorbed sequences.
template <typename V>
Status PlanDecodeVariant(const MlaShape& s, CudaMlaPlan& pl) {
  pl.decode_smem = V::DecodeSmem(static_cast<int>(s.d_cache()));
  if (static_cast<int64_t>(pl.decode_smem) > pl.smem_optin)
    return InvalidArgumentError("mla cuda: cache rows of d_latent + d_rope = ", s.d_cache(), " (", DTypeName(pl.dtype),
                                ") need ", pl.decode_smem,
                                " bytes of shared memory per decode block; the device allows ", pl.smem_optin,
                                " (cudaDevAttrMaxSharedMemoryPerBlockOptin)");
  MLARUN_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(V::DecodeKernel(), cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                   static_cast<int>(pl.smem_optin)));
  MLARUN_CUDA_RETURN_IF_ERROR(
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&pl.blocks_per_sm, V::DecodeKernel(), kThreads, pl.decode_smem));
  if (pl.blocks_per_sm < 1)
    return InternalError("mla cuda: the decode kernel cannot be resident (", pl.decode_smem,
                         " bytes of shared memory, ", kThreads, " threads)");
  const SplitPlanConfig sc{.h_q = s.h_q,
                           .rows_per_block = V::kRows,
                           .page_rows = pl.block_size,
                           .num_sms = pl.num_sms,
                           .blocks_per_sm = pl.blocks_per_sm,
                           .min_split_keys = cuda_mla::kMinSplitKeys,
                           .max_splits = cuda_mla::kMaxSplits};
  MLARUN_RETURN_IF_ERROR(CheckSplitPlanInput(sc, pl.split_in.data(), static_cast<int64_t>(pl.split_in.size())));
  PlanSplits(sc, pl.split_in.data(), static_cast<int64_t>(pl.split_in.size()), &pl.split);
  return Status::Ok();
}

// Step 4: the absorbed sequences' decode variant and split plan, and the
// splits written back into their descriptors.
Status PlanAbsorbed(const MlaShape& s, CudaMlaPlan& pl) {
  int64_t max_rows = 0;
  for (const DecodeSeq& d : pl.abs) max_rows = std::max<int64_t>(max_rows, int64_t{d.q_len} * s.h_q);
  pl.decode_variant = PickVariant(pl.dtype, s.d_latent, max_rows);
  if (pl.decode_variant == VariantId::kNone)
    return InvalidArgumentError("mla cuda: d_latent = ", s.d_latent, " is wider than the decode kernel's ",
                                kMaxValueWidth, " value columns (", s, ")");
  MLARUN_RETURN_IF_ERROR(CheckIntRange(pl.t_abs * s.h_q, "absorbed tokens * h_q"));
  MLARUN_RETURN_IF_ERROR(
      WithVariant(pl.decode_variant, [&](auto v) -> Status { return PlanDecodeVariant<decltype(v)>(s, pl); }));
  MLARUN_RETURN_IF_ERROR(CheckIntRange(static_cast<int64_t>(pl.split.items.size()), "decode work items"));
  for (size_t a = 0; a < pl.abs.size(); ++a) {
    DecodeSeq& d = pl.abs[a];
    d.num_splits = pl.split.num_splits[a];
    d.partial_offset = pl.split.partial_offset[a];
    pl.max_splits = std::max<int64_t>(pl.max_splits, d.num_splits);
    if (d.num_splits > 1) {
      pl.split_seqs.push_back(static_cast<int32_t>(a));
      pl.combine_rows_max = std::max<int64_t>(pl.combine_rows_max, int64_t{d.q_len} * s.h_q);
    }
  }
  if (static_cast<int64_t>(pl.split_seqs.size()) > cuda_mla::kMaxCombineSeqs)
    return InvalidArgumentError("mla cuda: ", pl.split_seqs.size(), " split sequences exceed one combine grid (",
                                cuda_mla::kMaxCombineSeqs, ")");
  return Status::Ok();
}

// Step 5: the expanded sequences' variant and its shared memory.
Status PlanExpanded(const MlaShape& s, CudaMlaPlan& pl) {
  pl.expand_variant = PickVariant(pl.dtype, s.d_v, std::numeric_limits<int64_t>::max());
  if (pl.expand_variant == VariantId::kNone)
    return InvalidArgumentError("mla cuda: d_v = ", s.d_v, " is wider than the expanded kernel's ", kMaxValueWidth,
                                " value columns (", s, ")");
  MLARUN_RETURN_IF_ERROR(CheckIntRange(pl.exp_cap * s.d_qk(), "chunk rows * (d_nope + d_rope)"));
  return WithVariant(pl.expand_variant, [&](auto v) -> Status {
    using V = decltype(v);
    pl.expand_smem = V::ExpandSmem(static_cast<int>(s.d_qk()), static_cast<int>(s.d_v));
    if (static_cast<int64_t>(pl.expand_smem) > pl.smem_optin)
      return InvalidArgumentError("mla cuda: expanded keys of d_nope + d_rope = ", s.d_qk(),
                                  " and values of d_v = ", s.d_v, " need ", pl.expand_smem,
                                  " bytes of shared memory per block; the device allows ", pl.smem_optin,
                                  " (cudaDevAttrMaxSharedMemoryPerBlockOptin)");
    MLARUN_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(V::ExpandKernel(), cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                     static_cast<int>(pl.smem_optin)));
    return Status::Ok();
  });
}

// Step 6: the descriptors into the host staging buffer (the layout of
// meta above), the block tables from the params.
void StageDescriptors(const MlaParams& p, CudaMlaPlan& pl) {
  size_t off = 0;
  auto take = [&](size_t bytes) {
    const size_t o = off;
    off = AlignUp(off + bytes);
    return o;
  };
  pl.off_seqs = take(pl.abs.size() * sizeof(DecodeSeq));
  pl.off_items = take(pl.split.items.size() * sizeof(SplitWorkItem));
  pl.off_split_seqs = take(pl.split_seqs.size() * 4);
  pl.off_tokens = take(pl.abs_tokens.size() * 4);
  pl.off_table = take(static_cast<size_t>(pl.table_entries) * 4);
  pl.staging.resize(off);
  if (!pl.abs.empty()) std::memcpy(pl.staging.data() + pl.off_seqs, pl.abs.data(), pl.abs.size() * sizeof(DecodeSeq));
  if (!pl.split.items.empty())
    std::memcpy(pl.staging.data() + pl.off_items, pl.split.items.data(), pl.split.items.size() * sizeof(SplitWorkItem));
  if (!pl.split_seqs.empty())
    std::memcpy(pl.staging.data() + pl.off_split_seqs, pl.split_seqs.data(), pl.split_seqs.size() * 4);
  if (!pl.abs_tokens.empty())
    std::memcpy(pl.staging.data() + pl.off_tokens, pl.abs_tokens.data(), pl.abs_tokens.size() * 4);
  StageTables(pl, p);
}

// The plan of a batch into `pl` (whose memory a new batch reuses), and its
// workspace size and path counts into `plan`.
Status FillPlan(const MlaParams& p, const MlaConfig& c, CudaMlaPlan& pl, MlaPlan* plan) {
  const MlaShape& s = p.shape;
  ResetPlan(p, c, pl);
  MLARUN_RETURN_IF_ERROR(QueryDevice(pl));
  MLARUN_RETURN_IF_ERROR(CheckIntRange(s.h_q * s.d_cache(), "h_q * (d_latent + d_rope)"));
  MLARUN_RETURN_IF_ERROR(CheckIntRange(s.h_q * std::max(s.d_qk(), s.d_v), "h_q * max(d_nope + d_rope, d_v)"));
  MLARUN_RETURN_IF_ERROR(CheckIntRange(p.num_tokens, "num_tokens"));
  AssignPaths(p, c, pl);
  if (!pl.abs.empty()) MLARUN_RETURN_IF_ERROR(PlanAbsorbed(s, pl));
  // Every token absorbed (no expanded sequence): fold 2 writes out directly.
  pl.out_direct = pl.exp.empty();
  if (!pl.exp.empty()) MLARUN_RETURN_IF_ERROR(PlanExpanded(s, pl));
  StageDescriptors(p, pl);
  pl.layout = MakeLayout(pl);
  plan->workspace_bytes = pl.layout.total;
  plan->absorbed_seqs = static_cast<int64_t>(pl.abs.size());
  plan->expanded_seqs = static_cast<int64_t>(pl.exp.size());
  return Status::Ok();
}

// ---- Running ----------------------------------------------------------------

struct Ws {
  std::byte* base;
  template <typename T = void>
  T* at(size_t off) const {
    return reinterpret_cast<T*>(base + off);
  }
};

cudaDataType_t CudaType(DType t) { return t == DType::kBF16 ? CUDA_R_16BF : CUDA_R_32F; }

bool Aligned16(const void* ptr, int64_t elems_a, int64_t elems_b, int64_t elems_c, size_t es) {
  return reinterpret_cast<uintptr_t>(ptr) % 16 == 0 && (static_cast<size_t>(elems_a) * es) % 16 == 0 &&
         (static_cast<size_t>(elems_b) * es) % 16 == 0 && (static_cast<size_t>(elems_c) * es) % 16 == 0;
}

const CudaMlaPlan* AsCudaPlan(const MlaPlanImpl& impl) { return dynamic_cast<const CudaMlaPlan*>(&impl); }

Status CheckRun(const MlaParams& p, const CudaMlaPlan* pl, WorkspaceView ws) {
  if (pl == nullptr) return InvalidArgumentError("MlaRun: the plan was not made for the CUDA backend");
  if (!(pl->shape == p.shape) || pl->dtype != p.cache.dtype || pl->num_tokens != p.num_tokens ||
      pl->block_size != p.cache.block_size || static_cast<int64_t>(pl->seq_lens.size()) != p.num_seqs ||
      !std::equal(pl->seq_lens.begin(), pl->seq_lens.end(), p.seq_lens) ||
      !std::equal(pl->query_start.begin(), pl->query_start.end(), p.query_start))
    return FailedPreconditionError("MlaRun: params do not match the batch the plan was made for");
  if (ws.bytes < pl->layout.total || (pl->layout.total > 0 && ws.data == nullptr))
    return InvalidArgumentError("MlaRun: workspace of ", ws.bytes, " bytes, the plan needs ", pl->layout.total);
  // The regions are aligned relative to ws.data; the kernels' 16-byte loads and
  // the staged int64 descriptors need the base aligned too.
  if (reinterpret_cast<uintptr_t>(ws.data) % 16 != 0)
    return InvalidArgumentError("MlaRun: the workspace at ", ws.data, " is not 16-byte aligned");
  int device = 0;
  MLARUN_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  if (device != pl->device)
    return FailedPreconditionError("MlaRun: the plan was made on CUDA device ", pl->device, ", the current one is ",
                                   device);
  return Status::Ok();
}

cuda_mla::DecodeParams MakeDecodeParams(const MlaParams& p, const CudaMlaPlan& pl, Ws w) {
  const MlaShape& s = pl.shape;
  const size_t es = Es(pl.dtype);
  cuda_mla::DecodeParams d{};
  d.qa = w.at(pl.layout.qa);
  d.cache = p.cache.data;
  d.stride_block = p.cache.stride_block;
  d.stride_token = p.cache.stride_token;
  d.block_size = static_cast<int32_t>(p.cache.block_size);
  d.cache_vec16 = Aligned16(p.cache.data, p.cache.stride_block, p.cache.stride_token, s.d_cache(), es);
  d.q_vec16 = (static_cast<size_t>(s.d_cache()) * es) % 16 == 0;
  d.block_table = w.at<const int32_t>(pl.layout.meta + pl.off_table);
  d.seqs = w.at<const DecodeSeq>(pl.layout.meta + pl.off_seqs);
  d.items = w.at<const SplitWorkItem>(pl.layout.meta + pl.off_items);
  d.h_q = static_cast<int32_t>(s.h_q);
  d.d_latent = static_cast<int32_t>(s.d_latent);
  d.d_cache = static_cast<int32_t>(s.d_cache());
  d.scale = p.softmax_scale;
  d.olat = w.at(pl.layout.olat);
  d.lse = p.lse;
  d.partial = w.at<float>(pl.layout.partial);
  d.partial_lse = w.at<float>(pl.layout.partial_lse);
  return d;
}

Status LaunchDecodeCore(const MlaParams& p, const CudaMlaPlan& pl, Ws w, bool combine) {
  const cuda_mla::DecodeParams d = MakeDecodeParams(p, pl, w);
  const unsigned blocks = static_cast<unsigned>(pl.split.items.size());
  return WithVariant(pl.decode_variant, [&](auto v) -> Status {
    using V = decltype(v);
    using T = typename V::Elem_t;
    V::DecodeKernel()<<<blocks, kThreads, pl.decode_smem>>>(d);
    MLARUN_CUDA_RETURN_IF_LAUNCH_FAILED("MlaSplitDecodeKernel");
    if (combine && !pl.split_seqs.empty()) {
      const cuda_mla::CombineParams cp{.seqs = d.seqs,
                                       .split_seqs = w.at<const int32_t>(pl.layout.meta + pl.off_split_seqs),
                                       .h_q = d.h_q,
                                       .d_latent = d.d_latent,
                                       .partial = d.partial,
                                       .partial_lse = d.partial_lse,
                                       .olat = d.olat,
                                       .lse = p.lse};
      const dim3 grid(static_cast<unsigned>((pl.combine_rows_max + kWarps - 1) / kWarps),
                      static_cast<unsigned>(pl.split_seqs.size()));
      cuda_mla::MlaCombineKernel<T><<<grid, kThreads>>>(cp);
      MLARUN_CUDA_RETURN_IF_LAUNCH_FAILED("MlaCombineKernel");
    }
    return Status::Ok();
  });
}

// C (m x n, ldc) = op(A) (m x k) B (k x n), column-major, per head h with
// batch strides; alpha 1, beta 0, fp32 compute.
struct BatchedGemm {
  cublasOperation_t op_a;
  int m, n, k;
  const void* a;
  cudaDataType_t a_type;
  int lda;
  long long stride_a;
  const void* b;
  int ldb;
  long long stride_b;
  void* c;
  cudaDataType_t c_type;
  int ldc;
  long long stride_c;
  int batch;
};

Status RunBatchedGemm(const BatchedGemm& g) {
  MLARUN_ASSIGN_OR_RETURN(cublasHandle_t h, cuda::CublasHandle());
  const float one = 1.f, zero = 0.f;
  MLARUN_CUBLAS_RETURN_IF_ERROR(cublasGemmStridedBatchedEx(
      h, g.op_a, CUBLAS_OP_N, g.m, g.n, g.k, &one, g.a, g.a_type, g.lda, g.stride_a, g.b, g.a_type, g.ldb, g.stride_b,
      &zero, g.c, g.c_type, g.ldc, g.stride_c, g.batch, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  return Status::Ok();
}

template <typename T>
Status RunAbsorbed(const MlaParams& p, const CudaMlaPlan& pl, Ws w) {
  const MlaShape& s = pl.shape;
  const int H = static_cast<int>(s.h_q), P = static_cast<int>(s.d_nope), R = static_cast<int>(s.d_rope),
            L = static_cast<int>(s.d_latent), V = static_cast<int>(s.d_v), Dk = static_cast<int>(s.d_cache());
  const int ta = static_cast<int>(pl.t_abs);
  const cudaDataType_t dt = CudaType(pl.dtype);
  const int32_t* abs_tokens = w.at<const int32_t>(pl.layout.meta + pl.off_tokens);

  AbsorbedQueryKernel<T><<<static_cast<unsigned>(ta), kThreads>>>(
      p.q, p.q_stride_token, p.q_stride_head, abs_tokens, H, P, R, L, w.at<T>(pl.layout.qn), w.at<T>(pl.layout.qa));
  MLARUN_CUDA_RETURN_IF_LAUNCH_FAILED("AbsorbedQueryKernel");
  // qa[:, h, :L] (L x t_abs, column-major, ld H Dk) = W_UK^T[h] (L x P, ld L) x qn[:, h] (P x t_abs, ld H P).
  MLARUN_RETURN_IF_ERROR(RunBatchedGemm({.op_a = CUBLAS_OP_N,
                                         .m = L,
                                         .n = ta,
                                         .k = P,
                                         .a = p.w_uk_t,
                                         .a_type = dt,
                                         .lda = L,
                                         .stride_a = static_cast<long long>(P) * L,
                                         .b = w.at(pl.layout.qn),
                                         .ldb = H * P,
                                         .stride_b = P,
                                         .c = w.at(pl.layout.qa),
                                         .c_type = dt,
                                         .ldc = H * Dk,
                                         .stride_c = Dk,
                                         .batch = H}));
  MLARUN_RETURN_IF_ERROR(LaunchDecodeCore(p, pl, w, /*combine=*/true));
  // out[:, h] (V x t_abs, ld out_stride_token) = W_UV[h] (V x L, ld V) x olat[:, h] (L x t_abs, ld H L).
  float* out = pl.out_direct ? p.out : w.at<float>(pl.layout.oabs);
  const int64_t ldc = pl.out_direct ? p.out_stride_token : int64_t{H} * V;
  const int64_t stride_c = pl.out_direct ? p.out_stride_head : V;
  MLARUN_RETURN_IF_ERROR(CheckIntRange(ldc, "out_stride_token"));
  MLARUN_RETURN_IF_ERROR(RunBatchedGemm({.op_a = CUBLAS_OP_N,
                                         .m = V,
                                         .n = ta,
                                         .k = L,
                                         .a = p.w_uv,
                                         .a_type = dt,
                                         .lda = V,
                                         .stride_a = static_cast<long long>(L) * V,
                                         .b = w.at(pl.layout.olat),
                                         .ldb = H * L,
                                         .stride_b = L,
                                         .c = out,
                                         .c_type = CUDA_R_32F,
                                         .ldc = static_cast<int>(ldc),
                                         .stride_c = static_cast<long long>(stride_c),
                                         .batch = H}));
  if (!pl.out_direct) {
    ScatterOutKernel<<<static_cast<unsigned>(ta), kThreads>>>(w.at<const float>(pl.layout.oabs), abs_tokens, H, V,
                                                              p.out, p.out_stride_token, p.out_stride_head);
    MLARUN_CUDA_RETURN_IF_LAUNCH_FAILED("ScatterOutKernel");
  }
  return Status::Ok();
}

template <typename T>
Status RunExpandedSeq(const MlaParams& p, const CudaMlaPlan& pl, Ws w, const ExpSeq& e) {
  const MlaShape& s = pl.shape;
  const int H = static_cast<int>(s.h_q), P = static_cast<int>(s.d_nope), R = static_cast<int>(s.d_rope),
            L = static_cast<int>(s.d_latent), V = static_cast<int>(s.d_v), Dk = static_cast<int>(s.d_cache()),
            Dq = static_cast<int>(s.d_qk());
  const int Q = static_cast<int>(e.q_len);
  const int64_t cap = pl.exp_cap;
  const size_t es = Es(pl.dtype);
  const cudaDataType_t dt = CudaType(pl.dtype);
  T* qe = w.at<T>(pl.layout.qe);
  T* lat = w.at<T>(pl.layout.lat);
  T* kx = w.at<T>(pl.layout.kx);
  T* vx = w.at<T>(pl.layout.vx);
  float* acc = w.at<float>(pl.layout.acc);
  float* acc_lse = w.at<float>(pl.layout.acc_lse);
  const int32_t* table = w.at<const int32_t>(pl.layout.meta + pl.off_table) + e.table_offset;

  ExpandedQueryKernel<T><<<static_cast<unsigned>(Q), kThreads>>>(p.q, p.q_stride_token, p.q_stride_head, e.token0, Q, H,
                                                                 Dq, V, qe, acc, acc_lse);
  MLARUN_CUDA_RETURN_IF_LAUNCH_FAILED("ExpandedQueryKernel");

  for (int64_t c0 = 0; c0 < e.seq_len; c0 += pl.chunk_rows) {
    const int64_t c1 = std::min(c0 + pl.chunk_rows, e.seq_len);
    const int n = static_cast<int>(c1 - c0);
    GatherChunkKernel<T><<<static_cast<unsigned>(n), 128>>>(static_cast<const T*>(p.cache.data), p.cache.stride_block,
                                                            p.cache.stride_token, static_cast<int>(p.cache.block_size),
                                                            table, c0, H, L, R, P, cap, lat, kx);
    MLARUN_CUDA_RETURN_IF_LAUNCH_FAILED("GatherChunkKernel");
    // kx[h][:, :P] (P x n, ld Dq) = op_T(W_UK^T[h] as L x P, ld L) x lat (L x n, ld Dk).
    MLARUN_RETURN_IF_ERROR(RunBatchedGemm({.op_a = CUBLAS_OP_T,
                                           .m = P,
                                           .n = n,
                                           .k = L,
                                           .a = p.w_uk_t,
                                           .a_type = dt,
                                           .lda = L,
                                           .stride_a = static_cast<long long>(P) * L,
                                           .b = lat,
                                           .ldb = Dk,
                                           .stride_b = 0,
                                           .c = kx,
                                           .c_type = dt,
                                           .ldc = Dq,
                                           .stride_c = static_cast<long long>(cap) * Dq,
                                           .batch = H}));
    // vx[h] (V x n, ld V) = W_UV[h] (V x L, ld V) x lat (L x n, ld Dk).
    MLARUN_RETURN_IF_ERROR(RunBatchedGemm({.op_a = CUBLAS_OP_N,
                                           .m = V,
                                           .n = n,
                                           .k = L,
                                           .a = p.w_uv,
                                           .a_type = dt,
                                           .lda = V,
                                           .stride_a = static_cast<long long>(L) * V,
                                           .b = lat,
                                           .ldb = Dk,
                                           .stride_b = 0,
                                           .c = vx,
                                           .c_type = dt,
                                           .ldc = V,
                                           .stride_c = static_cast<long long>(cap) * V,
                                           .batch = H}));
    cuda_mla::ExpandParams ep{};
    ep.q = qe;
    ep.k = kx;
    ep.v = vx;
    ep.kv_head_rows = cap;
    ep.q_len = Q;
    ep.d_qk = Dq;
    ep.d_v = V;
    ep.prefix = e.prefix;
    ep.c0 = c0;
    ep.c1 = c1;
    ep.q_vec16 = (static_cast<size_t>(Dq) * es) % 16 == 0;
    ep.k_vec16 = ep.q_vec16;
    ep.v_vec16 = (static_cast<size_t>(V) * es) % 16 == 0;
    ep.scale = p.softmax_scale;
    ep.acc = acc;
    ep.acc_lse = acc_lse;
    MLARUN_RETURN_IF_ERROR(WithVariant(pl.expand_variant, [&](auto v) -> Status {
      using Vt = decltype(v);
      const dim3 grid(static_cast<unsigned>((Q + Vt::kRows - 1) / Vt::kRows), static_cast<unsigned>(H));
      Vt::ExpandKernel()<<<grid, kThreads, pl.expand_smem>>>(ep);
      MLARUN_CUDA_RETURN_IF_LAUNCH_FAILED("MlaExpandedAttentionKernel");
      return Status::Ok();
    }));
  }
  FinishExpandedKernel<<<static_cast<unsigned>(Q), kThreads>>>(acc, acc_lse, e.token0, Q, H, V, p.out,
                                                               p.out_stride_token, p.out_stride_head, p.lse);
  MLARUN_CUDA_RETURN_IF_LAUNCH_FAILED("FinishExpandedKernel");
  return Status::Ok();
}

template <typename T>
Status RunTyped(const MlaParams& p, const CudaMlaPlan& pl, Ws w) {
  if (!pl.abs.empty()) MLARUN_RETURN_IF_ERROR(RunAbsorbed<T>(p, pl, w));
  for (const ExpSeq& e : pl.exp) MLARUN_RETURN_IF_ERROR(RunExpandedSeq<T>(p, pl, w, e));
  return Status::Ok();
}

}  // namespace

namespace cuda {

StatusOr<std::unique_ptr<MlaPlanImpl>> MakeMlaPlan(const MlaParams& p, const MlaConfig& c, MlaPlan* plan) {
  auto pl = std::make_unique<CudaMlaPlan>();
  MLARUN_RETURN_IF_ERROR(FillPlan(p, c, *pl, plan));
  return std::unique_ptr<MlaPlanImpl>(std::move(pl));
}

Status RemakeMlaPlan(const MlaParams& p, const MlaConfig& c, MlaPlan* plan) {
  auto* pl = dynamic_cast<CudaMlaPlan*>(plan->impl.get());
  if (pl != nullptr) return FillPlan(p, c, *pl, plan);
  MLARUN_ASSIGN_OR_RETURN(plan->impl, MakeMlaPlan(p, c, plan));
  return Status::Ok();
}

Status RunMla(const MlaParams& p, const MlaPlanImpl& impl, WorkspaceView ws) {
  const CudaMlaPlan* pl = AsCudaPlan(impl);
  MLARUN_RETURN_IF_ERROR(CheckRun(p, pl, ws));
  if (pl->abs.empty() && pl->exp.empty()) return Status::Ok();
  const Ws w{static_cast<std::byte*>(ws.data)};
  StageTables(*pl, p);
  MLARUN_CUDA_RETURN_IF_ERROR(
      cudaMemcpy(w.at(pl->layout.meta), pl->staging.data(), pl->staging.size(), cudaMemcpyHostToDevice));
  const Status st = pl->dtype == DType::kBF16 ? RunTyped<__nv_bfloat16>(p, *pl, w) : RunTyped<float>(p, *pl, w);
  if (!st.ok()) {
    // Kernels launched before the failure may still read the workspace and
    // write out: wait for them, so that the caller may free the buffers.
    if (cudaStreamSynchronize(0) != cudaSuccess) cudaGetLastError();  // st is the first error; do not leave a second
    return st;
  }
  MLARUN_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(0));
  return Status::Ok();
}

Status RunMlaDecodeCore(const MlaParams& p, const MlaPlanImpl& impl, WorkspaceView ws, bool combine) {
  const CudaMlaPlan* pl = AsCudaPlan(impl);
  MLARUN_RETURN_IF_ERROR(CheckRun(p, pl, ws));
  if (pl->abs.empty()) return Status::Ok();
  return LaunchDecodeCore(p, *pl, Ws{static_cast<std::byte*>(ws.data)}, combine);
}

StatusOr<MlaCudaPlanStats> MlaCudaStats(const MlaPlanImpl& impl) {
  const CudaMlaPlan* pl = AsCudaPlan(impl);
  if (pl == nullptr) return InvalidArgumentError("MlaCudaStats: the plan was not made for the CUDA backend");
  MlaCudaPlanStats st;
  st.decode_blocks = static_cast<int64_t>(pl->split.items.size());
  st.split_seqs = static_cast<int64_t>(pl->split_seqs.size());
  st.max_splits = pl->max_splits;
  st.split_keys = pl->split.split_keys;
  st.blocks_per_sm = pl->blocks_per_sm;
  if (pl->decode_variant != VariantId::kNone) {
    (void)WithVariant(pl->decode_variant, [&](auto v) -> Status {
      st.rows_per_block = decltype(v)::kRows;
      return Status::Ok();
    });
  }
  return st;
}

}  // namespace cuda
}  // namespace mlarun
