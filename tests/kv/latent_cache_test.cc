#include "kv/latent_cache.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <fstream>
#include <numeric>
#include <random>
#include <set>

namespace mlarun {
namespace {

std::vector<int32_t> Tokens(int n, int32_t start = 100) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  std::iota(t.begin(), t.end(), start);
  return t;
}

LatentCacheConfig SmallConfig(int64_t blocks, DType dtype = DType::kF32) {
  LatentCacheConfig c{.num_layers = 3, .kv_lora_rank = 8, .rope_dim = 4, .block_size = 4, .dtype = dtype};
  c.budget_bytes = blocks * c.block_size * c.num_layers * (c.kv_lora_rank + c.rope_dim) * DTypeSize(dtype);
  return c;
}

TEST(LatentCache, Accounting) {
  LatentCacheConfig c{.num_layers = 61,
                      .kv_lora_rank = 512,
                      .rope_dim = 64,
                      .block_size = 64,
                      .dtype = DType::kBF16,
                      .budget_bytes = 100 << 20};
  auto cache = LatentCache::Create(c);
  ASSERT_TRUE(cache.ok()) << cache.status();
  const LatentCacheStats s = (*cache)->stats();
  EXPECT_EQ(s.bytes_per_token, 61 * 576 * 2);  // 70,272 B: DeepSeek-V3
  EXPECT_EQ(s.block_bytes, 64 * 70272);
  EXPECT_EQ(s.blocks_total, (100 << 20) / (64 * 70272));
  EXPECT_EQ(s.blocks_free, s.blocks_total);
  EXPECT_EQ(s.bytes_used, 0);
  c.dtype = DType::kF32;
  EXPECT_EQ((*LatentCache::Create(c))->stats().bytes_per_token, 61 * 576 * 4);
}

TEST(LatentCache, BadConfig) {
  LatentCacheConfig c = SmallConfig(4);
  c.budget_bytes = 10;
  Status st = LatentCache::Create(c).status();
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("budget_bytes"), std::string::npos) << st;
  EXPECT_EQ(LatentPool::Create(c).status().code(), StatusCode::kInvalidArgument) << "the pool checks as the blocks do";
  c = SmallConfig(4);
  c.dtype = DType::kF16;
  EXPECT_EQ(LatentCache::Create(c).status().code(), StatusCode::kInvalidArgument);
  c = SmallConfig(4);
  c.block_size = 0;
  EXPECT_EQ(LatentCache::Create(c).status().code(), StatusCode::kInvalidArgument);
}

