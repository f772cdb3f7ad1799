#include "attention/mla.h"

#include <cmath>

#include "attention/backend.h"

namespace mlarun {

std::ostream& operator<<(std::ostream& os, const MlaShape& s) {
  return os << "mla{h_q=" << s.h_q << " L=" << s.d_latent << " R=" << s.d_rope << " P=" << s.d_nope << " V=" << s.d_v
            << "}";
}

std::ostream& operator<<(std::ostream& os, const MlaConfig& c) {
  return os << "mla_config{backend=" << BackendName(c.backend) << " path=" << static_cast<int>(c.path)
            << " absorb_below_query_len=" << c.absorb_below_query_len
            << " absorb_below_query_len_no_prefix=" << c.absorb_below_query_len_no_prefix
            << " expand_chunk_rows=" << c.expand_chunk_rows << " kv_tile_rows=" << c.kv_tile_rows
            << " q_tile_rows=" << c.q_tile_rows << " num_threads=" << c.num_threads << "}";
}

MlaPlan::MlaPlan() = default;
MlaPlan::~MlaPlan() = default;
MlaPlan::MlaPlan(MlaPlan&&) noexcept = default;
MlaPlan& MlaPlan::operator=(MlaPlan&&) noexcept = default;

Status MlaCheckConfig(const MlaConfig& c) {
  if (c.backend != Backend::kCpu && c.backend != Backend::kCuda)
    return InvalidArgumentError("mla config: unknown backend ", static_cast<int>(c.backend));
  if (c.path != MlaPath::kAuto && c.path != MlaPath::kAbsorbed && c.path != MlaPath::kExpanded)
    return InvalidArgumentError("mla config: unknown path ", static_cast<int>(c.path));
  auto valid = [](int64_t t) { return t >= 0 || t == kAbsorbThresholdOfCpu; };
  if (!valid(c.absorb_below_query_len) || !valid(c.absorb_below_query_len_no_prefix))
    return InvalidArgumentError("mla config: absorb_below_query_len (", c.absorb_below_query_len,
                                ") and absorb_below_query_len_no_prefix (", c.absorb_below_query_len_no_prefix,
                                ") must be >= 0, or ", kAbsorbThresholdOfCpu, " for the CPU's defaults");
  if (c.expand_chunk_rows <= 0)
    return InvalidArgumentError("mla config: expand_chunk_rows must be positive, got ", c.expand_chunk_rows);
  if (c.kv_tile_rows <= 0 || c.kv_tile_rows % 64 != 0)
    return InvalidArgumentError("mla config: kv_tile_rows must be a positive multiple of 64, got ", c.kv_tile_rows);
  if (c.q_tile_rows <= 0) return InvalidArgumentError("mla config: q_tile_rows must be positive, got ", c.q_tile_rows);
  if (c.num_threads < 0) return InvalidArgumentError("mla config: num_threads must be >= 0, got ", c.num_threads);
  return Status::Ok();
}

Status MlaCheck(const MlaParams& p) {
  const MlaShape& s = p.shape;
  if (s.h_q <= 0) return InvalidArgumentError("mla: head count h_q must be positive, got ", s.h_q);
  if (s.d_latent <= 0 || s.d_nope <= 0 || s.d_v <= 0 || s.d_rope < 0)
    return InvalidArgumentError("mla: dimensions must be positive (d_rope >= 0), got ", s);
  if (!IsValidDType(p.cache.dtype))
    return InvalidArgumentError("mla: unknown cache dtype value ", static_cast<int>(p.cache.dtype));
  if (!IsValidDType(p.w_dtype))
    return InvalidArgumentError("mla: unknown weight dtype value ", static_cast<int>(p.w_dtype));
  if (p.cache.dtype != DType::kF32 && p.cache.dtype != DType::kBF16)
    return InvalidArgumentError("mla: cache dtype ", DTypeName(p.cache.dtype), " is not supported (f32 or bf16)");
  if (p.w_dtype != p.cache.dtype)
    return InvalidArgumentError("mla: weight dtype ", DTypeName(p.w_dtype), " differs from cache dtype ",
                                DTypeName(p.cache.dtype), " (convert W_UK/W_UV at load)");
  if (p.w_uk_t == nullptr || p.w_uv == nullptr) return InvalidArgumentError("mla: w_uk_t and w_uv must be set");
  // The cache.
  const PagedRowsView& c = p.cache;
  if (c.data == nullptr) return InvalidArgumentError("mla: cache.data is null");
  if (c.row_width != s.d_cache())
    return InvalidArgumentError("mla: cache row width ", c.row_width, " != d_latent + d_rope = ", s.d_cache(), " for ",
                                s);
  if (c.block_size <= 0 || c.num_blocks <= 0)
    return InvalidArgumentError("mla: cache block_size (", c.block_size, ") and num_blocks (", c.num_blocks,
                                ") must be positive");
  if (c.stride_token < c.row_width || c.stride_block < c.block_size * c.stride_token)
    return InvalidArgumentError("mla: cache strides (block ", c.stride_block, ", token ", c.stride_token,
                                ") overlap rows of width ", c.row_width);
  // Queries and outputs.
  if (p.num_tokens < 0) return InvalidArgumentError("mla: num_tokens is negative");
  if (p.num_tokens > 0) {
    if (p.q == nullptr || p.out == nullptr) return InvalidArgumentError("mla: q and out must be set");
    if (p.q_stride_head < s.d_qk() || p.q_stride_token < (s.h_q - 1) * p.q_stride_head + s.d_qk())
      return InvalidArgumentError("mla: q strides (token ", p.q_stride_token, ", head ", p.q_stride_head,
                                  ") are too small for [h_q=", s.h_q, ", d_nope + d_rope=", s.d_qk(), "]");
    if (p.out_stride_head < s.d_v || p.out_stride_token < (s.h_q - 1) * p.out_stride_head + s.d_v)
      return InvalidArgumentError("mla: out strides (token ", p.out_stride_token, ", head ", p.out_stride_head,
                                  ") are too small for [h_q=", s.h_q, ", d_v=", s.d_v, "]");
  }
  if (!std::isfinite(p.softmax_scale) || p.softmax_scale <= 0.f)
    return InvalidArgumentError("mla: softmax_scale must be positive and finite, got ", p.softmax_scale);
  // The batch.
  if (p.num_seqs < 0) return InvalidArgumentError("mla: num_seqs is negative");
  if (p.query_start == nullptr || (p.num_seqs > 0 && (p.seq_lens == nullptr || p.block_table == nullptr)))
    return InvalidArgumentError("mla: query_start, seq_lens and block_table must be set");
  if (p.query_start[0] != 0) return InvalidArgumentError("mla: query_start[0] must be 0, got ", p.query_start[0]);
  if (p.query_start[p.num_seqs] != p.num_tokens)
    return InvalidArgumentError("mla: query_start[num_seqs] = ", p.query_start[p.num_seqs],
                                " != num_tokens = ", p.num_tokens);
  for (int32_t i = 0; i < p.num_seqs; ++i) {
    const int64_t q_len = int64_t{p.query_start[i + 1]} - p.query_start[i];
    if (q_len < 0) return InvalidArgumentError("mla: query_start decreases at sequence ", i);
    const int64_t seq_len = p.seq_lens[i];
    if (q_len > seq_len)
      return InvalidArgumentError("mla: sequence ", i, " has ", q_len, " query tokens but seq_lens = ", seq_len,
                                  " (the query is longer than the cache)");
    if (q_len == 0) continue;
    const int64_t blocks = (seq_len + c.block_size - 1) / c.block_size;
    if (blocks > p.block_table_stride)
      return InvalidArgumentError("mla: sequence ", i, " needs ", blocks, " blocks for ", seq_len,
                                  " keys but block_table_stride is ", p.block_table_stride);
    const int32_t* row = p.block_table + i * p.block_table_stride;
    for (int64_t j = 0; j < blocks; ++j) {
      if (row[j] < 0 || row[j] >= c.num_blocks)
        return InvalidArgumentError("mla: block_table[", i, "][", j, "] = ", row[j], " is outside [0, ", c.num_blocks,
                                    ")");
    }
  }
  return Status::Ok();
}

AbsorbThresholds DefaultAbsorbThresholds(CpuIsa isa) {
  // Measured per family by `mlarun bench attention` (the machines, dates and
  // figures: docs/attention.md). With a cached prefix every family crosses
  // over at 256; without one, AMX's bf16 products make the expanded path's
  // up-projection cheap enough to win from 32 tokens, the others from 64.
  switch (isa) {
    case CpuIsa::kAmx:
      return {.with_prefix = 256, .no_prefix = 32};
    case CpuIsa::kAvx512:
    case CpuIsa::kAvx2:
    case CpuIsa::kScalar:
      return {.with_prefix = 256, .no_prefix = 64};
  }
  return {.with_prefix = 256, .no_prefix = 64};
}

AbsorbThresholds MlaAbsorbThresholds(const MlaConfig& c) {
  const AbsorbThresholds cpu = DefaultAbsorbThresholds(ActiveCpuIsa());
  return {.with_prefix = c.absorb_below_query_len == kAbsorbThresholdOfCpu ? cpu.with_prefix : c.absorb_below_query_len,
          .no_prefix = c.absorb_below_query_len_no_prefix == kAbsorbThresholdOfCpu
                           ? cpu.no_prefix
                           : c.absorb_below_query_len_no_prefix};
}

MlaPath MlaPathFor(const MlaConfig& c, int64_t query_len, int64_t prefix_len) {
  if (c.path != MlaPath::kAuto) return c.path;
  const AbsorbThresholds t = MlaAbsorbThresholds(c);
  return query_len < (prefix_len == 0 ? t.no_prefix : t.with_prefix) ? MlaPath::kAbsorbed : MlaPath::kExpanded;
}

StatusOr<MlaPlan> MlaMakePlan(const MlaParams& p, const MlaConfig& c) {
  MLARUN_RETURN_IF_ERROR(MlaCheckConfig(c));
  MLARUN_RETURN_IF_ERROR(MlaCheck(p));
  MlaPlan plan;
  plan.backend = c.backend;
  switch (c.backend) {
    case Backend::kCpu: {
      MLARUN_ASSIGN_OR_RETURN(plan.impl, cpu::MakeMlaPlan(p, c, &plan));
      return plan;
    }
    case Backend::kCuda: {
      MLARUN_ASSIGN_OR_RETURN(plan.impl, cuda::MakeMlaPlan(p, c, &plan));
      return plan;
    }
  }
  return InvalidArgumentError("mla: unknown backend");
}

Status MlaReplan(const MlaParams& p, const MlaConfig& c, MlaPlan& plan) {
  if (!plan.impl || plan.backend != c.backend) {
    MLARUN_ASSIGN_OR_RETURN(plan, MlaMakePlan(p, c));
    return Status::Ok();
  }
  MLARUN_RETURN_IF_ERROR(MlaCheckConfig(c));
  MLARUN_RETURN_IF_ERROR(MlaCheck(p));
  return c.backend == Backend::kCuda ? cuda::RemakeMlaPlan(p, c, &plan) : cpu::RemakeMlaPlan(p, c, &plan);
}

Status MlaRun(const MlaParams& p, const MlaPlan& plan, WorkspaceView ws) {
  if (!plan.impl) return InvalidArgumentError("MlaRun: empty plan");
  if (p.num_tokens == 0) return Status::Ok();
  switch (plan.backend) {
    case Backend::kCpu:
      return cpu::RunMla(p, *plan.impl, ws);
    case Backend::kCuda:
      return cuda::RunMla(p, *plan.impl, ws);
  }
  return UnimplementedError("MlaRun: backend ", BackendName(plan.backend), " is not available");
}

Status MlaForward(const MlaParams& p, const MlaConfig& c, Workspace& ws) {
  MLARUN_ASSIGN_OR_RETURN(MlaPlan plan, MlaMakePlan(p, c));
  WorkspaceView view = ws.Reserve(plan.workspace_bytes);
  if (plan.workspace_bytes > 0 && view.data == nullptr)
    return ResourceExhaustedError("mla: cannot allocate a workspace of ", plan.workspace_bytes, " bytes");
  return MlaRun(p, plan, view);
}

namespace {
// Visible (query, key) pairs of a causal block of q tokens at the end of s keys.
double CausalPairs(int64_t q, int64_t s) {
  const double prefix = static_cast<double>(s - q);
  return static_cast<double>(q) * prefix + static_cast<double>(q) * static_cast<double>(q + 1) / 2.0;
}
}  // namespace

double MlaAbsorbedFlops(const MlaShape& s, int64_t q, int64_t seq_len) {
  const double n = static_cast<double>(s.h_q), L = static_cast<double>(s.d_latent);
  const double folds = 2.0 * static_cast<double>(q) * n * L * static_cast<double>(s.d_nope + s.d_v);
  const double per_pair = n * (2.0 * static_cast<double>(s.d_cache()) + 2.0 * L);
  return folds + CausalPairs(q, seq_len) * per_pair;
}

double MlaExpandedFlops(const MlaShape& s, int64_t q, int64_t seq_len) {
  const double n = static_cast<double>(s.h_q);
  const double up =
      2.0 * static_cast<double>(seq_len) * n * static_cast<double>(s.d_latent) * static_cast<double>(s.d_nope + s.d_v);
  const double per_pair = n * (2.0 * static_cast<double>(s.d_qk()) + 2.0 * static_cast<double>(s.d_v));
  return up + CausalPairs(q, seq_len) * per_pair;
}

}  // namespace mlarun
