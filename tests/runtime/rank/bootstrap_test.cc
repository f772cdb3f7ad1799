#include "runtime/rank/bootstrap.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "base/cuda_device.h"

namespace mlarun {
namespace {

const std::string kTiny = std::string(MLARUN_CONFIGS_DIR) + "/models/tiny.yaml";

DeploymentSpec Spec() {
  return DeploymentSpec{.model = kTiny,
                        .parallel = "dp=2,attn_tp=2",
                        .kv_dtype = "bf16",
                        .num_layers = 3,
                        .experts = 0,
                        .weights = "copied",
                        .attention_thresholds = "/some/file.json",
                        .device = "cuda",
                        .fp8_weights = "dequantize",
                        .lm_head = "int8",
                        .max_weight_bytes = 123456789,
                        .fail_forward_call = 7,
                        .fail_forward_rank = 2};
}

TEST(DeploymentSpec, FieldsTravelWhole) {
  const DeploymentSpec::Fields fields = Spec().ToFields();
  ASSERT_EQ(fields.size(), 12u);  // every member of DeploymentSpec
  auto back = DecodeSpecFields(EncodeSpecFields(fields));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, fields);
  EXPECT_EQ(DescribeSpecDifference(fields, *back, 1), "");
}

TEST(DeploymentSpec, DecodeRefusesWhatIsNotASpec) {
  for (const char* text : {"", "{}", "[3]", "[[\"--model\"]]", "[[\"--model\", 3]]", "not json"}) {
    const auto s = DecodeSpecFields(text);
    EXPECT_FALSE(s.ok()) << text;
    EXPECT_NE(s.status().message().find("deployment spec"), std::string::npos) << s.status();
  }
}

// Each field on its own: the difference names that field's flag and both
// ranks' values.
TEST(DeploymentSpec, NamesTheFirstFieldThatDiffers) {
  struct Case {
    void (*change)(DeploymentSpec&);
    std::string expect;
  };
  const Case cases[] = {
      {[](DeploymentSpec& s) { s.model = "other.yaml"; },
       "--model: rank 3 has 'other.yaml', rank 0 has '" + kTiny + "'"},
      {[](DeploymentSpec& s) { s.parallel = "dp=4"; }, "--parallel: rank 3 has 'dp=4', rank 0 has 'dp=2,attn_tp=2'"},
      {[](DeploymentSpec& s) { s.kv_dtype = ""; }, "--kv-dtype: rank 3 has none, rank 0 has 'bf16'"},
      {[](DeploymentSpec& s) { s.num_layers = 2; }, "--num-layers: rank 3 has '2', rank 0 has '3'"},
      {[](DeploymentSpec& s) { s.experts = 8; }, "--experts: rank 3 has '8', rank 0 has '0'"},
      {[](DeploymentSpec& s) { s.weights = "mapped"; }, "--weights: rank 3 has 'mapped', rank 0 has 'copied'"},
      {[](DeploymentSpec& s) { s.attention_thresholds = ""; }, "--attention-thresholds: rank 3 has none"},
      {[](DeploymentSpec& s) { s.device = "cpu"; }, "--device: rank 3 has 'cpu', rank 0 has 'cuda'"},
      {[](DeploymentSpec& s) { s.fp8_weights = "keep"; }, "--fp8-weights: rank 3 has 'keep', rank 0 has 'dequantize'"},
      {[](DeploymentSpec& s) { s.lm_head = "keep"; }, "--lm-head: rank 3 has 'keep', rank 0 has 'int8'"},
      {[](DeploymentSpec& s) { s.fail_forward_rank = -1; }, "--fail-forward-call: rank 3 has '7@-1', rank 0 has '7@2'"},
  };
  for (const Case& c : cases) {
    DeploymentSpec other = Spec();
    c.change(other);
    const std::string d = DescribeSpecDifference(Spec().ToFields(), other.ToFields(), 3);
    EXPECT_EQ(d.substr(0, c.expect.size()), c.expect) << d;
  }
}

TEST(LoadModelForSpec, LoadsTheShardWithTheOverrides) {
  DeploymentSpec s{.model = kTiny, .kv_dtype = "fp32", .num_layers = 2};
  auto lm = LoadModelForSpec(s, ModelShard{});
  ASSERT_TRUE(lm.ok()) << lm.status();
  EXPECT_EQ(lm->config.num_hidden_layers, 2);
  EXPECT_EQ(lm->config.kv_dtype, DType::kF32);
  ASSERT_NE(lm->model, nullptr);
  EXPECT_EQ(lm->model->weight_bytes().total(), lm->predicted.total());
  EXPECT_EQ(lm->options.fail_forward_call, -1);
}

// A checkpoint whose projections are stored F8_E4M3 is sized as loading
// holds it (kept fp8, the default), not dequantized: a limit between the two
// sizes loads it kept and refuses it dequantized.
TEST(LoadModelForSpec, SizesAnFp8CheckpointAsLoadingHoldsIt) {
  DeploymentSpec s{.model = std::string(MLARUN_FIXTURES_DIR) + "/models/v3_fp8"};
  auto kept = LoadModelForSpec(s, ModelShard{});
  ASSERT_TRUE(kept.ok()) << kept.status();
  EXPECT_EQ(kept->model->weight_bytes().total(), kept->predicted.total());
  s.fp8_weights = "dequantize";
  auto dequantized = LoadModelForSpec(s, ModelShard{});
  ASSERT_TRUE(dequantized.ok()) << dequantized.status();
  EXPECT_EQ(dequantized->model->weight_bytes().total(), dequantized->predicted.total());
  ASSERT_LT(kept->predicted.total(), dequantized->predicted.total());
  s.max_weight_bytes = (kept->predicted.total() + dequantized->predicted.total()) / 2;
  auto refused = LoadModelForSpec(s, ModelShard{});
  EXPECT_EQ(refused.status().code(), StatusCode::kResourceExhausted) << refused.status();
  s.fp8_weights = "keep";
  auto fits = LoadModelForSpec(s, ModelShard{});
  EXPECT_TRUE(fits.ok()) << fits.status();
}

// --lm-head int8 / int4 quantizes the output layer at load: predicted =
// held in each mode, the head smaller than bf16's, a bad value refused by
// name.
TEST(LoadModelForSpec, QuantizesTheLmHeadAtLoad) {
  DeploymentSpec s{.model = kTiny, .num_layers = 1};
  int64_t bf16_head = 0;
  for (const char* mode : {"keep", "int8", "int4"}) {
    SCOPED_TRACE(mode);
    s.lm_head = mode;
    auto lm = LoadModelForSpec(s, ModelShard{});
    ASSERT_TRUE(lm.ok()) << lm.status();
    EXPECT_EQ(lm->model->weight_bytes().embedding_and_head, lm->predicted.embedding_and_head);
    EXPECT_EQ(lm->model->weight_bytes().total(), lm->predicted.total());
    if (bf16_head == 0) bf16_head = lm->predicted.embedding_and_head;
    if (s.lm_head != "keep") EXPECT_LT(lm->predicted.embedding_and_head, bf16_head);
  }
  s.lm_head = "int2";
  auto bad = LoadModelForSpec(s, ModelShard{});
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("--lm-head must be keep, int8 or int4, got 'int2'"), std::string::npos)
      << bad.status();
}

