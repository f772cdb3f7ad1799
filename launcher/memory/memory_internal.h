// Internal to launcher/memory/: the pieces the prediction and the measurement
// share.
#pragma once

#include <optional>
#include <string>

#include "base/dtype.h"
#include "base/status.h"
#include "launcher/memory/memory.h"
#include "parallel/layout.h"
#include "runtime/model/memory_plan.h"
#include "runtime/model/model.h"
#include "runtime/model/model_config.h"

namespace mlarun::memory_internal {

// "tp8", "dp8", "dp2xtp4", or the --parallel form "dp=2,attn_tp=4[,moe=...]".
// With world > 0 the layout must have that many ranks.
StatusOr<ParallelLayout> ParseLayoutName(const std::string& name, int world);
// The short name: tp8, dp8, dp2xtp4 (plus "(moe=intermediate)").
std::string LayoutName(const ParallelLayout& l);

// A prefill/decode split (mlarun serve --prefill-parallel P --parallel D):
// two worker jobs, each its own world, so each shards the MLPs over its own
// ranks only.
struct SplitLayout {
  ParallelLayout prefill, decode;
  int world() const { return prefill.world() + decode.world(); }
};
// Whether `name` spells a split: it has a '+' between its two jobs.
bool IsSplitName(const std::string& name);
// "p:LAYOUT+d:LAYOUT" (LAYOUT any spelling ParseLayoutName takes; "prefill:"
// and "decode:" spelt out too, either job first), or the short form where
// the role letter stands for "dp": "p2+d2" is p:dp2+d:dp2, "p1xtp2+d2" is
// p:dp1xtp2+d:dp2. With world > 0 the two jobs' ranks must add up to it.
StatusOr<SplitLayout> ParseSplitName(const std::string& name, int world);
// The canonical name: "p:dp2+d:dp2", "p:tp2+d:dp4".
std::string SplitName(const SplitLayout& s);

// What a group's cache holds at once in units of `tokens_each` tokens
// (prompts on a prefill group, running sequences on a decode or mixed one),
// each taking whole blocks.
struct Held {
  int64_t tokens_each = 0, blocks_each = 0;
  int64_t per_group = 0, cluster = 0;  // cluster: per_group x the layout's DP groups
};
Held HeldBy(const RankMemory& plan, int64_t tokens_each);
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
