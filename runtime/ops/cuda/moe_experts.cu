// The MoE's experts on the GPU (moe_experts.h), from the host's MoePlan.
//
// The workspace holds the CPU's three buffers (the routed rows of x, every
// job's hidden [n, 2I], every job's outputs [n, H]) and then what this run
// copies in from the plan (one copy): each routed row's slot, in job order
// (so routed row r of the x buffer is token slots[r] / top_k), and slot_y.
//  1. GatherRowsKernel: the routed rows of x, by slot;
//  2. per job, its MLP as the CPU's ApplyMlp does it: gate and up products
//     into the two halves of its hidden rows, SiLU-mul, the down product into
//     its output rows (one per (token, k) slot; the shared experts' over
//     every token);
//  3. WeightedSlotSumKernel: y[t] = sum over k in k order of
//     route_weights[t][k] * its slot's row (routes to other ranks' experts add
//     0), then + the shared experts' row, each product and sum rounded on its
//     own as on the CPU; so y differs from the CPU's only by the products'
//     rounding.
#include <cstring>
#include <vector>

#include "runtime/ops/backend.h"
#include "runtime/ops/cuda/common.cuh"

namespace mlarun::cuda {
namespace {

constexpr int kThreads = 256;

// moe_x[r] = x[slots[r] / top_k] for r < rows, rows of hidden floats.
__global__ void GatherRowsKernel(const float* __restrict__ x, int64_t hidden, int64_t top_k,
                                 const int32_t* __restrict__ slots, int64_t rows, float* __restrict__ moe_x) {
  const int64_t total = rows * hidden;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = e / hidden, c = e - r * hidden;
    moe_x[e] = x[static_cast<int64_t>(slots[r]) / top_k * hidden + c];
  }
}

// y[t][j] = sum_k w[t][k] * moe_y[slot_y[t * K + k] + j] (slots with
// slot_y < 0 skipped) + shared[t][j] (shared may be nullptr).
__global__ void WeightedSlotSumKernel(const float* __restrict__ moe_y, const int64_t* __restrict__ slot_y,
                                      const float* __restrict__ route_weights, const float* __restrict__ shared,
                                      int64_t tokens, int64_t hidden, int64_t top_k, float* __restrict__ y) {
  const int64_t total = tokens * hidden;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = e / hidden, j = e - t * hidden;
    float acc = 0.f;
    for (int64_t k = 0; k < top_k; ++k) {
      const int64_t row = slot_y[t * top_k + k];
      if (row < 0) continue;
      acc = __fadd_rn(acc, __fmul_rn(moe_y[row + j], route_weights[t * top_k + k]));
    }
    if (shared != nullptr) acc = __fadd_rn(acc, shared[e]);
    y[e] = acc;
  }
}

}  // namespace

Status MoeExperts(const MoeExpertsParams& p, const MoePlan& plan, WorkspaceView ws) {
  using Job = MoePlan::Job;
  const int64_t T = p.tokens, K = p.top_k, H = p.hidden;
  if (T == 0) return Status::Ok();
  const size_t routed_rows = plan.x_elems / static_cast<size_t>(H);
  WorkspaceCarver carve(ws);
  float* const moe_x = carve.Take<float>(plan.x_elems);
  float* const moe_h = carve.Take<float>(plan.h_elems);
  float* const moe_y = carve.Take<float>(plan.y_elems);
  int32_t* const slots = carve.Take<int32_t>(routed_rows);
  int64_t* const slot_y = carve.Take<int64_t>(static_cast<size_t>(T * K));
  if (carve.overflowed())
    return InvalidArgumentError("moe_experts: workspace of ", ws.bytes, " bytes, the cuda run needs ",
                                carve.used_bytes(), " (plan with params whose backend is cuda)");
  if (plan.slot_y.size() != static_cast<size_t>(T * K))
    return InvalidArgumentError("moe_experts: the plan has ", plan.slot_y.size(), " slots, the params ", T * K);

  // The plan's slot lists, staged in one host buffer laid out as the
  // workspace is from `slots` on, then one copy.
  const std::vector<Job>& jobs = plan.jobs;
  const size_t slots_bytes = reinterpret_cast<std::byte*>(slot_y) - reinterpret_cast<std::byte*>(slots);
  const size_t staged_bytes = slots_bytes + static_cast<size_t>(T * K) * sizeof(int64_t);
  thread_local std::vector<std::byte> staged;
  staged.resize(staged_bytes);
  auto* host_slots = reinterpret_cast<int32_t*>(staged.data());
  size_t r = 0;
  for (size_t ji = 0; ji < plan.routed_jobs; ++ji) {
    const Job& j = jobs[ji];
    if (j.x != r * static_cast<size_t>(H) || j.slots == nullptr || j.slots->size() != static_cast<size_t>(j.n))
      return InternalError("moe_experts: routed job ", ji, " is not laid out as MoeReplan lays jobs out");
    std::memcpy(host_slots + r, j.slots->data(), static_cast<size_t>(j.n) * sizeof(int32_t));
    r += static_cast<size_t>(j.n);
  }
  if (r != routed_rows) return InternalError("moe_experts: the plan's routed rows (", r, ") and x_elems disagree");
  std::memcpy(staged.data() + slots_bytes, plan.slot_y.data(), static_cast<size_t>(T * K) * sizeof(int64_t));
  MLARUN_CUDA_RETURN_IF_ERROR(cudaMemcpy(slots, staged.data(), staged_bytes, cudaMemcpyHostToDevice));

  if (routed_rows > 0) {
    GatherRowsKernel<<<GridFor(static_cast<int64_t>(routed_rows) * H, kThreads), kThreads>>>(
        p.x, H, K, slots, static_cast<int64_t>(routed_rows), moe_x);
    MLARUN_CUDA_RETURN_IF_LAUNCH_FAILED("GatherRowsKernel");
  }
  for (size_t ji = 0; ji < jobs.size(); ++ji) {
    const Job& j = jobs[ji];
    MLARUN_RETURN_IF_ERROR(ApplyMlp({.mlp = j.mlp,
                                     .x = j.slots != nullptr ? moe_x + j.x : p.x,
                                     .rows = j.n,
                                     .ldx = H,
                                     .y = moe_y + j.y,
                                     .ldy = H,
                                     .hidden = moe_h + j.h,
                                     .backend = Backend::kCuda}));
  }
  const float* shared = jobs.size() > plan.routed_jobs ? moe_y + jobs.back().y : nullptr;
  WeightedSlotSumKernel<<<GridFor(T * H, kThreads), kThreads>>>(moe_y, slot_y, p.route_weights, shared, T, H, K, p.y);
  MLARUN_CUDA_RETURN_IF_LAUNCH_FAILED("WeightedSlotSumKernel");
  return Status::Ok();
}

}  // namespace mlarun::cuda
