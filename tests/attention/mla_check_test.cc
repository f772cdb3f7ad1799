// Bad input to the public attention functions: a clear error naming what is
// wrong, never a crash.
#include <gtest/gtest.h>

#include "attention/mla.h"
#include "base/cuda_device.h"
#include "bench/synthetic_batch.h"

namespace mlarun {
namespace {

class MlaCheckTest : public ::testing::Test {
 protected:
  MlaCheckTest()
      : batch_(SyntheticSpec{.shape = MlaShape{.h_q = 4, .d_latent = 16, .d_rope = 4, .d_nope = 8, .d_v = 8},
                             .dtype = DType::kF32,
                             .block_size = 16,
                             .seqs = {{1, 20}, {3, 10}}}) {}

  // Expects `p` to be rejected with INVALID_ARGUMENT and a message containing `what`.
  void ExpectRejected(const MlaParams& p, const std::string& what, const MlaConfig& c = {}) {
    Workspace ws;
    const Status st = MlaForward(p, c, ws);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st;
    EXPECT_NE(st.message().find(what), std::string::npos) << "message '" << st.message() << "' lacks '" << what << "'";
  }

  SyntheticBatch batch_;
};

TEST_F(MlaCheckTest, ValidBatchPasses) {
  Workspace ws;
  EXPECT_TRUE(MlaForward(batch_.params(), {}, ws).ok());
}

TEST_F(MlaCheckTest, ZeroHeads) {
  MlaParams p = batch_.params();
  p.shape.h_q = 0;
  ExpectRejected(p, "head count");
}

TEST_F(MlaCheckTest, MismatchedDims) {
  MlaParams p = batch_.params();
  p.shape.d_latent = 12;  // cache rows are 16 + 4 wide
  ExpectRejected(p, "row width");
  p = batch_.params();
  p.q_stride_head = 5;  // narrower than d_nope + d_rope
  ExpectRejected(p, "q strides");
}

TEST_F(MlaCheckTest, QueryLongerThanCache) {
  MlaParams p = batch_.params();
  std::vector<int32_t> seq_lens = {20, 2};  // sequence 1 has 3 query tokens
  p.seq_lens = seq_lens.data();
  ExpectRejected(p, "longer than the cache");
}

TEST_F(MlaCheckTest, UnknownAndUnsupportedDtypes) {
  MlaParams p = batch_.params();
  p.cache.dtype = static_cast<DType>(42);
  ExpectRejected(p, "unknown cache dtype");
  p = batch_.params();
  p.cache.dtype = DType::kF16;
  ExpectRejected(p, "not supported");
  p = batch_.params();
  p.w_dtype = DType::kBF16;
  ExpectRejected(p, "weight dtype");
  p = batch_.params();
  p.cache.dtype = DType::kInt8;  // a weight dtype, never a cache's
  ExpectRejected(p, "not supported");
  EXPECT_EQ(ParseDType("int2").status().code(), StatusCode::kInvalidArgument);
}

TEST_F(MlaCheckTest, BlockTableOutOfRange) {
  MlaParams p = batch_.params();
  batch_.block_table()[1] = static_cast<int32_t>(batch_.num_blocks());
  ExpectRejected(p, "block_table[0][1]");
}

TEST_F(MlaCheckTest, TooFewBlockTableColumns) {
  MlaParams p = batch_.params();
  p.block_table_stride = 1;  // sequence 0 needs 2 blocks for 20 keys
  ExpectRejected(p, "block_table_stride");
}

TEST_F(MlaCheckTest, InconsistentQueryStart) {
  MlaParams p = batch_.params();
  p.num_tokens = 5;
  ExpectRejected(p, "num_tokens");
}

TEST_F(MlaCheckTest, BadConfig) {
  ExpectRejected(batch_.params(), "kv_tile_rows", MlaConfig{.kv_tile_rows = 100});
  ExpectRejected(batch_.params(), "expand_chunk_rows", MlaConfig{.expand_chunk_rows = 0});
}

// The CUDA backend where it cannot run: a build without it answers
// UNIMPLEMENTED, a CUDA build on a machine without a GPU UNAVAILABLE, each
// with the reason (the batch here is host memory, so a machine with a GPU
// skips: mla_cuda_test covers it there).
TEST_F(MlaCheckTest, CudaBackendWithoutAGpuIsAClearError) {
  if (CudaDevices().ok()) GTEST_SKIP() << "a GPU is present";
  Workspace ws;
  const Status st = MlaForward(batch_.params(), MlaConfig{.backend = Backend::kCuda}, ws);
  EXPECT_EQ(st.code(), CudaBuilt() ? StatusCode::kUnavailable : StatusCode::kUnimplemented) << st;
  EXPECT_NE(st.message().find("CUDA"), std::string::npos) << st;
}

TEST_F(MlaCheckTest, PlanRejectsDifferentBatch) {
  MlaParams p = batch_.params();
  auto plan = MlaMakePlan(p, {});
  ASSERT_TRUE(plan.ok());
  std::vector<int32_t> seq_lens = {19, 10};
  p.seq_lens = seq_lens.data();
  Workspace ws;
  const Status st = MlaRun(p, *plan, ws.Reserve(plan->workspace_bytes));
  EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition) << st;
}

TEST_F(MlaCheckTest, WorkspaceTooSmall) {
  MlaParams p = batch_.params();
  auto plan = MlaMakePlan(p, {});
  ASSERT_TRUE(plan.ok());
  Workspace ws;
  const Status st = MlaRun(p, *plan, ws.Reserve(plan->workspace_bytes / 2));
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st;
}

}  // namespace
}  // namespace mlarun

