// The gtest main of every single-process test binary: applies the
// environment overrides first, as `mlarun` does, so ctest can run a binary
// under each CPU kernel family (MLARUN_CPU_ISA=avx2 ...). On a CPU that cannot
// run the requested family every test is skipped with the reason.
#include <gtest/gtest.h>

#include <cstdio>
#include <string>

#include "launcher/env.h"
#include "runtime/base/cpu_isa.h"

namespace {

class SkipAll : public ::testing::Environment {
 public:
  explicit SkipAll(std::string reason) : reason_(std::move(reason)) {}
  void SetUp() override { GTEST_SKIP() << reason_; }

 private:
  std::string reason_;
};

}  // namespace

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  const mlarun::Status env = mlarun::ApplyEnvironmentOverrides();
  if (!env.ok()) {
    std::fprintf(stderr, "%s\n", env.ToString().c_str());
    ::testing::AddGlobalTestEnvironment(new SkipAll(env.ToString()));
  }
  std::fprintf(stderr, "cpu: %s\n", mlarun::CpuSummary().c_str());
  return RUN_ALL_TESTS();
}