TEST(LatentCache, AppendAcrossBlocksAndWriteRows) {
  auto cache = std::move(LatentCache::Create(SmallConfig(8))).value();
  ASSERT_TRUE(cache->AddSequence(1).ok());
  EXPECT_EQ(cache->AddSequence(1).code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE(cache->Append(1, Tokens(3)).ok());
  EXPECT_EQ(cache->BlockTable(1).size(), 1u);
  ASSERT_TRUE(cache->Append(1, Tokens(1, 103)).ok());  // fills block 0 exactly
  EXPECT_EQ(cache->BlockTable(1).size(), 1u);
  EXPECT_EQ(*cache->BlocksNeeded(1, 5), 2);
  ASSERT_TRUE(cache->Append(1, Tokens(5, 104)).ok());  // crosses into blocks 1 and 2
  EXPECT_EQ(cache->BlockTable(1).size(), 3u);
  EXPECT_EQ(cache->NumTokens(1), 9);
  const auto table = cache->BlockTable(1);
  EXPECT_EQ(std::set<int32_t>(table.begin(), table.end()).size(), 3u);
  EXPECT_EQ(cache->stats().blocks_used, 3);
  EXPECT_EQ(cache->stats().bytes_used, 3 * cache->stats().block_bytes);

  // Rows go where the block table says, in every layer.
  std::mt19937 rng(1);
  std::normal_distribution<float> d;
  std::vector<float> kv(9 * 8), pe(9 * 4);
  for (float& v : kv) v = d(rng);
  for (float& v : pe) v = d(rng);
  auto pool = std::move(LatentPool::Create(cache->config())).value();
  for (int64_t layer = 0; layer < 3; ++layer)
    ASSERT_TRUE(pool->WriteRows(layer, table, 0, 9, kv.data(), 8, pe.data(), 4).ok());
  for (int64_t layer = 0; layer < 3; ++layer) {
    const PagedRowsView v = pool->Layer(layer);
    EXPECT_EQ(v.row_width, 12);
    for (int64_t pos = 0; pos < 9; ++pos) {
      const float* row = static_cast<const float*>(v.data) + table[static_cast<size_t>(pos / 4)] * v.stride_block +
                         pos % 4 * v.stride_token;
      for (int c = 0; c < 8; ++c) ASSERT_EQ(row[c], kv[static_cast<size_t>(pos * 8 + c)]);
      for (int c = 0; c < 4; ++c) ASSERT_EQ(row[8 + c], pe[static_cast<size_t>(pos * 4 + c)]);
    }
  }
  // Beyond the table, beyond the layers, a block id outside the pool: refused, nothing written.
  EXPECT_EQ(pool->WriteRows(0, table, 10, 3, kv.data(), 8, pe.data(), 4).code(), StatusCode::kOutOfRange);
  EXPECT_EQ(pool->WriteRows(3, table, 0, 1, kv.data(), 8, pe.data(), 4).code(), StatusCode::kOutOfRange);
  const std::vector<int32_t> bad = {table[0], 8};
  EXPECT_EQ(pool->WriteRows(0, bad, 3, 2, kv.data(), 8, pe.data(), 4).code(), StatusCode::kOutOfRange);
  const float* row3 = static_cast<const float*>(pool->Layer(0).data) + table[0] * pool->Layer(0).stride_block +
                      3 * pool->Layer(0).stride_token;
  EXPECT_EQ(row3[0], kv[3 * 8]) << "a refused write leaves the rows as they were";
  // The block manager's check of what a plan may write.
  EXPECT_TRUE(cache->CheckWritable(1, 0, 9).ok());
  EXPECT_EQ(cache->CheckWritable(1, 7, 3).code(), StatusCode::kOutOfRange);
  EXPECT_EQ(cache->CheckWritable(2, 0, 1).code(), StatusCode::kNotFound);
  EXPECT_EQ(cache->stats().blocks_retired, 0);
  ASSERT_TRUE(cache->Retire(1).ok());
  EXPECT_EQ(cache->stats().blocks_used, 0);
  EXPECT_EQ(cache->stats().blocks_retired, 3);  // 9 tokens in blocks of 4
  EXPECT_EQ(cache->Release(1).code(), StatusCode::kNotFound);
  EXPECT_EQ(cache->Retire(1).code(), StatusCode::kNotFound);
  EXPECT_EQ(cache->stats().blocks_retired, 3);
}

TEST(LatentPool, Bf16Rows) {
  auto pool = std::move(LatentPool::Create(SmallConfig(2, DType::kBF16))).value();
  const std::vector<int32_t> table = {1};
  std::vector<float> kv = {1.f, -2.5f, 3.14159f, 0.1f, 5, 6, 7, 8}, pe = {0.333f, 1e-3f, -7, 9};
  ASSERT_TRUE(pool->WriteRows(2, table, 0, 1, kv.data(), 8, pe.data(), 4).ok());
  const PagedRowsView v = pool->Layer(2);
  const bf16_t* row = static_cast<const bf16_t*>(v.data) + 1 * v.stride_block;
  for (int c = 0; c < 8; ++c) EXPECT_EQ(row[c], FloatToBf16(kv[static_cast<size_t>(c)]));
  for (int c = 0; c < 4; ++c) EXPECT_EQ(row[8 + c], FloatToBf16(pe[static_cast<size_t>(c)]));
}

TEST(LatentCache, ExhaustionIsAStatusAndChangesNothing) {
  auto cache = std::move(LatentCache::Create(SmallConfig(3))).value();
  ASSERT_TRUE(cache->AddSequence(1).ok());
  ASSERT_TRUE(cache->AddSequence(2).ok());
  ASSERT_TRUE(cache->Append(1, Tokens(9)).ok());  // 3 blocks: all of them
  const auto before = cache->stats();
  const Status st = cache->Append(2, Tokens(1));
  EXPECT_EQ(st.code(), StatusCode::kResourceExhausted) << st;
  EXPECT_EQ(cache->NumTokens(2), 0);
  EXPECT_EQ(cache->stats().blocks_used, before.blocks_used);
  EXPECT_EQ(cache->Append(1, Tokens(4, 200)).code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(cache->NumTokens(1), 9);
  ASSERT_TRUE(cache->Append(1, Tokens(3, 200)).ok());  // still room in the last block
  ASSERT_TRUE(cache->Retire(1).ok());
  EXPECT_EQ(cache->stats().blocks_retired, 3);     // 12 tokens; the refused appends took nothing
  EXPECT_TRUE(cache->Append(2, Tokens(12)).ok());  // everything is free again
  ASSERT_TRUE(cache->Release(2).ok());             // released, not retired: not counted
  EXPECT_EQ(cache->stats().blocks_retired, 3);
}

TEST(LatentCache, PrefixSharing) {
  auto cache = std::move(LatentCache::Create(SmallConfig(8))).value();
  const auto prompt = Tokens(10);
  ASSERT_TRUE(cache->AddSequence(1).ok());
  ASSERT_TRUE(cache->Append(1, prompt).ok());
  EXPECT_EQ(cache->MatchPrefix(prompt), 0) << "uncommitted blocks must not be shared";
  ASSERT_TRUE(cache->Commit(1).ok());
  EXPECT_EQ(cache->MatchPrefix(prompt), 8);  // two full blocks of 4
  auto other = prompt;
  other[5] = 999;
  EXPECT_EQ(cache->MatchPrefix(other), 4);  // diverges in the second block
  other = prompt;
  other[0] = 999;
  EXPECT_EQ(cache->MatchPrefix(other), 0);  // a later block never matches without its parent

  // A second request with the same prompt attaches the two full blocks.
  ASSERT_TRUE(cache->AddSequence(2).ok());
  EXPECT_EQ(*cache->AttachPrefix(2, prompt, static_cast<int64_t>(prompt.size()) - 1), 8);
  EXPECT_EQ(cache->BlockTable(2)[0], cache->BlockTable(1)[0]);
  EXPECT_EQ(cache->BlockTable(2)[1], cache->BlockTable(1)[1]);
  EXPECT_EQ(cache->stats().blocks_used, 3);
  EXPECT_EQ(cache->stats().prefix_hit_tokens, 8);
  ASSERT_TRUE(cache->Append(2, std::vector<int32_t>(prompt.begin() + 8, prompt.end())).ok());
  EXPECT_EQ(cache->CheckWritable(2, 3, 1).code(), StatusCode::kFailedPrecondition) << "a shared block's rows";
  EXPECT_EQ(cache->CheckWritable(1, 0, 1).code(), StatusCode::kFailedPrecondition) << "for its first owner too";
  EXPECT_NE(cache->BlockTable(2)[2], cache->BlockTable(1)[2]);
  EXPECT_TRUE(cache->CheckWritable(2, 8, 2).ok());

  // The first request ends: shared blocks stay in use by the second.
  ASSERT_TRUE(cache->Release(1).ok());
  EXPECT_EQ(cache->stats().blocks_used, 3);
  ASSERT_TRUE(cache->Release(2).ok());
  EXPECT_EQ(cache->stats().blocks_used, 0);
  EXPECT_EQ(cache->stats().blocks_cached, 2);  // the published prefix stays reusable
  EXPECT_EQ(cache->MatchPrefix(prompt), 8);
  // max_tokens caps the reuse to whole blocks below it.
  ASSERT_TRUE(cache->AddSequence(3).ok());
  EXPECT_EQ(*cache->AttachPrefix(3, prompt, 7), 4);
  EXPECT_EQ(cache->AttachPrefix(3, prompt, 7).status().code(), StatusCode::kFailedPrecondition);
}

TEST(LatentCache, LruEvictionOfCachedBlocks) {
  auto cache = std::move(LatentCache::Create(SmallConfig(4))).value();
  const auto a = Tokens(8, 0), b = Tokens(8, 1000);
  for (auto [id, toks] : {std::pair{1, a}, std::pair{2, b}}) {
    ASSERT_TRUE(cache->AddSequence(id).ok());
    ASSERT_TRUE(cache->Append(id, toks).ok());
    ASSERT_TRUE(cache->Commit(id).ok());
  }
  ASSERT_TRUE(cache->Release(1).ok());
  ASSERT_TRUE(cache->Release(2).ok());
  EXPECT_EQ(cache->stats().blocks_cached, 4);
  EXPECT_EQ(cache->stats().blocks_free, 0);
  // Touch `a` again so `b` becomes the least recently used prompt.
  ASSERT_TRUE(cache->AddSequence(3).ok());
  EXPECT_EQ(*cache->AttachPrefix(3, a, 8), 8);
  ASSERT_TRUE(cache->Release(3).ok());
  // One new block: evicts b's tail block first, so b keeps its head.
  ASSERT_TRUE(cache->AddSequence(4).ok());
  ASSERT_TRUE(cache->Append(4, Tokens(1, 5000)).ok());
  EXPECT_EQ(cache->stats().evictions, 1);
  EXPECT_EQ(cache->MatchPrefix(b), 4);
  EXPECT_EQ(cache->MatchPrefix(a), 8);
  // Two more: b's head goes, then a's tail.
  ASSERT_TRUE(cache->Append(4, Tokens(8, 6000)).ok());
  EXPECT_EQ(cache->MatchPrefix(b), 0);
  EXPECT_EQ(cache->MatchPrefix(a), 4);
  // Cached blocks count as allocatable, referenced ones never do.
  EXPECT_EQ(cache->stats().blocks_allocatable(), 1);
  EXPECT_EQ(cache->Append(4, Tokens(8, 7000)).code(), StatusCode::kResourceExhausted);
}

TEST(LatentCache, PrefixCachingOff) {
  LatentCacheConfig c = SmallConfig(4);
  c.enable_prefix_caching = false;
  auto cache = std::move(LatentCache::Create(c)).value();
  ASSERT_TRUE(cache->AddSequence(1).ok());
  ASSERT_TRUE(cache->Append(1, Tokens(8)).ok());
  ASSERT_TRUE(cache->Commit(1).ok());
  ASSERT_TRUE(cache->Release(1).ok());
  EXPECT_EQ(cache->MatchPrefix(Tokens(8)), 0);
  EXPECT_EQ(cache->stats().blocks_free, 4);
}

}  // namespace
}  // namespace mlarun