namespace mlarun {
namespace {

TEST(MlaDispatch, PathPerSequence) {
  const MlaConfig c{.absorb_below_query_len = 64, .absorb_below_query_len_no_prefix = 8};
  EXPECT_EQ(MlaPathFor(c, 1, 4096), MlaPath::kAbsorbed);
  EXPECT_EQ(MlaPathFor(c, 63, 10), MlaPath::kAbsorbed);
  EXPECT_EQ(MlaPathFor(c, 64, 10), MlaPath::kExpanded);
  EXPECT_EQ(MlaPathFor(c, 7, 0), MlaPath::kAbsorbed);
  EXPECT_EQ(MlaPathFor(c, 8, 0), MlaPath::kExpanded) << "a cold block has its own threshold";
  EXPECT_EQ(MlaPathFor(c, 1, 0), MlaPath::kAbsorbed);
  EXPECT_EQ(MlaPathFor(MlaConfig{.path = MlaPath::kAbsorbed}, 5000, 0), MlaPath::kAbsorbed);
  EXPECT_EQ(MlaPathFor(MlaConfig{.path = MlaPath::kExpanded}, 1, 5000), MlaPath::kExpanded);
}

TEST(MlaDispatch, PlanCountsEachPath) {
  SyntheticBatch batch(SyntheticSpec{.shape = MlaShape{.h_q = 2, .d_latent = 16, .d_rope = 4, .d_nope = 8, .d_v = 8},
                                     .dtype = DType::kF32,
                                     .block_size = 16,
                                     .seqs = {{1, 20}, {3, 10}, {5, 5}, {40, 90}}});
  auto plan =
      MlaMakePlan(batch.params(), MlaConfig{.absorb_below_query_len = 4, .absorb_below_query_len_no_prefix = 2});
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->absorbed_seqs, 2);  // q 1 and 3 over a prefix
  EXPECT_EQ(plan->expanded_seqs, 2);  // the 5-token cold prefill and the 40-token block
  EXPECT_EQ(MlaMakePlan(batch.params(), MlaConfig{.absorb_below_query_len_no_prefix = -2}).status().code(),
            StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace mlarun
