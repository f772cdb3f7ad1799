// The MoE's experts on the CPU: one parallel region of three phases over the
// plan's items (moe_experts.h; the products taken as ContiguousShares), then
// the weighted sum of the slots.
#include <omp.h>

#include <algorithm>
#include <cstring>

#include "base/contiguous_shares.h"
#include "base/first_error.h"
#include "runtime/ops/backend.h"

namespace mlarun::cpu {

Status MoeExperts(const MoeExpertsParams& p, const MoePlan& plan, WorkspaceView ws) {
  using Job = MoePlan::Job;
  using Item = MoePlan::Item;
  const int64_t T = p.tokens, K = p.top_k, H = p.hidden;
  const float* X = p.x;
  WorkspaceCarver carve(ws);
  float* const moe_x = carve.Take<float>(plan.x_elems);  // the routed experts' rows of X
  float* const moe_h = carve.Take<float>(plan.h_elems);  // every job's hidden [n, 2I]
  float* const moe_y = carve.Take<float>(plan.y_elems);  // every job's outputs [n, H]
  const std::vector<Job>& jobs = plan.jobs;
  const std::vector<Item>& up_items = plan.up_items;
  const std::vector<Item>& down_items = plan.down_items;
  const size_t routed_jobs = plan.routed_jobs;
  auto rows_of = [&](const Job& j) { return j.slots ? moe_x + j.x : X; };
  auto up_params = [&](const Item& item) {
    const Job& j = jobs[item.job];
    const int64_t I = j.mlp->intermediate();
    const bool up = item.matrix == 1;
    return LinearParams{.w = up ? &j.mlp->up : &j.mlp->gate,
                        .col_begin = item.c0,
                        .col_end = item.c1,
                        .x = rows_of(j),
                        .rows = j.n,
                        .ldx = H,
                        .y = moe_h + j.h + static_cast<size_t>((up ? I : 0) + item.c0),
                        .ldy = 2 * I};
  };
  auto down_params = [&](const Item& item) {
    const Job& j = jobs[item.job];
    return LinearParams{.w = &j.mlp->down,
                        .col_begin = item.c0,
                        .col_end = item.c1,
                        .x = moe_h + j.h,
                        .rows = j.n,
                        .ldx = 2 * j.mlp->intermediate(),
                        .y = moe_y + j.y + static_cast<size_t>(item.c0),
                        .ldy = H};
  };
  // Threads take the items dynamically (ContiguousShares: a thread slowed by
  // a shared core does not hold the others at the barrier), so each first
  // grows its linear buffers to the largest item's.
  LinearBufferSizes buffers;
  for (const Item& item : up_items) {
    MLARUN_ASSIGN_OR_RETURN(const LinearBufferSizes s, LinearBuffersFor(up_params(item)));
    buffers.Grow(s);
  }
  for (const Item& item : down_items) {
    MLARUN_ASSIGN_OR_RETURN(const LinearBufferSizes s, LinearBuffersFor(down_params(item)));
    buffers.Grow(s);
  }
  const int threads = std::max(1, omp_get_max_threads());
  ContiguousShares up_shares(static_cast<int64_t>(up_items.size()), threads, 1);
  ContiguousShares down_shares(static_cast<int64_t>(down_items.size()), threads, 1);
  FirstError err;
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num();
    ReserveLinearBuffers(buffers);
#pragma omp for schedule(static)
    for (size_t ji = 0; ji < routed_jobs; ++ji) {  // gather each expert's rows
      const Job& j = jobs[ji];
      for (int64_t r = 0; r < j.n; ++r)
        std::memcpy(moe_x + j.x + static_cast<size_t>(r * H), X + (*j.slots)[static_cast<size_t>(r)] / K * H,
                    static_cast<size_t>(H) * sizeof(float));
    }
    up_shares.Run(t, [&](int64_t b, int64_t e) {  // gate and up
      for (int64_t it = b; it < e; ++it) err.Set(ApplyLinear(up_params(up_items[static_cast<size_t>(it)])));
    });
#pragma omp barrier
#pragma omp for schedule(static)
    for (size_t ji = 0; ji < jobs.size(); ++ji)
      err.Set(SiluMul({.hidden = moe_h + jobs[ji].h, .rows = jobs[ji].n, .inter = jobs[ji].mlp->intermediate()}));
    down_shares.Run(t, [&](int64_t b, int64_t e) {  // down
      for (int64_t it = b; it < e; ++it) err.Set(ApplyLinear(down_params(down_items[static_cast<size_t>(it)])));
    });
  }
  MLARUN_RETURN_IF_ERROR(err.Get());

  // Weighted slots, summed in k order; routes to other ranks' experts add 0.
  const float* shared = jobs.size() > routed_jobs ? moe_y + jobs.back().y : nullptr;
  const int64_t* slot_y = plan.slot_y.data();
  const float* route_weights = p.route_weights;
  float* Y = p.y;
#pragma omp parallel for schedule(static) if (T > 4)
  for (int64_t t = 0; t < T; ++t) {
    float* dst = Y + t * H;
    std::fill(dst, dst + H, 0.f);
    for (int64_t k = 0; k < K; ++k) {
      if (slot_y[t * K + k] < 0) continue;
      const float* src = moe_y + slot_y[t * K + k];
      const float w = route_weights[t * K + k];
      for (int64_t j = 0; j < H; ++j) dst[j] += src[j] * w;
    }
    if (shared)
      for (int64_t j = 0; j < H; ++j) dst[j] += shared[t * H + j];
  }
  return Status::Ok();
}

}  // namespace mlarun::cpu
