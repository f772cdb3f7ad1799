// MLA attention entry points: validation, planning, running, dispatch.
//
// Two formulations over one paged latent cache (docs/design.md "Attention"):
//  * absorbed: q_nope is folded through W_UK^T into latent space, attention
//    runs MQA-shaped against the [L + R]-wide cached rows (values: their first L
//    columns), and the [L]-wide result is folded through W_UV. Cheap per
//    context token; its fixed cost is per query token. Decode.
//  * expanded: the context's latents are up-projected through W_UK / W_UV into
//    per-head keys [P + R] (k_pe broadcast to every head) and values [V], then
//    ordinary causal MHA. The up-projection is per context token and shared by
//    all queries of the block. Prefill. Long contexts are up-projected in
//    bounded chunks whose partial results are merged by log-sum-exp.
// The dispatch is per sequence within one call: query blocks shorter than a
// threshold take the absorbed path. Blocks over a cached prefix and blocks
// without one (cold prefills, where the expanded path up-projects only the new
// tokens) have separate thresholds, both measured by `mlarun bench attention`.
//
// Lifecycle (host side): MlaCheck -> MlaMakePlan -> reserve
// plan.workspace_bytes -> MlaRun. Kernels never allocate. MlaForward does the
// three steps with a caller-owned Workspace.
#pragma once

#include <cstdint>
#include <memory>
#include <ostream>

#include "attention/mla_params.h"
#include "base/backend.h"
#include "base/cpu_isa.h"
#include "base/status.h"
#include "base/workspace.h"

namespace mlarun {

enum class MlaPath : uint8_t {
  kAuto = 0,      // per sequence, by absorb_below_query_len
  kAbsorbed = 1,  // every sequence absorbed
  kExpanded = 2,  // every sequence expanded
};

// Where the absorbed path stops paying: query blocks shorter than these take
// it, for blocks over a cached prefix and for blocks without one. The
// crossover is a property of the machine's kernels (the absorbed path's cost
// per (query, key) pair against the expanded path's up-projection), measured
// by `mlarun bench attention`: the thresholds with the smallest worst-case
// slowdown over its Q x S grid.
struct AbsorbThresholds {
  int64_t with_prefix = 0;
  int64_t no_prefix = 0;
  friend bool operator==(const AbsorbThresholds&, const AbsorbThresholds&) = default;
};
// The measured defaults of a CPU kernel family (`mlarun bench attention`
// under each family; the machines and dates: docs/attention.md).
AbsorbThresholds DefaultAbsorbThresholds(CpuIsa isa);

// MlaConfig's thresholds when left at this value: DefaultAbsorbThresholds of
// the kernel family in force.
inline constexpr int64_t kAbsorbThresholdOfCpu = -1;

struct MlaConfig {
  Backend backend = Backend::kCpu;
  MlaPath path = MlaPath::kAuto;
  // Blocks over a cached prefix whose query length is below this take the
  // absorbed path. Default: kAbsorbThresholdOfCpu.
  int64_t absorb_below_query_len = kAbsorbThresholdOfCpu;
  // The same for blocks without a cached prefix. Lower: with nothing cached
  // the expanded path up-projects only the block itself, which costs what the
  // folds would, and its MHA core is 3.4x cheaper per pair; only tiny blocks,
  // where both paths are bound by reading W_UK / W_UV, favour absorption.
  // Default: kAbsorbThresholdOfCpu.
  int64_t absorb_below_query_len_no_prefix = kAbsorbThresholdOfCpu;
  // Expanded path: context rows up-projected at once (bounds its K/V
  // workspace; 64k rows as vLLM's chunked-prefill workspace). Default 65536.
  int64_t expand_chunk_rows = 65536;
  // CPU: keys per attention tile (scores stay in L2). Multiple of 64. Default 1024.
  int64_t kv_tile_rows = 1024;
  // CPU: query rows (token x head) per attention tile. Default 256.
  int64_t q_tile_rows = 256;
  // CPU threads; 0 means the OpenMP default.
  int num_threads = 0;

  friend bool operator==(const MlaConfig&, const MlaConfig&) = default;
};
std::ostream& operator<<(std::ostream& os, const MlaConfig& c);

// Checks shapes, dtypes, strides and the batch description, naming the first
// field that is wrong. Reads the host batch arrays; never the tensors.
Status MlaCheck(const MlaParams& p);
Status MlaCheckConfig(const MlaConfig& c);

// The thresholds `c` stands for (its own, or its kernel family's).
AbsorbThresholds MlaAbsorbThresholds(const MlaConfig& c);

// Which path a block of `query_len` tokens over `prefix_len` cached tokens
// takes under `c`.
MlaPath MlaPathFor(const MlaConfig& c, int64_t query_len, int64_t prefix_len);

struct MlaPlanImpl;  // backend-specific

// Host-side plan for one batch description. Valid for any MlaParams whose
// shape, dtypes, strides and batch arrays equal those it was made from (the
// data pointers may differ).
struct MlaPlan {
  MlaPlan();
  ~MlaPlan();
  MlaPlan(MlaPlan&&) noexcept;
  MlaPlan& operator=(MlaPlan&&) noexcept;

  Backend backend = Backend::kCpu;
  size_t workspace_bytes = 0;
  int64_t absorbed_seqs = 0;
  int64_t expanded_seqs = 0;
  std::unique_ptr<MlaPlanImpl> impl;
};

StatusOr<MlaPlan> MlaMakePlan(const MlaParams& p, const MlaConfig& c);
// The same into `plan`, reusing what an earlier plan of it allocated (its
// lists, its cached products): a model step plans every step, and after a
// few steps of the shapes it sees, planning allocates nothing. An empty
// plan, or one for another backend, is made anew.
Status MlaReplan(const MlaParams& p, const MlaConfig& c, MlaPlan& plan);

// Runs the plan. Blocks until done. `ws` must hold plan.workspace_bytes.
Status MlaRun(const MlaParams& p, const MlaPlan& plan, WorkspaceView ws);

// Check, plan, reserve and run.
Status MlaForward(const MlaParams& p, const MlaConfig& c, Workspace& ws);

// FLOPs of the attention as each path computes it (multiply-add = 2), for
// benchmarks: absorbed counts the two folds and the MQA-shaped core over the
// visible keys, expanded counts the up-projection of every context row and the
// causal MHA over the visible keys.
double MlaAbsorbedFlops(const MlaShape& s, int64_t query_len, int64_t seq_len);
double MlaExpandedFlops(const MlaShape& s, int64_t query_len, int64_t seq_len);

}  // namespace mlarun
