// A job whose rank 1 fails at start-up while the others already wait in a
// collective: MpiSession::Abort must take the whole job down (non-zero exit)
// instead of leaving them waiting. Run by tests/parallel/abort_test.sh.
//
// `--return-instead-of-abort` makes rank 1 just return: the others then wait
// forever, which is what the test's timeout must catch (a manual check that
// the test can fail).
#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>

#include "parallel/mpi/mpi_world.h"

int main(int argc, char** argv) {
  bool no_abort = false;
  for (int i = 1; i < argc; ++i) no_abort |= std::strcmp(argv[i], "--return-instead-of-abort") == 0;
  auto session = mlarun::MpiSession::Init(&argc, &argv);
  if (!session.ok()) {
    std::fprintf(stderr, "abort_main: %s\n", session.status().ToString().c_str());
    return 1;
  }
  if ((*session)->size() < 2) {
    std::fprintf(stderr, "abort_main: needs at least 2 ranks\n");
    return 1;
  }
  auto world = (*session)->World();
  if (!world.ok()) {
    std::fprintf(stderr, "abort_main: %s\n", world.status().ToString().c_str());
    return 1;
  }
  if ((*session)->rank() == 1) {
    // Let the others reach the barrier first.
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    if (no_abort) return 2;
    (*session)->Abort("simulated start-up failure: bad shard", 3);
  }
  const mlarun::Status st = (*world)->Barrier();
  // Not reached when rank 1 aborts: MPI_Abort kills this rank inside the barrier.
  std::fprintf(stderr, "abort_main: rank %d left the barrier: %s\n", (*session)->rank(), st.ToString().c_str());
  return 0;
}
