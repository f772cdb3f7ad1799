// NCCL collectives on device buffers, for CUDA builds. The unique id is
// created on rank 0 of `bootstrap` and broadcast over it (MPI), then every
// rank joins with its bootstrap rank. Without CUDA (or without a GPU) Create
// returns UNAVAILABLE/UNIMPLEMENTED with the reason.
#pragma once

#include <memory>

#include "parallel/communicator.h"

namespace mlarun {

// `device`: the CUDA device this rank uses. Buffers passed to the returned
// communicator's operations are device pointers; operations are synchronous
// (they wait for the NCCL stream).
StatusOr<std::unique_ptr<Communicator>> CreateNcclCommunicator(Communicator& bootstrap, int device);

}  // namespace mlarun
