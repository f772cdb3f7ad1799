// launcher/env: MLARUN_STREAM_PREFETCH switches the streaming products'
// vendor rule, MLARUN_INT_DOT the int weights' activations, MLARUN_BF16_DOT
// and MLARUN_VNNI the AVX-512 dot products, as the benchmarks' JSON reports
// them; a bad value is an error naming the variable, and changes nothing.
#include "launcher/env.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "bench/memory_bench.h"
#include "gemm/cpu/kernels.h"

namespace mlarun {
namespace {

// Sets `name` for one scope, and restores the variable after it.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = getenv(name)) old_ = old, had_ = true;
    setenv(name, value, 1);
  }
  ~ScopedEnv() {
    if (had_)
      setenv(name_, old_.c_str(), 1);
    else
      unsetenv(name_);
  }

 private:
  const char* name_;
  bool had_ = false;
  std::string old_;
};

// Sets MLARUN_STREAM_PREFETCH for one scope, and restores the variable and
// the rule after it.
class ScopedPrefetchEnv {
 public:
  explicit ScopedPrefetchEnv(const char* value) : rule_(cpu::StreamPrefetch()), env_("MLARUN_STREAM_PREFETCH", value) {}
  ~ScopedPrefetchEnv() { cpu::SetStreamPrefetch(rule_); }

 private:
  bool rule_;
  ScopedEnv env_;
};

nlohmann::json ReportedCpu() {
  std::ostringstream out, err;
  const Status st = RunMemoryBench({.passes = 1, .bytes = int64_t{16} << 20, .json = true}, out, err);
  EXPECT_TRUE(st.ok()) << st;
  return nlohmann::json::parse(out.str())["cpu"];
}
bool ReportedRule() { return ReportedCpu()["stream_prefetch"].get<bool>(); }

TEST(Environment, StreamPrefetchSwitchesTheVendorRule) {
  for (const bool want : {true, false, true}) {
    ScopedPrefetchEnv env(want ? "on" : "off");
    cpu::SetStreamPrefetch(!want);
    ASSERT_TRUE(ApplyEnvironmentOverrides().ok());
    EXPECT_EQ(cpu::StreamPrefetch(), want);
    EXPECT_EQ(ReportedRule(), want);
  }
}

TEST(Environment, BadStreamPrefetchValueIsRefusedAndChangesNothing) {
  for (const bool before : {true, false}) {
    ScopedPrefetchEnv env("maybe");
    cpu::SetStreamPrefetch(before);
    const Status st = ApplyEnvironmentOverrides();
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(st.message().find("MLARUN_STREAM_PREFETCH=maybe"), std::string::npos) << st;
    EXPECT_EQ(cpu::StreamPrefetch(), before);
  }
}

TEST(Environment, IntDotSetsTheModeAndBadValuesChangeNothing) {
  const cpu::IntDotMode before = cpu::GetIntDotMode();
  const std::pair<const char*, cpu::IntDotMode> modes[] = {
      {"on", cpu::IntDotMode::kOn}, {"off", cpu::IntDotMode::kOff}, {"auto", cpu::IntDotMode::kAuto}};
  for (const auto& [value, mode] : modes) {
    ScopedEnv env("MLARUN_INT_DOT", value);
    cpu::SetIntDotMode(mode == cpu::IntDotMode::kOn ? cpu::IntDotMode::kOff : cpu::IntDotMode::kOn);
    ASSERT_TRUE(ApplyEnvironmentOverrides().ok()) << value;
    EXPECT_EQ(cpu::GetIntDotMode(), mode) << value;
    EXPECT_EQ(ReportedCpu()["int_dot"], value);
  }
  {
    ScopedEnv env("MLARUN_INT_DOT", "yes");
    cpu::SetIntDotMode(cpu::IntDotMode::kOff);
    const Status st = ApplyEnvironmentOverrides();
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(st.message().find("MLARUN_INT_DOT=yes: expected auto, on or off"), std::string::npos) << st;
    EXPECT_EQ(cpu::GetIntDotMode(), cpu::IntDotMode::kOff);
  }
  cpu::SetIntDotMode(before);
}

// MLARUN_BF16_DOT and MLARUN_VNNI turn the AVX512-BF16 and AVX512-VNNI
// products off and on again where the kernels in force have them (the JSON
// says whether they run); elsewhere they stay off whatever the variable.
TEST(Environment, Bf16DotAndVnniSwitches) {
  const bool dot_before = cpu::SetBf16DotAllowed(true), vnni_before = cpu::SetVnniAllowed(true);
  const bool has_dot = cpu::UseBf16Dot(cpu::Kernels()), has_vnni = cpu::UseVnni();
  for (const bool want : {false, true}) {
    ScopedEnv dot("MLARUN_BF16_DOT", want ? "on" : "off"), vnni("MLARUN_VNNI", want ? "on" : "off");
    cpu::SetBf16DotAllowed(!want), cpu::SetVnniAllowed(!want);
    ASSERT_TRUE(ApplyEnvironmentOverrides().ok());
    EXPECT_EQ(cpu::UseBf16Dot(cpu::Kernels()), want && has_dot);
    EXPECT_EQ(cpu::UseVnni(), want && has_vnni);
    EXPECT_EQ(ReportedCpu()["bf16_dot"], want && has_dot);
    EXPECT_EQ(ReportedCpu()["vnni"], want && has_vnni);
  }
  {
    ScopedEnv dot("MLARUN_BF16_DOT", "1");
    const Status st = ApplyEnvironmentOverrides();
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(st.message().find("MLARUN_BF16_DOT=1: expected on or off"), std::string::npos) << st;
    EXPECT_TRUE(cpu::UseBf16Dot(cpu::Kernels()) == has_dot);
  }
  cpu::SetBf16DotAllowed(dot_before), cpu::SetVnniAllowed(vnni_before);
}

}  // namespace
}  // namespace mlarun
