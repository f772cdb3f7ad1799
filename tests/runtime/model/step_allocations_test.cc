// Heap allocations of a runner's step after warm-up: none. The step's
// buffers (activations, routing, the MoE's work lists, the attention's plan
// and scratch, the logits, the sampled tokens, the sampling scratch, the
// memory objects of oneDNN's products) live in the model, the runner, the
// prepared products and the sampling thread and are reused; a step whose
// shapes were seen before allocates nothing, prefill and decode alike. Every
// product runs on our kernels except, under the AMX family, bf16 products of
// many rows the tile kernel does not take: those run on oneDNN, whose execute
// allocates on every call (its argument map and execution context; its API
// has no way around that), so those are counted apart
// (CpuGemm::InOneDnnExecute). With oneDNN turned off (MLARUN_ONEDNN=off,
// ctest's .no_onednn variant) nothing at all. Counted with a replaced global
// operator new (every thread: the OpenMP workers too), so this test is its
// own binary.
#include <gtest/gtest.h>

// The replacement operators below pair malloc with free throughout; GCC's
// check cannot see that they replace the library's.
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"

#include <atomic>
#include <cstdlib>
#include <new>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "base/cpu_isa.h"
#include "gemm/cpu_gemm.h"
#include "kv/latent_cache.h"
#include "runtime/model/model.h"
#include "runtime/ops/sampler.h"
#include "runtime/runner/model_runner.h"

namespace {
std::atomic<bool> g_counting{false};
std::atomic<int64_t> g_allocations{0};
std::atomic<int64_t> g_onednn_allocations{0};  // inside oneDNN's execute

void Count() {
  if (!g_counting.load(std::memory_order_relaxed)) return;
  (mlarun::CpuGemm::InOneDnnExecute() ? g_onednn_allocations : g_allocations).fetch_add(1, std::memory_order_relaxed);
}
}  // namespace

void* operator new(std::size_t n) {
  Count();
  if (void* p = std::malloc(n == 0 ? 1 : n)) return p;
  throw std::bad_alloc();
}
void* operator new[](std::size_t n) { return operator new(n); }
void* operator new(std::size_t n, std::align_val_t a) {
  Count();
  const size_t align = static_cast<size_t>(a);
  if (void* p = std::aligned_alloc(align, (n + align - 1) / align * align)) return p;
  throw std::bad_alloc();
}
void* operator new[](std::size_t n, std::align_val_t a) { return operator new(n, a); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }

