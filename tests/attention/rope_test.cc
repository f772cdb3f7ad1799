// RoPE / YaRN against outputs produced by Hugging Face transformers'
// DeepSeek-V2/V3 code (tests/fixtures/gen_rope_fixture.py).
#include "attention/rope.h"

#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>

#include "runtime/ops/rope.h"

namespace mlarun {
namespace {

nlohmann::json LoadFixture() {
  std::ifstream f(std::string(MLARUN_FIXTURES_DIR) + "/rope_hf.json");
  EXPECT_TRUE(f.good()) << "missing fixture rope_hf.json";
  return nlohmann::json::parse(f);
}

RopeConfig ConfigOf(const nlohmann::json& c, RopeLayout layout) {
  RopeConfig r{.dim = c["dim"].get<int64_t>(), .theta = c["theta"].get<double>(), .layout = layout, .scaling = {}};
  if (!c["scaling"].is_null()) {
    const auto& s = c["scaling"];
    r.scaling.type = RopeScaling::Type::kYarn;
    r.scaling.factor = s["factor"].get<double>();
    r.scaling.original_max_position_embeddings = s["original_max_position_embeddings"].get<int64_t>();
    r.scaling.beta_fast = s.value("beta_fast", 32.0);
    r.scaling.beta_slow = s.value("beta_slow", 1.0);
    r.scaling.mscale = s.value("mscale", 0.0);
    r.scaling.mscale_all_dim = s.value("mscale_all_dim", 0.0);
  }
  return r;
}

TEST(Rope, MatchesHuggingFace) {
  const nlohmann::json fx = LoadFixture();
  ASSERT_GE(fx["cases"].size(), 4u);
  const std::vector<std::pair<std::string, RopeLayout>> layouts = {
      {"out_interleaved_to_half", RopeLayout::kInterleavedToHalf},
      {"out_half", RopeLayout::kHalf},
      {"out_interleaved", RopeLayout::kInterleaved}};
  int compared = 0;
  for (const auto& c : fx["cases"]) {
    SCOPED_TRACE(c["name"].get<std::string>());
    const auto positions = c["positions"].get<std::vector<int32_t>>();
    const auto input = c["input"].get<std::vector<float>>();
    const int64_t heads = c["heads"].get<int64_t>(), dim = c["dim"].get<int64_t>();
    for (const auto& [key, layout] : layouts) {
      if (!c.contains(key)) continue;
      auto rope = Rope::Create(ConfigOf(c, layout));
      ASSERT_TRUE(rope.ok()) << rope.status();
      // Frequencies and cos/sin factor.
      const auto inv = c["inv_freq"].get<std::vector<double>>();
      ASSERT_EQ(rope->inv_freq().size(), inv.size());
      for (size_t j = 0; j < inv.size(); ++j) EXPECT_NEAR(rope->inv_freq()[j], inv[j], 2e-7 * inv[j]) << j;
      EXPECT_NEAR(rope->attention_factor(), c["attention_factor"].get<double>(), 1e-7);
      // Softmax scale of the attention module.
      EXPECT_NEAR(MlaSoftmaxScale(128, dim, ConfigOf(c, layout).scaling), c["softmax_scale"].get<double>(), 1e-12);
      // Rotated vectors: input is [positions, heads, dim].
      std::vector<float> x = input;
      ASSERT_TRUE(RopeRun(WithRopeTables({.x = x.data(),
                                          .n_tokens = static_cast<int64_t>(positions.size()),
                                          .n_heads = heads,
                                          .stride_token = heads * dim,
                                          .stride_head = dim,
                                          .positions = positions.data()},
                                         *rope))
                      .ok());
      const auto expected = c[key].get<std::vector<float>>();
      ASSERT_EQ(x.size(), expected.size());
      double max_err = 0;
      for (size_t i = 0; i < x.size(); ++i) max_err = std::max(max_err, std::abs(double{x[i]} - expected[i]));
      EXPECT_LT(max_err, 4e-6) << key;
      ++compared;
    }
  }
  EXPECT_EQ(compared, 7);
}

TEST(Rope, YarnCorrectionsSeparate) {
  // DeepSeek-V3: factor 40, mscale = mscale_all_dim = 1: cos/sin unscaled,
  // softmax scale times (0.1 ln 40 + 1)^2.
  RopeScaling y{.type = RopeScaling::Type::kYarn, .factor = 40, .mscale = 1, .mscale_all_dim = 1};
  const double m = 0.1 * std::log(40.0) + 1.0;
  EXPECT_NEAR(MlaSoftmaxScale(128, 64, y), m * m / std::sqrt(192.0), 1e-15);
  EXPECT_NE(MlaSoftmaxScale(128, 64, y), 1.0 / std::sqrt(576.0));
  EXPECT_DOUBLE_EQ(MlaSoftmaxScale(128, 64, RopeScaling{}), 1.0 / std::sqrt(192.0));
}

TEST(Rope, BadConfigIsAnError) {
  EXPECT_EQ(Rope::Create(RopeConfig{.dim = 63, .scaling = {}}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(Rope::Create(RopeConfig{.dim = 64, .theta = 0, .scaling = {}}).status().code(),
            StatusCode::kInvalidArgument);
  RopeConfig bad{.dim = 64, .scaling = {}};
  bad.scaling = RopeScaling{.type = RopeScaling::Type::kYarn, .factor = -2};
  const Status st = Rope::Create(bad).status();
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("factor"), std::string::npos) << st;
}

}  // namespace
}  // namespace mlarun
