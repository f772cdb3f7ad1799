// `mlarun bench attention`: absorbed vs expanded MLA on this machine.
//
// Measures, with DeepSeek-V3 attention dims by default:
//  * decode (one query token, context 4096, batch 1 and 32): both paths, the
//    measured time ratio next to the FLOP-count prediction, and the absorbed
//    path's GFLOP/s against the GEMM library running the same matrix shapes in
//    the same process (plus the large square GEMM peak);
//  * a grid of query length Q x context S: both paths, the crossover Q for each
//    S and the dispatch threshold it suggests.
// Timing is Google Benchmark's (median of repetitions); every measured pair is
// verified first (both paths must agree).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "attention/mla_params.h"
#include "base/status.h"

namespace mlarun {

struct AttentionBenchOptions {
  bool quick = false;    // decode rows + a small grid, for scripts and the demo
  bool json = false;     // JSON document on stdout (the table goes to stderr)
  std::string svg_path;  // draw the Q x S grid here when set
  DType dtype = DType::kBF16;
  int64_t heads = 128;
  int threads = 0;                  // 0: OpenMP default
  int repetitions = 0;              // 0: 3 (1 with quick)
  double min_time_s = 0;            // per repetition; 0: 0.3 s (0.05 with quick)
  std::vector<int64_t> contexts;    // grid S; empty: default
  std::vector<int64_t> query_lens;  // grid Q; empty: default
  std::string write_thresholds;     // write the suggested thresholds here (runtime/rank/thresholds.h)
};

Status RunAttentionBench(const AttentionBenchOptions& options);

}  // namespace mlarun
