// The MoE router's choice of experts on the GPU (moe_gate.h), as
// runtime/ops/cpu/moe_gate.cc computes it, with the same arithmetic
// (runtime/ops/moe_gate_math.h) in the same order, so the experts and weights
// equal the CPU's.
//
// MoeGateKernel: one block per token, its row in shared memory:
//  1. scores: sigmoid per expert (V3), or softmax (V2: the block's max, the
//     exponentials per expert, their fp32 sum by one thread in expert order as
//     the CPU sums, the division per expert);
//  2. choice = scores + e_score_correction_bias;
//  3. group limits: one thread per group computes its score (GateGroupScore)
//     and then its rank among the groups; experts of groups ranked
//     >= topk_group get the masked choice (-inf V3, 0 V2);
//  4. top-k: every expert's rank in GateBefore's total order (GateRank), so
//     the experts ranked < top_k are the choice, best first, each slot written
//     by exactly one thread;
//  5. weights: one thread, in k order (the unbiased scores, the optional
//     renormalization, the scaling factor), as the CPU.
// Shared memory: (2 E + G) floats and (G + K) ints.
#include "runtime/ops/backend.h"
#include "runtime/ops/cuda/common.cuh"
#include "runtime/ops/moe_gate_math.h"

namespace mlarun::cuda {
namespace {

constexpr int kThreads = 256;

struct GateArgs {
  const float* logits;
  const float* bias;
  int64_t num_experts, top_k, n_group, topk_group;
  bool softmax, grouped, noaux_tc, norm_topk_prob;
  float routed_scaling_factor;
  int32_t* experts;
  float* weights;
};

__global__ void MoeGateKernel(GateArgs a) {
  extern __shared__ float smem[];
  const int64_t E = a.num_experts, K = a.top_k, G = a.n_group, per_group = E / G;
  float* scores = smem;
  float* choice = smem + E;
  float* group_scores = smem + 2 * E;
  int* keep = reinterpret_cast<int*>(group_scores + G);
  int* chosen = keep + G;
  const int64_t t = blockIdx.x;
  const float* logits = a.logits + t * E;

  if (a.softmax) {
    float mx = -INFINITY;
    for (int64_t e = threadIdx.x; e < E; e += kThreads) mx = fmaxf(mx, logits[e]);
    mx = BlockReduce(mx, MaxOp{}, -INFINITY);
    for (int64_t e = threadIdx.x; e < E; e += kThreads) scores[e] = GateExp(logits[e] - mx);
    __syncthreads();
    if (threadIdx.x == 0) {
      float sum = 0.f;
      for (int64_t e = 0; e < E; ++e) sum += scores[e];
      group_scores[0] = sum;  // handed to the other threads; the groups' use comes after a barrier
    }
    __syncthreads();
    const float sum = group_scores[0];
    for (int64_t e = threadIdx.x; e < E; e += kThreads) scores[e] /= sum;
  } else {
    for (int64_t e = threadIdx.x; e < E; e += kThreads) scores[e] = GateSigmoid(logits[e]);
  }
  for (int64_t e = threadIdx.x; e < E; e += kThreads) choice[e] = a.bias != nullptr ? scores[e] + a.bias[e] : scores[e];
  __syncthreads();

  if (a.grouped && G > 1) {
    for (int64_t g = threadIdx.x; g < G; g += kThreads)
      group_scores[g] = GateGroupScore(choice + g * per_group, per_group, a.noaux_tc);
    __syncthreads();
    for (int64_t g = threadIdx.x; g < G; g += kThreads) keep[g] = GateRank(group_scores, G, g) < a.topk_group;
    __syncthreads();
    const float masked = a.noaux_tc ? -INFINITY : 0.f;
    for (int64_t e = threadIdx.x; e < E; e += kThreads)
      if (!keep[e / per_group]) choice[e] = masked;
    __syncthreads();
  }

  for (int64_t e = threadIdx.x; e < E; e += kThreads) {
    const int64_t rank = GateRank(choice, E, e);
    if (rank < K) chosen[rank] = static_cast<int>(e);
  }
  __syncthreads();

  if (threadIdx.x == 0) {
    int32_t* experts = a.experts + t * K;
    float* weights = a.weights + t * K;
    float sum = 0.f;
    for (int64_t k = 0; k < K; ++k) {
      experts[k] = chosen[k];
      weights[k] = scores[chosen[k]];  // unbiased score
      sum += weights[k];
    }
    if (a.norm_topk_prob && K > 1)
      for (int64_t k = 0; k < K; ++k) weights[k] /= sum + 1e-20f;
    for (int64_t k = 0; k < K; ++k) weights[k] *= a.routed_scaling_factor;
  }
}

}  // namespace

Status MoeGate(const MoeGateParams& p) {
  if (p.tokens == 0) return Status::Ok();
  MLARUN_RETURN_IF_ERROR(CheckInt("moe_gate", "tokens", p.tokens));
  const int64_t E = p.num_experts, G = p.n_group, K = p.top_k;
  const size_t smem = static_cast<size_t>(2 * E + G) * sizeof(float) + static_cast<size_t>(G + K) * sizeof(int);
  // A block gets 48 KiB of shared memory without opting in, static included:
  // BlockReduce's 32 floats come out of it too.
  constexpr size_t kMaxDynamic = 48 * 1024 - 32 * sizeof(float);
  if (smem > kMaxDynamic)
    return InvalidArgumentError("moe_gate: ", E, " experts need ", smem, " bytes of shared memory on cuda (at most ",
                                kMaxDynamic, ")");
  const GateArgs a{.logits = p.logits,
                   .bias = p.bias,
                   .num_experts = E,
                   .top_k = K,
                   .n_group = G,
                   .topk_group = p.topk_group,
                   .softmax = p.scoring == ScoringFunc::kSoftmax,
                   .grouped = p.method == TopkMethod::kNoauxTc || p.method == TopkMethod::kGroupLimitedGreedy,
                   .noaux_tc = p.method == TopkMethod::kNoauxTc,
                   .norm_topk_prob = p.norm_topk_prob,
                   .routed_scaling_factor = static_cast<float>(p.routed_scaling_factor),
                   .experts = p.experts,
                   .weights = p.weights};
  MoeGateKernel<<<static_cast<unsigned>(p.tokens), kThreads, smem>>>(a);
  MLARUN_CUDA_RETURN_IF_LAUNCH_FAILED("MoeGateKernel");
  return Status::Ok();
}

}  // namespace mlarun::cuda
