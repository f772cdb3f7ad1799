// Built when the CUDA backend is not.
#include "kv/latent_write_backend.h"

namespace mlarun::cuda {

Status LaunchWriteLatentRows(const LatentWriteParams&) {
  return UnimplementedError("latent write: this build has no CUDA backend");
}

}  // namespace mlarun::cuda
