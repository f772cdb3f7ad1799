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
  const RequestLimits cache{.vocab_size = 512, .max_position_embeddings = kLimitUnknown, .block_size = 16,
                            .cache_blocks_total = 64};
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

}  // namespace
}  // namespace mlarun
