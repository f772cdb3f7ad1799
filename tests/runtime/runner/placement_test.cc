// Where the runner's memory lives. A model and runner on a DeviceMemory the
// host may not address (here host allocations behind host_accessible() =
// false, counting what crosses) must compute exactly what the host's do:
// its weights are copied in at load and their host copies released, its
// cache pool and step buffers come from that memory, the step's batch arrays
// are copied in, the routed expert ids copied out; and after warm-up a
// decode step allocates nothing there and copies only the batch arrays in.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <random>

#include "base/device_memory.h"
#include "runtime/engine/engine.h"
#include "runtime/runner/model_runner.h"
#include "tests/test_paths.h"

namespace mlarun {
namespace {

class OpaqueMemory final : public DeviceMemory {
 public:
  Backend backend() const override { return Backend::kCpu; }
  bool host_accessible() const override { return false; }
  void* Allocate(size_t bytes) override {
    ++allocations;
    allocated_bytes += bytes;
    const size_t rounded = (bytes + 63) / 64 * 64;
    void* p = std::aligned_alloc(64, rounded == 0 ? 64 : rounded);
    // What a device's fresh memory holds is not zero: poison it, so a buffer
    // read before it is written shows.
    if (p != nullptr) std::memset(p, 0xff, rounded);
    return p;
  }
  void Free(void* p) override { std::free(p); }
  Status CopyIn(void* dst, const void* src, size_t bytes) override {
    copied_in += bytes;
    std::memcpy(dst, src, bytes);
    return Status::Ok();
  }
  Status CopyOut(void* dst, const void* src, size_t bytes) override {
    copied_out += bytes;
    std::memcpy(dst, src, bytes);
    return Status::Ok();
  }
  Status Zero(void* dst, size_t bytes) override {
    std::memset(dst, 0, bytes);
    return Status::Ok();
  }
  int64_t allocations = 0;
  size_t allocated_bytes = 0, copied_in = 0, copied_out = 0;
};

std::unique_ptr<Model> Tiny(DeviceMemory* memory) {
  ModelOptions o;
  o.memory = memory;
  auto m = Model::Load(TinyYaml(), ModelOverrides{.kv_dtype = DType::kBF16}, o);
  EXPECT_TRUE(m.ok()) << m.status();
  return m.ok() ? std::move(m).value() : nullptr;
}

TEST(Placement, ARunnerOnMemoryTheHostCannotAddressComputesTheSame) {
  OpaqueMemory device;
  auto host_model = Tiny(nullptr);
  auto device_model = Tiny(&device);
  ASSERT_TRUE(host_model && device_model);
  EXPECT_EQ(&host_model->memory(), &HostMemory());
  EXPECT_EQ(&device_model->memory(), &device);
  const WeightBytes w = device_model->weight_bytes();
  const int64_t weights = w.attention + w.moe + w.dense_mlp + w.embedding_and_head;
  // Loading allocates exactly the weights there (and RoPE's frequencies):
  // a weight left on the host would be missing from the sum.
  const int64_t rope_bytes = device_model->config().qk_rope_head_dim / 2 * static_cast<int64_t>(sizeof(float));
  EXPECT_EQ(static_cast<int64_t>(device.allocated_bytes), weights + rope_bytes) << "every weight is placed";
  EXPECT_GE(static_cast<int64_t>(device.copied_in), weights);

  const EngineConfig ec{
      .max_num_batched_tokens = 64, .max_num_seqs = 4, .cache_budget_bytes = 4 << 20, .block_size = 16};
  const LatentCacheConfig pool = std::move(Engine::CacheConfig(host_model->config(), ec)).value();
  const size_t before_pool = device.allocated_bytes;
  auto on_host = std::move(ModelRunner::Create(*host_model, pool)).value();
  auto on_device = std::move(ModelRunner::Create(*device_model, pool)).value();
  EXPECT_GE(static_cast<int64_t>(device.allocated_bytes - before_pool), on_device->pool().bytes())
      << "the cache pool is in the runner's memory";

  // Greedy requests: both runners execute the same plans, and the samplers
  // (the leader's, in the plan) are deterministic.
  auto scheduler = std::move(Engine::CreateScheduler(host_model->config(), ec)).value();
  std::mt19937 rng(7);
  for (int i = 0; i < 4; ++i) {
    std::vector<int32_t> prompt(static_cast<size_t>(9 + 7 * i));
    for (auto& t : prompt) t = static_cast<int32_t>(1 + rng() % 500);
    ASSERT_TRUE(
        scheduler
            ->Add(GenerationRequest{prompt, SamplingParams{.temperature = 0.0, .max_tokens = 12, .ignore_eos = true}})
            .ok());
  }
  int steps = 0, decode_steps = 0;
  int64_t warm_allocations = -1;
  size_t warm_in = 0, warm_out = 0;
  int64_t checked_tokens = 0;
  while (scheduler->HasWork()) {
    ASSERT_LT(++steps, 100);
    auto plan = scheduler->Schedule();
    ASSERT_TRUE(plan.ok()) << plan.status();
    bool decode = !plan->seqs.empty();
    int64_t tokens = 0;
    for (const StepPlan::Seq& s : plan->seqs) {
      decode = decode && s.tokens.size() == 1;
      tokens += static_cast<int64_t>(s.tokens.size());
    }
    if (decode && ++decode_steps == 3) {  // warmed up: two decode steps of this shape ran
      warm_allocations = device.allocations;
      warm_in = device.copied_in;
      warm_out = device.copied_out;
    }
    const size_t in0 = device.copied_in;
    auto a = on_host->Execute(*plan);
    auto b = on_device->Execute(*plan);
    ASSERT_TRUE(a.ok()) << a.status();
    ASSERT_TRUE(b.ok()) << b.status();
    ASSERT_EQ(a->size(), b->size());
    for (size_t i = 0; i < a->size(); ++i) {
      EXPECT_EQ((*a)[i].token, (*b)[i].token) << "step " << steps << " row " << i;
      EXPECT_EQ((*a)[i].logprob, (*b)[i].logprob) << "step " << steps << " row " << i;
      ++checked_tokens;
    }
    if (decode) {
      // Per token its id, position and cache slot, per sampled row its id:
      // 20 bytes; nothing else goes in.
      EXPECT_LE(device.copied_in - in0, static_cast<size_t>(20 * tokens)) << "step " << steps;
    }
    ASSERT_TRUE(scheduler->Finish(*plan, *a).ok());
  }
  EXPECT_EQ(checked_tokens, 4 * 12);
  ASSERT_GE(decode_steps, 6);
  EXPECT_EQ(device.allocations, warm_allocations) << "decode steps after warm-up allocate nothing on the device";
  EXPECT_GT(device.copied_in, warm_in);
  // The routed ids of every MoE layer come out (3 of the tiny model's 4 layers).
  EXPECT_GT(device.copied_out, warm_out);
}

// A memory of `backend` that has nothing to give.
class EmptyMemory final : public DeviceMemory {
 public:
  explicit EmptyMemory(Backend b) : backend_(b) {}
  Backend backend() const override { return backend_; }
  bool host_accessible() const override { return false; }
  void* Allocate(size_t) override { return nullptr; }
  void Free(void*) override {}
  Status CopyIn(void*, const void*, size_t) override { return Status::Ok(); }
  Status CopyOut(void*, const void*, size_t) override { return Status::Ok(); }
  Status Zero(void*, size_t) override { return Status::Ok(); }

