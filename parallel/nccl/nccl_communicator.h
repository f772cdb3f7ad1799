// NCCL collectives on device buffers, for CUDA builds. The unique id is
// created on rank 0 of `bootstrap` and broadcast over it (MPI), then every
// rank joins with its bootstrap rank. Without CUDA (or without a GPU) Create
// returns UNAVAILABLE/UNIMPLEMENTED with the reason.
#pragma once

#include <memory>

#include "parallel/communicator.h"

namespace mlarun {

// `bootstrap` is a host (MPI) communicator over the same ranks; creating and
// destroying the NCCL communicator are collective over it: every rank calls,
// including ranks that will fail (they first agree on whether every rank has
// a usable device, so a rank without one does not leave the others waiting).
// If ncclCommInitRank itself fails on only some ranks, the others can still
// block inside NCCL. `device`: the CUDA device this rank uses. Buffers passed
// to the returned communicator's operations are device pointers; operations
// are synchronous (they wait for the NCCL stream, which spins a core).
StatusOr<std::unique_ptr<Communicator>> CreateNcclCommunicator(Communicator& bootstrap, int device);

}  // namespace mlarun
