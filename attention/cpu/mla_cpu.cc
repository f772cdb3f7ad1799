// CPU backend of MLA attention: both formulations built from AttendTile.
//
// Absorbed path (per call):
//   1. q_nope -> cache dtype; q_pe -> columns [L, L+R) of the absorbed query.
//   2. fold 1, one GEMM per head: q_nope[:, h] x W_UK^T[h] -> columns [0, L).
//   3. work items (sequence, block of (token, head) rows, key range): gather
//      the key rows from the paged cache into a contiguous tile (the only copy
//      of the cache; padding rows zeroed), AttendTile, merge successive key
//      tiles by LSE. A batch too small to keep every thread busy splits each
//      sequence's keys into ranges whose partial results are merged after.
//   4. fold 2, one GEMM per head: o_latent[:, h] x W_UV[h] -> [V].
// Expanded path (per sequence):
//   1. q -> cache dtype, head-major.
//   2. for each chunk of at most expand_chunk_rows context rows: gather the
//      latents, up-project K_nope and V per head (k_pe copied into each head's
//      K), and run causal MHA tiles merged by LSE into a running result.
#include <omp.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <vector>

#include "attention/backend.h"
#include "attention/cpu/attend_tile.h"
#include "base/first_error.h"
#include "gemm/convert.h"

namespace mlarun::cpu {
namespace {

using GemmPtr = std::shared_ptr<const CpuGemm>;

struct TileKey {
  int64_t rows, n_pad;
  auto operator<=>(const TileKey&) const = default;
};
struct TileGemms {
  GemmPtr scores, pv;
};

struct AbsSeq {
  int32_t seq;
  int64_t q_len, seq_len, prefix;
  int64_t tok_offset;  // first row of this sequence in the absorbed-token buffers
};
// Rows [row0, row0 + rows) of a sequence's (token x head) block against keys
// [key_begin, key_end). partial_row < 0: the result goes straight to o_latent.
struct AbsItem {
  int32_t aseq;
  int64_t row0, rows, key_begin, key_end;
  int64_t partial_row;
};
struct AbsMerge {
  int32_t aseq;
  int64_t row0, rows;
  std::vector<int64_t> partial_rows;
};
struct ExpSeq {
  int32_t seq;
  int64_t q_len, seq_len, prefix;
};

struct CpuMlaPlan final : MlaPlanImpl {
  MlaShape shape;
  DType dtype = DType::kF32;
  int64_t kv_tile = 0, q_tile = 0, chunk_rows = 0;
  int threads = 1;
  std::vector<int32_t> query_start, seq_lens;  // the batch this plan is for

  std::vector<AbsSeq> abs;
  int64_t t_abs = 0;  // absorbed tokens
  std::vector<AbsItem> abs_items, abs_base;
  std::vector<AbsMerge> abs_merges;  // the first num_merges are this batch's (the rest kept for reuse)
  size_t num_merges = 0;
  int64_t partial_rows = 0;
  GemmPtr fold1, fold2;
  std::map<TileKey, TileGemms> abs_tiles;

  std::vector<ExpSeq> exp;
  int64_t exp_q_max = 0, exp_rows_pad_max = 0;
  std::map<int64_t, std::pair<GemmPtr, GemmPtr>> up_proj;  // rows_pad -> (K, V)
  std::map<TileKey, TileGemms> exp_tiles;

