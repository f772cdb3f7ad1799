// The serving loop on the tiny DeepSeek-V3-shaped model (configs/models/tiny.yaml).
#include "runtime/engine/engine.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <set>

#include "tests/runtime/engine/pool_copy_importer.h"
#include "tests/test_paths.h"

namespace mlarun {
namespace {

std::unique_ptr<Model> Tiny(DType kv = DType::kF32) {
  auto m = Model::Load(TinyYaml(), ModelOverrides{.kv_dtype = kv, .num_layers = std::nullopt});
  EXPECT_TRUE(m.ok()) << m.status();
  return m.ok() ? std::move(m).value() : nullptr;
}

std::vector<int32_t> RandomPrompt(int n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int32_t> d(2, 511);
  std::vector<int32_t> p(static_cast<size_t>(n));
  for (auto& t : p) t = d(rng);
  return p;
}

SamplingParams Greedy(int64_t max_tokens) {
  return SamplingParams{.max_tokens = max_tokens, .stop_token_ids = {}, .ignore_eos = true};
}
SamplingParams Sampled(int64_t max_tokens, uint64_t seed) {
  return SamplingParams{.temperature = 0.8,
                        .top_k = 50,
                        .top_p = 0.9,
                        .seed = seed,
                        .max_tokens = max_tokens,
                        .stop_token_ids = {},
                        .ignore_eos = true};
}

std::vector<GenerationRequest> MixedRequests() {
  return {
      {RandomPrompt(1, 1), Greedy(6)},        {RandomPrompt(7, 2), Sampled(9, 11)},  {RandomPrompt(70, 3), Greedy(4)},
      {RandomPrompt(150, 4), Sampled(5, 12)}, {RandomPrompt(3, 5), Sampled(12, 13)}, {RandomPrompt(33, 6), Greedy(10)},
  };
}

std::vector<GenerationOutput> RunAll(Model& m, const EngineConfig& ec, std::vector<GenerationRequest> reqs,
                                     EngineStats* stats = nullptr, int64_t* blocks_retired = nullptr) {
  auto engine = std::move(Engine::Create(m, ec)).value();
  const size_t n = reqs.size();
  std::vector<GenerationOutput> out;
  for (auto& r : engine->Generate(std::move(reqs))) {
    EXPECT_TRUE(r.ok()) << r.status();
    out.push_back(r.ok() ? *r : GenerationOutput{});
  }
  EXPECT_EQ(out.size(), n) << "one output per request";
  out.resize(n);  // callers index by request
  if (stats) *stats = engine->stats();
  if (blocks_retired) *blocks_retired = engine->cache().stats().blocks_retired;
  return out;
}

TEST(Engine, MixedBatchGivesEachRequestItsTokensAlone) {
  auto m = Tiny();
  ASSERT_TRUE(m);
  const auto reqs = MixedRequests();
  std::vector<GenerationOutput> alone;
  for (const auto& r : reqs) alone.push_back(RunAll(*m, EngineConfig{.cache_budget_bytes = 16 << 20}, {r})[0]);
  // Together, with a small token budget: prompts are chunked and mixed with
  // other requests' decodes.
  EngineStats stats;
  const auto together =
      RunAll(*m, EngineConfig{.max_num_batched_tokens = 24, .cache_budget_bytes = 16 << 20}, reqs, &stats);
  ASSERT_EQ(together.size(), reqs.size());
  ASSERT_EQ(alone.size(), reqs.size());
  for (size_t i = 0; i < reqs.size(); ++i) {
    EXPECT_EQ(together[i].tokens, alone[i].tokens) << "request " << i;
    EXPECT_EQ(together[i].tokens.size(), static_cast<size_t>(reqs[i].sampling.max_tokens));
    EXPECT_EQ(together[i].finish_reason, FinishReason::kLength);
    for (size_t k = 0; k < together[i].logprobs.size(); ++k) {
      EXPECT_LE(together[i].logprobs[k], 0.0);
      EXPECT_NEAR(together[i].logprobs[k], alone[i].logprobs[k], 1e-4);
    }
  }
  EXPECT_GT(stats.steps, 20);  // the 150-token prompt alone takes 7 steps of 24
}

TEST(Engine, SameSeedSameOutputOtherSeedOtherOutput) {
  auto m = Tiny(DType::kBF16);
  ASSERT_TRUE(m);
  const auto p = RandomPrompt(12, 9);
  const EngineConfig ec{.cache_budget_bytes = 16 << 20};
  const auto a = RunAll(*m, ec, {{p, Sampled(16, 5)}, {p, Sampled(16, 5)}, {p, Sampled(16, 6)}});
  EXPECT_EQ(a[0].tokens, a[1].tokens);
  EXPECT_NE(a[0].tokens, a[2].tokens);
}

TEST(Engine, PreemptionKeepsOutputs) {
  auto m = Tiny();
  ASSERT_TRUE(m);
  // Four prompts of one full 16-token block each, all admitted at once, then
  // growing to three blocks each while decoding: 12 blocks wanted, 8 exist.
  std::vector<GenerationRequest> reqs;
  for (uint32_t i = 0; i < 4; ++i) reqs.push_back({RandomPrompt(16, 40 + i), i % 2 ? Sampled(20, i) : Greedy(20)});
  // Two of them also list their most likely tokens and their prompt's
  // logprobs: recomputed after a preemption, recorded once.
  for (size_t i : {size_t{1}, size_t{2}}) {
    reqs[i].sampling.logprobs = 2;
    reqs[i].sampling.prompt_logprobs = 1;
  }
  const auto free_run = RunAll(*m, EngineConfig{.cache_budget_bytes = 16 << 20, .block_size = 16}, reqs);
  const LatentCacheConfig cc = m->CacheConfig(0, 16);
  const int64_t block_bytes = cc.num_layers * (cc.kv_lora_rank + cc.rope_dim) * 4 * 16;
  EngineStats stats;
  int64_t retired = 0;
  const auto tight =
      RunAll(*m, EngineConfig{.cache_budget_bytes = 8 * block_bytes, .block_size = 16}, reqs, &stats, &retired);
  EXPECT_GT(stats.preemptions, 0) << "the cache was meant to run out";
  ASSERT_EQ(tight.size(), reqs.size());
  EXPECT_GT(tight[1].preemptions + tight[2].preemptions, 0) << "a request with logprobs was meant to be recomputed";
  for (size_t i = 0; i < reqs.size(); ++i) {
    EXPECT_EQ(tight[i].tokens, free_run[i].tokens) << "request " << i;
    const bool listed = reqs[i].sampling.logprobs > 0;
    ASSERT_EQ(tight[i].top_logprobs.size(), listed ? 20u : 0u) << "request " << i;
    ASSERT_EQ(free_run[i].top_logprobs.size(), tight[i].top_logprobs.size());
    for (size_t t = 0; t < tight[i].top_logprobs.size(); ++t) {
      ASSERT_EQ(tight[i].top_logprobs[t].size(), 2u);
      EXPECT_EQ(tight[i].top_logprobs[t][0].token, free_run[i].top_logprobs[t][0].token) << i << ", " << t;
      EXPECT_NEAR(tight[i].top_logprobs[t][0].logprob, free_run[i].top_logprobs[t][0].logprob, 1e-4) << i << ", " << t;
    }
    ASSERT_EQ(tight[i].prompt_logprobs.size(), listed ? 15u : 0u) << "request " << i;
    for (size_t j = 0; j < tight[i].prompt_logprobs.size(); ++j) {
      EXPECT_EQ(tight[i].prompt_logprobs[j].token.token, reqs[i].prompt[j + 1]);
      EXPECT_EQ(tight[i].prompt_logprobs[j].token.logprob, free_run[i].prompt_logprobs[j].token.logprob)
          << i << ", " << j;
    }
  }
  // Each request's footprint counts once, at its end, however often it was
  // preempted: 16 prompt + 20 generated - 1 = 35 cached tokens, 3 blocks.
  EXPECT_EQ(retired, 4 * 3);
}

// A long prompt's logprobs are scored at most max_scored_rows_per_step rows a
// step, whatever the token budget, and come out as they do in small chunks; a
// plain request beside it still takes the rest of the budget.
TEST(Engine, PromptScoresAreChunkedByTheirOwnBound) {
  auto m = Tiny();
  ASSERT_TRUE(m);
  GenerationRequest scored{RandomPrompt(150, 77), Greedy(2)};
  scored.sampling.prompt_logprobs = 1;
  const GenerationRequest plain{RandomPrompt(100, 78), Greedy(2)};
  EngineStats stats;
  const auto big = RunAll(
      *m, EngineConfig{.max_num_batched_tokens = 512, .max_scored_rows_per_step = 64, .cache_budget_bytes = 16 << 20},
      {scored, plain}, &stats);
  // 150 prompt tokens at 64 a step: 3 prefill steps, then the second token's.
  EXPECT_EQ(stats.steps, 4);
  const auto small = RunAll(*m, EngineConfig{.max_num_batched_tokens = 16, .cache_budget_bytes = 16 << 20}, {scored});
  ASSERT_EQ(big[0].prompt_logprobs.size(), 149u);
  ASSERT_EQ(small[0].prompt_logprobs.size(), 149u);
  for (size_t j = 0; j < 149; ++j) {
    EXPECT_EQ(big[0].prompt_logprobs[j].token.token, scored.prompt[j + 1]);
    EXPECT_NEAR(big[0].prompt_logprobs[j].token.logprob, small[0].prompt_logprobs[j].token.logprob, 1e-4) << j;
    ASSERT_EQ(big[0].prompt_logprobs[j].top.size(), 1u);
  }
  EXPECT_EQ(big[0].tokens, small[0].tokens);
  EXPECT_EQ(big[1].tokens.size(), 2u);
  EXPECT_TRUE(big[1].prompt_logprobs.empty());
  EXPECT_EQ(Engine::Create(*m, EngineConfig{.max_scored_rows_per_step = 0}).status().code(),
            StatusCode::kInvalidArgument);
}

TEST(Engine, PrefixBlocksAreReused) {
  auto m = Tiny();
  ASSERT_TRUE(m);
  auto engine = std::move(Engine::Create(*m, EngineConfig{.cache_budget_bytes = 16 << 20, .block_size = 16})).value();
  const auto p = RandomPrompt(70, 21);
  auto first = engine->Generate({{p, Greedy(5)}});
  auto second = engine->Generate({{p, Greedy(5)}});
  ASSERT_EQ(first.size(), 1u);
  ASSERT_EQ(second.size(), 1u);
  ASSERT_TRUE(first[0].ok() && second[0].ok());
  EXPECT_EQ(first[0]->prefix_hit_tokens, 0);
  EXPECT_EQ(second[0]->prefix_hit_tokens, 64);  // four full blocks of the 70-token prompt
  EXPECT_EQ(second[0]->tokens, first[0]->tokens);
  EXPECT_EQ(engine->cache().stats().blocks_used, 0);  // everything released
}

// A server hands each finished request's output over once and the engine
// forgets it; live and unknown requests are refused.
TEST(Engine, TakeOutputForgetsFinishedRequests) {
  auto m = Tiny();
  ASSERT_TRUE(m);
  auto engine = std::move(Engine::Create(*m, EngineConfig{.cache_budget_bytes = 16 << 20})).value();
  const int64_t done = *engine->Add({RandomPrompt(9, 31), Greedy(3)});
  const int64_t cancelled = *engine->Add({RandomPrompt(5, 32), Greedy(50)});
  EXPECT_EQ(engine->TakeOutput(done).status().code(), StatusCode::kFailedPrecondition);
  while (engine->Output(done)->finish_reason == FinishReason::kNone) ASSERT_TRUE(engine->Step().ok());
  auto out = engine->TakeOutput(done);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(out->tokens.size(), 3u);
  EXPECT_EQ(out->finish_reason, FinishReason::kLength);
  EXPECT_EQ(engine->Output(done), nullptr);
  EXPECT_EQ(engine->TakeOutput(done).status().code(), StatusCode::kNotFound);
  ASSERT_TRUE(engine->Cancel(cancelled).ok());
  auto c = engine->TakeOutput(cancelled);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->finish_reason, FinishReason::kCancelled);
  EXPECT_EQ(engine->Output(cancelled), nullptr);
  EXPECT_FALSE(engine->HasWork());
}

TEST(Engine, BadRequestsAreRejectedOthersComplete) {
  auto m = Tiny();
  ASSERT_TRUE(m);
  auto engine = std::move(Engine::Create(*m, EngineConfig{.cache_budget_bytes = 16 << 20})).value();
  auto bad_sampling = Greedy(4);
  bad_sampling.temperature = -1;
  auto bad_top_p = Greedy(4);
  bad_top_p.top_p = 0;
  std::vector<GenerationRequest> reqs = {
      {RandomPrompt(5, 1), Greedy(4)},
      {{}, Greedy(4)},                      // empty prompt
      {{3, 512, 4}, Greedy(4)},             // id == vocab size
      {RandomPrompt(4090, 2), Greedy(10)},  // beyond max_position_embeddings (4096)
      {RandomPrompt(5, 3), bad_sampling},
      {RandomPrompt(5, 4), bad_top_p},
      {RandomPrompt(6, 5), Greedy(3)},
  };
  const auto out = engine->Generate(reqs);
  const std::vector<std::string> field = {"",      "empty", "vocabulary", "max_position_embeddings", "temperature",
                                          "top_p", ""};
  ASSERT_EQ(field.size(), reqs.size());
  ASSERT_EQ(out.size(), reqs.size());
  for (size_t i = 0; i < out.size(); ++i) {
    if (field[i].empty()) {
      ASSERT_TRUE(out[i].ok()) << i << ": " << out[i].status();
      EXPECT_EQ(out[i]->tokens.size(), static_cast<size_t>(reqs[i].sampling.max_tokens));
    } else {
      ASSERT_FALSE(out[i].ok()) << i;
      EXPECT_EQ(out[i].status().code(), StatusCode::kInvalidArgument);
      EXPECT_NE(out[i].status().message().find(field[i]), std::string::npos) << out[i].status();
    }
  }
}

TEST(Engine, StopTokensAndEos) {
  auto m = Tiny();
  ASSERT_TRUE(m);
  const auto p = RandomPrompt(9, 31);
  const auto base = RunAll(*m, EngineConfig{.cache_budget_bytes = 16 << 20}, {{p, Greedy(8)}})[0];
  ASSERT_EQ(base.tokens.size(), 8u);
  // A stop id: generation ends with it (included, as vLLM reports it).
  auto stop = Greedy(8);
  stop.stop_token_ids = {base.tokens[2]};
  const auto stopped = RunAll(*m, EngineConfig{.cache_budget_bytes = 16 << 20}, {{p, stop}})[0];
  const auto first = std::find(base.tokens.begin(), base.tokens.end(), base.tokens[2]) - base.tokens.begin();
  EXPECT_EQ(stopped.tokens, std::vector<int64_t>(base.tokens.begin(), base.tokens.begin() + first + 1));
  EXPECT_EQ(stopped.finish_reason, FinishReason::kStop);
  // The config's eos stops generation unless ignore_eos.
  ModelConfig c = m->config();
  c.eos_token_ids = {base.tokens[3]};
  auto m_eos = std::move(Model::Random(c, 1234)).value();
  auto no_ignore = Greedy(8);
  no_ignore.ignore_eos = false;
  const auto outs = RunAll(*m_eos, EngineConfig{.cache_budget_bytes = 16 << 20}, {{p, no_ignore}, {p, Greedy(8)}});
  const auto eos_at = std::find(base.tokens.begin(), base.tokens.end(), base.tokens[3]) - base.tokens.begin();
  EXPECT_EQ(outs[0].tokens.size(), static_cast<size_t>(eos_at + 1));
  EXPECT_EQ(outs[0].finish_reason, FinishReason::kStop);
  EXPECT_EQ(outs[1].tokens, base.tokens) << "ignore_eos runs to max_tokens";
}

// Repeats in a token list: how many tokens equal an earlier one.
int64_t Repeats(const std::vector<int64_t>& tokens) {
  std::set<int64_t> seen;
  int64_t n = 0;
  for (int64_t t : tokens) n += seen.insert(t).second ? 0 : 1;
  return n;
}

// The penalties count each request's own tokens: greedy decoding that
// repeats itself stops repeating under a large repetition or frequency
// penalty, alone or batched with requests of other histories; min_tokens
// keeps the EOS out until then.
TEST(Engine, PenaltiesFollowEachRequestsOwnHistory) {
  auto m = Tiny();
  ASSERT_TRUE(m);
  const auto p = RandomPrompt(9, 31);
  const EngineConfig ec{.cache_budget_bytes = 16 << 20};
  const auto base = RunAll(*m, ec, {{p, Greedy(40)}})[0];
  ASSERT_GT(Repeats(base.tokens), 0) << "the tiny model's greedy output repeats";
  auto repetition = Greedy(40);
  repetition.repetition_penalty = 1e4;
  auto frequency = Greedy(40);
  frequency.frequency_penalty = 2.0;
  frequency.presence_penalty = 2.0;
  const auto alone = RunAll(*m, ec, {{p, repetition}})[0];
  EXPECT_EQ(Repeats(alone.tokens), 0);
  for (int64_t t : alone.tokens) EXPECT_EQ(std::count(p.begin(), p.end(), t), 0) << "prompt token " << t;
  const auto freq = RunAll(*m, ec, {{p, frequency}})[0];
  EXPECT_LT(Repeats(freq.tokens), Repeats(base.tokens));
  // Batched with the unpenalized request and one of another prompt, chunked.
  const auto together = RunAll(*m, EngineConfig{.max_num_batched_tokens = 8, .cache_budget_bytes = 16 << 20},
                               {{p, Greedy(40)}, {RandomPrompt(20, 5), repetition}, {p, repetition}, {p, frequency}});
  EXPECT_EQ(together[0].tokens, base.tokens);
  EXPECT_EQ(together[2].tokens, alone.tokens);
  EXPECT_EQ(together[3].tokens, freq.tokens);
  EXPECT_EQ(Repeats(together[1].tokens), 0);
  // The reported logprobs stay those of the unmodified distribution: the
  // same tokens at the same positions get the same logprobs.
  for (size_t i = 0; i < base.tokens.size() && base.tokens[i] == alone.tokens[i]; ++i)
    EXPECT_NEAR(alone.logprobs[i], base.logprobs[i], 1e-6);

  // min_tokens: the model's EOS (the base output's fourth token) cannot end
  // the request before 6 tokens.
  ModelConfig c = m->config();
  c.eos_token_ids = {base.tokens[3]};
  auto m_eos = std::move(Model::Random(c, 1234)).value();
  auto early = Greedy(40);
  early.ignore_eos = false;
  auto late = early;
  late.min_tokens = 6;
  const auto outs = RunAll(*m_eos, ec, {{p, early}, {p, late}});
  ASSERT_LT(outs[0].tokens.size(), 6u);
  EXPECT_EQ(outs[0].tokens.back(), base.tokens[3]);
  ASSERT_GE(outs[1].tokens.size(), 6u);
  for (size_t i = 0; i < 5; ++i) EXPECT_NE(outs[1].tokens[i], base.tokens[3]) << "token " << i;
}

// Runs `request` undisturbed on a fresh engine, then, for each k, resumes it
// on another fresh engine with its first k tokens as already generated
// (GenerationRequest::generated): the resumed run must produce exactly the
// rest, with the same logprobs, up to the same max_tokens and finish
// reason. Returns the undisturbed output.
GenerationOutput ExpectResumesContinueTheRun(Model& m, const GenerationRequest& request,
                                             std::initializer_list<size_t> ks) {
  const EngineConfig ec{.cache_budget_bytes = 16 << 20};
  const GenerationOutput whole = RunAll(m, ec, {request})[0];
  EXPECT_EQ(whole.tokens.size(), static_cast<size_t>(request.sampling.max_tokens));
  EXPECT_EQ(whole.finish_reason, FinishReason::kLength);
  for (const size_t k : ks) {
    SCOPED_TRACE("resumed after " + std::to_string(k) + " tokens");
    if (k >= whole.tokens.size()) {
      ADD_FAILURE() << "the undisturbed run has only " << whole.tokens.size() << " tokens";
      continue;
    }
    GenerationRequest resumed = request;
    resumed.generated.assign(whole.tokens.begin(), whole.tokens.begin() + static_cast<std::ptrdiff_t>(k));
    const GenerationOutput rest = RunAll(m, ec, {resumed})[0];
    EXPECT_EQ(rest.tokens,
              std::vector<int64_t>(whole.tokens.begin() + static_cast<std::ptrdiff_t>(k), whole.tokens.end()));
    EXPECT_EQ(rest.finish_reason, whole.finish_reason);
    EXPECT_EQ(rest.logprobs.size(), rest.tokens.size());
    for (size_t i = 0; i < rest.logprobs.size() && k + i < whole.logprobs.size(); ++i)
      EXPECT_NEAR(rest.logprobs[i], whole.logprobs[k + i], 1e-5) << "token " << k + i;
  }
  return whole;
}

// A request resumed on a fresh engine with the tokens it generated
// elsewhere (migrated, or recovered after its DP group died) goes on
// exactly as the undisturbed run: greedy, and seeded sampling, whose
// random stream skips the draws those tokens took.
TEST(Engine, ResumedRequestContinuesTheUndisturbedRun) {
  auto m = Tiny();
  ASSERT_TRUE(m);
  const auto p = RandomPrompt(20, 81);
  {
    SCOPED_TRACE("greedy");
    ExpectResumesContinueTheRun(*m, {p, Greedy(12)}, {1, 5, 11});
  }
  {
    SCOPED_TRACE("seeded sampling");
    const SamplingParams sampled{
        .temperature = 0.8, .top_p = 0.9, .seed = 7, .max_tokens = 12, .stop_token_ids = {}, .ignore_eos = true};
    ExpectResumesContinueTheRun(*m, {p, sampled}, {1, 5, 11});
  }
}

// The penalties, min_tokens and bad words of a resumed request count the
// tokens it generated elsewhere. The model's EOS (ignored, so it does not
// end the request) is a token greedy decoding first picks at position j,
// and min_tokens is j: a resumed request that did not count its earlier
// tokens would still mask it there.
TEST(Engine, ResumedRequestKeepsPenaltiesMinTokensAndBadWords) {
  auto m = Tiny();
  ASSERT_TRUE(m);
  const auto p = RandomPrompt(10, 83);
  const EngineConfig ec{.cache_budget_bytes = 16 << 20};
  SamplingParams sp = Greedy(12);
  sp.repetition_penalty = 1.3;
  sp.frequency_penalty = 0.4;
  sp.presence_penalty = 0.4;
  const auto plain = RunAll(*m, ec, {{p, sp}})[0];
  ASSERT_EQ(plain.tokens.size(), 12u);
  sp.bad_words = {{plain.tokens[2], plain.tokens[3]}};
  const auto worded = RunAll(*m, ec, {{p, sp}})[0];
  ASSERT_EQ(worded.tokens.size(), 12u);
  ASSERT_NE(worded.tokens, plain.tokens) << "the bad word was meant to change the run";
  size_t j = 6;
  auto seen_before = [&](size_t at) {
    return std::find(worded.tokens.begin(), worded.tokens.begin() + static_cast<std::ptrdiff_t>(at),
                     worded.tokens[at]) != worded.tokens.begin() + static_cast<std::ptrdiff_t>(at);
  };
  while (j < 10 && seen_before(j)) ++j;
  ASSERT_FALSE(seen_before(j)) << "no new token among positions 6 to 10";
  ModelConfig c = m->config();
  c.eos_token_ids = {worded.tokens[j]};
  auto m_eos = std::move(Model::Random(c, 1234)).value();
  sp.min_tokens = static_cast<int64_t>(j);
  const GenerationOutput whole = ExpectResumesContinueTheRun(*m_eos, {p, sp}, {1, 3, 5, 11});
  EXPECT_EQ(whole.tokens, worded.tokens) << "min_tokens masks the EOS only where greedy did not pick it";
}

// A resumed request is recomputed after a preemption from its prompt and
// every token it generated, here or before; its prompt's logprobs, which it
// reported where it started, are not computed again.
TEST(Engine, ResumedRequestsSurvivePreemption) {
  auto m = Tiny();
  ASSERT_TRUE(m);
  std::vector<GenerationRequest> reqs;
  for (uint32_t i = 0; i < 4; ++i) reqs.push_back({RandomPrompt(16, 90 + i), i % 2 ? Sampled(20, i) : Greedy(20)});
  reqs[1].sampling.prompt_logprobs = 1;
  const auto free_run = RunAll(*m, EngineConfig{.cache_budget_bytes = 16 << 20, .block_size = 16}, reqs);
  ASSERT_EQ(free_run.size(), reqs.size());
  ASSERT_EQ(free_run[1].prompt_logprobs.size(), 15u);
  const size_t k = 3;
  for (size_t i = 0; i < reqs.size(); ++i)
    reqs[i].generated.assign(free_run[i].tokens.begin(), free_run[i].tokens.begin() + k);
  const LatentCacheConfig cc = m->CacheConfig(0, 16);
  const int64_t block_bytes = cc.num_layers * (cc.kv_lora_rank + cc.rope_dim) * 4 * 16;
  EngineStats stats;
  const auto tight = RunAll(*m, EngineConfig{.cache_budget_bytes = 8 * block_bytes, .block_size = 16}, reqs, &stats);
  EXPECT_GT(stats.preemptions, 0) << "the cache was meant to run out";
  ASSERT_EQ(tight.size(), reqs.size());
  for (size_t i = 0; i < reqs.size(); ++i) {
    EXPECT_EQ(tight[i].tokens, std::vector<int64_t>(free_run[i].tokens.begin() + k, free_run[i].tokens.end()))
        << "request " << i;
    EXPECT_EQ(tight[i].finish_reason, FinishReason::kLength);
    EXPECT_TRUE(tight[i].prompt_logprobs.empty()) << "request " << i;
  }
}

// The tiny model whose Forward call `fail_call` (0-based) fails with INTERNAL.
std::unique_ptr<Model> TinyFailingAt(int64_t fail_call) {
  ModelOptions o;
  o.fail_forward_call = fail_call;
  auto m = Model::Load(TinyYaml(), ModelOverrides{.kv_dtype = DType::kF32}, o);
  EXPECT_TRUE(m.ok()) << m.status();
  return m.ok() ? std::move(m).value() : nullptr;
}

// A step whose computation fails ends the requests of that step with the
// error and nothing else: their blocks are released, the request that waited
// meanwhile and those added afterwards (one reusing a failed request's
// committed prompt blocks) produce exactly what a clean engine gives them.
TEST(Engine, FailedStepFailsItsRequestsOnly) {
  auto clean = Tiny();
  auto failing = TinyFailingAt(2);  // step 0: both prompts; 1: first decode; 2: fails
  ASSERT_TRUE(clean && failing);
  const EngineConfig ec{.max_num_seqs = 2, .cache_budget_bytes = 16 << 20, .block_size = 16};
  const GenerationRequest a{RandomPrompt(20, 61), Greedy(6)}, b{RandomPrompt(9, 62), Sampled(6, 7)};
  const GenerationRequest waits{RandomPrompt(5, 63), Greedy(5)};
  const GenerationRequest later{a.prompt, Greedy(7)};  // a's first block is committed and cached
  const auto want = RunAll(*clean, ec, {a, b, waits, later});
  ASSERT_EQ(want.size(), 4u);

  auto created = Engine::Create(*failing, ec);
  ASSERT_TRUE(created.ok()) << created.status();
  Engine& e = **created;
  const int64_t blocks_before = e.cache().stats().blocks_used;
  auto ia = e.Add(a), ib = e.Add(b), iw = e.Add(waits);
  ASSERT_TRUE(ia.ok() && ib.ok() && iw.ok());
  for (int step = 0; step < 2; ++step) {
    auto done = e.Step();
    ASSERT_TRUE(done.ok()) << done.status();
    EXPECT_TRUE(done->empty()) << "step " << step;
  }
  EXPECT_EQ(e.num_running(), 2);
  EXPECT_EQ(e.num_waiting(), 1);
  auto failed = e.Step();
  ASSERT_TRUE(failed.ok()) << "a failed computation is the requests' error, not the engine's: " << failed.status();
  EXPECT_EQ(*failed, (std::vector<int64_t>{*ia, *ib}));
  for (const auto& [id, ref] : {std::pair{*ia, &want[0]}, std::pair{*ib, &want[1]}}) {
    const GenerationOutput* out = e.Output(id);
    ASSERT_NE(out, nullptr);
    EXPECT_EQ(out->finish_reason, FinishReason::kError);
    EXPECT_EQ(FinishReasonName(out->finish_reason), "error");
    EXPECT_EQ(out->error.code(), StatusCode::kInternal) << out->error;
    EXPECT_NE(out->error.message().find("injected failure"), std::string::npos) << out->error;
    // The tokens of the two steps before the failure stay, and are right.
    ASSERT_EQ(out->tokens.size(), 2u);
    EXPECT_EQ(out->tokens, std::vector<int64_t>(ref->tokens.begin(), ref->tokens.begin() + 2));
  }
  EXPECT_EQ(e.num_running(), 0);
  EXPECT_EQ(e.num_waiting(), 1) << "the waiting request is untouched";
  EXPECT_EQ(e.cache().stats().blocks_used, blocks_before) << "the failed requests' blocks are released";
  EXPECT_EQ(e.cache().stats().blocks_retired, 0) << "released, not retired: they did not run to their end";
  auto ta = e.TakeOutput(*ia);
  ASSERT_TRUE(ta.ok()) << ta.status();
  EXPECT_EQ(ta->finish_reason, FinishReason::kError);

  auto il = e.Add(later);
  ASSERT_TRUE(il.ok());
  while (e.HasWork()) {
    auto step = e.Step();
    ASSERT_TRUE(step.ok()) << step.status();
  }
  for (const auto& [id, ref] : {std::pair{*iw, &want[2]}, std::pair{*il, &want[3]}}) {
    const GenerationOutput* out = e.Output(id);
    ASSERT_NE(out, nullptr);
    EXPECT_EQ(out->finish_reason, FinishReason::kLength);
    EXPECT_TRUE(out->error.ok());
    EXPECT_EQ(out->tokens, ref->tokens) << "request " << id;
  }
  EXPECT_EQ(e.Output(*il)->prefix_hit_tokens, 16) << "the failed request's committed prompt block was reused";
  EXPECT_EQ(e.cache().stats().blocks_used, blocks_before);
}

// Generate puts a failed step's error in the slots of that step's requests;
// the others complete as on a clean engine.
TEST(Engine, GenerateReportsAFailedStepInItsRequestsSlots) {
  auto clean = Tiny();
  auto failing = TinyFailingAt(1);  // step 0: the first prompt; step 1 (its first decode) fails
  ASSERT_TRUE(clean && failing);
  const EngineConfig ec{.max_num_seqs = 1, .cache_budget_bytes = 16 << 20, .block_size = 16};
  const std::vector<GenerationRequest> reqs = {{RandomPrompt(7, 71), Greedy(4)}, {RandomPrompt(11, 72), Greedy(3)}};
  const auto want = RunAll(*clean, ec, reqs);
  auto engine = Engine::Create(*failing, ec);
  ASSERT_TRUE(engine.ok()) << engine.status();
  const auto out = (*engine)->Generate(reqs);
  ASSERT_EQ(out.size(), 2u);
  ASSERT_FALSE(out[0].ok());
  EXPECT_EQ(out[0].status().code(), StatusCode::kInternal);
  EXPECT_NE(out[0].status().message().find("injected failure"), std::string::npos) << out[0].status();
  ASSERT_TRUE(out[1].ok()) << out[1].status();
  EXPECT_EQ(out[1]->tokens, want[1].tokens);
  EXPECT_EQ((*engine)->cache().stats().blocks_used, 0);
}

// ---- Moving a request between groups with its cache rows ----------------

// Runs `request` alone on `a` until it has generated `k` tokens, then
// exports it; `id` gets its id there.
ExportedRequest RunThenExport(Engine& a, const GenerationRequest& request, size_t k, int64_t* id) {
  auto added = a.Add(request);
  EXPECT_TRUE(added.ok()) << added.status();
  if (!added.ok()) return {};
  *id = *added;
  for (int steps = 0; a.Output(*id)->tokens.size() < k && steps < 100; ++steps) {
    auto step = a.Step();
    EXPECT_TRUE(step.ok()) << step.status();
    if (!step.ok()) return {};
  }
  EXPECT_EQ(a.Output(*id)->tokens.size(), k);
  auto exported = a.Export(*id);
  EXPECT_TRUE(exported.ok()) << exported.status();
  return exported.ok() ? *exported : ExportedRequest{};
}

// `request` as the new group gets it: the first k tokens of `whole`
// generated, the rows where `exported` says.
GenerationRequest Moved(GenerationRequest request, const GenerationOutput& whole, size_t k,
                        const ExportedRequest& exported) {
  request.generated.assign(whole.tokens.begin(), whole.tokens.begin() + static_cast<std::ptrdiff_t>(k));
  request.import = ImportSource{.descriptors = {"a"}, .blocks = exported.blocks, .rows = exported.rows};
  return request;
}

// Engine B of `ec` with imports, its pool poisoned (NaN rows), fetching
// through `importer`.
std::unique_ptr<Engine> Importing(Model& m, EngineConfig ec, BlockImporter* importer) {
  ec.imports = true;
  auto b = Engine::Create(m, ec);
  EXPECT_TRUE(b.ok()) << b.status();
  if (!b.ok()) return nullptr;
  PoisonPool((*b)->runner()->pool());
  (*b)->runner()->SetImporter(importer);
  return std::move(b).value();
}

void ExpectTail(const GenerationOutput& rest, const GenerationOutput& whole, size_t k) {
  EXPECT_EQ(rest.tokens,
            std::vector<int64_t>(whole.tokens.begin() + static_cast<std::ptrdiff_t>(k), whole.tokens.end()));
  EXPECT_EQ(rest.finish_reason, whole.finish_reason);
  ASSERT_EQ(rest.logprobs.size(), rest.tokens.size());
  for (size_t i = 0; i < rest.logprobs.size() && k + i < whole.logprobs.size(); ++i)
    EXPECT_NEAR(rest.logprobs[i], whole.logprobs[k + i], 1e-5) << "token " << k + i;
}

// A request exported by engine A after k tokens and imported by engine B
// (its rows fetched from A's pool, not computed) goes on exactly as the
// undisturbed run, greedy and seeded; B computes only the one row after
// them. Block sizes 4 and 16 on a 23-token prompt: the imported rows span
// several blocks and end in a partial one. A then unpins the blocks.
TEST(Engine, ImportedRequestContinuesTheUndisturbedRun) {
  auto m = Tiny();
  ASSERT_TRUE(m);
  const auto p = RandomPrompt(23, 85);
  for (const int64_t bs : {4, 16}) {
    const EngineConfig ec{.cache_budget_bytes = 16 << 20, .block_size = bs};
    for (const GenerationRequest& request : {GenerationRequest{p, Greedy(12)}, GenerationRequest{p, Sampled(12, 7)}}) {
      const GenerationOutput whole = RunAll(*m, ec, {request})[0];
      ASSERT_EQ(whole.tokens.size(), 12u);
      for (const size_t k : {1, 5, 11}) {
        SCOPED_TRACE("block_size " + std::to_string(bs) + ", temperature " +
                     std::to_string(request.sampling.temperature) + ", moved after " + std::to_string(k));
        auto a = std::move(Engine::Create(*m, ec)).value();
        int64_t id = -1;
        const ExportedRequest exported = RunThenExport(*a, request, k, &id);
        const int64_t rows = static_cast<int64_t>(p.size() + k) - 1;  // the last token's row is not computed yet
        ASSERT_EQ(exported.rows, rows);
        ASSERT_EQ(std::ssize(exported.blocks), (rows + bs - 1) / bs);
        EXPECT_EQ(a->num_exported(), 1);
        EXPECT_FALSE(a->HasWork());
        EXPECT_EQ(a->Cancel(id).code(), StatusCode::kNotFound) << "an exported request is no longer live";
        EXPECT_EQ(a->Export(id).status().code(), StatusCode::kNotFound);
        auto left = a->TakeOutput(id);
        ASSERT_TRUE(left.ok()) << left.status();
        EXPECT_EQ(left->finish_reason, FinishReason::kCancelled);
        EXPECT_EQ(left->tokens, std::vector<int64_t>(whole.tokens.begin(), whole.tokens.begin() + k));
        EXPECT_EQ(a->cache().stats().blocks_used, std::ssize(exported.blocks)) << "the exported blocks stay pinned";

        PoolCopyImporter importer(&a->runner()->pool());
        auto b = Importing(*m, ec, &importer);
        ASSERT_TRUE(b);
        const auto rest = b->Generate({Moved(request, whole, k, exported)});
        ASSERT_TRUE(rest[0].ok()) << rest[0].status();
        ExpectTail(*rest[0], whole, k);
        ASSERT_EQ(importer.calls.size(), 1u);
        EXPECT_EQ(importer.calls[0].src, exported.blocks);
        EXPECT_EQ(importer.calls[0].dst.size(), exported.blocks.size());
        EXPECT_EQ(importer.calls[0].descriptors, std::vector<std::string>{"a"});
        EXPECT_EQ(importer.ranks, std::vector<int>{0});
        EXPECT_EQ(b->stats().imported_tokens, rows);
        EXPECT_EQ(b->stats().prefill_tokens, 1) << "only the row after the imported ones is computed";
        EXPECT_EQ(b->stats().import_failures, 0);
        EXPECT_EQ(b->cache().stats().blocks_used, 0);

        ASSERT_TRUE(a->ReleaseExport(id).ok());
        EXPECT_EQ(a->cache().stats().blocks_used, 0);
        EXPECT_EQ(a->num_exported(), 0);
        EXPECT_EQ(a->ReleaseExport(id).code(), StatusCode::kNotFound);
        EXPECT_EQ(a->stats().exported, 1);
      }
    }
  }
}

// The new group imports only the rows its prefix cache lacks: with the
// prompt's five full blocks of 4 cached, the request imports from block 5
// on; with every imported row cached, it imports nothing and runs as a
// resumed request.
TEST(Engine, ImportSkipsTheLocallyCachedPrefix) {
  auto m = Tiny();
  ASSERT_TRUE(m);
  const EngineConfig ec{.cache_budget_bytes = 16 << 20, .block_size = 4};
  {
    SCOPED_TRACE("part cached");
    const GenerationRequest request{RandomPrompt(23, 86), Sampled(12, 9)};
    const GenerationOutput whole = RunAll(*m, ec, {request})[0];
    auto a = std::move(Engine::Create(*m, ec)).value();
    int64_t id = -1;
    const size_t k = 5;
    const ExportedRequest exported = RunThenExport(*a, request, k, &id);
    ASSERT_EQ(exported.rows, 27);
    ASSERT_EQ(exported.blocks.size(), 7u);
    PoolCopyImporter importer(&a->runner()->pool());
    auto b = Importing(*m, ec, &importer);
    ASSERT_TRUE(b);
    ASSERT_TRUE(b->Generate({{request.prompt, Greedy(1)}})[0].ok());  // caches the prompt's 5 full blocks
    const auto rest = b->Generate({Moved(request, whole, k, exported)});
    ASSERT_TRUE(rest[0].ok()) << rest[0].status();
    ExpectTail(*rest[0], whole, k);
    EXPECT_EQ(rest[0]->prefix_hit_tokens, 20);
    ASSERT_EQ(importer.calls.size(), 1u);
    EXPECT_EQ(importer.calls[0].src, std::vector<int32_t>(exported.blocks.begin() + 5, exported.blocks.end()));
    EXPECT_EQ(importer.calls[0].dst.size(), 2u);
    EXPECT_EQ(b->stats().imported_tokens, 7);
    EXPECT_EQ(b->stats().prefill_tokens, 23 + 1);
    EXPECT_EQ(b->cache().stats().blocks_used, 0);
  }
  {
    SCOPED_TRACE("all cached");
    const GenerationRequest request{RandomPrompt(24, 87), Greedy(6)};
    const GenerationOutput whole = RunAll(*m, ec, {request})[0];
    auto a = std::move(Engine::Create(*m, ec)).value();
    int64_t id = -1;
    const ExportedRequest exported = RunThenExport(*a, request, 1, &id);
    ASSERT_EQ(exported.rows, 24);
    PoolCopyImporter importer(&a->runner()->pool());
    auto b = Importing(*m, ec, &importer);
    ASSERT_TRUE(b);
    ASSERT_TRUE(b->Generate({{request.prompt, Greedy(1)}})[0].ok());  // caches all 6 blocks of the prompt
    const auto rest = b->Generate({Moved(request, whole, 1, exported)});
    ASSERT_TRUE(rest[0].ok()) << rest[0].status();
    ExpectTail(*rest[0], whole, 1);
    EXPECT_TRUE(importer.calls.empty());
    EXPECT_EQ(b->stats().imported_tokens, 0);
    EXPECT_EQ(b->stats().prefill_tokens, 24 + 1);
  }
}

// Another group's cached prefix, imported instead of computed: engine A
// serves a prompt, pins what its cache holds of a second prompt that shares
// its first 30 tokens (ExportPrefix: 7 whole blocks of 4), and engine B
// (NaN-poisoned pool) imports them and computes only the 7 rows after. The
// tokens equal those of one engine serving both prompts in turn (whose
// second one reuses the first's rows from its own cache). Another salt, an
// uncached prompt or prefix caching off export nothing; A unpins the blocks
// on ReleaseExport and keeps them cached.
TEST(Engine, AnExportedPrefixIsImportedInsteadOfComputed) {
  auto m = Tiny();
  ASSERT_TRUE(m);
  const EngineConfig ec{.cache_budget_bytes = 16 << 20, .block_size = 4};
  const auto shared = RandomPrompt(30, 88);
  auto first = shared, second = shared;
  for (int32_t t : RandomPrompt(2, 89)) first.push_back(t);
  for (int32_t t : RandomPrompt(5, 90)) second.push_back(t);
  for (const SamplingParams& sampling : {Greedy(8), Sampled(8, 5)}) {
    SCOPED_TRACE("temperature " + std::to_string(sampling.temperature));
    auto one = std::move(Engine::Create(*m, ec)).value();
    ASSERT_TRUE(one->Generate({{first, Greedy(2)}})[0].ok());
    const auto want = one->Generate({{second, sampling}});
    ASSERT_TRUE(want[0].ok()) << want[0].status();
    ASSERT_EQ(want[0]->prefix_hit_tokens, 28);

    auto a = std::move(Engine::Create(*m, ec)).value();
    ASSERT_TRUE(a->Generate({{first, Greedy(2)}})[0].ok());
    const std::span<const int32_t> asked(second.data(), 32);  // whole blocks, one token left to compute
    auto held = a->ExportPrefix(asked, 0);
    ASSERT_TRUE(held.ok()) << held.status();
    ASSERT_GE(held->handle, 0);
    ASSERT_EQ(held->held.rows, 28);
    ASSERT_EQ(held->held.blocks.size(), 7u);
    EXPECT_EQ(a->num_exported(), 1);
    EXPECT_EQ(a->stats().exported_prefixes, 1);
    EXPECT_EQ(a->cache().stats().blocks_used, 7) << "the exported blocks stay pinned";
    EXPECT_FALSE(a->HasWork());
    EXPECT_EQ(a->ExportPrefix(asked, 7)->handle, -1) << "another salt shares nothing";
    EXPECT_EQ(a->ExportPrefix(RandomPrompt(32, 91), 0)->held.rows, 0);

    PoolCopyImporter importer(&a->runner()->pool());
    auto b = Importing(*m, ec, &importer);
    ASSERT_TRUE(b);
    GenerationRequest request{second, sampling};
    request.import = ImportSource{.descriptors = {"a"}, .blocks = held->held.blocks, .rows = held->held.rows};
    const auto got = b->Generate({request});
    ASSERT_TRUE(got[0].ok()) << got[0].status();
    ExpectTail(*got[0], *want[0], 0);
    ASSERT_EQ(importer.calls.size(), 1u);
    EXPECT_EQ(importer.calls[0].src, held->held.blocks);
    EXPECT_EQ(b->stats().imported_tokens, 28);
    EXPECT_EQ(b->stats().prefill_tokens, 7) << "only the rows after the imported ones are computed";
    EXPECT_EQ(b->cache().MatchPrefix(asked), 32) << "B caches the imported blocks and the one it computed";

    ASSERT_TRUE(a->ReleaseExport(held->handle).ok());
    EXPECT_EQ(a->cache().stats().blocks_used, 0);
    EXPECT_EQ(a->num_exported(), 0);
    EXPECT_EQ(a->ReleaseExport(held->handle).code(), StatusCode::kNotFound);
    EXPECT_EQ(a->cache().MatchPrefix(asked), 28) << "released, the blocks stay cached";
  }
  EngineConfig off = ec;
  off.enable_prefix_caching = false;
  auto c = std::move(Engine::Create(*m, off)).value();
  ASSERT_TRUE(c->Generate({{first, Greedy(2)}})[0].ok());
  EXPECT_EQ(c->ExportPrefix(std::span<const int32_t>(second.data(), 32), 0)->handle, -1);
  EXPECT_EQ(c->num_exported(), 0);
}

// A fetch that fails (half-way) costs only the recompute: the request is
// computed from its tokens, gives the same output, is not imported again,
// and B keeps no block of it. A group without importers (imports off)
// computes the rows without asking.
TEST(Engine, AFailedOrDisabledImportIsRecomputed) {
  auto m = Tiny();
  ASSERT_TRUE(m);
  const EngineConfig ec{.cache_budget_bytes = 16 << 20, .block_size = 4};
  const GenerationRequest request{RandomPrompt(23, 88), Sampled(12, 3)};
  const GenerationOutput whole = RunAll(*m, ec, {request})[0];
  auto a = std::move(Engine::Create(*m, ec)).value();
  int64_t id = -1;
  const size_t k = 5;
  const ExportedRequest exported = RunThenExport(*a, request, k, &id);
  ASSERT_EQ(exported.rows, 27);
  {
    SCOPED_TRACE("failed");
    PoolCopyImporter importer(&a->runner()->pool());
    importer.fail = true;
    auto b = Importing(*m, ec, &importer);
    ASSERT_TRUE(b);
    // Beside it, a request that runs throughout.
    const auto out = b->Generate({Moved(request, whole, k, exported), {RandomPrompt(9, 89), Greedy(8)}});
    ASSERT_TRUE(out[0].ok()) << out[0].status();
    ExpectTail(*out[0], whole, k);
    ASSERT_TRUE(out[1].ok()) << out[1].status();
    EXPECT_EQ(out[1]->tokens, RunAll(*m, ec, {{RandomPrompt(9, 89), Greedy(8)}})[0].tokens);
    EXPECT_EQ(importer.calls.size(), 1u) << "a failed import is not tried again";
    EXPECT_EQ(b->stats().import_failures, 1);
    EXPECT_EQ(b->stats().imported_tokens, 0);
    EXPECT_EQ(b->stats().prefill_tokens, 23 + 5 + 9);
    EXPECT_EQ(b->cache().stats().blocks_used, 0) << "no block of the failed import is kept";
  }
  {
    SCOPED_TRACE("no importer set");
    auto b = Importing(*m, ec, nullptr);
    ASSERT_TRUE(b);
    const auto out = b->Generate({Moved(request, whole, k, exported)});
    ASSERT_TRUE(out[0].ok()) << out[0].status();
    ExpectTail(*out[0], whole, k);
    EXPECT_EQ(b->stats().import_failures, 1);
    EXPECT_EQ(b->cache().stats().blocks_used, 0);
  }
  {
    SCOPED_TRACE("imports off");
    PoolCopyImporter importer(&a->runner()->pool());
    auto b = std::move(Engine::Create(*m, ec)).value();
    PoisonPool(b->runner()->pool());
    b->runner()->SetImporter(&importer);
    const auto out = b->Generate({Moved(request, whole, k, exported)});
    ASSERT_TRUE(out[0].ok()) << out[0].status();
    ExpectTail(*out[0], whole, k);
    EXPECT_TRUE(importer.calls.empty());
    EXPECT_EQ(b->stats().import_failures, 0);
    EXPECT_EQ(b->stats().prefill_tokens, 23 + 5);
  }
  ASSERT_TRUE(a->ReleaseExport(id).ok());
  EXPECT_EQ(a->cache().stats().blocks_used, 0);
}

// A move into a destination whose cache is full: the moved request waits
// (its blocks are not taken, nothing is preempted) until a running request
// frees room, then imports and goes on exactly as the undisturbed run. B
// holds 20 blocks of 4 tokens; a 60-token request beside it takes 15 at
// once and 17 by its end, the import needs 7.
TEST(Engine, AMoveIntoAFullCacheWaitsForRoom) {
  auto m = Tiny();
  ASSERT_TRUE(m);
  const EngineConfig roomy{.cache_budget_bytes = 16 << 20, .block_size = 4};
  const int64_t block_bytes = [&] {
    auto e = std::move(Engine::Create(*m, roomy)).value();
    return roomy.cache_budget_bytes / e->cache().stats().blocks_total;
  }();
  EngineConfig small = roomy;
  small.cache_budget_bytes = 20 * block_bytes;
  const GenerationRequest request{RandomPrompt(23, 91), Sampled(12, 5)};
  const GenerationRequest filler{RandomPrompt(60, 92), Greedy(8)};
  const GenerationOutput whole = RunAll(*m, roomy, {request})[0];
  auto a = std::move(Engine::Create(*m, roomy)).value();
  int64_t id = -1;
  const size_t k = 5;
  const ExportedRequest exported = RunThenExport(*a, request, k, &id);
  ASSERT_EQ(exported.rows, 27);
  PoolCopyImporter importer(&a->runner()->pool());
  auto b = Importing(*m, small, &importer);
  ASSERT_TRUE(b);
  ASSERT_EQ(b->cache().stats().blocks_total, 20);
  const auto out = b->Generate({filler, Moved(request, whole, k, exported)});
  ASSERT_TRUE(out[0].ok()) << out[0].status();
  EXPECT_EQ(out[0]->tokens, RunAll(*m, roomy, {filler})[0].tokens);
  ASSERT_TRUE(out[1].ok()) << out[1].status();
  ExpectTail(*out[1], whole, k);
  EXPECT_EQ(out[1]->preemptions, 0);
  EXPECT_EQ(b->stats().preemptions, 0);
  ASSERT_EQ(importer.calls.size(), 1u) << "one import, once there was room";
  EXPECT_EQ(b->stats().import_failures, 0);
  EXPECT_EQ(b->stats().imported_tokens, 27);
  EXPECT_EQ(b->stats().prefill_tokens, 60 + 1);
  EXPECT_EQ(b->cache().stats().blocks_used, 0);
  ASSERT_TRUE(a->ReleaseExport(id).ok());
}

// The scheduler's side, step by step: an importing request holds a
// sequence slot and its blocks but is in no plan's sequences; Schedule
// refuses to go on before FinishImports; one exported while importing
// leaves with no blocks. Requests without blocks export none.
TEST(Engine, ImportsAndExportsBetweenSteps) {
  auto m = Tiny();
  ASSERT_TRUE(m);
  EngineConfig ec{.max_num_seqs = 1, .cache_budget_bytes = 16 << 20, .block_size = 4};
  ec.imports = true;
  auto s = std::move(Engine::CreateScheduler(m->config(), ec)).value();
  const GenerationRequest base{RandomPrompt(10, 90), Greedy(6)};
  GenerationRequest moved = base;
  moved.generated = {5, 6};
  moved.import = ImportSource{.descriptors = {"x", "y"}, .blocks = {40, 41, 42}, .rows = 11};
  const int64_t first = *s->Add(moved), second = *s->Add(moved);
  auto plan = s->Schedule();
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_TRUE(plan->seqs.empty());
  ASSERT_EQ(plan->imports.size(), 1u) << "max_num_seqs 1: the importing request holds the one slot";
  const StepPlan::Import& imp = plan->imports[0];
  EXPECT_EQ(imp.id, first);
  EXPECT_EQ(imp.descriptors, (std::vector<std::string>{"x", "y"}));
  EXPECT_EQ(imp.src, (std::vector<int32_t>{40, 41, 42}));
  EXPECT_EQ(imp.dst, std::vector<int32_t>(s->cache().BlockTable(first).begin(), s->cache().BlockTable(first).end()));
  EXPECT_EQ(s->num_importing(), 1);
  EXPECT_EQ(s->num_waiting(), 1);
  EXPECT_TRUE(s->HasWork());
  EXPECT_EQ(s->Schedule().status().code(), StatusCode::kFailedPrecondition);
  ASSERT_TRUE(s->FinishImports(*plan, true).ok());
  EXPECT_EQ(s->num_importing(), 0);
  EXPECT_EQ(s->num_running(), 1);
  EXPECT_EQ(s->stats().imported_tokens, 11);
  plan = s->Schedule();
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_EQ(plan->seqs.size(), 1u);
  EXPECT_EQ(plan->seqs[0].start_pos, 11);
  EXPECT_EQ(plan->seqs[0].tokens, std::vector<int32_t>{6});
  EXPECT_TRUE(plan->imports.empty());
  // Exported mid-step is not what a server does; here the plan is done with.
  ASSERT_TRUE(s->FailStep(*plan, InternalError("test: dropped")).ok());
  // The second one now imports; exported before FinishImports, it leaves
  // with nothing and its blocks go back.
  plan = s->Schedule();
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_EQ(plan->imports.size(), 1u);
  EXPECT_EQ(plan->imports[0].id, second);
  EXPECT_GT(s->cache().stats().blocks_used, 0);
  auto out = s->Export(second);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_TRUE(out->blocks.empty());
  EXPECT_EQ(out->rows, 0);
  EXPECT_EQ(s->num_exported(), 0);
  ASSERT_TRUE(s->FinishImports(*plan, true).ok());
  EXPECT_EQ(s->num_running(), 0);
  EXPECT_EQ(s->cache().stats().blocks_used, 0);
  EXPECT_EQ(s->stats().imported_tokens, 11) << "the exported request imported nothing";
  EXPECT_FALSE(s->HasWork());
  // A waiting request exports no blocks; unknown ids are NOT_FOUND.
  const int64_t waiting = *s->Add(base);
  out = s->Export(waiting);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_TRUE(out->blocks.empty());
  EXPECT_EQ(out->rows, 0);
  EXPECT_EQ(s->ReleaseExport(waiting).code(), StatusCode::kNotFound);
  EXPECT_EQ(s->Export(12345).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(s->stats().exported, 2);
  EXPECT_FALSE(s->HasWork());
  // A failed import goes back to the front of the queue, without its
  // source: the next step computes it, from the first import's two full
  // blocks on (published when its import succeeded).
  const int64_t third = *s->Add(moved), fourth = *s->Add(moved);
  plan = s->Schedule();
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_EQ(plan->imports.size(), 1u);
  EXPECT_EQ(plan->imports[0].id, third);
  ASSERT_TRUE(s->FinishImports(*plan, false).ok());
  EXPECT_EQ(s->num_waiting(), 2);
  EXPECT_EQ(s->stats().import_failures, 1);
  EXPECT_EQ(s->cache().stats().blocks_used, 0);
  plan = s->Schedule();
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_TRUE(plan->imports.empty());
  ASSERT_EQ(plan->seqs.size(), 1u);
  EXPECT_EQ(plan->seqs[0].id, third);
  EXPECT_EQ(plan->seqs[0].start_pos, 8);
  EXPECT_EQ(plan->seqs[0].tokens.size(), 4u);
  ASSERT_TRUE(s->Cancel(third).ok());
  ASSERT_TRUE(s->Cancel(fourth).ok());
}

}  // namespace
}  // namespace mlarun

