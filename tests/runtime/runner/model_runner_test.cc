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
#include "tests/runtime/engine/pool_copy_importer.h"
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
  // Imports: none, or some, with descriptors of every length around a word
  // (empty, 7, 8, 9 bytes, ...) and any bytes, NULs included.
  for (int i = 0, n_imports = static_cast<int>(rng() % 3); i < n_imports; ++i) {
    StepPlan::Import m{.id = int64_t(rng()) << 4};
    for (int d = 0, nd = 1 + static_cast<int>(rng() % 3); d < nd; ++d) {
      std::string desc(rng() % 20, '\0');
      for (char& c : desc) c = static_cast<char>(rng() % 256);
      m.descriptors.push_back(std::move(desc));
    }
    for (int b = 0, nb = static_cast<int>(rng() % 9); b < nb; ++b) {
      m.src.push_back(int32_t(rng() % 100000));
      m.dst.push_back(int32_t(rng() % 100000));
    }
    p.imports.push_back(std::move(m));
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
    ASSERT_EQ(back->imports.size(), p.imports.size());
    for (size_t i = 0; i < p.imports.size(); ++i) {
      EXPECT_EQ(back->imports[i].id, p.imports[i].id);
      EXPECT_EQ(back->imports[i].descriptors, p.imports[i].descriptors);
      EXPECT_EQ(back->imports[i].src, p.imports[i].src);
      EXPECT_EQ(back->imports[i].dst, p.imports[i].dst);
    }
  }
}

// A plan with an import whose descriptors fill words exactly and not.
StepPlan PlanWithImports() {
  StepPlan p;
  p.seqs.push_back({.id = 3, .start_pos = 0, .tokens = {5, 6}, .block_table = {1}});
  p.imports.push_back({.id = 4, .descriptors = {"", "12345678", std::string("a\0b", 3)}, .src = {7, 8}, .dst = {1, 2}});
  p.imports.push_back({.id = 5, .descriptors = {"ucx:0123456789"}, .src = {9}, .dst = {3}});
  return p;
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

  // The imports: every truncation, and each count out of range, is refused
  // naming the import.
  const std::vector<int64_t> with = PlanWithImports().Encode();
  ASSERT_TRUE(StepPlan::Decode(with).ok()) << StepPlan::Decode(with).status();
  for (size_t n = 0; n < with.size(); ++n)
    EXPECT_EQ(StepPlan::Decode(std::span<const int64_t>(with.data(), n)).status().code(), StatusCode::kInvalidArgument)
        << n << " of " << with.size() << " words";
  // [header 7][seq: id, pos, 2, 5, 6, 1, 1][n_imports][id 4, 3 descriptors: 0; 8, w; 3, w][2, 7, 8][2, 1, 2]...
  const size_t at = 14;
  ASSERT_EQ(with[at], 2);
  ASSERT_EQ(with[at + 1], 4);
  ASSERT_EQ(with[at + 2], 3);
  auto refused = [&](size_t word, int64_t value, const std::string& says) {
    std::vector<int64_t> bad = with;
    bad[word] = value;
    const Status st = StepPlan::Decode(bad).status();
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << "word " << word << " = " << value;
    EXPECT_NE(st.message().find(says), std::string::npos) << st;
  };
  refused(at, -1, "import count");
  refused(at, 3, "import 2");  // one more than there are
  refused(at + 2, -1, "import 0");
  refused(at + 2, int64_t{1} << 40, "import 0");
  refused(at + 4, -8, "import 0");  // the second descriptor's byte length
  refused(at + 4, int64_t{1} << 62, "import 0");
  refused(at + 8, 3, "import 0");                 // src count 3 of what is 2: dst comes out short
  refused(at + 9, int64_t{1} << 33, "import 0");  // a source block id outside int32
  refused(at + 11, 1, "import 0 has 2 source blocks and 1 destination");
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

// Import fills the pool through the importer, each import checked first;
// without an importer a plan with imports is refused, one without runs.
TEST(ModelRunner, ImportGoesThroughTheImporter) {
  auto m = Tiny();
  ASSERT_TRUE(m);
  const LatentCacheConfig pool = m->CacheConfig(2 << 20, 16);
  auto from = std::move(LatentPool::Create(pool)).value();
  auto runner = std::move(ModelRunner::Create(*m, pool, nullptr, "rank 5 (test)")).value();
  const int64_t row = from->row_width(), per_block = pool.block_size * row;
  for (int64_t l = 0; l < pool.num_layers; ++l) {
    float* p = static_cast<float*>(from->LayerData(l));
    for (int64_t i = 0; i < from->num_blocks() * per_block; ++i) p[i] = static_cast<float>(l * 1000003 + i);
  }
  PoisonPool(runner->pool());
  StepPlan plan;
  EXPECT_TRUE(runner->Import(plan, 0).ok()) << "nothing to import";
  plan.imports.push_back({.id = 8, .descriptors = {"a", "b"}, .src = {3, 1}, .dst = {6, 2}});
  const Status none = runner->Import(plan, 1);
  EXPECT_EQ(none.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(none.message().find("rank 5 (test)"), std::string::npos) << none;
  PoolCopyImporter importer(from.get());
  runner->SetImporter(&importer);
  ASSERT_TRUE(runner->Import(plan, 1).ok());
  ASSERT_EQ(importer.calls.size(), 1u);
  EXPECT_EQ(importer.ranks, std::vector<int>{1});
  for (int64_t l = 0; l < pool.num_layers; ++l)
    for (const auto& [src, dst] : {std::pair{3, 6}, std::pair{1, 2}}) {
      const float* a = static_cast<const float*>(from->LayerData(l)) + src * per_block;
      const float* b = static_cast<const float*>(runner->pool().LayerData(l)) + dst * per_block;
      ASSERT_EQ(std::memcmp(a, b, static_cast<size_t>(per_block) * sizeof(float)), 0) << "layer " << l;
    }
  StepPlan bad = plan;
  bad.imports[0].dst = {6, int32_t(runner->pool().num_blocks())};
  Status st = runner->Import(bad, 0);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("outside"), std::string::npos) << st;
  bad.imports[0].dst = {6};
  EXPECT_EQ(runner->Import(bad, 0).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(importer.calls.size(), 1u) << "a bad import never reaches the importer";
  importer.fail = true;
  st = runner->Import(plan, 0);
  EXPECT_EQ(st.code(), StatusCode::kUnavailable);
  EXPECT_NE(st.message().find("import of request 8 on rank 5 (test)"), std::string::npos) << st;
  EXPECT_NE(st.message().find("the old group is gone"), std::string::npos) << st;
  runner->SetImporter(nullptr);
  EXPECT_EQ(runner->Import(plan, 0).code(), StatusCode::kFailedPrecondition);
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
