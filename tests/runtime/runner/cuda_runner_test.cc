// The whole model on the CUDA backend against the CPU backend: the same
// checkpoint loaded twice, the same batches (a prefill of three prompts of
// different lengths, then decode steps), logits compared per step and
// greedy tokens compared with teacher forcing (both models are fed the CPU's
// choice, so one near-tie cannot make every later step incomparable). Then
// the runner's own loop (scheduler, device sampler) on the tiny model.
// Skips without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "base/cuda_device.h"
#include "base/device_memory.h"
#include "bench/local_cache.h"
#include "runtime/engine/engine.h"
#include "runtime/model/model.h"
#include "runtime/runner/model_runner.h"
#include "tests/test_paths.h"

namespace mlarun {
namespace {

namespace fs = std::filesystem;

std::unique_ptr<Model> LoadOn(const std::string& path, Backend backend, DType kv) {
  ModelOptions o;
  o.attention.backend = backend;
  auto m = Model::Load(path, ModelOverrides{.kv_dtype = kv}, o);
  EXPECT_TRUE(m.ok()) << path << ": " << m.status();
  return m.ok() ? std::move(m).value() : nullptr;
}

int64_t Argmax(const float* row, int64_t n) { return std::max_element(row, row + n) - row; }

// The gap between the best and the second-best logit of a row.
double Margin(const float* row, int64_t n) {
  float a = -INFINITY, b = -INFINITY;
  for (int64_t i = 0; i < n; ++i) {
    if (row[i] > a) {
      b = a;
      a = row[i];
    } else if (row[i] > b) {
      b = row[i];
    }
  }
  return static_cast<double>(a) - b;
}

struct Compared {
  double rel_err = 0;  // max over steps of max |cuda - cpu| / max |cpu|
  int tokens = 0, same = 0, near_ties = 0;
};

// Three sequences, a prefill step then `decode_steps` decode steps.
Compared CompareModels(Model& cpu, Model& gpu, int decode_steps) {
  Compared out;
  const int64_t vocab = cpu.config().vocab_size;
  const LatentCacheConfig cc = cpu.CacheConfig(16 << 20, 16);
  auto host_cache = LocalLatentCache::Create(cc);
  auto dev_cache = LocalLatentCache::Create(cc, gpu.memory());
  EXPECT_TRUE(host_cache.ok() && dev_cache.ok());
  if (!host_cache.ok() || !dev_cache.ok()) return out;
  std::mt19937 rng(11);
  std::vector<std::vector<int32_t>> next(3);
  std::vector<std::vector<int32_t>> prompts = {std::vector<int32_t>(5), std::vector<int32_t>(37),
                                               std::vector<int32_t>(70)};
  for (auto& p : prompts)
    for (auto& t : p) t = static_cast<int32_t>(1 + rng() % static_cast<uint32_t>(vocab - 1));
  for (int step = 0; step <= decode_steps; ++step) {
    std::vector<ForwardSeq> hs, ds;
    for (int i = 0; i < 3; ++i) {
      const auto& toks = step == 0 ? prompts[static_cast<size_t>(i)] : next[static_cast<size_t>(i)];
      auto a = host_cache->Append(i, toks);
      auto b = dev_cache->Append(i, toks);
      EXPECT_TRUE(a.ok() && b.ok());
      if (!a.ok() || !b.ok()) return out;
      hs.push_back(*a);
      ds.push_back(*b);
    }
    auto lc = cpu.Forward(hs, *host_cache->pool);
    auto lg = gpu.Forward(ds, *dev_cache->pool);
    EXPECT_TRUE(lc.ok()) << lc.status();
    EXPECT_TRUE(lg.ok()) << lg.status();
    if (!lc.ok() || !lg.ok()) return out;
    EXPECT_EQ(lc->size(), lg->size());
    if (lc->size() != lg->size()) return out;
    double num = 0, den = 0;
    for (size_t k = 0; k < lc->size(); ++k) {
      EXPECT_FALSE(std::isnan((*lg)[k])) << "step " << step << " logit " << k;
      num = std::max(num, std::abs(static_cast<double>((*lg)[k]) - (*lc)[k]));
      den = std::max(den, std::abs(static_cast<double>((*lc)[k])));
    }
    out.rel_err = std::max(out.rel_err, num / den);
    for (int i = 0; i < 3; ++i) {
      const float* rc = lc->data() + i * vocab;
      const float* rg = lg->data() + i * vocab;
      const int64_t want = Argmax(rc, vocab), got = Argmax(rg, vocab);
      ++out.tokens;
      if (want == got)
        ++out.same;
      else if (Margin(rc, vocab) < 4 * num)
        ++out.near_ties;  // within the measured error: either is right
      next[static_cast<size_t>(i)] = {static_cast<int32_t>(want)};
    }
  }
  return out;
}

class CudaModel : public ::testing::TestWithParam<std::string> {};

// f32 weights and cache: both backends compute fp32 products (no TF32), so
// only the summation order differs: 1e-4 of the logits' scale. bf16: every
// product's input is rounded to bf16 on both, but a different sum can round
// an activation to the neighbouring bf16 value: 3e-2, as the CPU's own
// bf16-vs-transformers bound in model_test.
TEST_P(CudaModel, LogitsAndGreedyTokensMatchTheCpu) {
  auto devices = CudaDevices();
  if (!devices.ok()) GTEST_SKIP() << devices.status();
  const std::string path = GetParam();
  for (DType kv : {DType::kF32, DType::kBF16}) {
    auto cpu = LoadOn(path, Backend::kCpu, kv);
    auto gpu = LoadOn(path, Backend::kCuda, kv);
    ASSERT_TRUE(cpu && gpu);
    const bool f32 = cpu->config().weight_dtype == DType::kF32 && kv == DType::kF32;
    const Compared c = CompareModels(*cpu, *gpu, 6);
    std::printf("[cuda model] %s kv %s: rel err %.3g, tokens %d same %d near-ties %d\n",
                fs::path(path).filename().c_str(), std::string(DTypeName(kv)).c_str(), c.rel_err, c.tokens, c.same,
                c.near_ties);
    EXPECT_LT(c.rel_err, f32 ? 1e-4 : 3e-2) << path << " kv " << DTypeName(kv);
    EXPECT_EQ(c.same + c.near_ties, c.tokens) << path << " kv " << DTypeName(kv);
    EXPECT_GE(c.same, c.tokens - 1) << "more than one near-tie is not a tie";
  }
}

std::vector<std::string> Models() {
  std::vector<std::string> out = {TinyYaml()};
  const fs::path root = fs::path(MLARUN_FIXTURES_DIR) / "models";
  if (fs::exists(root))
    for (const auto& e : fs::directory_iterator(root))
      if (e.is_directory() && fs::exists(e.path() / "config.json")) out.push_back(e.path().string());
  std::sort(out.begin() + 1, out.end());
  return out;
}

INSTANTIATE_TEST_SUITE_P(Checkpoints, CudaModel, ::testing::ValuesIn(Models()), [](const auto& info) {
  std::string n = fs::path(info.param).stem().string();
  for (char& ch : n)
    if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
  return n;
});

// The runner on the GPU, its sampler on the device for the greedy rows and
// the host's for the seeded ones: the same plans give the same tokens as the
// CPU runner (the tiny model's margins are far above the backends'
// difference at f32).
TEST(CudaRunner, SamplesWhatTheCpuRunnerSamples) {
  auto devices = CudaDevices();
  if (!devices.ok()) GTEST_SKIP() << devices.status();
  ModelOptions co, go;
  go.attention.backend = Backend::kCuda;
  auto cpu = Model::Load(TinyYaml(), ModelOverrides{.kv_dtype = DType::kF32}, co);
  auto gpu = Model::Load(TinyYaml(), ModelOverrides{.kv_dtype = DType::kF32}, go);
  ASSERT_TRUE(cpu.ok() && gpu.ok());
  const EngineConfig ec{
      .max_num_batched_tokens = 64, .max_num_seqs = 4, .cache_budget_bytes = 4 << 20, .block_size = 16};
  const LatentCacheConfig pool = std::move(Engine::CacheConfig((*cpu)->config(), ec)).value();
  auto on_cpu = std::move(ModelRunner::Create(**cpu, pool)).value();
  auto on_gpu = std::move(ModelRunner::Create(**gpu, pool)).value();
  // Each runner needs its own samplers (their random streams advance), so
  // two schedulers get the same requests.
  auto s_cpu = std::move(Engine::CreateScheduler((*cpu)->config(), ec)).value();
  auto s_gpu = std::move(Engine::CreateScheduler((*cpu)->config(), ec)).value();
  std::mt19937 rng(5);
  for (int i = 0; i < 4; ++i) {
    std::vector<int32_t> prompt(static_cast<size_t>(6 + 9 * i));
    for (auto& t : prompt) t = static_cast<int32_t>(1 + rng() % 500);
    SamplingParams sp = i % 2 == 0 ? SamplingParams{.temperature = 0.0, .max_tokens = 10, .ignore_eos = true}
                                   : SamplingParams{.temperature = 0.8,
                                                    .top_k = 40,
                                                    .top_p = 0.9,
                                                    .seed = static_cast<uint64_t>(100 + i),
                                                    .max_tokens = 10,
                                                    .ignore_eos = true};
    if (i >= 2) {  // the most likely tokens, and the prompt's logprobs: rows read back whole
      sp.logprobs = 3;
      sp.prompt_logprobs = 2;
    }
    ASSERT_TRUE(s_cpu->Add(GenerationRequest{prompt, sp}).ok());
    ASSERT_TRUE(s_gpu->Add(GenerationRequest{prompt, sp}).ok());
  }
  int steps = 0, compared = 0, scored = 0;
  while (s_cpu->HasWork()) {
    ASSERT_LT(++steps, 100);
    ASSERT_TRUE(s_gpu->HasWork());
    auto pc = s_cpu->Schedule();
    auto pg = s_gpu->Schedule();
    ASSERT_TRUE(pc.ok() && pg.ok());
    auto a = on_cpu->Execute(*pc);
    auto b = on_gpu->Execute(*pg);
    ASSERT_TRUE(a.ok()) << a.status();
    ASSERT_TRUE(b.ok()) << b.status();
    ASSERT_EQ(a->size(), b->size());
    auto same_list = [&](const SampledToken& x, const SampledToken& y, const std::string& what) {
      ASSERT_EQ(x.num_top, y.num_top) << what;
      for (int32_t j = 0; j < x.num_top; ++j) EXPECT_NEAR(x.top[j].logprob, y.top[j].logprob, 1e-3) << what;
    };
    for (size_t i = 0; i < a->size(); ++i) {
      EXPECT_EQ((*a)[i].token, (*b)[i].token) << "step " << steps << " row " << i;
      EXPECT_NEAR((*a)[i].logprob, (*b)[i].logprob, 1e-3) << "step " << steps << " row " << i;
      same_list((*a)[i], (*b)[i], "step " + std::to_string(steps) + " row " + std::to_string(i));
      ++compared;
    }
    const auto sa = on_cpu->last_scores(), sb = on_gpu->last_scores();
    ASSERT_EQ(sa.size(), sb.size());
    for (size_t q = 0; q < sa.size(); ++q) {
      ASSERT_EQ(sa[q].size(), sb[q].size()) << "step " << steps << " sequence " << q;
      for (size_t j = 0; j < sa[q].size(); ++j) {
        EXPECT_EQ(sa[q][j].token, sb[q][j].token);
        EXPECT_NEAR(sa[q][j].logprob, sb[q][j].logprob, 1e-3) << "step " << steps << " sequence " << q << " row " << j;
        same_list(sa[q][j], sb[q][j], "step " + std::to_string(steps) + " sequence " + std::to_string(q));
        ++scored;
      }
    }
    // The CPU's tokens and scores: the two stay in step even after a difference.
    ASSERT_TRUE(s_cpu->Finish(*pc, *a, sa).ok());
    ASSERT_TRUE(s_gpu->Finish(*pg, *a, sa).ok());
  }
  EXPECT_EQ(compared, 40);
  EXPECT_EQ(scored, (6 + 9 * 2 - 1) + (6 + 9 * 3 - 1)) << "the prompt tokens of requests 2 and 3, after their first";
}

// Without a GPU, a CUDA model is refused with the reason, not a crash.
TEST(CudaRunner, ACudaModelWithoutAGpuIsAClearError) {
  if (CudaDevices().ok()) GTEST_SKIP() << "a GPU is present";
  ModelOptions o;
  o.attention.backend = Backend::kCuda;
  auto m = Model::Load(TinyYaml(), ModelOverrides{}, o);
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("CUDA"), std::string::npos) << m.status();
}

}  // namespace
}  // namespace mlarun
