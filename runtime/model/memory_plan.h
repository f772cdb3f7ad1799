// What one rank of a layout holds, from the model's shapes alone: weights by
// category, the latent cache per token, the prefill workspace, and how many
// tokens of cache fit in what is left of a memory budget. `mlarun memory`
// prints it; `mlarun worker --memory-gib` sizes its cache with the same
// arithmetic over the bytes it actually loaded, so a live run confirms it.
//
// Ranks of one layout are alike (ValidateModelShard only admits even splits),
// so one rank's plan speaks for all of them.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "base/block_size.h"
#include "base/dtype.h"
#include "base/status.h"
#include "parallel/layout.h"
#include "runtime/model/model.h"
#include "runtime/model/model_config.h"

namespace mlarun {

// ---- Cache bytes per token ---------------------------------------------------

// One token's latent row in one layer: (kv_lora_rank + qk_rope_head_dim) in the
// cache dtype. DeepSeek-V3 in bf16: 576 x 2 = 1,152 B.
int64_t LatentBytesPerTokenLayer(const ModelConfig& c);
// Over all layers: what the latent cache holds per token (V3 bf16: 70,272 B).
int64_t LatentBytesPerToken(const ModelConfig& c);

// The DeepSeek-V3.2 indexer key of one token in one layer: index_head_dim
// e4m3 values plus one fp32 scale per 128 of them (128 + 4 = 132 B).
int64_t IndexerKeyBytesPerTokenLayer(int64_t index_head_dim);
inline constexpr int64_t kV32IndexHeadDim = 128;  // DeepseekV32Config default

// Everything cached per token: the latent, plus the indexer key when the
// model has one.
int64_t CacheBytesPerToken(const ModelConfig& c);

// The per-head keys and values ordinary multi-head attention would cache for
// the same model: layers x heads x ((qk_nope + qk_rope) + v_head) in the cache
// dtype. DeepSeek-V3 in bf16: 4,997,120 B = 4.765625 MiB, 71.11x the latent.
int64_t ExpandedKvBytesPerToken(const ModelConfig& c);

// A grouped-query-attention model to compare with: its K and V heads are
// cached per token and split by tensor parallelism (up to kv_heads ranks;
// beyond that each rank keeps one head).
struct GqaModel {
  std::string name;
  int64_t layers = 0, kv_heads = 0, head_dim = 0;
  DType dtype = DType::kBF16;
};
// Llama-3-70B: 80 layers, 8 KV heads of 128: 320 KiB per token in bf16.
GqaModel Llama3_70B();
int64_t GqaKvBytesPerToken(const GqaModel& m);
int64_t GqaKvBytesPerTokenPerRank(const GqaModel& m, int tp);
// The TP size at which an MLA latent replicated on every TP rank costs the
// cluster as much per token as GQA heads split over the ranks: gqa / mla
// (Llama-3-70B vs DeepSeek-V3: 327,680 / 70,272 = 4.66).
double MlaTpBreakEven(int64_t gqa_bytes_per_token, int64_t mla_bytes_per_token);

// ---- Workspace -----------------------------------------------------------------

// The expanded (prefill) path up-projects the context in chunks of at most
// `chunk_rows` rows (MlaConfig::expand_chunk_rows; vLLM caps its chunked-
// prefill workspace at 64k rows too): one chunk of latent rows and its
// per-head keys and values, for this rank's heads, in the cache dtype.
// DeepSeek-V3 bf16, 65,536 rows, 128 heads: latent 75,497,472 B, keys
// 3,221,225,472 B, values 2,147,483,648 B. Rows are capped at the model's
// max_position_embeddings (no chunk is longer than a sequence).
struct PrefillWorkspace {
  int64_t rows = 0, heads = 0;
  int64_t latent_bytes = 0, key_bytes = 0, value_bytes = 0;
  int64_t total() const { return latent_bytes + key_bytes + value_bytes; }
};
PrefillWorkspace PredictPrefillWorkspace(const ModelConfig& c, int attn_tp, int64_t chunk_rows);

// ---- One rank --------------------------------------------------------------------

struct MemoryPlanOptions {
  int64_t memory_bytes = 0;                // per rank: HBM on a GPU, the share of host memory on CPU
  int64_t block_size = kDefaultBlockSize;  // tokens per cache block
  int64_t chunk_rows = 65536;              // expanded-path chunk (MlaConfig::expand_chunk_rows)
  std::optional<DType> projection_dtype;   // PredictWeightBytes' what-if (kF8E4M3)
  // The full what-if (int8 / int4 with their group size, offsets and the
  // modules they cover): used instead of projection_dtype when its
  // projection_dtype is set.
  WeightFormat weight_format;
};

struct RankMemory {
  ParallelLayout layout;
  WeightBytes weights;
  PrefillWorkspace workspace;
  int64_t memory_bytes = 0;
  int64_t cache_bytes_per_token = 0;  // CacheBytesPerToken
  int64_t block_size = 0, block_bytes = 0;
  // memory - weights - workspace; negative when the weights alone do not fit.
  int64_t cache_budget_bytes = 0;
  int64_t cache_blocks = 0;       // whole blocks in the budget (0 if it is negative)
  int64_t max_cached_tokens = 0;  // cache_blocks x block_size, on this rank
  // Distinct tokens the cluster caches: the ranks of an attn-TP group hold
  // the same tokens, so this is max_cached_tokens x dp.
  int64_t cluster_cached_tokens() const { return max_cached_tokens * layout.dp; }
  bool fits() const { return cache_blocks > 0; }
};

// The plan of rank 0 of `layout`. INVALID_ARGUMENT naming the field when the
// model cannot be split that way or an option is out of range.
StatusOr<RankMemory> PlanRankMemory(const ModelConfig& c, const ParallelLayout& layout, const MemoryPlanOptions& o);

// The memory per rank at which `more_dp` caches as many distinct tokens in the
// cluster as `less_dp` (same world, more_dp.layout.dp > less_dp.layout.dp):
// DP replicates attention weights (and a wider workspace) on every rank, TP
// replicates every cached token on every rank of a group. Above the returned
// bytes the more data-parallel layout holds more. Ignores rounding to blocks.
// INVALID_ARGUMENT if the layouts do not differ in dp that way.
StatusOr<double> BreakEvenMemoryBytes(const RankMemory& less_dp, const RankMemory& more_dp);

}  // namespace mlarun
