// The MoE's experts over a step's rows: y[t] = sum_k weight[t][k] *
// expert[t][k](x[t]) (over the routed experts this rank holds; routes to
// other ranks' experts add 0) + shared(x[t]).
//
// Lifecycle: MoeReplan (host: groups the tokens by expert and splits the
// products into work items) -> reserve plan.workspace_bytes -> MoeExpertsRun.
//
// The plan, for the CPU: tokens are grouped by expert so each expert runs one
// product over its tokens, and the products are cut into (expert, matrix,
// column range) items of about 1 MiB of weights, so a few experts with one
// token each (a decode step) keep every thread streaming weights to the end
// of each phase. The run: the gate and up items, then SiLU, then the down
// items, each thread taking one contiguous run of items (each reads its
// weights as a few long sequential runs; a run that starts anew costs the
// prefetchers' warm-up: handing out items one by one was slower). Each
// (token, k) result goes to its own slot (no two threads add into one row)
// and the slots are summed in k order, so the result does not depend on the
// thread count.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "base/backend.h"
#include "base/status.h"
#include "base/workspace.h"
#include "runtime/ops/linear.h"

namespace mlarun {

struct MoeExpertsParams {
  const Mlp* experts = nullptr;  // [num_local]: global expert ids [expert_begin, expert_begin + num_local)
  int64_t num_local = 0;
  int64_t expert_begin = 0;
  int64_t num_experts = 0;      // E: route ids lie in [0, E)
  const Mlp* shared = nullptr;  // the shared experts (fused), over every token; nullptr: none
  const float* x = nullptr;     // [tokens, hidden], contiguous
  int64_t tokens = 0;
  int64_t hidden = 0;
  const int32_t* route_experts = nullptr;  // [tokens, top_k] (MoeGateRun's)
  const float* route_weights = nullptr;    // [tokens, top_k]
  int64_t top_k = 0;
  float* y = nullptr;  // [tokens, hidden], contiguous; overwritten
  Backend backend = Backend::kCpu;
};

// Made from one step's routes; valid for params with the same shapes and
// route_experts (the data pointers may differ). Reused step after step: after
// the first steps of a shape, re-planning allocates nothing.
struct MoePlan {
  struct Job {  // one MLP over its rows
    const Mlp* mlp = nullptr;
    const std::vector<int32_t>* slots = nullptr;  // its rows' slots (t * top_k + k); nullptr: every token
    int64_t n = 0;                                // rows
    size_t x = 0, h = 0, y = 0;                   // element offsets into the x, hidden and y buffers
  };
  struct Item {  // columns [c0, c1) of one matrix of one job
    uint32_t job = 0;
    uint8_t matrix = 0;  // 0 gate, 1 up, 2 down
    int64_t c0 = 0, c1 = 0;
  };
  int64_t tokens = 0, hidden = 0, top_k = 0;
  std::vector<std::vector<int32_t>> by_expert;  // [num_experts]: slots routed to each expert
  std::vector<Job> jobs;                        // the routed experts some token chose, then the shared
  size_t routed_jobs = 0;
  std::vector<Item> up_items, down_items;        // gate and up items, down items, in job order
  std::vector<int64_t> slot_y;                   // [tokens * top_k]: its output row's offset in y, -1: none here
  size_t x_elems = 0, h_elems = 0, y_elems = 0;  // buffer sizes (floats)
  size_t workspace_bytes = 0;
};

// Plans `p` into `plan`, reusing its lists. Reads route_experts (host
// memory); an id outside [0, num_experts) is an error naming it.
Status MoeReplan(const MoeExpertsParams& p, MoePlan& plan);
// Runs the plan. Blocks until done. `ws` must hold plan.workspace_bytes.
Status MoeExpertsRun(const MoeExpertsParams& p, const MoePlan& plan, WorkspaceView ws);

}  // namespace mlarun
