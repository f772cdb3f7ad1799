#include "runtime/model/memory_plan.h"

#include <algorithm>

namespace mlarun {

std::ostream& operator<<(std::ostream& os, const WeightBytes& w) {
  return os << "{attention " << w.attention << " (replicated " << w.attention_replicated << "), dense_mlp "
            << w.dense_mlp << ", moe " << w.moe << ", embedding_and_head " << w.embedding_and_head << "}";
}

namespace {
int64_t Size(DType t) { return static_cast<int64_t>(DTypeSize(t)); }
}  // namespace

int64_t LatentBytesPerTokenLayer(const ModelConfig& c) {
  return (c.kv_lora_rank + c.qk_rope_head_dim) * Size(c.kv_dtype);
}

int64_t LatentBytesPerToken(const ModelConfig& c) { return CacheConfigFor(c, 0, 1).bytes_per_token(); }

int64_t IndexerKeyBytesPerTokenLayer(int64_t index_head_dim) {
  constexpr int64_t kScaleBlock = 128;  // one fp32 scale per 128 e4m3 values
  return index_head_dim * Size(DType::kF8E4M3) + (index_head_dim + kScaleBlock - 1) / kScaleBlock * 4;
}

int64_t CacheBytesPerToken(const ModelConfig& c) {
  return LatentBytesPerToken(c) +
         (c.has_indexer() ? c.num_hidden_layers * IndexerKeyBytesPerTokenLayer(c.index_head_dim) : 0);
}

int64_t ExpandedKvBytesPerToken(const ModelConfig& c) {
  return c.num_hidden_layers * c.num_attention_heads * (c.q_head_dim() + c.v_head_dim) * Size(c.kv_dtype);
}

GqaModel Llama3_70B() { return GqaModel{.name = "Llama-3-70B", .layers = 80, .kv_heads = 8, .head_dim = 128}; }

int64_t GqaKvBytesPerToken(const GqaModel& m) { return m.layers * m.kv_heads * m.head_dim * 2 * Size(m.dtype); }

int64_t GqaKvBytesPerTokenPerRank(const GqaModel& m, int tp) {
  const int64_t heads = std::max<int64_t>(1, (m.kv_heads + tp - 1) / tp);
  return m.layers * heads * m.head_dim * 2 * Size(m.dtype);
}

double MlaTpBreakEven(int64_t gqa_bytes_per_token, int64_t mla_bytes_per_token) {
  return static_cast<double>(gqa_bytes_per_token) / static_cast<double>(mla_bytes_per_token);
}

PrefillWorkspace PredictPrefillWorkspace(const ModelConfig& c, int attn_tp, int64_t chunk_rows) {
  PrefillWorkspace w;
  w.rows = c.max_position_embeddings > 0 ? std::min(chunk_rows, c.max_position_embeddings) : chunk_rows;
  w.heads = c.num_attention_heads / attn_tp;
  const int64_t e = Size(c.kv_dtype);
  w.latent_bytes = w.rows * (c.kv_lora_rank + c.qk_rope_head_dim) * e;
  w.key_bytes = w.rows * w.heads * c.q_head_dim() * e;
  w.value_bytes = w.rows * w.heads * c.v_head_dim * e;
  return w;
}

StatusOr<RankMemory> PlanRankMemory(const ModelConfig& c, const ParallelLayout& layout, const MemoryPlanOptions& o) {
  if (o.memory_bytes < 0) return InvalidArgumentError("memory per rank must not be negative, got ", o.memory_bytes);
  if (o.block_size <= 0) return InvalidArgumentError("block size must be positive, got ", o.block_size);
  if (o.chunk_rows <= 0) return InvalidArgumentError("workspace chunk rows must be positive, got ", o.chunk_rows);
  WeightFormat f = o.weight_format;
  if (!f.projection_dtype) f.projection_dtype = o.projection_dtype;
  if (f.projection_dtype && *f.projection_dtype != DType::kF8E4M3 && *f.projection_dtype != DType::kBF16 &&
      *f.projection_dtype != DType::kF32 && !IsIntWeight(*f.projection_dtype))
    return InvalidArgumentError("weight dtype must be f32, bf16, f8_e4m3, int8 or int4, got ",
                                DTypeName(*f.projection_dtype));
  if (f.projection_dtype && IsIntWeight(*f.projection_dtype) && f.group > 0 && f.group % 2 != 0)
    return InvalidArgumentError("group size must be even (or <= 0: per channel), got ", f.group);
  const ModelShard shard = ModelShard::For(layout, 0);
  MLARUN_RETURN_IF_ERROR(ValidateModelShard(c, shard));
  RankMemory r;
  r.layout = layout;
  r.weights = PredictWeightBytes(c, shard, f);
  r.workspace = PredictPrefillWorkspace(c, layout.attn_tp, o.chunk_rows);
  r.memory_bytes = o.memory_bytes;
  r.cache_bytes_per_token = CacheBytesPerToken(c);
  r.block_size = o.block_size;
  r.block_bytes = o.block_size * r.cache_bytes_per_token;
  r.cache_budget_bytes = o.memory_bytes - r.weights.total() - r.workspace.total();
  r.cache_blocks = LatentCacheConfig::BlocksIn(r.cache_budget_bytes, r.block_bytes);
  r.max_cached_tokens = r.cache_blocks * o.block_size;
  return r;
}

StatusOr<double> BreakEvenMemoryBytes(const RankMemory& a, const RankMemory& b) {
  if (a.layout.world() != b.layout.world() || b.layout.dp <= a.layout.dp)
    return InvalidArgumentError("break-even: compare two layouts of one world, the second with more DP groups (got ",
                                a.layout, " and ", b.layout, ")");
  // dp_a (M - o_a) = dp_b (M - o_b), o = weights + workspace per rank.
  const double oa = static_cast<double>(a.weights.total() + a.workspace.total());
  const double ob = static_cast<double>(b.weights.total() + b.workspace.total());
  const double da = a.layout.dp, db = b.layout.dp;
  return (db * ob - da * oa) / (db - da);
}

}  // namespace mlarun