 private:
  const Backend backend_;
};

TEST(Placement, TheModelsMemoryMustBeItsBackends) {
  EmptyMemory cuda_like(Backend::kCuda);
  ModelOptions o;
  o.memory = &cuda_like;  // the ops stay on the CPU
  auto m = Model::Load(TinyYaml(), {}, o);
  EXPECT_EQ(m.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(m.status().message().find("its memory is cuda's but its ops run on cpu"), std::string::npos) << m.status();
}

TEST(Placement, AnAllocationThatFailsNamesWhatItWasFor) {
  EmptyMemory full(Backend::kCpu);
  ModelOptions o;
  o.memory = &full;
  auto m = Model::Load(TinyYaml(), {}, o);
  EXPECT_EQ(m.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(m.status().message().find("the embedding"), std::string::npos) << m.status();
  auto pool = LatentPool::Create(LatentCacheConfig{.num_layers = 2, .budget_bytes = 1 << 20}, full);
  EXPECT_EQ(pool.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(pool.status().message().find("the latent cache"), std::string::npos) << pool.status();
  // A CUDA build without a GPU, or a build without CUDA, says so.
  auto cuda = MemoryFor(Backend::kCuda);
  if (cuda.ok()) {
    EXPECT_EQ((*cuda)->backend(), Backend::kCuda);
    EXPECT_FALSE((*cuda)->host_accessible());
  } else {
    EXPECT_NE(cuda.status().message().find("CUDA memory"), std::string::npos) << cuda.status();
  }
}

}  // namespace
}  // namespace mlarun
