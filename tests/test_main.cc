// The gtest main of every single-process test binary: applies the
// environment overrides first, as `mlarun` does, so ctest can run a binary
// under each CPU kernel family (MLARUN_CPU_ISA=avx2 ...). On a CPU that cannot
// run the requested family every test is skipped with the reason.
// MLARUN_TEST_CPU_ISA_BELOW_NATIVE=<isa> forces <isa> only on a CPU whose own
// family is higher, and skips every test elsewhere.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "base/cpu_isa.h"
#include "launcher/env.h"

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
  } else if (const char* below = std::getenv("MLARUN_TEST_CPU_ISA_BELOW_NATIVE"); below != nullptr && *below != '\0') {
    // A variant for CPUs that have more than this family: forced as
    // MLARUN_CPU_ISA would; where it is the CPU's own family (or more), the
    // plain run covered it.
    const mlarun::StatusOr<mlarun::CpuIsa> isa = mlarun::ParseCpuIsa(below);
    std::string reason;
    if (!isa.ok()) {
      reason = "MLARUN_TEST_CPU_ISA_BELOW_NATIVE: " + isa.status().ToString();
    } else if (static_cast<int>(*isa) > static_cast<int>(mlarun::HostCpu().best())) {
      reason = "this CPU cannot run the " + std::string(below) + " kernels";
    } else if (*isa == mlarun::HostCpu().best()) {
      reason = "the " + std::string(below) +
               " kernels are this CPU's own family: the run without MLARUN_CPU_ISA covered them";
    } else if (const mlarun::Status set = mlarun::SetCpuIsaLimit(*isa); !set.ok()) {
      reason = set.ToString();
    }
    if (!reason.empty()) {
      std::fprintf(stderr, "%s\n", reason.c_str());
      ::testing::AddGlobalTestEnvironment(new SkipAll(reason));
    }
  }
  std::fprintf(stderr, "cpu: %s\n", mlarun::CpuSummary().c_str());
  return RUN_ALL_TESTS();
}