namespace mlarun {
namespace {

// The one request check (engine, simulated worker, coordinator): limits not
// known yet check nothing against them; known ones name the field and whose
// limit it was.
TEST(ValidateRequest, UnknownLimitsCheckOnlyTheRequestItself) {
  SamplingParams s;
  s.max_tokens = 1'000'000;
  const std::vector<int32_t> big = {3, 1'000'000'000, 7};
  EXPECT_TRUE(ValidateRequest(big, s, RequestLimits{}).ok());
  const std::vector<int32_t> negative = {3, -2};
  const Status st = ValidateRequest(negative, s, RequestLimits{});
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(st.message(), "prompt_ids[1]: token id -2 is negative");
  EXPECT_EQ(ValidateRequest({}, s, RequestLimits{}).message(), "prompt_ids: must not be empty");
  s.top_p = 0;
  EXPECT_EQ(ValidateRequest(big, s, RequestLimits{}).message().rfind("sampling.top_p", 0), 0u);
}

TEST(ValidateRequest, KnownLimitsNameFieldAndOwner) {
  const RequestLimits limits{
      .vocab_size = 100, .max_position_embeddings = 20, .block_size = 4, .cache_blocks_total = 3, .whose = "group 2's"};
  SamplingParams s;
  s.max_tokens = 5;
  const std::vector<int32_t> ok = {1, 2, 3, 4, 5, 6, 7};  // 7 + 5 = 12 tokens = 3 blocks
  EXPECT_TRUE(ValidateRequest(ok, s, limits).ok());
  const std::vector<int32_t> out = {1, 100};
  EXPECT_EQ(ValidateRequest(out, s, limits).message(),
            "prompt_ids[1]: token id 100 is outside the vocabulary (group 2's vocab_size 100)");
  s.max_tokens = 6;  // 13 tokens: 4 blocks
  EXPECT_EQ(ValidateRequest(ok, s, limits).message(),
            "sampling.max_tokens: prompt_ids + max_tokens need 4 cache blocks, the whole cache has 3");
  s.max_tokens = 14;  // 21 positions
  const std::string m =
      ValidateRequest(ok, s, RequestLimits{.vocab_size = 100, .max_position_embeddings = 20}).message();
  EXPECT_EQ(m,
            "sampling.max_tokens: prompt_ids (7 tokens) + max_tokens (14) = 21 exceeds the model's "
            "max_position_embeddings 20");
  s.max_tokens = 21;  // more than the context alone
  EXPECT_EQ(ValidateRequest(ok, s, limits).message().rfind("sampling.max_tokens must be in [1, 20]", 0), 0u);
}

// Tokens already generated are checked as the prompt's are, and at least
// one token must be left to generate.
TEST(ValidateRequest, GeneratedTokensAreInTheVocabularyAndFewerThanMaxTokens) {
  const RequestLimits limits{.vocab_size = 100, .max_position_embeddings = 20};
  SamplingParams s;
  s.max_tokens = 5;
  const std::vector<int32_t> prompt = {1, 2, 3};
  EXPECT_TRUE(ValidateRequest(prompt, s, limits, std::vector<int32_t>{4, 5, 6, 99}).ok());
  const Status out = ValidateRequest(prompt, s, limits, std::vector<int32_t>{4, 100});
  EXPECT_EQ(out.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(out.message(), "generated_ids[1]: token id 100 is outside the vocabulary (the model's vocab_size 100)");
  EXPECT_EQ(ValidateRequest(prompt, s, RequestLimits{}, std::vector<int32_t>{-3}).message(),
            "generated_ids[0]: token id -3 is negative");
  const Status all = ValidateRequest(prompt, s, limits, std::vector<int32_t>{4, 5, 6, 7, 8});
  EXPECT_EQ(all.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(all.message(), "generated_ids: 5 tokens already generated, max_tokens is 5");
}

// An import source names the rows of a prefix of prompt + generated (at
// least one, not all), one block per block_size of them, and the old
// group's ranks.
TEST(ValidateRequest, ImportSourcesNameTheirField) {
  const RequestLimits limits{.vocab_size = 100, .block_size = 4};
  GenerationRequest r{{1, 2, 3, 4, 5, 6}, SamplingParams{.max_tokens = 5}};
  r.generated = {7, 8};  // 8 tokens: rows in [1, 7]
  r.import = ImportSource{.descriptors = {"d"}, .blocks = {3, 9}, .rows = 7};
  EXPECT_TRUE(ValidateGenerationRequest(r, limits).ok());
  auto with = [&](ImportSource i) {
    GenerationRequest c = r;
    c.import = std::move(i);
    return ValidateGenerationRequest(c, limits);
  };
  const Status all = with({.descriptors = {"d"}, .blocks = {3, 9}, .rows = 8});
  EXPECT_EQ(all.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(all.message().rfind("import.rows: 8 is outside [1, 7]", 0), 0u) << all;
  EXPECT_EQ(with({.descriptors = {"d"}, .blocks = {}, .rows = 0}).message().rfind("import.rows: ", 0), 0u);
  EXPECT_EQ(with({.descriptors = {"d"}, .blocks = {3}, .rows = 5}).message(),
            "import.blocks: 1 blocks for 5 rows, want 2 (block_size 4)");
  EXPECT_EQ(with({.descriptors = {"d"}, .blocks = {3, 9}, .rows = 4}).message().rfind("import.blocks: ", 0), 0u);
  EXPECT_EQ(with({.descriptors = {"d"}, .blocks = {3, -1}, .rows = 5}).message().rfind("import.blocks[1]: ", 0), 0u);
  EXPECT_EQ(with({.descriptors = {}, .blocks = {3, 9}, .rows = 5}).message(), "import.descriptors: must not be empty");
  // The request's own fields come first.
  GenerationRequest bad = r;
  bad.prompt.clear();
  EXPECT_EQ(ValidateGenerationRequest(bad, limits).message(), "prompt_ids: must not be empty");
}

TEST(Engine, RequestsWithBadImportSourcesAreRejected) {
  auto m = Tiny();
  ASSERT_TRUE(m);
  auto engine = std::move(Engine::Create(*m, EngineConfig{.cache_budget_bytes = 16 << 20, .block_size = 16})).value();
  GenerationRequest r{RandomPrompt(20, 1), Greedy(4)};
  r.import = ImportSource{.descriptors = {"d"}, .blocks = {1}, .rows = 17};  // 17 rows are two blocks of 16
  const auto a = engine->Add(r);
  EXPECT_EQ(a.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(a.status().message().rfind("import.blocks: ", 0), 0u) << a.status();
  EXPECT_FALSE(engine->HasWork());
}

TEST(Engine, ResumedRequestsWithBadGeneratedTokensAreRejected) {
  auto m = Tiny();
  ASSERT_TRUE(m);
  auto engine = std::move(Engine::Create(*m, EngineConfig{.cache_budget_bytes = 16 << 20})).value();
  GenerationRequest outside{RandomPrompt(5, 1), Greedy(4)};
  outside.generated = {7, 512};
  const auto a = engine->Add(outside);
  EXPECT_EQ(a.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(a.status().message().rfind("generated_ids[1]: ", 0), 0u) << a.status();
  GenerationRequest done{RandomPrompt(5, 2), Greedy(4)};
  done.generated = {7, 8, 9, 10};
  const auto b = engine->Add(done);
  EXPECT_EQ(b.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(b.status().message(), "generated_ids: 4 tokens already generated, max_tokens is 4");
  EXPECT_FALSE(engine->HasWork()) << "a refused request changes nothing";
}

}  // namespace
}  // namespace mlarun