TEST(LoadModelForSpec, DeviceAndFp8FlagsAreCheckedWithTheirNames) {
  DeploymentSpec s{.model = kTiny, .num_layers = 1, .device = "tpu"};
  auto bad_device = LoadModelForSpec(s, ModelShard{});
  ASSERT_FALSE(bad_device.ok());
  EXPECT_NE(bad_device.status().message().find("--device"), std::string::npos) << bad_device.status();
  s.device = "cpu";
  s.fp8_weights = "sometimes";
  auto bad_fp8 = LoadModelForSpec(s, ModelShard{});
  ASSERT_FALSE(bad_fp8.ok());
  EXPECT_NE(bad_fp8.status().message().find("--fp8-weights"), std::string::npos) << bad_fp8.status();
  if (!CudaDevices().ok()) {  // no GPU: --device cuda is refused with the reason, not a crash
    s.fp8_weights = "keep";
    s.device = "cuda";
    auto no_gpu = LoadModelForSpec(s, ModelShard{});
    ASSERT_FALSE(no_gpu.ok());
    EXPECT_EQ(no_gpu.status().code(), StatusCode::kUnavailable) << no_gpu.status();
    EXPECT_NE(no_gpu.status().message().find("--device cuda"), std::string::npos) << no_gpu.status();
  }
}

TEST(LoadModelForSpec, FaultInjectionOnlyOnTheNamedRank) {
  DeploymentSpec s{.model = kTiny, .num_layers = 1, .fail_forward_call = 4, .fail_forward_rank = 1};
  auto on0 = LoadModelForSpec(s, ModelShard{}, 0);
  auto on1 = LoadModelForSpec(s, ModelShard{}, 1);
  ASSERT_TRUE(on0.ok() && on1.ok());
  EXPECT_EQ(on0->options.fail_forward_call, -1);
  EXPECT_EQ(on1->options.fail_forward_call, 4);
}

