// Heap allocations of a model step after warm-up: none. The step's buffers
// (activations, routing, the MoE's work lists, the attention's plan and
// scratch, the logits) live in the model and are reused; a step whose shapes
// were seen before allocates nothing. Counted with a replaced global
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
#include <utility>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "kv/latent_cache.h"
#include "runtime/model/model.h"

namespace {
std::atomic<bool> g_counting{false};
std::atomic<int64_t> g_allocations{0};
}  // namespace

void* operator new(std::size_t n) {
  if (g_counting.load(std::memory_order_relaxed)) g_allocations.fetch_add(1, std::memory_order_relaxed);
  if (void* p = std::malloc(n == 0 ? 1 : n)) return p;
  throw std::bad_alloc();
}
void* operator new[](std::size_t n) { return operator new(n); }
void* operator new(std::size_t n, std::align_val_t a) {
  if (g_counting.load(std::memory_order_relaxed)) g_allocations.fetch_add(1, std::memory_order_relaxed);
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

// Allocations made while `f` runs.
template <typename F>
int64_t Allocations(F&& f) {
  g_allocations = 0;
  g_counting = true;
  f();
  g_counting = false;
  return g_allocations.load();
}

// One pass: three sequences (ids first..first+2) with prompts of different
// lengths in one prefill step, then `steps` decode steps of all three, each
// feeding back its argmax. Returns each step's allocations (the prefill's
// first); the cache's own bookkeeping is outside the counted calls.
std::vector<int64_t> Pass(Model& model, LatentCache& cache, SeqId first, int steps) {
  std::mt19937 rng(5);
  std::vector<std::vector<int32_t>> prompts(3);
  std::vector<int64_t> counts;
  for (size_t i = 0; i < prompts.size(); ++i) {
    for (size_t j = 0; j < 9 + 7 * i; ++j) prompts[i].push_back(static_cast<int32_t>(2 + rng() % 500));
    EXPECT_TRUE(cache.AddSequence(first + static_cast<SeqId>(i)).ok());
    EXPECT_TRUE(cache.Append(first + static_cast<SeqId>(i), prompts[i]).ok());
  }
  std::vector<ForwardSeq> batch;
  for (size_t i = 0; i < prompts.size(); ++i)
    batch.push_back({.id = first + static_cast<SeqId>(i), .tokens = prompts[i], .start_pos = 0});
  std::vector<int32_t> next(prompts.size(), 3);
  const int64_t vocab = model.config().vocab_size;
  for (int s = 0; s <= steps; ++s) {
    if (s > 0) {  // a decode step
      batch.clear();
      for (size_t i = 0; i < prompts.size(); ++i) {
        const SeqId id = first + static_cast<SeqId>(i);
        EXPECT_TRUE(cache.Append(id, std::span<const int32_t>(&next[i], 1)).ok());
        batch.push_back({.id = id, .tokens = std::span<const int32_t>(&next[i], 1),
                         .start_pos = static_cast<int64_t>(prompts[i].size()) + s - 1});
      }
    }
    std::optional<StatusOr<std::span<const float>>> result;
    counts.push_back(Allocations([&] { result.emplace(model.ForwardInto(batch, cache)); }));
    EXPECT_TRUE(result->ok()) << result->status();
    if (!result->ok()) return counts;
    const std::span<const float> logits = **result;
    EXPECT_EQ(logits.size(), prompts.size() * static_cast<size_t>(vocab));
    for (size_t i = 0; i < prompts.size(); ++i) {
      const float* row = logits.data() + i * static_cast<size_t>(vocab);
      next[i] = static_cast<int32_t>(std::max_element(row, row + vocab) - row);
    }
  }
  return counts;
}

// The second pass repeats the first one's shapes step by step (prompt
// lengths, contexts, blocks): none of its decode steps may allocate. The
// first pass does allocate (buffers grow to each new size), so the count is
// not trivially zero. Prefill steps are not held to it yet: their products of
// many rows go through oneDNN, whose execute() takes a hash map of memory
// objects made per call, and the packed kernels size their scratch per call.
TEST(StepAllocations, StepsOfShapesSeenBeforeAllocateNothing) {
  for (const auto [weights, kv] : {std::pair{DType::kF32, DType::kF32}, std::pair{DType::kF32, DType::kBF16},
                                   std::pair{DType::kBF16, DType::kBF16}}) {
    uint64_t seed = 0;
    auto config = Model::LoadConfig(kTiny, ModelOverrides{.kv_dtype = kv}, &seed);
    ASSERT_TRUE(config.ok()) << config.status();
    config->weight_dtype = weights;  // bf16 weights take the kernels that widen them (and their scratch)
    auto m = Model::Random(*config, seed);
    ASSERT_TRUE(m.ok()) << m.status();
    auto cache = std::move(LatentCache::Create((*m)->CacheConfig(16 << 20, 16))).value();
    const std::vector<int64_t> first = Pass(**m, *cache, 0, 20);
    ASSERT_EQ(first.size(), 21u);
    EXPECT_GT(first[0], 0) << "the first prefill grows the buffers; a count of 0 means nothing was counted";
    const std::vector<int64_t> again = Pass(**m, *cache, 10, 20);
    ASSERT_EQ(again.size(), 21u);
    for (size_t s = 1; s < again.size(); ++s)
      EXPECT_EQ(again[s], 0) << "decode step " << s << " of the second pass, weights " << DTypeName(weights)
                             << ", cache " << DTypeName(kv)
                             << " (first pass: " << first[s] << ")";
  }
}

}  // namespace
}  // namespace mlarun
