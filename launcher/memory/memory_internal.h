// Internal to launcher/memory/: the pieces the prediction and the measurement
// share.
#pragma once

#include <optional>
#include <string>

#include "base/dtype.h"
#include "base/status.h"
#include "launcher/memory/memory.h"
#include "parallel/layout.h"
#include "runtime/model/model.h"
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
// "" (what mlarun holds), bf16, fp32, fp8, int8, int4.
StatusOr<std::optional<DType>> ParseWeightDType(const std::string& name);
// --weight-dtype and --group-size, or the checkpoint's format when
// --weight-dtype is "".
StatusOr<WeightFormat> MemoryWeightFormat(const MemoryOptions& o);
// How `f` is described in the report ("int4 projections (...)").
std::string WeightFormatName(const WeightFormat& f, DType weight_dtype);

}  // namespace mlarun::memory_internal