  size_t gemm_scratch = 0;
  size_t thread_bytes = 0;
};

// Workspace buffers; carved identically when sizing and when running.
struct Buffers {
  // absorbed
  void* qn = nullptr;        // [t_abs, N, P] dtype
  void* qa = nullptr;        // [t_abs, N, L + R] dtype
  float* olat = nullptr;     // [t_abs, N, L]
  float* olse = nullptr;     // [t_abs, N]
  void* olat_c = nullptr;    // [t_abs, N, L] dtype (aliases olat for f32)
  float* oabs = nullptr;     // [t_abs, N, V]
  float* partial = nullptr;  // [partial_rows, L]
  float* partial_lse = nullptr;
  // expanded
  void* qe = nullptr;            // [N, q_max, P + R] dtype
  void* lat = nullptr;           // [rows_pad_max, L + R] dtype
  void* kx = nullptr;            // [N, rows_pad_max, P + R] dtype
  void* vx = nullptr;            // [N, rows_pad_max, V] dtype
  float* acc = nullptr;          // [N, q_max, V]
  float* acc_lse = nullptr;      // [N, q_max]
  std::byte* threads = nullptr;  // threads x thread_bytes
};

struct ThreadScratch {
  float* scores;
  void* probs;
  float* row_scale;
  float* tout;
  float* tlse;
  void* gather;
  void* gemm;
};

ThreadScratch CarveThread(const CpuMlaPlan& pl, WorkspaceCarver& c) {
  const int64_t es = static_cast<int64_t>(DTypeSize(pl.dtype));
  const int64_t dv = std::max(pl.abs.empty() ? 0 : pl.shape.d_latent, pl.exp.empty() ? 0 : pl.shape.d_v);
  ThreadScratch t;
  t.scores = c.Take<float>(static_cast<size_t>(pl.q_tile * pl.kv_tile));
  t.probs = c.Take<std::byte>(static_cast<size_t>(pl.dtype == DType::kF32 ? 0 : pl.q_tile * pl.kv_tile * es));
  t.row_scale = c.Take<float>(static_cast<size_t>(pl.q_tile));
  t.tout = c.Take<float>(static_cast<size_t>(pl.q_tile * dv));
  t.tlse = c.Take<float>(static_cast<size_t>(pl.q_tile));
  t.gather = c.Take<std::byte>(static_cast<size_t>(pl.abs.empty() ? 0 : pl.kv_tile * pl.shape.d_cache() * es));
  t.gemm = c.Take<std::byte>(pl.gemm_scratch);
  return t;
}

Buffers Carve(const CpuMlaPlan& pl, WorkspaceCarver& c) {
  const MlaShape& s = pl.shape;
  const size_t es = DTypeSize(pl.dtype);
  const size_t ta = static_cast<size_t>(pl.t_abs), n = static_cast<size_t>(s.h_q);
  Buffers b;
  if (ta > 0) {
    b.qn = c.Take<std::byte>(ta * n * static_cast<size_t>(s.d_nope) * es);
    b.qa = c.Take<std::byte>(ta * n * static_cast<size_t>(s.d_cache()) * es);
    b.olat = c.Take<float>(ta * n * static_cast<size_t>(s.d_latent));
    b.olse = c.Take<float>(ta * n);
    b.olat_c = pl.dtype == DType::kF32 ? static_cast<void*>(b.olat)
                                       : c.Take<std::byte>(ta * n * static_cast<size_t>(s.d_latent) * es);
    b.oabs = c.Take<float>(ta * n * static_cast<size_t>(s.d_v));
    b.partial = c.Take<float>(static_cast<size_t>(pl.partial_rows * s.d_latent));
    b.partial_lse = c.Take<float>(static_cast<size_t>(pl.partial_rows));
  }
  if (!pl.exp.empty()) {
    const size_t qm = static_cast<size_t>(pl.exp_q_max), rp = static_cast<size_t>(pl.exp_rows_pad_max);
    b.qe = c.Take<std::byte>(n * qm * static_cast<size_t>(s.d_qk()) * es);
    b.lat = c.Take<std::byte>(rp * static_cast<size_t>(s.d_cache()) * es);
    b.kx = c.Take<std::byte>(n * rp * static_cast<size_t>(s.d_qk()) * es);
    b.vx = c.Take<std::byte>(n * rp * static_cast<size_t>(s.d_v) * es);
    b.acc = c.Take<float>(n * qm * static_cast<size_t>(s.d_v));
    b.acc_lse = c.Take<float>(n * qm);
  }
  b.threads = c.Take<std::byte>(static_cast<size_t>(pl.threads) * pl.thread_bytes);
  return b;
}

ThreadScratch ThreadAt(const CpuMlaPlan& pl, const Buffers& b, int t) {
  WorkspaceCarver c(WorkspaceView{b.threads + static_cast<size_t>(t) * pl.thread_bytes, pl.thread_bytes});
  return CarveThread(pl, c);
}

template <typename T = std::byte>
T* At(const void* base, int64_t elems, size_t esize) {
  return reinterpret_cast<T*>(const_cast<std::byte*>(static_cast<const std::byte*>(base)) +
                              elems * static_cast<int64_t>(esize));
}

// Calls f(kb, len) for consecutive key tiles of at most `tile` keys in [begin, end).
template <typename F>
void ForEachKeyTile(int64_t begin, int64_t end, int64_t tile, F&& f) {
  for (int64_t kb = begin; kb < end; kb += tile) f(kb, std::min(tile, end - kb));
}

// Expanded path geometry shared by planning and running.
template <typename F>
void ForEachContextChunk(const ExpSeq& e, int64_t chunk_rows, F&& f) {
  for (int64_t c0 = 0; c0 < e.seq_len; c0 += chunk_rows) f(c0, std::min(c0 + chunk_rows, e.seq_len));
}
// Keys of chunk [c0, c1) that query rows [j0, j0 + rows) can see.
inline int64_t ExpTileKeyEnd(const ExpSeq& e, int64_t j0, int64_t rows, int64_t c1) {
  return std::min(c1, CausalVisibleKeys(e.prefix, j0 + rows - 1));
}

// Copies rows [k0, k0 + n) of a sequence from the paged cache into `dst`
// ([n_pad, row_width], contiguous) and zeroes rows [n, n_pad).
void GatherRows(const PagedRowsView& c, const int32_t* table, int64_t k0, int64_t n, int64_t n_pad, void* dst) {
  const size_t es = DTypeSize(c.dtype);
  const size_t row_bytes = static_cast<size_t>(c.row_width) * es;
  std::byte* out = static_cast<std::byte*>(dst);
  for (int64_t r = 0; r < n;) {
    const int64_t pos = k0 + r;
    const int64_t block = table[pos / c.block_size], off = pos % c.block_size;
    const int64_t run = std::min(c.block_size - off, n - r);
    const std::byte* src = At(c.data, block * c.stride_block + off * c.stride_token, es);
    if (c.stride_token == c.row_width) {
      std::memcpy(out + r * row_bytes, src, static_cast<size_t>(run) * row_bytes);
    } else {
      for (int64_t i = 0; i < run; ++i)
        std::memcpy(out + (r + i) * row_bytes, src + i * c.stride_token * static_cast<int64_t>(es), row_bytes);
    }
    r += run;
  }
  std::memset(out + n * row_bytes, 0, static_cast<size_t>(n_pad - n) * row_bytes);
}

Status GetGemm(const GemmDesc& d, GemmPtr* out, size_t* scratch) {
  auto g = CpuGemm::Get(d);
  if (!g.ok()) return g.status();
  *out = *g;
  *scratch = std::max(*scratch, (*out)->scratch_bytes());
  return Status::Ok();
}

Status GetTile(std::map<TileKey, TileGemms>& tiles, DType dt, int64_t rows, int64_t n_pad, int64_t d_qk, int64_t ldq,
               int64_t ldk, int64_t d_v, int64_t ldv, size_t* scratch) {
  TileGemms& t = tiles[TileKey{rows, n_pad}];
  if (t.scores) return Status::Ok();
  MLARUN_RETURN_IF_ERROR(GetGemm(TileScoresDesc(dt, rows, n_pad, d_qk, ldq, ldk), &t.scores, scratch));
  return GetGemm(TilePvDesc(dt, rows, n_pad, d_v, ldv, d_v), &t.pv, scratch);
}

Status PlanAbsorbed(CpuMlaPlan& pl) {
  const MlaShape& s = pl.shape;
  const int64_t N = s.h_q, L = s.d_latent, Dk = s.d_cache();
  // Base items: one per block of q_tile (token x head) rows.
  std::vector<AbsItem>& base = pl.abs_base;
  base.clear();
  for (int32_t a = 0; a < static_cast<int32_t>(pl.abs.size()); ++a) {
    const AbsSeq& q = pl.abs[static_cast<size_t>(a)];
    const int64_t M = q.q_len * N;
    for (int64_t row0 = 0; row0 < M; row0 += pl.q_tile) {
      const int64_t rows = std::min(pl.q_tile, M - row0);
      const int64_t key_end = CausalVisibleKeys(q.prefix, (row0 + rows - 1) / N);
      base.push_back(AbsItem{a, row0, rows, 0, key_end, -1});
    }
  }
  // Too few items to occupy every thread (small decode batches): split keys
  // into ranges, merged by LSE after. With fewer items than threads (a
  // batch-1 decode) the ranges are whole kKeyPad groups: in whole key tiles a
  // context shorter than one tile ran on one thread while the others waited,
  // and longer ones split unevenly (1500 keys: 1024 + 476); the groups
  // measured faster than whole tiles from 128 to 4096 keys. With as many
  // items as threads, whole tiles: finer ranges there cost more in merges
  // than they gain (figures: docs/attention.md).
  const int64_t threads = pl.threads, items = static_cast<int64_t>(base.size());
  const int64_t want = items == 0 ? 1 : (2 * threads + items - 1) / items;
  const int64_t unit = items < threads ? kKeyPad : pl.kv_tile;
  for (const AbsItem& it : base) {
    const int64_t units = (it.key_end + unit - 1) / unit;
    const int64_t splits = std::min(want, units);
    if (splits <= 1) {
      pl.abs_items.push_back(it);
      continue;
    }
    if (pl.abs_merges.size() <= pl.num_merges) pl.abs_merges.emplace_back();
    AbsMerge& m = pl.abs_merges[pl.num_merges++];
    m.aseq = it.aseq;
    m.row0 = it.row0;
    m.rows = it.rows;
    m.partial_rows.clear();
    for (int64_t k = 0; k < splits; ++k) {
      AbsItem part = it;
      part.key_begin = units * k / splits * unit;
      part.key_end = std::min(it.key_end, units * (k + 1) / splits * unit);
      part.partial_row = pl.partial_rows;
      pl.partial_rows += it.rows;
      m.partial_rows.push_back(part.partial_row);
      pl.abs_items.push_back(part);
    }
  }
  for (const AbsItem& it : pl.abs_items) {
    Status st;
    ForEachKeyTile(it.key_begin, it.key_end, pl.kv_tile, [&](int64_t, int64_t len) {
      if (st.ok()) st = GetTile(pl.abs_tiles, pl.dtype, it.rows, PadKeys(len), Dk, Dk, Dk, L, Dk, &pl.gemm_scratch);
    });
    MLARUN_RETURN_IF_ERROR(st);
  }
  const GemmDesc fold1{.m = pl.t_abs,
                       .n = L,
                       .k = s.d_nope,
                       .a_type = pl.dtype,
                       .b_type = pl.dtype,
                       .c_type = pl.dtype,
                       .lda = N * s.d_nope,
                       .b_stride_k = L,
                       .b_stride_n = 1,
                       .ldc = N * Dk};
  const GemmDesc fold2{.m = pl.t_abs,
                       .n = s.d_v,
                       .k = L,
                       .a_type = pl.dtype,
                       .b_type = pl.dtype,
                       .c_type = DType::kF32,
                       .lda = N * L,
                       .b_stride_k = s.d_v,
                       .b_stride_n = 1,
                       .ldc = N * s.d_v};
  MLARUN_RETURN_IF_ERROR(GetGemm(fold1, &pl.fold1, &pl.gemm_scratch));
  return GetGemm(fold2, &pl.fold2, &pl.gemm_scratch);
}

Status PlanExpanded(CpuMlaPlan& pl) {
  const MlaShape& s = pl.shape;
  const int64_t L = s.d_latent, Dk = s.d_cache(), Dq = s.d_qk(), V = s.d_v;
  for (const ExpSeq& e : pl.exp) {
    pl.exp_q_max = std::max(pl.exp_q_max, e.q_len);
    Status st;
    ForEachContextChunk(e, pl.chunk_rows, [&](int64_t c0, int64_t c1) {
      const int64_t rows_pad = PadKeys(c1 - c0);
      pl.exp_rows_pad_max = std::max(pl.exp_rows_pad_max, rows_pad);
      auto& up = pl.up_proj[rows_pad];
      if (st.ok() && !up.first) {
        const GemmDesc k{.m = rows_pad,
                         .n = s.d_nope,
                         .k = L,
                         .a_type = pl.dtype,
                         .b_type = pl.dtype,
                         .c_type = pl.dtype,
                         .lda = Dk,
                         .b_stride_k = 1,
                         .b_stride_n = L,
                         .ldc = Dq};
        const GemmDesc v{.m = rows_pad,
                         .n = V,
                         .k = L,
                         .a_type = pl.dtype,
                         .b_type = pl.dtype,
                         .c_type = pl.dtype,
                         .lda = Dk,
                         .b_stride_k = V,
                         .b_stride_n = 1,
                         .ldc = V};
        st = GetGemm(k, &up.first, &pl.gemm_scratch);
        if (st.ok()) st = GetGemm(v, &up.second, &pl.gemm_scratch);
      }
      for (int64_t j0 = 0; j0 < e.q_len; j0 += pl.q_tile) {
        const int64_t rows = std::min(pl.q_tile, e.q_len - j0);
        ForEachKeyTile(c0, ExpTileKeyEnd(e, j0, rows, c1), pl.kv_tile, [&](int64_t, int64_t len) {
          if (st.ok()) st = GetTile(pl.exp_tiles, pl.dtype, rows, PadKeys(len), Dq, Dq, Dq, V, V, &pl.gemm_scratch);
        });
      }
    });
    MLARUN_RETURN_IF_ERROR(st);
  }
  return Status::Ok();
}

Status RunAbsorbed(const MlaParams& p, const CpuMlaPlan& pl, const Buffers& b) {
  const MlaShape& s = pl.shape;
  const int64_t N = s.h_q, L = s.d_latent, R = s.d_rope, P = s.d_nope, V = s.d_v, Dk = s.d_cache();
  const DType dt = pl.dtype;
  const size_t es = DTypeSize(dt);
  FirstError err;

  // 1. Queries into the cache dtype.
#pragma omp parallel for num_threads(pl.threads) schedule(static)
  for (size_t a = 0; a < pl.abs.size(); ++a) {
    const AbsSeq& q = pl.abs[a];
    for (int64_t j = 0; j < q.q_len; ++j) {
      const int64_t t = p.query_start[q.seq] + j, ta = q.tok_offset + j;
      for (int64_t h = 0; h < N; ++h) {
        const float* src = p.q + t * p.q_stride_token + h * p.q_stride_head;
        StoreFromF32(src, At(b.qn, (ta * N + h) * P, es), dt, P);
        StoreFromF32(src + P, At(b.qa, (ta * N + h) * Dk + L, es), dt, R);
      }
    }
  }
  // 2. Fold W_UK into the queries.
#pragma omp parallel for num_threads(pl.threads) schedule(static)
  for (int64_t h = 0; h < N; ++h) {
    const ThreadScratch ts = ThreadAt(pl, b, omp_get_thread_num());
    err.Set(pl.fold1->Run(At(b.qn, h * P, es), At(p.w_uk_t, h * P * L, es), At(b.qa, h * Dk, es), ts.gemm));
  }
  MLARUN_RETURN_IF_ERROR(err.Get());

  // 3. Attention over the latent rows.
#pragma omp parallel for num_threads(pl.threads) schedule(dynamic, 1)
  for (size_t i = 0; i < pl.abs_items.size(); ++i) {
    const AbsItem& it = pl.abs_items[i];
    const AbsSeq& q = pl.abs[static_cast<size_t>(it.aseq)];
    const ThreadScratch ts = ThreadAt(pl, b, omp_get_thread_num());
    const int32_t* table = p.block_table + q.seq * p.block_table_stride;
    const int64_t first_row = q.tok_offset * N + it.row0;
    float* dest = it.partial_row < 0 ? b.olat + first_row * L : b.partial + it.partial_row * L;
    float* dest_lse = it.partial_row < 0 ? b.olse + first_row : b.partial_lse + it.partial_row;
    bool first = true;
    ForEachKeyTile(it.key_begin, it.key_end, pl.kv_tile, [&](int64_t kb, int64_t len) {
      const int64_t n_pad = PadKeys(len);
      GatherRows(p.cache, table, kb, len, n_pad, ts.gather);
      const TileGemms& g = pl.abs_tiles.at(TileKey{it.rows, n_pad});
      TileArgs ta{.dtype = dt,
                  .q = At(b.qa, first_row * Dk, es),
                  .k = ts.gather,
                  .v = ts.gather,
                  .rows = it.rows,
                  .d_v = L,
                  .n_keys = len,
                  .n_pad = n_pad,
                  .vis_offset = q.prefix + 1 - kb,
                  .row_base = it.row0,
                  .rows_per_token = N,
                  .scale = p.softmax_scale,
                  .scores_gemm = g.scores.get(),
                  .pv_gemm = g.pv.get(),
                  .scores = ts.scores,
                  .probs = ts.probs,
                  .row_scale = ts.row_scale,
                  .gemm_scratch = ts.gemm,
                  .out = first ? dest : ts.tout,
                  .ldo = L,
                  .lse = first ? dest_lse : ts.tlse};
      err.Set(AttendTile(ta));
      if (!first) MergeLse(dest, L, dest_lse, ts.tout, L, ts.tlse, it.rows, L);
      first = false;
    });
  }
  MLARUN_RETURN_IF_ERROR(err.Get());

  // Merge key-split partial results.
#pragma omp parallel for num_threads(pl.threads) schedule(dynamic, 1)
  for (size_t i = 0; i < pl.num_merges; ++i) {
    const AbsMerge& m = pl.abs_merges[i];
    const int64_t first_row = pl.abs[static_cast<size_t>(m.aseq)].tok_offset * N + m.row0;
    float* dest = b.olat + first_row * L;
    float* dest_lse = b.olse + first_row;
    std::fill(dest_lse, dest_lse + m.rows, -std::numeric_limits<float>::infinity());
    for (int64_t pr : m.partial_rows) MergeLse(dest, L, dest_lse, b.partial + pr * L, L, b.partial_lse + pr, m.rows, L);
  }

  // 4. Fold W_UV into the latent outputs.
  if (dt != DType::kF32) {
    const int64_t rows = pl.t_abs * N;
#pragma omp parallel for num_threads(pl.threads) schedule(static)
    for (int64_t r = 0; r < rows; ++r) StoreFromF32(b.olat + r * L, At(b.olat_c, r * L, es), dt, L);
  }
#pragma omp parallel for num_threads(pl.threads) schedule(static)
  for (int64_t h = 0; h < N; ++h) {
    const ThreadScratch ts = ThreadAt(pl, b, omp_get_thread_num());
    err.Set(pl.fold2->Run(At(b.olat_c, h * L, es), At(p.w_uv, h * L * V, es), b.oabs + h * V, ts.gemm));
  }
  MLARUN_RETURN_IF_ERROR(err.Get());

  for (const AbsSeq& q : pl.abs) {
    for (int64_t j = 0; j < q.q_len; ++j) {
      const int64_t t = p.query_start[q.seq] + j, ta = q.tok_offset + j;
      for (int64_t h = 0; h < N; ++h) {
        std::memcpy(p.out + t * p.out_stride_token + h * p.out_stride_head, b.oabs + (ta * N + h) * V,
                    static_cast<size_t>(V) * sizeof(float));
        if (p.lse) p.lse[t * N + h] = b.olse[ta * N + h];
      }
    }
  }
  return Status::Ok();
}

Status RunExpandedSeq(const MlaParams& p, const CpuMlaPlan& pl, const Buffers& b, const ExpSeq& e) {
  const MlaShape& s = pl.shape;
  const int64_t N = s.h_q, L = s.d_latent, R = s.d_rope, P = s.d_nope, V = s.d_v, Dk = s.d_cache(), Dq = s.d_qk();
  const int64_t Q = e.q_len, t0 = p.query_start[e.seq];
  const DType dt = pl.dtype;
  const size_t es = DTypeSize(dt);
  const int32_t* table = p.block_table + e.seq * p.block_table_stride;
  FirstError err;

#pragma omp parallel for num_threads(pl.threads) schedule(static)
  for (int64_t h = 0; h < N; ++h) {
    for (int64_t j = 0; j < Q; ++j)
      StoreFromF32(p.q + (t0 + j) * p.q_stride_token + h * p.q_stride_head, At(b.qe, (h * Q + j) * Dq, es), dt, Dq);
    std::fill(b.acc_lse + h * Q, b.acc_lse + (h + 1) * Q, -std::numeric_limits<float>::infinity());
  }

  const int64_t q_tiles = (Q + pl.q_tile - 1) / pl.q_tile;
  ForEachContextChunk(e, pl.chunk_rows, [&](int64_t c0, int64_t c1) {
    if (!err.Get().ok()) return;
    const int64_t rows = c1 - c0, rows_pad = PadKeys(rows);
    // Gather the chunk's latents, in pieces so both cores copy.
    const int64_t piece = 1024;
#pragma omp parallel for num_threads(pl.threads) schedule(static)
    for (int64_t r = 0; r < rows_pad; r += piece) {
      const int64_t n = std::clamp<int64_t>(rows - r, 0, piece), n_pad = std::min(piece, rows_pad - r);
      GatherRows(p.cache, table, c0 + r, n, n_pad, At(b.lat, r * Dk, es));
    }
    // Up-project per head: K = [kv_c W_UK | k_pe], V = kv_c W_UV.
    const auto& up = pl.up_proj.at(rows_pad);
#pragma omp parallel for num_threads(pl.threads) schedule(static)
    for (int64_t h = 0; h < N; ++h) {
      const ThreadScratch ts = ThreadAt(pl, b, omp_get_thread_num());
      std::byte* kh = At(b.kx, h * rows_pad * Dq, es);
      err.Set(up.first->Run(b.lat, At(p.w_uk_t, h * P * L, es), kh, ts.gemm));
      err.Set(up.second->Run(b.lat, At(p.w_uv, h * L * V, es), At(b.vx, h * rows_pad * V, es), ts.gemm));
      for (int64_t r = 0; r < rows_pad; ++r)
        std::memcpy(kh + (r * Dq + P) * static_cast<int64_t>(es), At(b.lat, r * Dk + L, es),
                    static_cast<size_t>(R) * es);
    }
    if (!err.Get().ok()) return;
      // Causal MHA tiles, merged into the running result.
#pragma omp parallel for num_threads(pl.threads) schedule(dynamic, 1)
    for (int64_t idx = 0; idx < N * q_tiles; ++idx) {
      const int64_t h = idx / q_tiles, j0 = idx % q_tiles * pl.q_tile, qrows = std::min(pl.q_tile, Q - j0);
      const ThreadScratch ts = ThreadAt(pl, b, omp_get_thread_num());
      ForEachKeyTile(c0, ExpTileKeyEnd(e, j0, qrows, c1), pl.kv_tile, [&](int64_t kb, int64_t len) {
        const int64_t n_pad = PadKeys(len);
        const TileGemms& g = pl.exp_tiles.at(TileKey{qrows, n_pad});
        TileArgs ta{.dtype = dt,
                    .q = At(b.qe, (h * Q + j0) * Dq, es),
                    .k = At(b.kx, (h * rows_pad + kb - c0) * Dq, es),
                    .v = At(b.vx, (h * rows_pad + kb - c0) * V, es),
                    .rows = qrows,
                    .d_v = V,
                    .n_keys = len,
                    .n_pad = n_pad,
                    .vis_offset = e.prefix + 1 - kb,
                    .row_base = j0,
                    .rows_per_token = 1,
                    .scale = p.softmax_scale,
                    .scores_gemm = g.scores.get(),
                    .pv_gemm = g.pv.get(),
                    .scores = ts.scores,
                    .probs = ts.probs,
                    .row_scale = ts.row_scale,
                    .gemm_scratch = ts.gemm,
                    .out = ts.tout,
                    .ldo = V,
                    .lse = ts.tlse};
        err.Set(AttendTile(ta));
        MergeLse(b.acc + (h * Q + j0) * V, V, b.acc_lse + h * Q + j0, ts.tout, V, ts.tlse, qrows, V);
      });
    }
  });
  MLARUN_RETURN_IF_ERROR(err.Get());

  for (int64_t j = 0; j < Q; ++j) {
    for (int64_t h = 0; h < N; ++h) {
      std::memcpy(p.out + (t0 + j) * p.out_stride_token + h * p.out_stride_head, b.acc + (h * Q + j) * V,
                  static_cast<size_t>(V) * sizeof(float));
      if (p.lse) p.lse[(t0 + j) * N + h] = b.acc_lse[h * Q + j];
    }
  }
  return Status::Ok();
}

}  // namespace

namespace {

// Plans `p` into `pl`, new or reused: the batch's lists start empty (their
// memory kept), the cached products (abs_tiles, up_proj, exp_tiles, and
// gemm_scratch, the most any of them needs) stay from earlier batches.
Status FillPlan(const MlaParams& p, const MlaConfig& c, CpuMlaPlan& pl, MlaPlan* plan) {
  pl.abs.clear();
  pl.t_abs = 0;
  pl.abs_items.clear();
  pl.num_merges = 0;
  pl.partial_rows = 0;
  pl.exp.clear();
  pl.exp_q_max = 0;
  pl.exp_rows_pad_max = 0;
  pl.shape = p.shape;
  pl.dtype = p.cache.dtype;
  pl.kv_tile = c.kv_tile_rows;
  pl.q_tile = c.q_tile_rows;
  pl.chunk_rows = c.expand_chunk_rows;
  pl.threads = c.num_threads > 0 ? c.num_threads : omp_get_max_threads();
  pl.query_start.assign(p.query_start, p.query_start + p.num_seqs + 1);
  pl.seq_lens.assign(p.seq_lens, p.seq_lens + p.num_seqs);
  for (int32_t i = 0; i < p.num_seqs; ++i) {
    const int64_t q_len = p.query_start[i + 1] - p.query_start[i], seq_len = p.seq_lens[i];
    if (q_len == 0) continue;  // nothing to compute for this sequence
    if (MlaPathFor(c, q_len, seq_len - q_len) == MlaPath::kAbsorbed) {
      pl.abs.push_back(AbsSeq{i, q_len, seq_len, seq_len - q_len, pl.t_abs});
      pl.t_abs += q_len;
    } else {
      pl.exp.push_back(ExpSeq{i, q_len, seq_len, seq_len - q_len});
    }
  }
  if (!pl.abs.empty()) MLARUN_RETURN_IF_ERROR(PlanAbsorbed(pl));
  if (!pl.exp.empty()) MLARUN_RETURN_IF_ERROR(PlanExpanded(pl));
  pl.thread_bytes = 0;
  if (!pl.abs.empty() || !pl.exp.empty()) {
    WorkspaceCarver per_thread(WorkspaceView{});
    CarveThread(pl, per_thread);
    pl.thread_bytes = per_thread.used_bytes();
  }
  WorkspaceCarver total(WorkspaceView{});
  Carve(pl, total);
  plan->workspace_bytes = total.used_bytes();
  plan->absorbed_seqs = static_cast<int64_t>(pl.abs.size());
  plan->expanded_seqs = static_cast<int64_t>(pl.exp.size());
  return Status::Ok();
}

}  // namespace

StatusOr<std::unique_ptr<MlaPlanImpl>> MakeMlaPlan(const MlaParams& p, const MlaConfig& c, MlaPlan* plan) {
  auto pl = std::make_unique<CpuMlaPlan>();
  MLARUN_RETURN_IF_ERROR(FillPlan(p, c, *pl, plan));
  return std::unique_ptr<MlaPlanImpl>(std::move(pl));
}

Status RemakeMlaPlan(const MlaParams& p, const MlaConfig& c, MlaPlan* plan) {
  auto* pl = dynamic_cast<CpuMlaPlan*>(plan->impl.get());
  // Another shape or dtype: the cached products are for other sizes.
  if (pl != nullptr && pl->shape == p.shape && pl->dtype == p.cache.dtype) return FillPlan(p, c, *pl, plan);
  MLARUN_ASSIGN_OR_RETURN(plan->impl, MakeMlaPlan(p, c, plan));
  return Status::Ok();
}

Status RunMla(const MlaParams& p, const MlaPlanImpl& impl, WorkspaceView ws) {
  const auto* pl = dynamic_cast<const CpuMlaPlan*>(&impl);
  if (pl == nullptr) return InvalidArgumentError("MlaRun: the plan was not made for the CPU backend");
  if (!(pl->shape == p.shape) || pl->dtype != p.cache.dtype ||
      static_cast<int64_t>(pl->seq_lens.size()) != p.num_seqs ||
      !std::equal(pl->seq_lens.begin(), pl->seq_lens.end(), p.seq_lens) ||
      !std::equal(pl->query_start.begin(), pl->query_start.end(), p.query_start))
    return FailedPreconditionError("MlaRun: params do not match the batch the plan was made for");
  WorkspaceCarver carver(ws);
  const Buffers b = Carve(*pl, carver);
  if (carver.overflowed() || (carver.used_bytes() > 0 && ws.data == nullptr))
    return InvalidArgumentError("MlaRun: workspace of ", ws.bytes, " bytes, the plan needs ", carver.used_bytes());
  if (!pl->abs.empty()) MLARUN_RETURN_IF_ERROR(RunAbsorbed(p, *pl, b));
  for (const ExpSeq& e : pl->exp) MLARUN_RETURN_IF_ERROR(RunExpandedSeq(p, *pl, b, e));
  return Status::Ok();
}

}  // namespace mlarun::cpu
