// Whether a model's weights fit this machine: checked before loading, from
// the config's shapes and the checkpoint's headers alone.
#pragma once

#include <cstdint>
#include <optional>

#include "base/dtype.h"
#include "base/status.h"
#include "runtime/model/model.h"
#include "runtime/model/safetensors.h"

namespace mlarun {

// The dtype in which loading `ckpt` with `fp8` holds the decoder layers'
// projections when it is not config.weight_dtype: kF8E4M3 when the checkpoint
// stores them F8_E4M3 (as DeepSeek-V3's release does) and `fp8` is kKeep,
// else nullopt. What WeightFormat::projection_dtype says for PredictWeightBytes.
std::optional<DType> KeptProjectionDType(const Checkpoint& ckpt, Fp8Weights fp8);

// Refuses weights that `machine_bytes` (physical memory plus swap) cannot
// hold: PredictWeightBytes(config, shard, held), the projections in the
// format loading holds them, less `mapped_bytes` the checkpoint files back.
// The message names the bytes and the largest tensor with the config fields
// of its shape.
Status CheckWeightsFit(const ModelConfig& config, const ModelShard& shard, const WeightFormat& held,
                       int64_t mapped_bytes, int64_t machine_bytes);

}  // namespace mlarun
