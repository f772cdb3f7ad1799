// The MPI process world: initialization, the world communicator, and the
// process groups of a layout. The MPI headers stay inside mpi_world.cc.
#pragma once

#include <memory>
#include <string>

#include "base/status.h"
#include "parallel/communicator.h"
#include "parallel/layout.h"

namespace mlarun {

// RAII owner of MPI_Init / MPI_Finalize. One per process.
class MpiSession {
 public:
  // Initializes MPI (with MPI_THREAD_FUNNELED). Safe to call when the process
  // was not started by mpirun: it is then a world of one rank. Under an MPMD
  // launch (`mpirun -np P mlarun worker ... : -np D mlarun worker ...`) the
  // contexts form one job (per-rank environment or arguments for one job),
  // unless any rank passes `job_per_context`: then each application context
  // is a job of its own, and rank(), size(), World() and Groups() are its
  // ranks only, so one mpirun can start several worker jobs (a prefill job
  // and a decode job). Abort still ends the whole launch. Every rank must
  // call Init (the choice is agreed on collectively).
  static StatusOr<std::unique_ptr<MpiSession>> Init(int* argc, char*** argv, bool job_per_context = false);
  ~MpiSession();  // MPI_Finalize

  // Within this process's job (its application context).
  int rank() const { return rank_; }
  int size() const { return size_; }
  // The application context (MPI_APPNUM; 0 without an MPMD launch).
  int appnum() const { return appnum_; }
  std::string host() const { return host_; }

  // The job's ranks as a Communicator (a duplicate of MPI_COMM_WORLD, or of
  // this application context's part of it; owned by the caller).
  StatusOr<std::unique_ptr<Communicator>> World() const;

  // Splits the world into the layout's groups. The layout's world size must
  // equal size(): otherwise INVALID_ARGUMENT naming both, on every rank.
  StatusOr<ProcessGroups> Groups(const ParallelLayout& layout) const;

  // Ends the whole job (MPI_Abort) with `code` after printing `message` with
  // this rank and host. For start-up errors that must not leave other ranks
  // waiting in a collective. Only launcher/ calls it.
  [[noreturn]] void Abort(const std::string& message, int code) const;

 private:
  MpiSession() = default;
  int rank_ = 0, size_ = 1, appnum_ = 0;
  std::string host_;
};

}  // namespace mlarun
