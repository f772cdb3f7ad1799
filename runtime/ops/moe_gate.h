// The MoE router's choice of experts per token, as transformers'
// DeepseekV2TopkRouter / DeepseekV3TopkRouter compute it from the router
// logits (the router's product itself is a LinearRun):
//  * scores: softmax over the experts (V2) or sigmoid of each logit (V3);
//  * choice scores: the scores plus e_score_correction_bias (V3; none in V2);
//  * group-limited (V2 group_limited_greedy: a group's best choice score; V3
//    noaux_tc: the sum of its two best): only the topk_group best groups keep
//    their experts (the others' choice scores masked to 0 in V2, -inf in V3);
//  * the top_k experts by choice score (ties: the lower id), weighted by their
//    unbiased scores, renormalized to sum 1 with norm_topk_prob, times
//    routed_scaling_factor.
#pragma once

#include <cstdint>

#include "base/backend.h"
#include "base/status.h"

namespace mlarun {

// Values are frozen (configs).
enum class TopkMethod : uint8_t { kGreedy = 0, kGroupLimitedGreedy = 1, kNoauxTc = 2 };
enum class ScoringFunc : uint8_t { kSoftmax = 0, kSigmoid = 1 };

struct MoeGateParams {
  const float* logits = nullptr;  // [tokens, num_experts] router logits, contiguous
  int64_t tokens = 0;
  int64_t num_experts = 0;
  const float* bias = nullptr;  // [num_experts] e_score_correction_bias; nullptr: none (V2)
  ScoringFunc scoring = ScoringFunc::kSoftmax;
  TopkMethod method = TopkMethod::kGreedy;
  int64_t top_k = 0;       // num_experts_per_tok
  int64_t n_group = 1;     // expert groups; num_experts a multiple of it
  int64_t topk_group = 1;  // groups kept per token (group-limited methods)
  bool norm_topk_prob = false;
  double routed_scaling_factor = 1.0;
  int32_t* experts = nullptr;  // [tokens, top_k] out: ids, best choice score first
  float* weights = nullptr;    // [tokens, top_k] out
  Backend backend = Backend::kCpu;
};
// CPU: one thread; per-thread scratch, grown once.
Status MoeGateRun(const MoeGateParams& p);

}  // namespace mlarun