TEST(LoadModelForSpec, RefusesBadSettingsByName) {
  struct Case {
    DeploymentSpec spec;
    StatusCode code;
    std::string needle;
  };
  const Case cases[] = {
      {{.model = kTiny, .kv_dtype = "fp8"}, StatusCode::kInvalidArgument, "--kv-dtype"},
      {{.model = kTiny, .num_layers = 99}, StatusCode::kInvalidArgument, "--num-layers"},
      {{.model = kTiny, .experts = 3}, StatusCode::kInvalidArgument, "--experts 3"},
      {{.model = kTiny, .weights = "borrowed"}, StatusCode::kInvalidArgument, "--weights"},
      {{.model = kTiny, .max_weight_bytes = 1000}, StatusCode::kResourceExhausted, "limit"},
      {{.model = std::string(MLARUN_FIXTURES_DIR) + "/no-such-checkpoint", .experts = 8},
       StatusCode::kInvalidArgument,
       "YAML models only"},
      {{.model = kTiny, .attention_thresholds = "/no/such/thresholds.json"}, StatusCode::kNotFound, ""},
  };
  for (const Case& c : cases) {
    auto lm = LoadModelForSpec(c.spec, ModelShard{});
    ASSERT_FALSE(lm.ok()) << c.needle;
    EXPECT_NE(lm.status().message().find(c.needle), std::string::npos) << lm.status();
    if (c.code != StatusCode::kNotFound) {
      EXPECT_EQ(lm.status().code(), c.code) << lm.status();
    }
  }
}

TEST(LoadModelForSpec, RefusesAShardTheModelCannotSplit) {
  // tiny.yaml has 4 heads: 3-way attention TP cannot split them.
  DeploymentSpec s{.model = kTiny};
  auto lm = LoadModelForSpec(s, ModelShard{.attn_tp_size = 3, .attn_tp_rank = 0, .mlp_size = 3, .mlp_rank = 0});
  ASSERT_FALSE(lm.ok());
  EXPECT_NE(lm.status().message().find("not divisible"), std::string::npos) << lm.status();
}

}  // namespace
}  // namespace mlarun

namespace mlarun {
namespace {

TEST(DeploymentSpec, ParsesFailForwardCall) {
  DeploymentSpec s;
  ASSERT_TRUE(ParseFailForwardCall("3", &s).ok());
  EXPECT_EQ(s.fail_forward_call, 3);
  EXPECT_EQ(s.fail_forward_rank, -1);
  ASSERT_TRUE(ParseFailForwardCall("12@2", &s).ok());
  EXPECT_EQ(s.fail_forward_call, 12);
  EXPECT_EQ(s.fail_forward_rank, 2);
  for (const char* bad : {"", "x", "-1", "3@", "@2", "3@-1", "3@2@1", "3 "}) {
    const Status st = ParseFailForwardCall(bad, &s);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(st.message().find("--fail-forward-call"), std::string::npos) << st;
    EXPECT_EQ(s.fail_forward_call, 12) << bad;  // unchanged
    EXPECT_EQ(s.fail_forward_rank, 2) << bad;
  }
}

}  // namespace
}  // namespace mlarun

namespace mlarun {
namespace {

// The loading progress lines: at most one per period, with the layer, the
// bytes that share of the weights is, the rate and the time left, worked
// out here from a clock the test moves.
TEST(LoadProgressLog, OneLinePerPeriodWithRateAndEta) {
  double now = 1000;
  std::vector<std::string> lines;
  LoadProgressLog log(
      "mlarun worker: rank 3 (h)", 5.0, [&] { return now; }, [&](const std::string& l) { lines.push_back(l); });
  const int64_t layers = 61, bytes = int64_t{21} << 30;  // 21 GiB
  std::mt19937 rng(3);
  std::vector<std::pair<int64_t, double>> said;  // (layer, time)
  double last = now;
  for (int64_t done = 1; done < layers; ++done) {
    now += std::uniform_real_distribution<double>(0.2, 1.6)(rng);
    log.OnLayer(done, layers, bytes);
    if (now - last >= 5.0) {
      said.emplace_back(done, now);
      last = now;
    }
  }
  ASSERT_EQ(lines.size(), said.size());
  ASSERT_GE(lines.size(), 4u);
  for (size_t i = 0; i < lines.size(); ++i) {
    const auto [done, t] = said[i];
    const double read = static_cast<double>(done) / layers * static_cast<double>(bytes);
    const double rate = read / (t - 1000), eta = (static_cast<double>(bytes) - read) / rate;
    char want[200];
    std::snprintf(want, sizeof want,
                  "mlarun worker: rank 3 (h): loading: layer %lld/61, about %.2f GiB of 21.00 GiB (%.0f%%), %.2f %s/s, "
                  "ETA %.0f s",
                  static_cast<long long>(done), read / (1 << 30), 100.0 * done / layers,
                  rate >= (1 << 30) ? rate / (1 << 30) : rate / (1 << 20), rate >= (1 << 30) ? "GiB" : "MiB", eta);
    EXPECT_EQ(lines[i], want);
  }
}

TEST(LoadProgressLog, FormatBytes) {
  EXPECT_EQ(FormatBytes(512), "512 B");
  EXPECT_EQ(FormatBytes(1536), "1.50 KiB");
  EXPECT_EQ(FormatBytes(double(int64_t{5} << 40)), "5.00 TiB");
  EXPECT_EQ(FormatBytes(1288490188.8), "1.20 GiB");
}

}  // namespace
}  // namespace mlarun
