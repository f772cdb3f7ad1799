// The common end of the gtest mains run under mpirun (comm_test,
// parallel_model_test): every rank runs every test; rank 0 prints gtest's
// report, the other ranks print their failed assertions only (tagged with the
// rank, so a failure on rank 3 is never silent); and every rank exits with the
// job's verdict, failed if any rank failed.
//
//   ::testing::InitGoogleTest(&argc, argv);
//   ... MpiSession::Init, World() ...
//   return mlarun::mpi_test::RunAllTestsOnEveryRank(*session, *world, "comm_test");
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>

#include "parallel/communicator.h"
#include "parallel/mpi/mpi_world.h"

namespace mlarun::mpi_test {

// On ranks other than 0: print failed assertions (with the rank) and nothing else.
class FailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit FailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& result) override {
    if (!result.failed()) return;
    std::fprintf(stderr, "[rank %d] %s:%d: Failure\n%s\n", rank_, result.file_name() ? result.file_name() : "?",
                 result.line_number(), result.summary());
  }

 private:
  int rank_;
};

// Runs all tests (gtest already initialised) and returns the exit code every
// rank agrees on: 1 if the tests failed on any rank (or the ranks could not
// agree), else 0. `world` spans all ranks; every rank must call this.
inline int RunAllTestsOnEveryRank(const MpiSession& session, Communicator& world, const char* name) {
  if (session.rank() != 0) {
    ::testing::TestEventListeners& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new FailurePrinter(session.rank()));
  }
  const int local_result = RUN_ALL_TESTS();

  int32_t failed = local_result != 0 ? 1 : 0;
  const Status st = world.AllReduceSum(&failed, 1, CommType::kI32);
  if (!st.ok()) {
    std::fprintf(stderr, "%s: [rank %d] agreeing on the result: %s\n", name, session.rank(), st.ToString().c_str());
    failed = 1;
  }
  if (failed != 0 && session.rank() == 0) std::fprintf(stderr, "%s: %d rank(s) failed\n", name, failed);
  return failed != 0 ? 1 : 0;
}

}  // namespace mlarun::mpi_test
