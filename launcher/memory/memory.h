// `mlarun memory`: what each rank holds under tensor-parallel and
// data-parallel attention layouts, predicted from the model's shapes
// (runtime/model/memory_plan.h); and `mlarun memory --measure`, the same
// prediction set beside what a live deployment's ranks report through the
// coordinator's GetStats.
#pragma once

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "base/block_size.h"
#include "base/status.h"
#include "serving/security/security.h"

namespace mlarun {

struct MemoryOptions {
  std::string model;                 // checkpoint dir, config.json, or configs/models/*.yaml
  int world = 8;                     // ranks
  std::vector<std::string> layouts;  // "tp8", "dp8", "dp2xtp4", "dp=2,attn_tp=4", split "p4+d4"; empty: tpW, dpW, a mix
  double memory_gib = 141;           // per rank (H200: 141)
  std::string kv_dtype;              // "" keeps the model's
  std::string weight_dtype;          // "" what mlarun holds (the model's); "fp8": the release's block-fp8;
                                     // "int8" / "int4": integer projections with fp32 group scales
  int64_t group_size = 128;          // --weight-dtype int8 / int4: elements per scale (<= 0: per channel)
  std::string lm_head = "keep";      // keep, or int8 / int4: quantized at load (--lm-head)
  int64_t num_layers = 0;            // YAML models: reduced depth
  int64_t block_size = kDefaultBlockSize;
  int64_t chunk_rows = 65536;  // expanded-path workspace rows
  bool json = false;           // one JSON document instead of the tables
  std::string json_path;       // also write that document to this file (the tables still print)
  std::string svg_path;        // the chart, if set

  // What a group's cache holds at once, whole blocks each: a prefill group's
  // prompts of prompt_tokens, a decode or mixed group's running sequences of
  // context_tokens (0: prompt_tokens + 1024).
  int64_t prompt_tokens = 4096;
  int64_t context_tokens = 0;

  // --measure: compare with a live deployment.
  bool measure = false;
  std::string coordinator;
  std::string requests_path;  // the request set submitted (JSON lines with prompt_ids)
  std::string results_path;   // `mlarun submit --json` output for it, same order (tokens, dp_group)
  double timeout_s = 15;      // waiting for the ranks' reports to settle
  ClientSecurity security;    // TLS and the bearer token for GetStats
};

// Prints the prediction for opt.layouts. Errors (a bad model file, a layout
// that does not match the world or the model) name what was wrong.
Status RunMemory(const MemoryOptions& opt, std::ostream& out);

// Reads GetStats from opt.coordinator, predicts every reporting rank from the
// model and its job's layout, and prints both side by side. Returns
// FAILED_PRECONDITION (after printing) when any latent-cache figure differs.
Status RunMemoryMeasure(const MemoryOptions& opt, std::ostream& out);

}  // namespace mlarun
