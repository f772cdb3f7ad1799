// CUDA MLA attention: what the benchmark sees beyond attention/backend.h.
// Plain C++ (no CUDA headers). Implemented by attention/cuda/mla_cuda.cu;
// only in builds with CUDA.
#pragma once

#include <cstdint>

#include "attention/backend.h"

namespace mlarun::cuda {

// What a CUDA plan decided for its absorbed sequences.
struct MlaCudaPlanStats {
  int64_t decode_blocks = 0;   // work items of the split decode kernel
  int64_t split_seqs = 0;      // sequences with more than one split
  int64_t max_splits = 0;      // most splits of one sequence
  int64_t rows_per_block = 0;  // query rows (token x head) per decode block
  int64_t split_keys = 0;      // the split length of the rule (attention/cuda/split_plan.h)
  int64_t blocks_per_sm = 0;   // resident decode blocks per SM
};
StatusOr<MlaCudaPlanStats> MlaCudaStats(const MlaPlanImpl& plan);

// Runs only the absorbed path's attention kernels of `plan`: the split
// decode and, with `combine`, the merge of the splits (not the query
// conversion, the two folds or the staging copy). The workspace must hold
// what a RunMla of the same plan and params left there. Does not wait for
// the kernels (they run on the legacy default stream). For benchmarks.
Status RunMlaDecodeCore(const MlaParams& p, const MlaPlanImpl& plan, WorkspaceView ws, bool combine);

}  // namespace mlarun::cuda
