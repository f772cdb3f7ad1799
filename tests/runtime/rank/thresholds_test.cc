// The attention thresholds file: written and read back, refused with a
// message naming the field when it is wrong, refused when measured under
// other kernels; and the compiled-in defaults follow the kernel family.
#include "runtime/rank/thresholds.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "base/cpu_isa.h"

namespace mlarun {
namespace {

class ThresholdsFile : public ::testing::Test {
 protected:
  void SetUp() override {
    path_ = (std::filesystem::temp_directory_path() /
             ("mlarun_thresholds_" + std::to_string(::testing::UnitTest::GetInstance()->random_seed()) + "_" +
              ::testing::UnitTest::GetInstance()->current_test_info()->name() + ".json"))
                .string();
  }
  void TearDown() override { std::filesystem::remove(path_); }
  void Write(const std::string& text) { std::ofstream(path_) << text; }
  std::string path_;
};

TEST_F(ThresholdsFile, RoundTripsAndOverridesTheDefaults) {
  ASSERT_TRUE(WriteAbsorbThresholds(path_, {.with_prefix = 77, .no_prefix = 5}).ok());
  auto t = LoadAbsorbThresholds(path_);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->with_prefix, 77);
  EXPECT_EQ(t->no_prefix, 5);
  MlaConfig c;
  ASSERT_TRUE(ApplyAbsorbThresholdsFile(path_, &c).ok());
  EXPECT_EQ(MlaPathFor(c, 76, 100), MlaPath::kAbsorbed);
  EXPECT_EQ(MlaPathFor(c, 77, 100), MlaPath::kExpanded);
  EXPECT_EQ(MlaPathFor(c, 4, 0), MlaPath::kAbsorbed);
  EXPECT_EQ(MlaPathFor(c, 5, 0), MlaPath::kExpanded);
  // No file: nothing changes.
  MlaConfig d;
  ASSERT_TRUE(ApplyAbsorbThresholdsFile("", &d).ok());
  EXPECT_EQ(d, MlaConfig{});
}

TEST_F(ThresholdsFile, BadFilesNameWhatIsWrong) {
  MlaConfig c;
  EXPECT_EQ(LoadAbsorbThresholds(path_ + ".absent").status().code(), StatusCode::kNotFound);
  Write("{not json");
  EXPECT_NE(LoadAbsorbThresholds(path_).status().message().find("not JSON"), std::string::npos);
  Write(R"({"absorb_below_query_len": 10})");
  EXPECT_NE(LoadAbsorbThresholds(path_).status().message().find("absorb_below_query_len_no_prefix"), std::string::npos);
  Write(R"({"absorb_below_query_len": -3, "absorb_below_query_len_no_prefix": 2})");
  EXPECT_NE(LoadAbsorbThresholds(path_).status().message().find("non-negative"), std::string::npos);
  Write(R"({"absorb_below_query_len": 1.5, "absorb_below_query_len_no_prefix": 2})");
  EXPECT_EQ(LoadAbsorbThresholds(path_).status().code(), StatusCode::kInvalidArgument);
  Write(R"({"absorb_below_query_len": 8, "absorb_below_query_len_no_prefix": 2, "kernels": "mmx"})");
  EXPECT_EQ(LoadAbsorbThresholds(path_).status().code(), StatusCode::kInvalidArgument);
  // Measured under another family than the one in force.
  const CpuIsa other = ActiveCpuIsa() == CpuIsa::kScalar ? CpuIsa::kAvx2 : CpuIsa::kScalar;
  Write(std::string(R"({"absorb_below_query_len": 8, "absorb_below_query_len_no_prefix": 2, "kernels": ")") +
        std::string(CpuIsaName(other)) + "\"}");
  const Status st = ApplyAbsorbThresholdsFile(path_, &c);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("measured with the"), std::string::npos) << st;
  EXPECT_EQ(c, MlaConfig{});  // unchanged
}

TEST(AbsorbDefaults, FollowTheKernelFamily) {
  for (CpuIsa isa : HostCpu().supported()) {
    ScopedCpuIsa scope(isa);
    ASSERT_TRUE(scope.status().ok());
    const AbsorbThresholds t = DefaultAbsorbThresholds(isa);
    EXPECT_GT(t.with_prefix, 0);
    const MlaConfig c;  // kAbsorbThresholdOfCpu
    EXPECT_EQ(MlaAbsorbThresholds(c), t) << CpuIsaName(isa);
    EXPECT_EQ(MlaPathFor(c, t.with_prefix - 1, 10), MlaPath::kAbsorbed);
    EXPECT_EQ(MlaPathFor(c, t.with_prefix, 10), MlaPath::kExpanded);
  }
  MlaConfig bad;
  bad.absorb_below_query_len = -7;
  EXPECT_EQ(MlaCheckConfig(bad).code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace mlarun
