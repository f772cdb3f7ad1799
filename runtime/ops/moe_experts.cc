#include "runtime/ops/moe_experts.h"

#include <algorithm>

#include "runtime/ops/backend.h"

namespace mlarun {
namespace {

Status Check(const MoeExpertsParams& p) {
  if (p.tokens < 0 || p.hidden <= 0)
    return InvalidArgumentError("moe_experts: tokens (", p.tokens, ") must be >= 0 and hidden (", p.hidden,
                                ") positive");
  if (p.num_experts <= 0 || p.top_k <= 0 || p.top_k > p.num_experts)
    return InvalidArgumentError("moe_experts: num_experts (", p.num_experts, ") must be positive and top_k (", p.top_k,
                                ") in [1, num_experts]");
  if (p.num_local < 0 || p.expert_begin < 0 || p.expert_begin + p.num_local > p.num_experts)
    return InvalidArgumentError("moe_experts: local experts [expert_begin, expert_begin + num_local) = [",
                                p.expert_begin, ", ", p.expert_begin + p.num_local, ") outside [0, ", p.num_experts,
                                ")");
  if (p.num_local > 0 && p.experts == nullptr) return InvalidArgumentError("moe_experts: experts is null");
  if (p.tokens > 0 && (p.x == nullptr || p.y == nullptr || p.route_experts == nullptr || p.route_weights == nullptr))
    return InvalidArgumentError("moe_experts: x, y, route_experts and route_weights must be set");
  return Status::Ok();
}

Status CheckMlp(const Mlp& m, int64_t hidden, std::string_view what, int64_t id) {
  if (m.gate.in != hidden || m.up.in != hidden || m.down.out != hidden || m.up.out != m.gate.out ||
      m.down.in != m.gate.out)
    return InvalidArgumentError("moe_experts: ", what, id >= 0 ? " " : "", id >= 0 ? std::to_string(id) : "",
                                " has gate [", m.gate.out, ", ", m.gate.in, "], up [", m.up.out, ", ", m.up.in,
                                "], down [", m.down.out, ", ", m.down.in, "] for hidden ", hidden);
  return Status::Ok();
}

}  // namespace

Status MoeReplan(const MoeExpertsParams& p, MoePlan& plan) {
  MLARUN_RETURN_IF_ERROR(Check(p));
  const int64_t T = p.tokens, K = p.top_k, H = p.hidden, E = p.num_experts;
  plan.tokens = T, plan.hidden = H, plan.top_k = K;
  std::vector<std::vector<int32_t>>& by_expert = plan.by_expert;  // slot ids (t * K + k)
  by_expert.resize(static_cast<size_t>(E));
  for (auto& v : by_expert) v.clear();
  for (int64_t sl = 0; sl < T * K; ++sl) {
    const int32_t e = p.route_experts[sl];
    if (e < 0 || e >= E)
      return InvalidArgumentError("moe_experts: route_experts[", sl, "] = ", e, " outside [0, ", E, ")");
    by_expert[static_cast<size_t>(e)].push_back(static_cast<int32_t>(sl));
  }

  // The MLPs to run: the routed experts some token chose, then the shared
  // experts over every token. Each gets its rows of x, a hidden [n, 2I] and
  // an output [n, H] in three flat buffers.
  std::vector<MoePlan::Job>& jobs = plan.jobs;
  jobs.clear();
  size_t x_size = 0, h_size = 0, y_size = 0;
  auto add = [&](const Mlp& m, const std::vector<int32_t>* slots, int64_t n) {
    jobs.push_back(MoePlan::Job{&m, slots, n, x_size, h_size, y_size});
    x_size += static_cast<size_t>(slots ? n * H : 0);
    h_size += static_cast<size_t>(n * 2 * m.intermediate());
    y_size += static_cast<size_t>(n * H);
  };
  for (int64_t e = p.expert_begin; e < p.expert_begin + p.num_local; ++e) {
    const std::vector<int32_t>& slots = by_expert[static_cast<size_t>(e)];
    if (slots.empty()) continue;
    const Mlp& m = p.experts[e - p.expert_begin];
    MLARUN_RETURN_IF_ERROR(CheckMlp(m, H, "expert", e));
    add(m, &slots, static_cast<int64_t>(slots.size()));
  }
  plan.routed_jobs = jobs.size();
  if (p.shared != nullptr && T > 0) {
    MLARUN_RETURN_IF_ERROR(CheckMlp(*p.shared, H, "shared experts", -1));
    add(*p.shared, nullptr, T);
  }
  plan.x_elems = x_size, plan.h_elems = h_size, plan.y_elems = y_size;
  WorkspaceCarver sizing({});
  sizing.Take<float>(x_size), sizing.Take<float>(h_size), sizing.Take<float>(y_size);
  // CUDA also copies the plan's slots in (runtime/ops/cuda/moe_experts.cu):
  // each routed row's slot, then slot_y.
  if (p.backend == Backend::kCuda)
    sizing.Take<int32_t>(x_size / static_cast<size_t>(H)), sizing.Take<int64_t>(static_cast<size_t>(T * K));
  plan.workspace_bytes = sizing.used_bytes();

  // The products as items of at most ~1 MiB of weights each (a column range
  // of one matrix), in matrix order.
  plan.up_items.clear();
  plan.down_items.clear();
  constexpr int64_t kItemBytes = int64_t{1} << 20;
  auto split = [](std::vector<MoePlan::Item>& out, uint32_t job, uint8_t matrix, const Linear& w) {
    const int64_t parts =
        std::clamp<int64_t>((w.bytes() + kItemBytes - 1) / kItemBytes, 1, std::max<int64_t>(w.out / 16, 1));
    for (int64_t q = 0; q < parts; ++q)
      out.push_back(MoePlan::Item{job, matrix, w.out * q / parts, w.out * (q + 1) / parts});
  };
  for (uint32_t ji = 0; ji < jobs.size(); ++ji) {
    split(plan.up_items, ji, 0, jobs[ji].mlp->gate);
    split(plan.up_items, ji, 1, jobs[ji].mlp->up);
    split(plan.down_items, ji, 2, jobs[ji].mlp->down);
  }

  // Where each slot's output row lands; routes to other ranks' experts have none.
  plan.slot_y.assign(static_cast<size_t>(T * K), -1);
  for (size_t ji = 0; ji < plan.routed_jobs; ++ji)
    for (int64_t r = 0; r < jobs[ji].n; ++r)
      plan.slot_y[static_cast<size_t>((*jobs[ji].slots)[static_cast<size_t>(r)])] =
          static_cast<int64_t>(jobs[ji].y) + r * H;
  return Status::Ok();
}

Status MoeExpertsRun(const MoeExpertsParams& p, const MoePlan& plan, WorkspaceView ws) {
  MLARUN_RETURN_IF_ERROR(Check(p));
  if (plan.tokens != p.tokens || plan.hidden != p.hidden || plan.top_k != p.top_k)
    return InvalidArgumentError("moe_experts: the plan is for tokens ", plan.tokens, ", hidden ", plan.hidden,
                                ", top_k ", plan.top_k, "; the params have ", p.tokens, ", ", p.hidden, ", ", p.top_k);
  if (ws.bytes < plan.workspace_bytes || (plan.workspace_bytes > 0 && ws.data == nullptr))
    return InvalidArgumentError("moe_experts: workspace of ", ws.bytes, " bytes, the plan needs ",
                                plan.workspace_bytes);
  switch (p.backend) {
    case Backend::kCpu:
      return cpu::MoeExperts(p, plan, ws);
    case Backend::kCuda:
      return cuda::MoeExperts(p, plan, ws);
  }
  return NoBackend("moe_experts", p.backend);
}

}  // namespace mlarun
