// Built when the CUDA backend is not.
#include "kv/latent_write.h"

namespace mlarun {

Status LaunchWriteLatentRows(const LatentWriteParams&) {
  return UnimplementedError("latent write: this build has no CUDA backend");
}

}  // namespace mlarun
