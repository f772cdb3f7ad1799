// The plan a scheduler makes and the runners that execute it: the broadcast
// form carries everything a member needs (a member's pool ends up holding
// the leader's rows from the plans alone), and a bad plan is an error that
// leaves the runner usable.
#include "runtime/runner/model_runner.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <set>

#include "runtime/engine/engine.h"
#include "tests/test_paths.h"

namespace mlarun {
namespace {

std::unique_ptr<Model> Tiny() {
  auto m = Model::Load(TinyYaml(), ModelOverrides{.kv_dtype = DType::kF32});
  EXPECT_TRUE(m.ok()) << m.status();
  return m.ok() ? std::move(m).value() : nullptr;
}

std::vector<int32_t> RandomTokens(int n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (auto& v : t) v = static_cast<int32_t>(2 + rng() % 500);
  return t;
}

StepPlan RandomPlan(std::mt19937& rng) {
  StepPlan p;
  p.has_work = rng() % 2 == 0;
  p.cache = {.blocks_used = int64_t(rng() % 1000),
             .blocks_cached = int64_t(rng() % 100),
             .blocks_retired = int64_t(rng() % 5000),
             .prefix_hit_tokens = int64_t(rng()),
             .evictions = 7};
  const int n = 1 + static_cast<int>(rng() % 6);
  for (int i = 0; i < n; ++i) {
    StepPlan::Seq s{.id = int64_t(rng()) << 8, .start_pos = int64_t(rng() % 4000)};
    s.tokens = RandomTokens(1 + static_cast<int>(rng() % 40), rng());
    for (int b = 0, nb = 1 + static_cast<int>(rng() % 70); b < nb; ++b)
      s.block_table.push_back(int32_t(rng() % 100000));
    p.seqs.push_back(std::move(s));
  }
  return p;
}

TEST(StepPlan, EncodeDecodeRoundTrip) {
  std::mt19937 rng(1);
  Sampler sampler(SamplingParams{});
  for (int trial = 0; trial < 50; ++trial) {
    StepPlan p = RandomPlan(rng);
    p.seqs[0].sampler = &sampler;
    auto back = StepPlan::Decode(p.Encode());
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(back->has_work, p.has_work);
    EXPECT_EQ(back->cache, p.cache);
    ASSERT_EQ(back->seqs.size(), p.seqs.size());
    for (size_t i = 0; i < p.seqs.size(); ++i) {
      EXPECT_EQ(back->seqs[i].id, p.seqs[i].id);
      EXPECT_EQ(back->seqs[i].start_pos, p.seqs[i].start_pos);
      EXPECT_EQ(back->seqs[i].tokens, p.seqs[i].tokens);
      EXPECT_EQ(back->seqs[i].block_table, p.seqs[i].block_table);
      EXPECT_EQ(back->seqs[i].sampler, nullptr) << "samplers stay with the scheduler";
    }
    EXPECT_EQ(back->num_tokens(), p.num_tokens());
  }
}

TEST(StepPlan, DecodeRefusesWhatIsNotAPlan) {
  std::mt19937 rng(2);
  const std::vector<int64_t> full = RandomPlan(rng).Encode();
  for (size_t n = 0; n < full.size(); ++n) {  // every truncation
    auto p = StepPlan::Decode(std::span<const int64_t>(full.data(), n));
    EXPECT_EQ(p.status().code(), StatusCode::kInvalidArgument) << n << " of " << full.size() << " words";
  }
  std::vector<int64_t> longer = full;
  longer.push_back(5);
  EXPECT_NE(StepPlan::Decode(longer).status().message().find("trailing"), std::string::npos);
  std::vector<int64_t> wide = full;
  wide[10] = int64_t{1} << 40;  // a token id (the first sequence's tokens start at word 10)
  EXPECT_EQ(StepPlan::Decode(wide).status().code(), StatusCode::kInvalidArgument);
  std::vector<int64_t> negative = full;
  negative[9] = -3;  // the first sequence's token count
  EXPECT_EQ(StepPlan::Decode(negative).status().code(), StatusCode::kInvalidArgument);
}

// A DP group of two ranks in one process: the leader's scheduler makes the
// plans, the leader's runner runs each as made, a member's runner runs its
// broadcast form. The member has no block manager; its pool must end up with
// the leader's rows in every block the requests used.
TEST(ModelRunner, AMemberNeedsOnlyThePlans) {
  auto m = Tiny();
  ASSERT_TRUE(m);
  const EngineConfig ec{
      .max_num_batched_tokens = 24, .max_num_seqs = 4, .cache_budget_bytes = 4 << 20, .block_size = 16};
  auto scheduler = std::move(Engine::CreateScheduler(m->config(), ec)).value();
  const LatentCacheConfig pool = std::move(Engine::CacheConfig(m->config(), ec)).value();
  auto leader = std::move(ModelRunner::Create(*m, pool)).value();
  auto member = std::move(ModelRunner::Create(*m, pool)).value();
  std::vector<int64_t> ids;
  for (int i = 0; i < 4; ++i) {
    GenerationRequest r{
        RandomTokens(5 + 13 * i, 10 + i),
        SamplingParams{
            .temperature = i % 2 ? 0.7 : 0.0, .top_k = 40, .seed = uint64_t(i), .max_tokens = 6, .ignore_eos = true}};
    ids.push_back(std::move(scheduler->Add(std::move(r))).value());
  }
  std::set<int32_t> used;
  int steps = 0;
  while (scheduler->HasWork()) {
    ASSERT_LT(++steps, 200);
    auto plan = scheduler->Schedule();
    ASSERT_TRUE(plan.ok()) << plan.status();
    for (const StepPlan::Seq& s : plan->seqs) used.insert(s.block_table.begin(), s.block_table.end());
    auto sampled = leader->Execute(*plan);
    ASSERT_TRUE(sampled.ok()) << sampled.status();
    EXPECT_EQ(static_cast<int64_t>(sampled->size()), plan->num_sampled());
    const std::vector<int64_t> words = plan->Encode();
    auto received = StepPlan::Decode(words);
    ASSERT_TRUE(received.ok()) << received.status();
    auto none = member->Execute(*received);
    ASSERT_TRUE(none.ok()) << none.status();
    EXPECT_TRUE(none->empty()) << "a member samples nothing";
    ASSERT_TRUE(scheduler->Finish(*plan, *sampled).ok());
  }
  for (int64_t id : ids) EXPECT_EQ(scheduler->Output(id)->tokens.size(), 6u);
  ASSERT_FALSE(used.empty());
  const int64_t row = pool.kv_lora_rank + pool.rope_dim;
  for (int64_t layer = 0; layer < pool.num_layers; ++layer) {
    const PagedRowsView a = leader->pool().Layer(layer), b = member->pool().Layer(layer);
    for (int32_t blk : used) {
      const float* pa = static_cast<const float*>(a.data) + blk * a.stride_block;
      const float* pb = static_cast<const float*>(b.data) + blk * b.stride_block;
      ASSERT_EQ(std::memcmp(pa, pb, static_cast<size_t>(pool.block_size * row) * sizeof(float)), 0)
          << "layer " << layer << " block " << blk;
    }
  }
}

// A plan whose block table does not cover its positions, or names a block
// outside the pool, is refused with what is wrong; the runner then runs the
// next plan as a fresh one would.
TEST(ModelRunner, ABadPlanIsAnErrorAndTheNextRuns) {
  auto m = Tiny();
  ASSERT_TRUE(m);
  LatentCacheConfig pool = m->CacheConfig(2 << 20, 16);
  auto runner = std::move(ModelRunner::Create(*m, pool)).value();
  auto fresh = std::move(ModelRunner::Create(*m, pool)).value();
  Sampler s1(SamplingParams{}), s2(SamplingParams{});
  StepPlan good;
  good.seqs.push_back({.id = 1, .start_pos = 0, .tokens = RandomTokens(20, 3), .block_table = {4, 9}, .sampler = &s1});

  StepPlan short_table = good;
  short_table.seqs[0].block_table = {4};
  auto r = runner->Execute(short_table);
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("block table"), std::string::npos) << r.status();

