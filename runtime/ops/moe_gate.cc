#include "runtime/ops/moe_gate.h"

#include <cmath>

#include "runtime/ops/backend.h"

namespace mlarun {

Status MoeGateRun(const MoeGateParams& p) {
  if (p.tokens < 0) return InvalidArgumentError("moe_gate: tokens is negative (", p.tokens, ")");
  if (p.num_experts <= 0) return InvalidArgumentError("moe_gate: num_experts must be positive, got ", p.num_experts);
  if (p.top_k <= 0 || p.top_k > p.num_experts)
    return InvalidArgumentError("moe_gate: top_k (", p.top_k, ") must be in [1, num_experts = ", p.num_experts, "]");
  if (p.scoring != ScoringFunc::kSoftmax && p.scoring != ScoringFunc::kSigmoid)
    return InvalidArgumentError("moe_gate: unknown scoring ", static_cast<int>(p.scoring));
  if (p.method != TopkMethod::kGreedy && p.method != TopkMethod::kGroupLimitedGreedy &&
      p.method != TopkMethod::kNoauxTc)
    return InvalidArgumentError("moe_gate: unknown method ", static_cast<int>(p.method));
  if (p.n_group <= 0 || p.num_experts % p.n_group != 0)
    return InvalidArgumentError("moe_gate: n_group (", p.n_group, ") must divide num_experts (", p.num_experts, ")");
  if (p.method != TopkMethod::kGreedy && p.n_group > 1 && (p.topk_group <= 0 || p.topk_group > p.n_group))
    return InvalidArgumentError("moe_gate: topk_group (", p.topk_group, ") must be in [1, n_group = ", p.n_group, "]");
  if (!std::isfinite(p.routed_scaling_factor))
    return InvalidArgumentError("moe_gate: routed_scaling_factor must be finite, got ", p.routed_scaling_factor);
  if (p.tokens == 0) return Status::Ok();
  if (p.logits == nullptr || p.experts == nullptr || p.weights == nullptr)
    return InvalidArgumentError("moe_gate: logits, experts and weights must be set");
  switch (p.backend) {
    case Backend::kCpu:
      return cpu::MoeGate(p);
    case Backend::kCuda:
      return cuda::MoeGate(p);
  }
  return NoBackend("moe_gate", p.backend);
}

}  // namespace mlarun