namespace mlarun {
namespace {

// The published chain is what PrefixBlockHashes computes: a prompt matches
// exactly as many blocks as its chain shares with a cached one.
TEST(LatentCache, PrefixBlockHashesAreThePublishedChain) {
  auto cache = std::move(LatentCache::Create(SmallConfig(8))).value();
  const auto a = Tokens(12);
  ASSERT_TRUE(cache->AddSequence(1).ok());
  ASSERT_TRUE(cache->Append(1, a).ok());
  ASSERT_TRUE(cache->Commit(1).ok());
  auto b = a;
  b[9] = 7777;  // differs in the third block
  const auto ha = PrefixBlockHashes(a, 4), hb = PrefixBlockHashes(b, 4);
  ASSERT_EQ(ha.size(), 3u);
  ASSERT_EQ(hb.size(), 3u);
  int64_t shared = 0;
  while (shared < 3 && ha[static_cast<size_t>(shared)] == hb[static_cast<size_t>(shared)]) ++shared;
  EXPECT_EQ(shared, 2);
  EXPECT_EQ(cache->MatchPrefix(b), shared * 4);
  EXPECT_EQ(PrefixBlockHashes(std::span<const int32_t>(a).first(7), 4).size(), 1u);
  EXPECT_TRUE(PrefixBlockHashes(a, 0).empty());
}

// A salt seeds the chain: under different salts the same tokens share no
// block hash (any block, any position), under equal salts all of them; salt
// 0 is the unsalted chain. The cache reuses a prefix only under the salt it
// was committed with.
TEST(LatentCache, SaltedChainsShareNoBlockAcrossSalts) {
  std::mt19937_64 rng(20261207);
  std::uniform_int_distribution<int32_t> token(0, 129279);
  for (int trial = 0; trial < 20; ++trial) {
    const int64_t bs = 1 + static_cast<int64_t>(rng() % 17);
    std::vector<int32_t> t(static_cast<size_t>(bs * (3 + rng() % 6) + rng() % 5));
    for (int32_t& x : t) x = token(rng);
    const uint64_t s1 = rng(), s2 = trial == 0 ? s1 ^ 1 : rng();  // trial 0: salts one bit apart
    const auto h1 = PrefixBlockHashes(t, bs, s1), h2 = PrefixBlockHashes(t, bs, s2);
    ASSERT_EQ(h1.size(), t.size() / static_cast<size_t>(bs));
    ASSERT_EQ(h2.size(), h1.size());
    const std::set<uint64_t> set1(h1.begin(), h1.end());
    for (uint64_t h : h2) EXPECT_FALSE(set1.contains(h)) << "trial " << trial;
    EXPECT_EQ(PrefixBlockHashes(t, bs, s1), h1);
    const auto unsalted = PrefixBlockHashes(t, bs);
    EXPECT_EQ(PrefixBlockHashes(t, bs, 0), unsalted);
    for (uint64_t h : unsalted) EXPECT_FALSE(set1.contains(h)) << "trial " << trial;
  }

  auto cache = std::move(LatentCache::Create(SmallConfig(16))).value();
  std::vector<int32_t> t(13);
  for (int32_t& x : t) x = token(rng);
  const uint64_t alice = rng(), bob = rng();
  ASSERT_TRUE(cache->AddSequence(1, alice).ok());
  ASSERT_TRUE(cache->Append(1, t).ok());
  ASSERT_TRUE(cache->Commit(1).ok());
  ASSERT_TRUE(cache->Release(1).ok());
  EXPECT_EQ(cache->MatchPrefix(t, alice), 12);
  EXPECT_EQ(cache->MatchPrefix(t, bob), 0);
  EXPECT_EQ(cache->MatchPrefix(t), 0);
  ASSERT_TRUE(cache->AddSequence(2, bob).ok());
  EXPECT_EQ(cache->AttachPrefix(2, t, 12).value(), 0);
  ASSERT_TRUE(cache->AddSequence(3, alice).ok());
  EXPECT_EQ(cache->AttachPrefix(3, t, 12).value(), 12);
  EXPECT_EQ(cache->BlockTable(3).size(), 3u);
  // Bob's own copy is published under his salt, beside Alice's.
  ASSERT_TRUE(cache->Append(2, t).ok());
  ASSERT_TRUE(cache->Commit(2).ok());
  EXPECT_EQ(cache->MatchPrefix(t, bob), 12);
  for (int b = 0; b < 3; ++b) EXPECT_NE(cache->BlockTable(2)[b], cache->BlockTable(3)[b]);
}

}  // namespace
}  // namespace mlarun

