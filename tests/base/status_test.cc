#include "base/status.h"

#include <gtest/gtest.h>

namespace mlarun {
namespace {

StatusOr<int> Half(int x) {
  if (x % 2) return InvalidArgumentError("odd value ", x);
  return x / 2;
}

Status Quarter(int x, int* out) {
  MLARUN_ASSIGN_OR_RETURN(int h, Half(x));
  MLARUN_ASSIGN_OR_RETURN(*out, Half(h));
  return Status::Ok();
}

TEST(Status, OkAndErrors) {
  EXPECT_TRUE(Status::Ok().ok());
  EXPECT_EQ(Status::Ok().ToString(), "OK");
  const Status s = ResourceExhaustedError("needs ", 3, " blocks");
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(s.ToString(), "RESOURCE_EXHAUSTED: needs 3 blocks");
  EXPECT_EQ(s.WithContext("layer 2").message(), "layer 2: needs 3 blocks");
}

TEST(Status, StatusOrAndMacros) {
  int q = 0;
  EXPECT_TRUE(Quarter(12, &q).ok());
  EXPECT_EQ(q, 3);
  const Status st = Quarter(6, &q);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(st.message(), "odd value 3");
  const StatusOr<int> bad = Status::Ok();  // a value-less OK is a bug, reported as one
  EXPECT_EQ(bad.status().code(), StatusCode::kInternal);
}

}  // namespace
}  // namespace mlarun
