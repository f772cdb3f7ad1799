// A DeepSeek-V3 checkpoint whose projections are stored as the release stores
// them (F8_E4M3 + `_scale_inv` 128 x 128 block scales): tests/fixtures/models/
// v3_fp8, written by tests/runtime/model/make_fp8_fixture.py from v3_bf16. Loaded
// with Fp8Weights::kKeep the projections stay e4m3 in place and the model's
// logits and greedy tokens equal those of the same checkpoint dequantized to
// f32 at load.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>

#include "base/float8.h"
#include "bench/local_cache.h"
#include "gemm/cpu/kernels.h"
#include "runtime/engine/engine.h"
#include "runtime/model/model.h"
#include "runtime/model/weight_fit.h"

namespace mlarun {
namespace {

namespace fs = std::filesystem;

const std::string kDir = std::string(MLARUN_FIXTURES_DIR) + "/models/v3_fp8";

// The bytes the projections keep: e4m3 elements and their fp32 block scales
// (kv_b_proj excepted: it becomes W_UK / W_UV in the cache dtype).
struct Fp8Bytes {
  int64_t data = 0, scales = 0, tensors = 0;
};
Fp8Bytes ProjectionFp8Bytes() {
  Fp8Bytes b;
  auto ckpt = Checkpoint::Open(kDir);
  EXPECT_TRUE(ckpt.ok()) << ckpt.status();
  if (!ckpt.ok()) return b;
  for (const std::string& name : (*ckpt)->Names()) {
    const TensorRef* t = (*ckpt)->Find(name);
    if (t->dtype != SafetensorsDType::kF8E4M3 || name.find("kv_b_proj") != std::string::npos) continue;
    b.data += t->numel();
    b.scales += Fp8Blocks(t->shape[0]) * Fp8Blocks(t->shape[1]) * 4;
    ++b.tensors;
  }
  return b;
}

std::unique_ptr<Model> LoadWith(const ModelConfig& config, Fp8Weights fp8,
                                WeightLoading loading = WeightLoading::kMapped) {
  auto ckpt = Checkpoint::Open(kDir);
  EXPECT_TRUE(ckpt.ok()) << ckpt.status();
  if (!ckpt.ok()) return nullptr;
  ModelOptions o;
  o.fp8_weights = fp8;
  o.weights = loading;
  auto m = Model::FromCheckpoint(config, std::shared_ptr<const Checkpoint>(std::move(ckpt).value()), o);
  EXPECT_TRUE(m.ok()) << m.status();
  return m.ok() ? std::move(m).value() : nullptr;
}

ModelConfig Config(DType weight_dtype) {
  auto c = Model::LoadConfig(kDir, ModelOverrides{.kv_dtype = DType::kF32, .num_layers = std::nullopt});
  EXPECT_TRUE(c.ok()) << c.status();
  ModelConfig config = c.ok() ? *c : ModelConfig{};
  config.weight_dtype = weight_dtype;
  return config;
}

TEST(Fp8Checkpoint, ProjectionsStayFp8InPlace) {
  const ModelConfig config = Config(DType::kBF16);  // as the checkpoint says: embeddings bf16, in place
  const Fp8Bytes fp8 = ProjectionFp8Bytes();
  EXPECT_EQ(fp8.tensors, 69);  // 7 in the dense layer, 4 + 3 x (8 experts + shared) in each of 2 MoE layers
  auto keep = LoadWith(config, Fp8Weights::kKeep);
  auto deq = LoadWith(config, Fp8Weights::kDequantize);
  auto copied = LoadWith(config, Fp8Weights::kKeep, WeightLoading::kCopied);
  ASSERT_TRUE(keep && deq && copied);
  // What `mlarun memory --weight-dtype fp8` predicts is what the model holds.
  EXPECT_EQ(keep->weight_bytes(), PredictWeightBytes(config, {}, DType::kF8E4M3)) << "kept fp8";
  EXPECT_EQ(copied->weight_bytes(), PredictWeightBytes(config, {}, DType::kF8E4M3)) << "kept fp8, copied";
  EXPECT_EQ(deq->weight_bytes(), PredictWeightBytes(config)) << "dequantized";
  // fp8 keeps one byte per element plus the scales where bf16 takes two.
  EXPECT_EQ(deq->weight_bytes().total() - keep->weight_bytes().total(), 2 * fp8.data - (fp8.data + fp8.scales));
  // Dequantized, the projections are copies; kept, their e4m3 bytes are the
  // mapped file's (the embeddings are in place either way). The scales are
  // copies in both cases (whether weight_bytes_in_place counts them with
  // their weight is the model's choice), so the difference lies between.
  const int64_t more_in_place = keep->weight_bytes_in_place() - deq->weight_bytes_in_place();
  EXPECT_GE(more_in_place, fp8.data);
  EXPECT_LE(more_in_place, fp8.data + fp8.scales);
  EXPECT_EQ(copied->weight_bytes_in_place(), 0);  // kCopied: every weight is a copy
}

// The check before loading sizes an fp8 checkpoint's projections as loading
// holds them (kept fp8), not dequantized to weight_dtype: a machine between
// the two sizes loads it kept and refuses it dequantized. (At DeepSeek-V3's
// widths the dequantized f32 size of two layers, 46 GiB, was refused on a
// 24 GiB host that holds them kept in 13.)
TEST(Fp8Checkpoint, FitCheckSizesKeptProjections) {
  const ModelConfig config = Config(DType::kF32);
  auto ckpt = Checkpoint::Open(kDir);
  auto bf16 = Checkpoint::Open(std::string(MLARUN_FIXTURES_DIR) + "/models/v3_bf16");
  ASSERT_TRUE(ckpt.ok() && bf16.ok());
  EXPECT_EQ(KeptProjectionDType(**ckpt, Fp8Weights::kKeep), DType::kF8E4M3);
  EXPECT_EQ(KeptProjectionDType(**ckpt, Fp8Weights::kDequantize), std::nullopt);
  EXPECT_EQ(KeptProjectionDType(**bf16, Fp8Weights::kKeep), std::nullopt);
  const int64_t kept = PredictWeightBytes(config, {}, DType::kF8E4M3).total();
  const int64_t dequantized = PredictWeightBytes(config).total();
  ASSERT_LT(kept, dequantized);
  const int64_t machine = (kept + dequantized) / 2;
  auto held = [&](Fp8Weights fp8) { return WeightFormat{.projection_dtype = KeptProjectionDType(**ckpt, fp8)}; };
  EXPECT_TRUE(CheckWeightsFit(config, {}, held(Fp8Weights::kKeep), 0, machine).ok());
  const Status refused = CheckWeightsFit(config, {}, held(Fp8Weights::kDequantize), 0, machine);
  EXPECT_EQ(refused.code(), StatusCode::kResourceExhausted) << refused;
  EXPECT_NE(refused.message().find("more than this machine's memory and swap (" + std::to_string(machine)),
            std::string::npos)
      << refused;
  // Bytes the mapped files back count as available.
  EXPECT_TRUE(CheckWeightsFit(config, {}, WeightFormat{}, dequantized - machine, machine).ok());
  EXPECT_FALSE(CheckWeightsFit(config, {}, WeightFormat{}, dequantized - machine - 1, machine).ok());
  // And the loader itself, on this machine: kept, the model holds the kept size.
  auto keep = LoadWith(config, Fp8Weights::kKeep);
  ASSERT_TRUE(keep);
  EXPECT_EQ(keep->weight_bytes().total(), kept);
}

// The logits of full forwards over a few prompts.
std::vector<std::vector<float>> Logits(Model& m, const std::vector<std::vector<int32_t>>& prompts) {
  std::vector<std::vector<float>> out;
  for (const auto& p : prompts) {
    auto cache = std::move(LocalLatentCache::Create(m.CacheConfig(64 << 20, 16))).value();
    const ForwardSeq s = cache.Append(0, p, ForwardSeq::Logits::kAll).value();
    auto logits = m.Forward(std::span<const ForwardSeq>(&s, 1), *cache.pool);
    EXPECT_TRUE(logits.ok()) << logits.status();
    out.push_back(logits.ok() ? *logits : std::vector<float>{});
  }
  return out;
}

std::vector<std::vector<int32_t>> Prompts() {
  std::mt19937 rng(5);
  std::uniform_int_distribution<int32_t> tok(2, 255);
  std::vector<std::vector<int32_t>> prompts;
  for (int len : {1, 7, 19, 40}) {  // 40: the products of more rows than the streaming kernels take
    std::vector<int32_t> p(static_cast<size_t>(len));
    for (int32_t& t : p) t = tok(rng);
    prompts.push_back(p);
  }
  return prompts;
}

// The largest difference between two sets of logits, relative to the
// largest of `b`, per prompt; each prompt's checked against its bound.
void ExpectLogitsNear(const std::vector<std::vector<float>>& a, const std::vector<std::vector<float>>& b,
                      const std::vector<double>& bounds, const std::string& property) {
  ASSERT_EQ(a.size(), b.size());
  ASSERT_EQ(a.size(), bounds.size());
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_EQ(a[i].size(), b[i].size());
    ASSERT_FALSE(a[i].empty());
    double diff = 0, scale = 0;
    for (size_t k = 0; k < a[i].size(); ++k) {
      diff = std::max(diff, std::abs(double(a[i][k]) - b[i][k]));
      scale = std::max(scale, std::abs(double(b[i][k])));
    }
    EXPECT_LE(diff, bounds[i] * scale) << "prompt " << i << ": max |diff| " << diff << ", scale " << scale;
    ::testing::Test::RecordProperty(property + std::to_string(i), std::to_string(diff / scale));
  }
}

// The fp8 products on fp32 panels, not on the AVX512-BF16 dot products
// (which round the activations to bf16 first), for a scope.
struct Fp32Panels {
  bool was = cpu::SetBf16DotAllowed(false);
  ~Fp32Panels() { cpu::SetBf16DotAllowed(was); }
};

// Kept fp8 and dequantized to f32 at load, every product multiplies the same
// fp32 weights (each the fp32 rounding of e4m3 x scale) with the same fp32
// activations and sums in fp32 (the packed fp8 products on fp32 panels);
// only the order of the sums differs (our fp8 kernels against the f32 ones
// or oneDNN). Through three layers that leaves differences of a few fp32
// ulps of the largest terms: measured ~1e-6 of the logits' scale, bound 1e-4
// (the f32 fixtures' bound against transformers).
TEST(Fp8Checkpoint, LogitsAndGreedyTokensMatchDequantizedF32) {
  const Fp32Panels fp32_panels;
  const ModelConfig config = Config(DType::kF32);
  auto keep = LoadWith(config, Fp8Weights::kKeep);
  auto deq = LoadWith(config, Fp8Weights::kDequantize);
  ASSERT_TRUE(keep && deq);
  EXPECT_LT(keep->weight_bytes().total(), deq->weight_bytes().total());
  const auto prompts = Prompts();
  const auto a = Logits(*keep, prompts), b = Logits(*deq, prompts);
  ExpectLogitsNear(a, b, {1e-4, 1e-4, 1e-4, 1e-4}, "rel_diff_prompt_");
  // Greedy decoding: the same tokens.
  std::vector<std::vector<int32_t>> tokens[2];
  for (int which = 0; which < 2; ++which) {
    auto engine =
        std::move(Engine::Create(which ? *deq : *keep, EngineConfig{.cache_budget_bytes = 64 << 20, .block_size = 16}))
            .value();
    std::vector<GenerationRequest> reqs;
    for (const auto& p : prompts)
      reqs.push_back(GenerationRequest{
          .prompt = p, .sampling = SamplingParams{.max_tokens = 8, .stop_token_ids = {}, .ignore_eos = true}});
    for (const auto& o : engine->Generate(reqs)) {
      ASSERT_TRUE(o.ok()) << o.status();
      tokens[which].push_back(std::vector<int32_t>(o->tokens.begin(), o->tokens.end()));
    }
  }
  EXPECT_EQ(tokens[0], tokens[1]);
}

// With the AVX512-BF16 dot products, the fp8 products of more rows than the
// streaming kernels take (the prompts of 19 and 40 tokens) round their
// activations to bf16 first, as the products of bf16 weights do: their
// logits move by what that rounding leaves through three layers (measured
// 5.2e-3 and 6.2e-3 of the logits' scale; bound 2e-2); the shorter prompts
// keep the streaming kernels' fp32 activations (bound 1e-4).
TEST(Fp8Checkpoint, Bf16DotProductsStayNearDequantizedF32) {
  if (!cpu::UseBf16Dot(cpu::Kernels())) GTEST_SKIP() << "no AVX512-BF16 dot products under this kernel family";
  const ModelConfig config = Config(DType::kF32);
  auto keep = LoadWith(config, Fp8Weights::kKeep);
  auto deq = LoadWith(config, Fp8Weights::kDequantize);
  ASSERT_TRUE(keep && deq);
  const auto prompts = Prompts();
  ExpectLogitsNear(Logits(*keep, prompts), Logits(*deq, prompts), {1e-4, 1e-4, 2e-2, 2e-2}, "bf16_dot_rel_diff_");
}

// Shards: slices that start on a 128 boundary stay fp8, the others are
// dequantized (here every rank but the first: the fixture is narrower than a
// block), each with a log line; the prediction per rank says the same.
TEST(Fp8Checkpoint, ShardsKeepAlignedSlicesOnly) {
  const ModelConfig config = Config(DType::kBF16);
  for (MoeSharding moe : {MoeSharding::kByExpert, MoeSharding::kByIntermediate})
    for (int rank = 0; rank < 2; ++rank) {
      const ModelShard shard{.attn_tp_size = 2, .attn_tp_rank = rank, .mlp_size = 2, .mlp_rank = rank, .moe = moe};
      auto ckpt = Checkpoint::Open(kDir);
      ASSERT_TRUE(ckpt.ok()) << ckpt.status();
      std::vector<std::string> lines;
      ModelOptions o;
      o.shard = shard;
      o.progress = [&lines](const std::string& l) { lines.push_back(l); };
      auto m = Model::FromCheckpoint(config, std::shared_ptr<const Checkpoint>(std::move(ckpt).value()), o);
      ASSERT_TRUE(m.ok()) << m.status();
      const std::string what = std::string(moe == MoeSharding::kByExpert ? "by expert" : "by intermediate") + " rank " +
                               std::to_string(rank);
      EXPECT_EQ((*m)->weight_bytes(), PredictWeightBytes(config, shard, DType::kF8E4M3)) << what;
      const int64_t fallbacks = std::count_if(lines.begin(), lines.end(), [](const std::string& l) {
        return l.find("does not start on a 128 boundary; dequantized to bf16") != std::string::npos;
      });
      if (rank == 0) {
        EXPECT_EQ(fallbacks, 0) << what;
      } else {
        // q_b and o_proj in 3 layers, the dense MLP (3), the shared experts
        // (3 in 2 layers), and by intermediate the routed experts (3 x 8 x 2).
        EXPECT_EQ(fallbacks, 6 + 3 + 6 + (moe == MoeSharding::kByIntermediate ? 48 : 0)) << what;
      }
    }
}

// A NaN code in an e4m3 weight is refused at load, naming the element.
TEST(Fp8Checkpoint, NanCodeIsRefused) {
  const fs::path dir = fs::temp_directory_path() / ("mlarun_fp8_nan_" + std::to_string(getpid()));
  fs::create_directories(dir);
  fs::copy_file(fs::path(kDir) / "config.json", dir / "config.json", fs::copy_options::overwrite_existing);
  fs::copy_file(fs::path(kDir) / "model.safetensors", dir / "model.safetensors", fs::copy_options::overwrite_existing);
  // Element [3, 5] of one expert's up_proj: its offset from the header.
  const std::string name = "model.layers.2.mlp.experts.6.up_proj.weight";
  std::fstream f(dir / "model.safetensors", std::ios::in | std::ios::out | std::ios::binary);
  uint64_t n = 0;
  f.read(reinterpret_cast<char*>(&n), 8);
  std::string header(n, '\0');
  f.read(header.data(), static_cast<std::streamsize>(n));
  const auto h = nlohmann::json::parse(header);
  ASSERT_EQ(h[name]["dtype"], "F8_E4M3");
  const int64_t cols = h[name]["shape"][1].get<int64_t>();
  f.seekp(static_cast<std::streamoff>(8 + n + h[name]["data_offsets"][0].get<uint64_t>() + 3 * cols + 5));
  f.put(static_cast<char>(0xff));
  f.close();
  auto m = Model::Load(dir.string());
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(m.status().message().find(name), std::string::npos) << m.status();
  EXPECT_NE(m.status().message().find("NaN code (0xff) at element [3, 5]"), std::string::npos) << m.status();
  // Dequantized at load it is refused too (a NaN weight).
  ModelOptions o;
  o.fp8_weights = Fp8Weights::kDequantize;
  auto d = Model::Load(dir.string(), {}, o);
  EXPECT_FALSE(d.ok());
  fs::remove_all(dir);
}

}  // namespace
}  // namespace mlarun
