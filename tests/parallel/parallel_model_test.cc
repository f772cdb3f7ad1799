// The tiny DeepSeek-V3-shaped model on W ranks (run by ctest under mpirun,
// one entry per layout) against the same model on one rank: logits, tokens
// and where the latent cache lives.
//
//   mpirun -np W parallel_model_test --layout dp=D,attn_tp=T[,moe=...]
#include <gtest/gtest.h>

#include <bit>
#include <cstring>
#include <random>

#include "bench/local_cache.h"
#include "launcher/env.h"
#include "parallel/mpi/mpi_world.h"
#include "runtime/engine/rank_runner.h"
#include "tests/parallel/mpi_gtest_main.h"
#include "tests/runtime/engine/pool_copy_importer.h"
#include "tests/test_paths.h"

namespace mlarun {
namespace {

MpiSession* g_session = nullptr;
ParallelLayout g_layout;

// `fail_forward_call`: ModelOptions' fault injection (-1: never).
std::unique_ptr<Model> LoadTiny(const ModelShard& shard, int64_t fail_forward_call = -1) {
  ModelOptions o;
  o.shard = shard;
  o.fail_forward_call = fail_forward_call;
  auto m = Model::Load(TinyYaml(), ModelOverrides{.kv_dtype = DType::kF32}, o);
  EXPECT_TRUE(m.ok()) << m.status();
  return m.ok() ? std::move(m).value() : nullptr;
}

std::vector<int32_t> Prompt(int n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> p(static_cast<size_t>(n));
  for (auto& t : p) t = static_cast<int32_t>(2 + rng() % 500);
  return p;
}

// The layout's groups; false (with a failure) if they cannot be made, the
// same on every rank (the layout against the world size).
bool Groups(ProcessGroups* out) {
  auto g = g_session->Groups(g_layout);
  EXPECT_TRUE(g.ok()) << g.status();
  if (!g.ok()) return false;
  *out = std::move(g).value();
  return true;
}

// Gathers every rank's int64/float vector to all ranks, in rank order.
template <typename T>
std::vector<std::vector<T>> GatherAll(Communicator& world, const std::vector<T>& mine, CommType t) {
  const int64_t n = static_cast<int64_t>(mine.size());
  std::vector<int64_t> counts(static_cast<size_t>(world.size()));
  EXPECT_TRUE(world.AllGather(&n, 1, counts.data(), CommType::kI64).ok());
  int64_t total = 0;
  for (int64_t c : counts) total += c;
  std::vector<T> flat(static_cast<size_t>(total));
  EXPECT_TRUE(world.AllGatherV(mine.data(), counts, flat.data(), t).ok());
  std::vector<std::vector<T>> out;
  int64_t off = 0;
  for (int64_t c : counts) {
    out.emplace_back(flat.begin() + off, flat.begin() + off + c);
    off += c;
  }
  return out;
}

// Every DP group runs a full forward of its own prompts (the last group has
// none when dp > 1: an idle group still joins every collective). Rank 0 checks
// each group's logits against the whole model on one rank.
TEST(Parallel, LogitsMatchOneRank) {
  ProcessGroups g;
  ASSERT_TRUE(Groups(&g));
  auto model = LoadTiny(ModelShard::For(g_layout, g.rank));
  ASSERT_TRUE(model);
  const int D = g_layout.dp;
  auto prompts_of = [&](int group) {
    std::vector<std::vector<int32_t>> p;
    if (D > 1 && group == D - 1) return p;
    for (int k = 0; k <= group; ++k) p.push_back(Prompt(3 + 5 * k + group, static_cast<uint32_t>(100 * group + k)));
    return p;
  };
  auto created = LocalLatentCache::Create(model->CacheConfig(16 << 20, 16));
  ASSERT_TRUE(created.ok()) << created.status();
  LocalLatentCache cache = std::move(created).value();
  const auto mine = prompts_of(g.dp_rank());
  std::vector<ForwardSeq> seqs;
  for (size_t k = 0; k < mine.size(); ++k) {
    auto s = cache.Append(static_cast<SeqId>(k), mine[k], ForwardSeq::Logits::kAll);
    ASSERT_TRUE(s.ok()) << s.status();
    seqs.push_back(*s);
  }
  ParallelStep step{.attn_tp = g.attn_tp.get(), .dp_peers = g.dp_peers.get(), .dp_rank = g.dp_rank()};
  for (int grp = 0; grp < D; ++grp) {
    int64_t n = 0;
    for (const auto& p : prompts_of(grp)) n += static_cast<int64_t>(p.size());
    step.dp_tokens.push_back(n);
  }
  auto logits = model->Forward(seqs, *cache.pool, &step);
  ASSERT_TRUE(logits.ok()) << logits.status();
  const auto all = GatherAll(*g.world, g.is_leader() ? *logits : std::vector<float>{}, CommType::kF32);
  if (g.rank != 0) return;
  auto whole = LoadTiny(ModelShard{});
  ASSERT_TRUE(whole);
  for (int grp = 0; grp < D; ++grp) {
    const auto prompts = prompts_of(grp);
    auto ref_created = LocalLatentCache::Create(whole->CacheConfig(16 << 20, 16));
    ASSERT_TRUE(ref_created.ok()) << ref_created.status();
    LocalLatentCache ref_cache = std::move(ref_created).value();
    std::vector<ForwardSeq> ref_seqs;
    for (size_t k = 0; k < prompts.size(); ++k) {
      auto s = ref_cache.Append(static_cast<SeqId>(k), prompts[k], ForwardSeq::Logits::kAll);
      ASSERT_TRUE(s.ok()) << s.status();
      ref_seqs.push_back(*s);
    }
    auto ref = whole->Forward(ref_seqs, *ref_cache.pool);
    ASSERT_TRUE(ref.ok()) << ref.status();
    const auto& got = all[static_cast<size_t>(g_layout.leader_of(grp))];
    ASSERT_EQ(got.size(), ref->size()) << "group " << grp;
    double err = 0, scale = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      err = std::max(err, double{std::abs(got[i] - (*ref)[i])});
      scale = std::max(scale, double{std::abs((*ref)[i])});
    }
    EXPECT_LE(err, 1e-5 * std::max(scale, 1.0)) << "group " << grp << " of " << g_layout;
  }
}

std::vector<GenerationRequest> Requests() {
  // Different lengths and max_tokens: groups finish on different steps, and
  // with more groups than requests some groups never get one.
  std::vector<GenerationRequest> r;
  const int lens[] = {5, 40, 3, 17, 9};
  const int max_tokens[] = {12, 3, 7, 20, 5};
  for (int i = 0; i < 5; ++i) {
    SamplingParams sp{.max_tokens = max_tokens[i], .ignore_eos = true};
    if (i == 3) sp.temperature = 0.7, sp.top_p = 0.9, sp.seed = 42;
    r.push_back({Prompt(lens[i], static_cast<uint32_t>(7 + i)), sp});
  }
  return r;
}

TEST(Parallel, TokensMatchOneRankAndCacheLivesWhereItShould) {
  ProcessGroups g;
  ASSERT_TRUE(Groups(&g));
  auto model = LoadTiny(ModelShard::For(g_layout, g.rank));
  ASSERT_TRUE(model);
  const EngineConfig ec{
      .max_num_batched_tokens = 16, .cache_budget_bytes = 16 << 20, .block_size = 16, .enable_prefix_caching = false};
  auto runner = RankRunner::Create(*model, ec, g);
  ASSERT_TRUE(runner.ok()) << runner.status();
  auto reqs = Requests();
  // Every other request also has its prompt's logprobs (its leader's runner
  // scores them across prefill chunks).
  for (size_t i = 1; i < reqs.size(); i += 2) reqs[i].sampling.prompt_logprobs = 2;
  // Request i goes to DP group i % dp (only its leader queues it).
  std::vector<std::pair<int, int64_t>> mine;
  for (size_t i = 0; i < reqs.size(); ++i) {
    if (static_cast<int>(i) % g_layout.dp != g.dp_rank() || !g.is_leader()) continue;
    auto id = (*runner)->Add(reqs[i]);
    ASSERT_TRUE(id.ok()) << id.status();
    mine.emplace_back(static_cast<int>(i), *id);
  }
  for (;;) {
    auto more = (*runner)->Step();
    ASSERT_TRUE(more.ok()) << more.status();
    if (!*more) break;
  }
  // Leaders send [index, n, tokens..., m, prompt logprobs' bits...] per request.
  std::vector<int64_t> out;
  for (const auto& [i, id] : mine) {
    const GenerationOutput* o = (*runner)->Output(id);
    out.push_back(i);
    out.push_back(static_cast<int64_t>(o->tokens.size()));
    out.insert(out.end(), o->tokens.begin(), o->tokens.end());
    out.push_back(static_cast<int64_t>(o->prompt_logprobs.size()));
    for (const LogprobEntry& p : o->prompt_logprobs) out.push_back(std::bit_cast<int64_t>(p.token.logprob));
  }
  const auto all = GatherAll(*g.world, out, CommType::kI64);
  const auto written =
      GatherAll(*g.world, std::vector<int64_t>{(*runner)->cache_stats().bytes_written}, CommType::kI64);
  if (g.rank != 0) return;
  std::vector<std::vector<int64_t>> tokens(reqs.size());
  std::vector<std::vector<double>> prompt_logprobs(reqs.size());
  for (const auto& v : all)
    for (size_t k = 0; k < v.size();) {
      const size_t i = static_cast<size_t>(v[k]), n = static_cast<size_t>(v[k + 1]);
      tokens[i].assign(v.begin() + static_cast<int64_t>(k + 2), v.begin() + static_cast<int64_t>(k + 2 + n));
      const size_t m = static_cast<size_t>(v[k + 2 + n]);
      for (size_t j = 0; j < m; ++j) prompt_logprobs[i].push_back(std::bit_cast<double>(v[k + 3 + n + j]));
      k += 3 + n + m;
    }
  auto whole = LoadTiny(ModelShard{});
  ASSERT_TRUE(whole);
  auto engine = Engine::Create(*whole, ec);
  ASSERT_TRUE(engine.ok()) << engine.status();
  const auto ref = (*engine)->Generate(reqs);
  ASSERT_EQ(ref.size(), reqs.size());
  for (size_t i = 0; i < reqs.size(); ++i) {
    ASSERT_TRUE(ref[i].ok());
    EXPECT_EQ(tokens[i], ref[i]->tokens) << "request " << i << " under " << g_layout;
    ASSERT_EQ(prompt_logprobs[i].size(), ref[i]->prompt_logprobs.size()) << "request " << i;
    EXPECT_EQ(prompt_logprobs[i].empty(), reqs[i].sampling.prompt_logprobs < 0 || reqs[i].prompt.size() < 2);
    for (size_t j = 0; j < prompt_logprobs[i].size(); ++j)  // head-sharded sums round differently
      EXPECT_NEAR(prompt_logprobs[i][j], ref[i]->prompt_logprobs[j].token.logprob, 1e-4)
          << "request " << i << ", prompt token " << j + 1 << " under " << g_layout;
  }
  // The latent cache: every member of a DP group holds the group's rows; the
  // groups' copies add up to one copy of the whole set.
  int64_t total = 0;
  for (const auto& req : reqs)
    total += static_cast<int64_t>(req.prompt.size()) + req.sampling.max_tokens - 1;  // the last token is never fed back
  const int64_t per_token =
      whole->CacheConfig(0).num_layers * (whole->config().kv_lora_rank + whole->config().qk_rope_head_dim) * 4;
  int64_t sum_over_groups = 0;
  for (int grp = 0; grp < g_layout.dp; ++grp) {
    const int64_t leader = written[static_cast<size_t>(g_layout.leader_of(grp))][0];
    for (int t = 0; t < g_layout.attn_tp; ++t)
      EXPECT_EQ(written[static_cast<size_t>(g_layout.leader_of(grp) + t)][0], leader)
          << "group " << grp << " member " << t;
    sum_over_groups += leader;
  }
  EXPECT_EQ(sum_over_groups, total * per_token);
  if (g_layout.dp == 1) {
    for (const auto& w : written) EXPECT_EQ(w[0], total * per_token) << "under pure TP every rank holds the whole set";
  }
}

// A step whose computation fails on one rank (the last; rank 1 under dp=2)
// fails the requests of that step on every group, with a message naming that
// rank, and the ranks go on in lockstep: the requests queued afterwards on
// every group produce the tokens one rank gives, and every member's cache
// mirrors its leader's (the failed requests released on all of them, never
// retired). A hang here is a failure too (ctest TIMEOUT).
// A stop voted by one rank only (the last, with code 15, as a SIGTERM that
// mpirun has passed to it first) stops every rank at the same step, before
// it runs, and every rank learns the code: a leader that got no signal still
// tells its coordinator why. Ranks that did not vote see 0 until then.
TEST(Parallel, OneRanksStopVoteStopsEveryRankWithItsCode) {
  ProcessGroups g;
  ASSERT_TRUE(Groups(&g));
  auto model = LoadTiny(ModelShard::For(g_layout, g.rank));
  ASSERT_TRUE(model);
  const EngineConfig ec{.max_num_batched_tokens = 64, .cache_budget_bytes = 16 << 20, .block_size = 16};
  auto runner = RankRunner::Create(*model, ec, g, "rank " + std::to_string(g.rank) + " (test)");
  ASSERT_TRUE(runner.ok()) << runner.status();
  const bool voter = g.rank == g_layout.world() - 1;
  auto first = (*runner)->StepOrStop(0);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(*first, RankRunner::StepResult::kIdle);
  EXPECT_EQ((*runner)->stop_code(), 0);
  auto second = (*runner)->StepOrStop(voter ? 15 : 0);
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(*second, RankRunner::StepResult::kStop) << "on rank " << g.rank;
  EXPECT_EQ((*runner)->stop_code(), 15) << "on rank " << g.rank;
}

TEST(Parallel, FailedStepFailsItsRequestsAndTheRanksGoOn) {
  ProcessGroups g;
  ASSERT_TRUE(Groups(&g));
  const int failing_rank = g_layout.world() - 1;
  constexpr int64_t kFailCall = 2;  // steps 0 and 1 run (prefill, a decode), step 2 fails
  auto model = LoadTiny(ModelShard::For(g_layout, g.rank), g.rank == failing_rank ? kFailCall : -1);
  ASSERT_TRUE(model);
  const EngineConfig ec{.max_num_batched_tokens = 64, .cache_budget_bytes = 16 << 20, .block_size = 16};
  const std::string rank_name = "rank " + std::to_string(g.rank) + " (test)";
  auto runner = RankRunner::Create(*model, ec, g, rank_name);
  ASSERT_TRUE(runner.ok()) << runner.status();
  // Two requests per group in each wave; the first wave's run together, so
  // all of them are in the failing step.
  auto wave = [&](int w) {
    std::vector<GenerationRequest> r;
    for (int grp = 0; grp < g_layout.dp; ++grp)
      for (int k = 0; k < 2; ++k)
        r.push_back({Prompt(4 + 3 * k + grp, static_cast<uint32_t>(1000 * w + 10 * grp + k)),
                     SamplingParams{.max_tokens = 6 + k, .ignore_eos = true}});
    return r;
  };
  auto run = [&](const std::vector<GenerationRequest>& reqs, std::vector<std::pair<size_t, int64_t>>* mine,
                 int64_t* failed_steps) {
    for (size_t i = 0; i < reqs.size(); ++i) {
      if (static_cast<int>(i / 2) != g.dp_rank() || !g.is_leader()) continue;
      auto id = (*runner)->Add(reqs[i]);
      ASSERT_TRUE(id.ok()) << id.status();
      mine->emplace_back(i, *id);
    }
    for (;;) {
      auto more = (*runner)->StepOrStop(0);
      ASSERT_TRUE(more.ok()) << "a computation failure must not be fatal: " << more.status();
      if (!(*runner)->last_step_failure().ok()) ++*failed_steps;
      if (*more == RankRunner::StepResult::kIdle) break;
    }
  };
  const auto first = wave(1), second = wave(2);
  std::vector<std::pair<size_t, int64_t>> mine1, mine2;
  int64_t failed1 = 0, failed2 = 0;
  run(first, &mine1, &failed1);
  run(second, &mine2, &failed2);
  EXPECT_EQ(failed1, 1) << "exactly one step failed, seen on every rank";
  EXPECT_EQ(failed2, 0);
  // The first wave: the error, naming the failing rank, on every group's leader.
  const std::string failing_name = "rank " + std::to_string(failing_rank) + " (test)";
  for (const auto& [i, id] : mine1) {
    const GenerationOutput* o = (*runner)->Output(id);
    ASSERT_NE(o, nullptr);
    EXPECT_EQ(o->finish_reason, FinishReason::kError) << "request " << i;
    EXPECT_EQ(o->error.code(), StatusCode::kInternal) << o->error;
    EXPECT_NE(o->error.message().find(failing_name), std::string::npos) << o->error;
    EXPECT_NE(o->error.message().find("injected failure"), std::string::npos) << o->error;
    EXPECT_EQ(o->tokens.size(), 2u) << "the tokens of the two steps before the failure";
  }
  // Every rank's cache: empty again, and the members mirror the leader
  // (retired blocks: the second wave's only).
  const LatentCacheStats cs = (*runner)->cache_stats().now;
  EXPECT_EQ(cs.blocks_used, 0) << "on rank " << g.rank;
  const auto retired = GatherAll(*g.world, std::vector<int64_t>{cs.blocks_retired}, CommType::kI64);
  int64_t expect_retired = 0;
  for (int k = 0; k < 2; ++k) {
    const GenerationRequest& r = second[static_cast<size_t>(2 * g.dp_rank() + k)];
    expect_retired += (static_cast<int64_t>(r.prompt.size()) + r.sampling.max_tokens - 1 + 15) / 16;
  }
  EXPECT_EQ(cs.blocks_retired, expect_retired) << "on rank " << g.rank;
  EXPECT_EQ(retired[static_cast<size_t>(g_layout.leader_of(g.dp_rank()))][0], cs.blocks_retired)
      << "rank " << g.rank << " and its leader";
  // The second wave: the tokens one rank gives.
  std::vector<int64_t> out;
  for (const auto& [i, id] : mine2) {
    const GenerationOutput* o = (*runner)->Output(id);
    out.push_back(static_cast<int64_t>(i));
    out.push_back(o->finish_reason == FinishReason::kLength ? static_cast<int64_t>(o->tokens.size()) : -1);
    if (o->finish_reason == FinishReason::kLength) out.insert(out.end(), o->tokens.begin(), o->tokens.end());
  }
  const auto all = GatherAll(*g.world, out, CommType::kI64);
  if (g.rank != 0) return;
  std::vector<std::vector<int64_t>> tokens(second.size());
  std::vector<bool> seen(second.size(), false);
  for (const auto& v : all)
    for (size_t k = 0; k < v.size(); k += 2 + static_cast<size_t>(std::max<int64_t>(v[k + 1], 0))) {
      const size_t i = static_cast<size_t>(v[k]);
      ASSERT_LT(i, second.size());
      ASSERT_GE(v[k + 1], 0) << "second-wave request " << i << " did not finish by length";
      seen[i] = true;
      tokens[i].assign(v.begin() + static_cast<int64_t>(k) + 2, v.begin() + static_cast<int64_t>(k) + 2 + v[k + 1]);
    }
  auto whole = LoadTiny(ModelShard{});
  ASSERT_TRUE(whole);
  auto engine = Engine::Create(*whole, ec);
  ASSERT_TRUE(engine.ok()) << engine.status();
  const auto ref = (*engine)->Generate(second);
  ASSERT_EQ(ref.size(), second.size());
  for (size_t i = 0; i < second.size(); ++i) {
    EXPECT_TRUE(seen[i]) << "second-wave request " << i << " was not reported";
    ASSERT_TRUE(ref[i].ok()) << ref[i].status();
    EXPECT_EQ(tokens[i], ref[i]->tokens) << "second-wave request " << i << " under " << g_layout;
  }
}

// Requests moved to this layout's groups from an old group: on every rank,
// an engine over the whole model (the same on every rank) runs each request
// alone for k tokens and exports it, keeping its blocks; each rank's
// importer reads that engine's pool, as the worker's transfer plane reads
// the old group's. Every rank's own pool starts poisoned (NaN rows), so a
// rank that did not import shows in the tokens. With `failing_rank` >= 0,
// that rank's fetch fails: its whole group computes the rows instead, and
// every rank of that group counts the failure.
void ExpectImportsGoOnAsOneRank(int failing_rank) {
  ProcessGroups g;
  ASSERT_TRUE(Groups(&g));
  auto model = LoadTiny(ModelShard::For(g_layout, g.rank));
  auto whole = LoadTiny(ModelShard{});
  ASSERT_TRUE(model && whole);
  const EngineConfig ec{.max_num_batched_tokens = 64, .cache_budget_bytes = 16 << 20, .block_size = 16};
  std::vector<GenerationRequest> reqs;
  const int lens[] = {23, 40, 9, 17};
  for (int i = 0; i < 4; ++i) {
    SamplingParams sp{.max_tokens = 8, .ignore_eos = true};
    if (i == 1) sp.temperature = 0.8, sp.top_p = 0.9, sp.seed = 5;
    reqs.push_back({Prompt(lens[i], static_cast<uint32_t>(50 + i)), sp});
  }
  const size_t k = 3;
  auto ref_engine = Engine::Create(*whole, ec);
  ASSERT_TRUE(ref_engine.ok()) << ref_engine.status();
  const auto ref = (*ref_engine)->Generate(reqs);
  auto old = Engine::Create(*whole, ec);
  ASSERT_TRUE(old.ok()) << old.status();
  std::vector<GenerationRequest> moved;
  for (size_t i = 0; i < reqs.size(); ++i) {
    ASSERT_TRUE(ref[i].ok()) << ref[i].status();
    const int64_t id = *(*old)->Add(reqs[i]);
    while ((*old)->Output(id)->tokens.size() < k) ASSERT_TRUE((*old)->Step().ok());
    auto exported = (*old)->Export(id);
    ASSERT_TRUE(exported.ok()) << exported.status();
    ASSERT_EQ(exported->rows, static_cast<int64_t>(reqs[i].prompt.size() + k) - 1);
    GenerationRequest m = reqs[i];
    m.generated.assign(ref[i]->tokens.begin(), ref[i]->tokens.begin() + k);
    m.import = ImportSource{.descriptors = {"old0", "old1"}, .blocks = exported->blocks, .rows = exported->rows};
    moved.push_back(std::move(m));
  }
  PoolCopyImporter importer(&(*old)->runner()->pool());
  importer.fail = g.rank == failing_rank;
  auto runner = RankRunner::Create(*model, ec, g, "rank " + std::to_string(g.rank) + " (test)", &importer);
  ASSERT_TRUE(runner.ok()) << runner.status();
  PoisonPool((*runner)->runner().pool());
  std::vector<std::pair<size_t, int64_t>> mine;
  for (size_t i = 0; i < moved.size(); ++i) {
    if (static_cast<int>(i) % g_layout.dp != g.dp_rank() || !g.is_leader()) continue;
    auto id = (*runner)->Add(moved[i]);
    ASSERT_TRUE(id.ok()) << id.status();
    mine.emplace_back(i, *id);
  }
  for (;;) {
    auto more = (*runner)->Step();
    ASSERT_TRUE(more.ok()) << "a failed import must not be fatal: " << more.status();
    if (!*more) break;
  }
  // This group's requests, and whether its import failed.
  int64_t group_requests = 0, group_rows = 0;
  for (size_t i = 0; i < moved.size(); ++i)
    if (static_cast<int>(i) % g_layout.dp == g.dp_rank()) {
      ++group_requests;
      group_rows += moved[i].import->rows;
    }
  const bool group_fails = failing_rank >= 0 && g_layout.dp_rank(failing_rank) == g.dp_rank() && group_requests > 0;
  EXPECT_EQ((*runner)->import_failures(), group_fails ? 1 : 0) << "on rank " << g.rank;
  const Status& failure = (*runner)->last_import_failure();
  if (!group_fails) {
    EXPECT_TRUE(failure.ok()) << failure;
    EXPECT_EQ(static_cast<int64_t>(importer.calls.size()), group_requests) << "on rank " << g.rank;
  } else if (g.rank == failing_rank) {
    EXPECT_EQ(failure.code(), StatusCode::kUnavailable) << failure;
    EXPECT_NE(failure.message().find("rank " + std::to_string(g.rank) + " (test)"), std::string::npos) << failure;
  } else {
    EXPECT_EQ(failure.code(), StatusCode::kAborted) << failure;
  }
  for (const int r : importer.ranks) EXPECT_EQ(r, g.attn_tp_rank());
  if (g.is_leader()) {
    const EngineStats& st = (*runner)->engine()->stats();
    EXPECT_EQ(st.imported_tokens, group_fails ? 0 : group_rows) << "group " << g.dp_rank();
    EXPECT_EQ(st.import_failures, group_fails ? group_requests : 0) << "group " << g.dp_rank();
    if (!group_fails) EXPECT_EQ(st.prefill_tokens, group_requests) << "one row computed per imported request";
  }
  EXPECT_EQ((*runner)->cache_stats().now.blocks_used, 0) << "on rank " << g.rank;
  std::vector<int64_t> out;
  for (const auto& [i, id] : mine) {
    const GenerationOutput* o = (*runner)->Output(id);
    out.push_back(static_cast<int64_t>(i));
    out.push_back(static_cast<int64_t>(o->tokens.size()));
    out.insert(out.end(), o->tokens.begin(), o->tokens.end());
  }
  const auto all = GatherAll(*g.world, out, CommType::kI64);
  if (g.rank != 0) return;
  std::vector<bool> seen(moved.size(), false);
  for (const auto& v : all)
    for (size_t at = 0; at < v.size(); at += 2 + static_cast<size_t>(v[at + 1])) {
      const size_t i = static_cast<size_t>(v[at]);
      ASSERT_LT(i, moved.size());
      seen[i] = true;
      const std::vector<int64_t> got(v.begin() + static_cast<int64_t>(at) + 2,
                                     v.begin() + static_cast<int64_t>(at) + 2 + v[at + 1]);
      EXPECT_EQ(got, std::vector<int64_t>(ref[i]->tokens.begin() + k, ref[i]->tokens.end()))
          << "request " << i << " under " << g_layout;
    }
  for (size_t i = 0; i < moved.size(); ++i) EXPECT_TRUE(seen[i]) << "request " << i << " was not reported";
}

TEST(Parallel, ImportedRequestsGoOnAsOneRank) { ExpectImportsGoOnAsOneRank(-1); }

TEST(Parallel, OneRanksFailedImportIsRecomputedByItsGroup) { ExpectImportsGoOnAsOneRank(g_layout.world() - 1); }

}  // namespace
}  // namespace mlarun

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  // MLARUN_CPU_ISA, as `mlarun` reads it; a family this CPU lacks skips the run.
  if (const mlarun::Status env = mlarun::ApplyEnvironmentOverrides(); !env.ok()) {
    fprintf(stderr, "parallel_model_test: skipped: %s\n", env.ToString().c_str());
    return 0;
  }
  auto session = mlarun::MpiSession::Init(&argc, &argv);
  if (!session.ok()) {
    fprintf(stderr, "%s\n", session.status().ToString().c_str());
    return 2;
  }
  std::string layout = "dp=1";
  for (int i = 1; i + 1 < argc; ++i)
    if (std::strcmp(argv[i], "--layout") == 0) layout = argv[i + 1];
  auto parsed = mlarun::ParseParallelLayout(layout);
  if (!parsed.ok()) (*session)->Abort(parsed.status().ToString(), 2);
  mlarun::g_session = session->get();
  mlarun::g_layout = *parsed;
  auto world = (*session)->World();
  if (!world.ok()) (*session)->Abort(world.status().ToString(), 2);
  const int result = mlarun::mpi_test::RunAllTestsOnEveryRank(**session, **world, "parallel_model_test");
  world->reset();  // frees the communicator before MPI_Finalize
  return result;
}