  StepPlan outside = good;
  outside.seqs[0].block_table = {4, int32_t(runner->pool().num_blocks())};
  r = runner->Execute(outside);
  EXPECT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("outside"), std::string::npos) << r.status();

  StepPlan bad_token = good;
  bad_token.seqs[0].tokens[3] = int32_t(m->config().vocab_size);
  r = runner->Execute(bad_token);
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("token id"), std::string::npos) << r.status();

  auto got = runner->Execute(good);
  ASSERT_TRUE(got.ok()) << got.status();
  const SampledToken a = (*got)[0];
  StepPlan again = good;
  again.seqs[0].sampler = &s2;
  auto want = fresh->Execute(again);
  ASSERT_TRUE(want.ok()) << want.status();
  EXPECT_EQ(a.token, (*want)[0].token);
  EXPECT_EQ(a.logprob, (*want)[0].logprob);
}

TEST(ModelRunner, ThePoolMustMatchTheModel) {
  auto m = Tiny();
  ASSERT_TRUE(m);
  LatentCacheConfig pool = m->CacheConfig(2 << 20, 16);
  pool.dtype = DType::kBF16;  // the model's cache is f32
  EXPECT_EQ(ModelRunner::Create(*m, pool).status().code(), StatusCode::kInvalidArgument);
  pool = m->CacheConfig(2 << 20, 16);
  pool.num_layers += 1;
  EXPECT_EQ(ModelRunner::Create(*m, pool).status().code(), StatusCode::kInvalidArgument);
  pool = m->CacheConfig(10, 16);  // less than one block
  auto st = ModelRunner::Create(*m, pool).status();
  EXPECT_NE(st.message().find("budget_bytes"), std::string::npos) << st;
}

}  // namespace
}  // namespace mlarun
