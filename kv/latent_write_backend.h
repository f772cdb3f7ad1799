// Internal: the cache write's implementations (kv/latent_write.h). Not part of
// the public API.
#pragma once

#include "kv/latent_write.h"

namespace mlarun {

namespace cpu {
// REQUIRES: LatentWriteCheck(p) is OK.
Status WriteLatentRows(const LatentWriteParams& p);
}  // namespace cpu

namespace cuda {
// Checks (LatentWriteCheck), then launches. Without CUDA: UNIMPLEMENTED.
Status LaunchWriteLatentRows(const LatentWriteParams& p);
}  // namespace cuda

}  // namespace mlarun
