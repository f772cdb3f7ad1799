// The memory model against numbers worked out by hand from the shapes
// (docs/design.md "The numbers that define the problem"), and against what a
// loaded model and a real LatentCache occupy.
#include "runtime/model/memory_plan.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "kv/latent_cache.h"
#include "tests/ref/deepseek_v3_by_hand.h"
#include "tests/test_paths.h"

namespace mlarun {
namespace {

const std::string kModels = ConfigPath("models/");

// DeepSeek-V3's config. Call it through ASSERT_NO_FATAL_FAILURE: a config
// that does not load stops the test there instead of feeding it on.
void LoadV3(ModelConfig* c) {
  auto loaded = Model::LoadConfig(kModels + "deepseek-v3.yaml");
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  *c = *loaded;
}

TEST(MemoryPlan, DeepSeekV3CachePerToken) {
  ModelConfig c;
  ASSERT_NO_FATAL_FAILURE(LoadV3(&c));
  // (512 + 64) values x 2 B per layer, 61 layers.
  EXPECT_EQ(LatentBytesPerTokenLayer(c), 1152);
  EXPECT_EQ(LatentBytesPerToken(c), 70272);
  EXPECT_EQ(LatentBytesPerToken(c) / 1024.0, 68.625);
  EXPECT_EQ(CacheBytesPerToken(c), 70272);  // no indexer in V3
  // 61 x 128 heads x (192 + 128) x 2 B.
  EXPECT_EQ(ExpandedKvBytesPerToken(c), 61 * 128 * 320 * 2);
  EXPECT_EQ(ExpandedKvBytesPerToken(c) / (1024.0 * 1024.0), 4.765625);
  EXPECT_EQ(std::round(100.0 * ExpandedKvBytesPerToken(c) / LatentBytesPerToken(c)) / 100.0, 71.11);
  // The cache dtype scales all of it.
  ModelConfig f32 = c;
  f32.kv_dtype = DType::kF32;
  EXPECT_EQ(LatentBytesPerToken(f32), 2 * 70272);
}

TEST(MemoryPlan, GqaComparisonAndTpBreakEven) {
  const GqaModel llama = Llama3_70B();
  EXPECT_EQ(GqaKvBytesPerToken(llama), 80 * 8 * 128 * 2 * 2);
  EXPECT_EQ(GqaKvBytesPerToken(llama), 320 * 1024);
  EXPECT_EQ(GqaKvBytesPerTokenPerRank(llama, 1), 320 * 1024);
  EXPECT_EQ(GqaKvBytesPerTokenPerRank(llama, 4), 80 * 1024);
  EXPECT_EQ(GqaKvBytesPerTokenPerRank(llama, 8), 40 * 1024);
  EXPECT_EQ(GqaKvBytesPerTokenPerRank(llama, 16), 40 * 1024);  // 8 KV heads: replicated beyond TP 8
  ModelConfig v3;
  ASSERT_NO_FATAL_FAILURE(LoadV3(&v3));
  const double tp = MlaTpBreakEven(GqaKvBytesPerToken(llama), LatentBytesPerToken(v3));
  EXPECT_NEAR(tp, 320.0 / 68.625, 1e-12);
  EXPECT_EQ(std::floor(tp * 100) / 100, 4.66);
}

TEST(MemoryPlan, IndexerKeyOfDeepSeekV32) {
  EXPECT_EQ(IndexerKeyBytesPerTokenLayer(128), 128 + 4);
  EXPECT_EQ(61 * IndexerKeyBytesPerTokenLayer(kV32IndexHeadDim), 8052);
  EXPECT_EQ(std::round(100.0 * 8052 / 1024) / 100, 7.86);
  ModelConfig v32;
  ASSERT_NO_FATAL_FAILURE(LoadV3(&v32));
  v32.index_n_heads = 64;
  v32.index_head_dim = 128;
  v32.index_topk = 2048;
  EXPECT_EQ(CacheBytesPerToken(v32), 70272 + 8052);
}

TEST(MemoryPlan, PrefillWorkspaceOf64kRows) {
  ModelConfig c;
  ASSERT_NO_FATAL_FAILURE(LoadV3(&c));
  const PrefillWorkspace w = PredictPrefillWorkspace(c, 1, 65536);
  EXPECT_EQ(w.rows, 65536);
  EXPECT_EQ(w.latent_bytes, int64_t{2} * 576 * 65536);
  EXPECT_EQ(w.latent_bytes, 75497472);
  EXPECT_EQ(w.key_bytes, int64_t{2} * 192 * 128 * 65536);
  EXPECT_EQ(w.key_bytes, 3221225472);
  EXPECT_EQ(w.value_bytes, int64_t{2} * 128 * 128 * 65536);
  // A rank of attn_tp 8 up-projects its 16 heads.
  const PrefillWorkspace w8 = PredictPrefillWorkspace(c, 8, 65536);
  EXPECT_EQ(w8.key_bytes, 3221225472 / 8);
  EXPECT_EQ(w8.latent_bytes, w.latent_bytes);
  // No chunk is longer than the longest sequence.
  ModelConfig short_ctx = c;
  short_ctx.max_position_embeddings = 4096;
  EXPECT_EQ(PredictPrefillWorkspace(short_ctx, 1, 65536).rows, 4096);
}

// V3 attention weights per layer, by hand: q_a [1536, 7168], q_b [128 x 192,
// 1536], kv_a [576, 7168], W_UK / W_UV [128 x 256 x 512], o [7168, 128 x 128],
// norms in fp32 (q_a 1536, kv_a 512, two of 7168).
TEST(MemoryPlan, DeepSeekV3AttentionByHand) {
  ModelConfig c;
  ASSERT_NO_FATAL_FAILURE(LoadV3(&c));
  const int64_t replicated = (1536 * 7168 + 576 * 7168) * 2 + (1536 + 512 + 2 * 7168) * 4;
  const int64_t split_tp1 = (128 * 192 * 1536 + 7168 * 128 * 128) * 2 + 128 * 256 * 512 * 2;
  for (int tp : {1, 8}) {
    const WeightBytes w = PredictWeightBytes(c, ModelShard{.attn_tp_size = tp, .mlp_size = 8});
    EXPECT_EQ(w.attention_replicated, 61 * replicated) << tp;
    EXPECT_EQ(w.attention - w.attention_replicated, 61 * split_tp1 / tp) << tp;
  }
  // fp8 projections: one byte each plus an fp32 scale per 128 x 128 block;
  // W_UK / W_UV stay in the cache dtype.
  const WeightBytes f8 = PredictWeightBytes(c, ModelShard{.mlp_size = 8}, DType::kF8E4M3);
  const int64_t f8_replicated = 1536 * 7168 + 12 * 56 * 4 + 576 * 7168 + 5 * 56 * 4 + (1536 + 512 + 2 * 7168) * 4;
  EXPECT_EQ(f8.attention_replicated, 61 * f8_replicated);
}

// int4 / int8 projections (docs/quantized-weights.md): packed values plus an
// fp32 scale per group of a row (and as many offsets when asymmetric); W_UK /
// W_UV stay in the cache dtype, lm_head bf16 unless quantized.
TEST(MemoryPlan, DeepSeekV3IntProjectionsByHand) {
  ModelConfig c;
  ASSERT_NO_FATAL_FAILURE(LoadV3(&c));
  const int64_t norms = (1536 + 512 + 2 * 7168) * 4;
  const WeightFormat int4{.projection_dtype = DType::kInt4, .group = 128};
  const WeightBytes w4 = PredictWeightBytes(c, ModelShard{.mlp_size = 8}, int4);
  EXPECT_EQ(w4.attention_replicated, 61 * ((1536 + 576) * (3584 + 56 * 4) + norms));
  // by expert on 8 ranks: 32 experts of gate / up [2048, 7168] and down
  // [7168, 2048]; the shared expert's 256-wide slice (down: 2 groups); the
  // router and its bias fp32.
  const int64_t expert = 2 * 2048 * (3584 + 56 * 4) + 7168 * (1024 + 16 * 4);
  const int64_t shared = 2 * 256 * (3584 + 56 * 4) + 7168 * (128 + 2 * 4);
  EXPECT_EQ(w4.moe, 58 * (32 * expert + shared + 256 * 7168 * 4 + 256 * 4));
  EXPECT_EQ(w4.embedding_and_head, int64_t{2} * 129280 * 7168 * 2 + 7168 * 4);
  const WeightFormat asym{.projection_dtype = DType::kInt4, .group = 128, .offsets = true};
  EXPECT_EQ(PredictWeightBytes(c, ModelShard{.mlp_size = 8}, asym).attention_replicated,
            61 * ((1536 + 576) * (3584 + 2 * 56 * 4) + norms));
  // int8 per channel, lm_head quantized too.
  const WeightFormat int8{
      .projection_dtype = DType::kInt8, .group = 0, .quantized = [](std::string_view) { return true; }};
  const WeightBytes w8 = PredictWeightBytes(c, ModelShard{.mlp_size = 8}, int8);
  EXPECT_EQ(w8.attention_replicated, 61 * ((1536 + 576) * (7168 + 4) + norms));
  EXPECT_EQ(w8.embedding_and_head, int64_t{129280} * 7168 * 2 + int64_t{129280} * (7168 + 4) + 7168 * 4);
  // The plan takes the format and refuses an odd group.
  auto plan = PlanRankMemory(c, {.dp = 1, .attn_tp = 8}, {.memory_bytes = int64_t{141} << 30, .weight_format = int4});
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->weights.attention_replicated, w4.attention_replicated);
  auto odd = PlanRankMemory(
      c, {.dp = 1, .attn_tp = 8},
      {.memory_bytes = int64_t{141} << 30, .weight_format = {.projection_dtype = DType::kInt4, .group = 33}});
  ASSERT_FALSE(odd.ok());
  EXPECT_NE(odd.status().message().find("group size must be even"), std::string::npos) << odd.status();
}

// fp8 DeepSeek-V3 on 8 ranks of 141 GiB against the hand arithmetic of
// tests/ref/deepseek_v3_by_hand.h: every weight category, the workspace, the
// cache budget, blocks and tokens, for tp8, dp8 and dp2xtp4.
TEST(MemoryPlan, DeepSeekV3Fp8On8RanksByHand) {
  namespace hand = v3_by_hand;
  // The hand formulas give the totals worked out on paper: per rank and MoE
  // layer 32 experts of 3 x (2048 x 7168 + 16 x 56 scales x 4 B) = 1,409,630,208 B,
  // the shared expert's 256-wide slice 5,506,368 B, router and bias 7,341,056 B
  // (1,422,477,632 B x 58); per dense layer 3 x (2304 x 7168 + 18 x 56 x 4) B x 3.
  static_assert(hand::ByHand(8, true).moe == 82'503'702'656);
  static_assert(hand::ByHand(1, true).moe == 82'503'702'656);  // attn_tp does not touch the MLPs
  static_assert(hand::ByHand(8, true).dense_mlp == 148'671'936);
  // docs/memory.md's table: max cached tokens per rank.
  constexpr int64_t kMemory = int64_t{141} << 30;
  static_assert(hand::CacheOf(hand::ByHand(8, true), kMemory).tokens == 881'152);
  static_assert(hand::CacheOf(hand::ByHand(1, true), kMemory).tokens == 670'976);
  static_assert(hand::CacheOf(hand::ByHand(4, true), kMemory).tokens == 851'136);

  ModelConfig c;
  ASSERT_NO_FATAL_FAILURE(LoadV3(&c));
  for (int tp : {8, 1, 4}) {
    auto plan = PlanRankMemory(c, {.dp = 8 / tp, .attn_tp = tp},
                               {.memory_bytes = kMemory, .block_size = 64, .projection_dtype = DType::kF8E4M3});
    ASSERT_TRUE(plan.ok()) << plan.status();
    const hand::Rank want = hand::ByHand(tp, true);
    const hand::Cache cache = hand::CacheOf(want, kMemory);
    EXPECT_EQ(plan->weights.moe, want.moe) << "tp" << tp;
    EXPECT_EQ(plan->weights.dense_mlp, want.dense_mlp) << "tp" << tp;
    EXPECT_EQ(plan->weights.attention_replicated, want.attention_replicated) << "tp" << tp;
    EXPECT_EQ(plan->weights.attention - plan->weights.attention_replicated, want.attention_split) << "tp" << tp;
    EXPECT_EQ(plan->weights.embedding_and_head, want.embedding_and_head) << "tp" << tp;
    EXPECT_EQ(plan->weights.total(), want.weights()) << "tp" << tp;
    EXPECT_EQ(plan->workspace.total(), want.workspace) << "tp" << tp;
    EXPECT_EQ(plan->cache_bytes_per_token, hand::kCacheBytesPerToken);
    EXPECT_EQ(plan->block_bytes, hand::kBlockBytes);
    EXPECT_EQ(plan->cache_budget_bytes, cache.budget) << "tp" << tp;
    EXPECT_EQ(plan->cache_blocks, cache.blocks) << "tp" << tp;
    EXPECT_EQ(plan->max_cached_tokens, cache.tokens) << "tp" << tp;
    EXPECT_EQ(plan->cluster_cached_tokens(), cache.tokens * (8 / tp)) << "tp" << tp;
  }
}

// The plan of each rank equals what the loaded shard holds and the cache it
// would allocate from the same budget.
TEST(MemoryPlan, AgreesWithLoadedShardsAndTheCache) {
  auto yaml = LoadModelYaml(kModels + "tiny.yaml");
  ASSERT_TRUE(yaml.ok()) << yaml.status();
  for (const char* text : {"dp=4", "attn_tp=4", "dp=2,attn_tp=2", "dp=2,attn_tp=2,moe=intermediate"}) {
    const ParallelLayout layout = *ParseParallelLayout(text);
    const int64_t memory = int64_t{48} << 20;
    auto plan = PlanRankMemory(yaml->config, layout, {.memory_bytes = memory, .block_size = 16, .chunk_rows = 65536});
    ASSERT_TRUE(plan.ok()) << plan.status();
    for (int rank = 0; rank < layout.world(); ++rank) {
      ModelOptions mo;
      mo.shard = ModelShard::For(layout, rank);
      auto m = Model::Load(kModels + "tiny.yaml", {}, mo);
      ASSERT_TRUE(m.ok()) << m.status();
      const WeightBytes got = (*m)->weight_bytes();
      // Every category of the predicted weight bytes, not just their sum.
      EXPECT_EQ(got, plan->weights) << text << " rank " << rank;
      const int64_t budget = memory - got.total() - plan->workspace.total();
      auto cache = LatentCache::Create((*m)->CacheConfig(budget, 16));
      ASSERT_TRUE(cache.ok()) << cache.status();
      EXPECT_EQ((*cache)->stats().blocks_total, plan->cache_blocks) << text;
      EXPECT_EQ((*cache)->stats().bytes_per_token, plan->cache_bytes_per_token) << text;
      EXPECT_EQ(plan->max_cached_tokens, plan->cache_blocks * 16);
    }
    EXPECT_EQ(plan->cluster_cached_tokens(), plan->max_cached_tokens * layout.dp);
  }
}

// The same with a checkpoint whose projections are stored fp8 (the V3
// release's format, tests/fixtures/models/v3_fp8) and kept so: the plan with
// projection_dtype fp8 is rank 0's holding, PredictWeightBytes every rank's
// (ranks whose slices do not start on a 128 boundary hold those dequantized).
TEST(MemoryPlan, AgreesWithLoadedFp8Checkpoint) {
  const std::string dir = std::string(MLARUN_FIXTURES_DIR) + "/models/v3_fp8";
  auto config = Model::LoadConfig(dir);
  ASSERT_TRUE(config.ok()) << config.status();
  for (const char* text : {"dp=2", "attn_tp=2", "dp=2,moe=intermediate", "attn_tp=2,moe=intermediate"}) {
    const ParallelLayout layout = *ParseParallelLayout(text);
    auto plan =
        PlanRankMemory(*config, layout, {.memory_bytes = int64_t{48} << 20, .projection_dtype = DType::kF8E4M3});
    ASSERT_TRUE(plan.ok()) << plan.status();
    for (int rank = 0; rank < layout.world(); ++rank) {
      ModelOptions mo;
      mo.shard = ModelShard::For(layout, rank);
      mo.progress = [](const std::string&) {};
      auto m = Model::Load(dir, {}, mo);
      ASSERT_TRUE(m.ok()) << m.status();
      const WeightBytes got = (*m)->weight_bytes();
      const WeightBytes want = rank == 0 ? plan->weights : PredictWeightBytes(*config, mo.shard, DType::kF8E4M3);
      EXPECT_EQ(got, want) << text << " rank " << rank;
    }
    // fp8 where bf16 would take two bytes: less than the bf16 plan.
    auto bf16 = PlanRankMemory(*config, layout, {.memory_bytes = int64_t{48} << 20});
    ASSERT_TRUE(bf16.ok());
    EXPECT_LT(plan->weights.total(), bf16->weights.total()) << text;
  }
}

// compressed-tensors checkpoints (tests/fixtures/models/v3_w4a16, _asym,
// v3_w8a16) kept int4 / int8: every rank of each layout holds what the plan
// of the checkpoint's scheme says (slices that cut a group dequantized).
TEST(MemoryPlan, AgreesWithLoadedQuantizedCheckpoints) {
  for (const char* name : {"v3_w4a16", "v3_w4a16_asym", "v3_w8a16"}) {
    const std::string dir = std::string(MLARUN_FIXTURES_DIR) + "/models/" + name;
    auto config = Model::LoadConfig(dir);
    ASSERT_TRUE(config.ok()) << config.status();
    auto scheme = ReadQuantScheme(dir);
    ASSERT_TRUE(scheme.ok()) << scheme.status();
    const WeightFormat format = WeightFormatOf(*scheme);
    for (const char* text : {"dp=2", "attn_tp=2", "dp=2,moe=intermediate", "attn_tp=2,moe=intermediate"}) {
      const ParallelLayout layout = *ParseParallelLayout(text);
      auto plan = PlanRankMemory(*config, layout, {.memory_bytes = int64_t{48} << 20, .weight_format = format});
      ASSERT_TRUE(plan.ok()) << plan.status();
      for (int rank = 0; rank < layout.world(); ++rank) {
        ModelOptions mo;
        mo.shard = ModelShard::For(layout, rank);
        mo.progress = [](const std::string&) {};
        auto m = Model::Load(dir, {}, mo);
        ASSERT_TRUE(m.ok()) << m.status();
        const WeightBytes got = (*m)->weight_bytes();
        const WeightBytes want = rank == 0 ? plan->weights : PredictWeightBytes(*config, mo.shard, format);
        EXPECT_EQ(got, want) << name << " " << text << " rank " << rank;
      }
      auto bf16 = PlanRankMemory(*config, layout, {.memory_bytes = int64_t{48} << 20});
      ASSERT_TRUE(bf16.ok());
      EXPECT_LT(plan->weights.total(), bf16->weights.total()) << name << " " << text;
    }
  }
}

TEST(MemoryPlan, BreakEvenBalancesDistinctTokens) {
  ModelConfig c;
  ASSERT_NO_FATAL_FAILURE(LoadV3(&c));
  const MemoryPlanOptions o{.memory_bytes = int64_t{141} << 30, .projection_dtype = DType::kF8E4M3};
  auto tp8 = PlanRankMemory(c, {.dp = 1, .attn_tp = 8}, o);
  auto dp8 = PlanRankMemory(c, {.dp = 8, .attn_tp = 1}, o);
  ASSERT_TRUE(tp8.ok() && dp8.ok());
  auto m = BreakEvenMemoryBytes(*tp8, *dp8);
  ASSERT_TRUE(m.ok()) << m.status();
  // At the break-even both hold as many distinct tokens (before block rounding).
  auto distinct = [&](const RankMemory& r, double M) {
    return r.layout.dp * (M - double(r.weights.total() + r.workspace.total())) / double(r.cache_bytes_per_token);
  };
  EXPECT_NEAR(distinct(*tp8, *m), distinct(*dp8, *m), 1e-6 * distinct(*tp8, *m));
  EXPECT_GT(distinct(*dp8, *m * 1.01), distinct(*tp8, *m * 1.01));
  EXPECT_LT(distinct(*dp8, *m * 0.99), distinct(*tp8, *m * 0.99));
  EXPECT_FALSE(BreakEvenMemoryBytes(*dp8, *tp8).ok());  // the second must have more DP groups
}

TEST(MemoryPlan, ErrorsNameWhatIsWrong) {
  ModelConfig c;
  ASSERT_NO_FATAL_FAILURE(LoadV3(&c));
  auto bad_split = PlanRankMemory(c, {.dp = 1, .attn_tp = 3}, {.memory_bytes = 1});
  ASSERT_FALSE(bad_split.ok());
  EXPECT_NE(bad_split.status().message().find("num_attention_heads"), std::string::npos) << bad_split.status();
  EXPECT_FALSE(PlanRankMemory(c, {.dp = 8}, {.memory_bytes = -1}).ok());
  EXPECT_FALSE(PlanRankMemory(c, {.dp = 8}, {.memory_bytes = 1, .block_size = 0}).ok());
  // Weights larger than the memory: a negative budget and no blocks.
  auto small = PlanRankMemory(c, {.dp = 8}, {.memory_bytes = int64_t{1} << 30});
  ASSERT_TRUE(small.ok());
  EXPECT_LT(small->cache_budget_bytes, 0);
  EXPECT_EQ(small->cache_blocks, 0);
  EXPECT_FALSE(small->fits());
}

}  // namespace
}  // namespace mlarun
