// Internal to launcher/memory/: the pieces the prediction and the measurement
// share.
#pragma once

#include <optional>
#include <string>

#include "base/dtype.h"
#include "base/status.h"
#include "launcher/memory/memory.h"
#include "parallel/layout.h"
#include "runtime/model/model_config.h"

namespace mlarun::memory_internal {

// "tp8", "dp8", "dp2xtp4", or the --parallel form "dp=2,attn_tp=4[,moe=...]".
// With world > 0 the layout must have that many ranks.
StatusOr<ParallelLayout> ParseLayoutName(const std::string& name, int world);
// The short name: tp8, dp8, dp2xtp4 (plus "(moe=intermediate)").
std::string LayoutName(const ParallelLayout& l);
// The model's config with --kv-dtype / --num-layers applied, validated.
StatusOr<ModelConfig> LoadMemoryModel(const std::string& path, const std::string& kv_dtype, int64_t num_layers);
// Prints `doc` (--json) or `text`, and writes `doc` to opt.json_path if set.
Status Emit(const MemoryOptions& opt, const std::string& doc, const std::string& text, std::ostream& out);
// "" (what mlarun holds), bf16, fp32, fp8.
StatusOr<std::optional<DType>> ParseWeightDType(const std::string& name);
// What "" means for `path`: f8_e4m3 for a checkpoint directory whose
// projections are stored F8_E4M3 (loading keeps them so), else nullopt (the
// config's weight dtype).
std::optional<DType> CheckpointProjectionDType(const std::string& path);

}  // namespace mlarun::memory_internal
