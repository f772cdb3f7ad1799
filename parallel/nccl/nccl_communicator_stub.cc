// Built when CUDA or NCCL is missing: the same entry point, reporting why.
#include "parallel/nccl/nccl_communicator.h"

namespace mlarun {

StatusOr<std::unique_ptr<Communicator>> CreateNcclCommunicator(Communicator& bootstrap, int device) {
  return UnimplementedError("this build has no NCCL backend (needs the CUDA toolkit with NCCL at configure time)");
}

}  // namespace mlarun
