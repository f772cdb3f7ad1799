// The compressed-tensors reader (quantized_weights.h).
#include "runtime/model/quantized_weights.h"

namespace mlarun::quant_internal {

StatusOr<Linear> LoadCompressedTensors(const Checkpoint&, const QuantScheme&, const std::string& prefix, int64_t,
                                       int64_t, int64_t, int64_t, int64_t, int64_t) {
  return UnimplementedError("compressed-tensors checkpoints are not read yet (module ", prefix, ")");
}

}  // namespace mlarun::quant_internal