namespace mlarun {
namespace {

int64_t ResidentBytes() {
  std::ifstream statm("/proc/self/statm");
  int64_t size = 0, resident = 0;
  statm >> size >> resident;
  return resident * static_cast<int64_t>(sysconf(_SC_PAGESIZE));
}

// A committed pool is resident from the start (and zeroed); an uncommitted
// one only as blocks are written.
TEST(LatentPool, CommitMemoryMakesThePoolResident) {
  const int64_t budget = int64_t{48} << 20;
  LatentCacheConfig c{.num_layers = 4, .kv_lora_rank = 512, .rope_dim = 64, .block_size = 64, .budget_bytes = budget};
  const int64_t before_lazy = ResidentBytes();
  auto lazy = LatentPool::Create(c);
  ASSERT_TRUE(lazy.ok()) << lazy.status();
  EXPECT_LT(ResidentBytes() - before_lazy, budget / 4);
  c.commit_memory = true;
  const int64_t before = ResidentBytes();
  auto committed = LatentPool::Create(c);
  ASSERT_TRUE(committed.ok()) << committed.status();
  EXPECT_GE(ResidentBytes() - before, (*committed)->bytes() * 9 / 10);
  const PagedRowsView v = (*committed)->Layer(3);
  const bf16_t* last = static_cast<const bf16_t*>(v.data) + ((*committed)->num_blocks() - 1) * v.stride_block;
  EXPECT_EQ(last[0], 0);
}

}  // namespace
}  // namespace mlarun