namespace mlarun {
namespace {

const std::string kTiny = std::string(MLARUN_CONFIGS_DIR) + "/models/tiny.yaml";

// Allocations made while `f` runs, outside oneDNN's execute; those inside it
// are added to *onednn when given.
template <typename F>
int64_t Allocations(F&& f, int64_t* onednn = nullptr) {
  g_allocations = 0;
  g_onednn_allocations = 0;
  g_counting = true;
  f();
  g_counting = false;
  if (onednn) *onednn += g_onednn_allocations.load();
  return g_allocations.load();
}

// One pass: three sequences (ids first..first+2) with prompts of different
// lengths in one prefill step, then `steps` decode steps of all three, each
// feeding back its sampled token (greedy, top-k and top-p with temperature,
// so the samplers' scratch is in play). Returns each step's allocations in
// ModelRunner::Execute (the prefill's first), outside oneDNN's execute (those
// inside are added to *onednn); the plan is made and the block manager kept
// outside the counted call, as a scheduler would.
std::vector<int64_t> Pass(ModelRunner& runner, LatentCache& blocks, SeqId first, int steps, int64_t* onednn) {
  std::mt19937 rng(5);
  std::vector<std::vector<int32_t>> prompts(3);
  std::vector<std::unique_ptr<Sampler>> samplers;
  for (const SamplingParams& sp :
       {SamplingParams{.temperature = 0}, SamplingParams{.temperature = 0.8, .top_k = 20, .seed = 3},
        SamplingParams{.temperature = 1.2, .top_p = 0.9, .seed = 4}})
    samplers.push_back(std::make_unique<Sampler>(sp));
  std::vector<int64_t> counts;
  for (size_t i = 0; i < prompts.size(); ++i) {
    for (size_t j = 0; j < 9 + 7 * i; ++j) prompts[i].push_back(static_cast<int32_t>(2 + rng() % 500));
    EXPECT_TRUE(blocks.AddSequence(first + static_cast<SeqId>(i)).ok());
  }
  std::vector<int32_t> next(prompts.size(), 3);
  for (int s = 0; s <= steps; ++s) {
    StepPlan plan;
    for (size_t i = 0; i < prompts.size(); ++i) {
      const SeqId id = first + static_cast<SeqId>(i);
      const std::vector<int32_t> tokens = s == 0 ? prompts[i] : std::vector<int32_t>{next[i]};
      const int64_t start = blocks.NumTokens(id);
      EXPECT_TRUE(blocks.Append(id, tokens).ok());
      const auto table = blocks.BlockTable(id);
      plan.seqs.push_back({.id = id,
                           .start_pos = start,
                           .tokens = tokens,
                           .block_table = std::vector<int32_t>(table.begin(), table.end()),
                           .sampler = samplers[i].get()});
    }
    StatusOr<std::span<const SampledToken>> result = InternalError("the step did not run");
    counts.push_back(Allocations([&] { result = runner.Execute(plan); }, onednn));
    EXPECT_TRUE(result.ok()) << result.status();
    if (!result.ok()) return counts;
    EXPECT_EQ(result->size(), prompts.size());
    for (size_t i = 0; i < prompts.size() && i < result->size(); ++i)
      next[i] = static_cast<int32_t>((*result)[i].token);
  }
  for (size_t i = 0; i < prompts.size(); ++i) EXPECT_TRUE(blocks.Release(first + static_cast<SeqId>(i)).ok());
  return counts;
}

// The second pass repeats the first one's shapes step by step (prompt
// lengths, contexts, blocks): none of its steps may allocate, the prefill
// (48 rows: the products of many rows, the attention's prefill form) and
// the decode steps alike. The first pass does allocate (buffers grow to each
// new size), so the count is not trivially zero.
TEST(StepAllocations, StepsOfShapesSeenBeforeAllocateNothing) {
  for (const auto& [weights, kv] : {std::pair{DType::kF32, DType::kF32}, std::pair{DType::kF32, DType::kBF16},
                                    std::pair{DType::kBF16, DType::kBF16}}) {
    uint64_t seed = 0;
    auto config = Model::LoadConfig(kTiny, ModelOverrides{.kv_dtype = kv}, &seed);
    ASSERT_TRUE(config.ok()) << config.status();
    config->weight_dtype = weights;  // bf16 weights take the kernels that widen them (and their scratch)
    auto m = Model::Random(*config, seed);
    ASSERT_TRUE(m.ok()) << m.status();
    const LatentCacheConfig cc = (*m)->CacheConfig(16 << 20, 16);
    auto blocks = std::move(LatentCache::Create(cc)).value();
    auto runner = std::move(ModelRunner::Create(**m, cc)).value();
    int64_t onednn_first = 0, onednn_again = 0;
    const std::vector<int64_t> first = Pass(*runner, *blocks, 0, 20, &onednn_first);
    ASSERT_EQ(first.size(), 21u);
    EXPECT_GT(first[0], 0) << "the first prefill grows the buffers; a count of 0 means nothing was counted";
    const std::vector<int64_t> again = Pass(*runner, *blocks, 10, 20, &onednn_again);
    ASSERT_EQ(again.size(), 21u);
    for (size_t s = 0; s < again.size(); ++s)
      EXPECT_EQ(again[s], 0) << (s == 0 ? "the prefill step" : "decode step " + std::to_string(s))
                             << " of the second pass, weights " << DTypeName(weights) << ", cache " << DTypeName(kv)
                             << " (first pass: " << first[s]
                             << "; inside oneDNN's execute, not counted: " << onednn_again << ")";
    // Without oneDNN products the step allocates nothing at all: every
    // family runs f32 products and (below AMX) bf16 ones on our kernels, and
    // so does every family under MLARUN_ONEDNN=off. Under AMX, oneDNN's AMX
    // product keeps the bf16 products of many rows the tiles do not take
    // (the bf16 weights', and with a bf16 cache the attention's): its
    // execute's allocations are counted apart above, not asserted.
    const bool no_bf16 = weights == DType::kF32 && kv == DType::kF32;
    const bool ours_only = !OneDnnEnabled() || no_bf16 || ActiveCpuIsa() != CpuIsa::kAmx;
    if (ours_only) {
      EXPECT_EQ(onednn_again, 0) << "weights " << DTypeName(weights) << ", cache " << DTypeName(kv);
    }
  }
}

// A request's sampler holds only its random stream; the working memory of
// sampling (weights per token id, candidates) belongs to the thread. So a new
// request's first token, on a thread that has sampled rows of that size,
// allocates nothing: the cost the prefill step of every new request would
// otherwise pay (about 2 MB per request at a 129k vocabulary).
TEST(StepAllocations, ANewRequestsFirstSampleAllocatesNothing) {
  const int64_t vocab = 129280;  // larger than any row the other tests sample
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.f, 3.f);
  std::vector<float> logits(static_cast<size_t>(vocab));
  for (float& x : logits) x = normal(rng);
  const SamplingParams params[] = {SamplingParams{.temperature = 0},
                                   SamplingParams{.temperature = 0.8, .top_k = 50, .seed = 1},
                                   SamplingParams{.temperature = 1.1, .top_p = 0.9, .seed = 2},
                                   SamplingParams{.temperature = 0.7, .top_k = 4000, .top_p = 0.95, .seed = 3},
                                   SamplingParams{.temperature = 1.0, .seed = 4}};
  int64_t warm = 0;
  for (const SamplingParams& p : params) {
    Sampler s(p);
    warm += Allocations([&] { s.Sample(logits); });
  }
  EXPECT_GT(warm, 0) << "the thread's first rows of this size grow its scratch; 0 means nothing was counted";
  for (const SamplingParams& p : params) {
    std::optional<Sampler> fresh;
    fresh.emplace(p);                                   // constructed outside the count: the request's own state
    logits[static_cast<size_t>(rng() % vocab)] += 5.f;  // a different row, same size
    SampledToken t;
    EXPECT_EQ(Allocations([&] { t = fresh->Sample(logits); }), 0)
        << "temperature " << p.temperature << ", top_k " << p.top_k << ", top_p " << p.top_p;
    EXPECT_GE(t.token, 0);
    EXPECT_LT(t.token, vocab);
  }
}

}  // namespace
}  // namespace mlarun
