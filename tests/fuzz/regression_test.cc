// Inputs the fuzz targets (tests/fuzz/*_fuzz.cc) found crashing, each as a
// regular test of the behaviour that replaced the crash.
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>

#include "runtime/request/request.h"

namespace mlarun {
namespace {

// request_fuzz: {"prompt_ids": [5], "max_tokens": 9223372036854775807}
// overflowed prompt + max_tokens (signed overflow) in ValidateRequest.
TEST(FuzzRegression, MaxTokensInt64MaxDoesNotOverflow) {
  auto r = ParseRequestLine(R"({"prompt_ids": [5], "max_tokens": 9223372036854775807})", SamplingParams{});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->sampling.max_tokens, std::numeric_limits<int64_t>::max());
  // No limit known: nothing to exceed.
  EXPECT_TRUE(ValidateGenerationRequest(*r, RequestLimits{}).ok());
  // A cache of known size: the blocks it would need are named, saturated.
  const RequestLimits cache{
      .vocab_size = 512, .max_position_embeddings = kLimitUnknown, .block_size = 16, .cache_blocks_total = 64};
  const Status st = ValidateGenerationRequest(*r, cache);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find("sampling.max_tokens"), std::string::npos) << st;
  EXPECT_NE(st.message().find("576460752303423488 cache blocks"), std::string::npos) << st;
  // A context limit: the sum is reported as exceeding it.
  const RequestLimits context{.vocab_size = 512, .max_position_embeddings = std::numeric_limits<int64_t>::max() - 1};
  EXPECT_EQ(ValidateGenerationRequest(*r, context).code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace mlarun

#include "attention/rope.h"
#include "runtime/model/model_config.h"

namespace mlarun {
namespace {

// model_yaml_fuzz: a scalar that is not UTF-8 in an integer field made the
// error message's JSON dump throw (std::terminate, exit 134).
TEST(FuzzRegression, NonUtf8YamlScalarIsAnError) {
  const Status st = ParseModelYaml("model_type: deepseek_v3\nhidden_size: \"\\xff\\xfe\"\n", "bad.yaml").status();
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find("hidden_size"), std::string::npos) << st;
  const Status raw = ParseModelYaml("model_type: deepseek_v3\nhidden_size: \xff\xfe\n", "bad.yaml").status();
  EXPECT_EQ(raw.code(), StatusCode::kInvalidArgument) << raw;
}

// config_json_fuzz: "qk_rope_head_dim": 9999999999999998 (even) reached
// Rope::Create, which sized its frequency table by it (an allocation of
// ~20 PB: out of memory).
TEST(FuzzRegression, HugeRopeWidthIsAnError) {
  const std::string json = R"({"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
    "hidden_size": 64, "intermediate_size": 96, "kv_lora_rank": 32, "max_position_embeddings": 256,
    "moe_intermediate_size": 32, "n_group": 4, "n_routed_experts": 8, "n_shared_experts": 2,
    "num_attention_heads": 4, "num_experts_per_tok": 3, "num_hidden_layers": 2, "num_key_value_heads": 4,
    "q_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 9999999999999998, "rms_norm_eps": 1e-06,
    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}, "v_head_dim": 16, "vocab_size": 256,
    "hidden_act": "silu", "first_k_dense_replace": 0})";
  const Status st = ParseHfConfigJson(json, "config.json").status();
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find("rope: dim must be at most 65536"), std::string::npos) << st;
  // The same config at DeepSeek's width parses, so the bound is what refused it.
  std::string ok = json;
  ok.replace(ok.find("9999999999999998"), 16, "8");
  EXPECT_TRUE(ParseHfConfigJson(ok, "config.json").ok()) << ParseHfConfigJson(ok, "config.json").status();
  // The largest width Rope takes builds its tables.
  EXPECT_TRUE(Rope::Create({.dim = kMaxRopeDim, .theta = 10000.0}).ok());
}

}  // namespace
}  // namespace mlarun
