#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "runtime/ops/backend.h"
#include "runtime/ops/moe_gate_math.h"

namespace mlarun::cpu {
namespace {

// Indices of the k largest values in GateBefore's order (ties: the lower
// index first; NaN as -inf).
void TopK(const float* v, int64_t n, int64_t k, std::vector<int32_t>& idx) {
  idx.resize(static_cast<size_t>(n));
  std::iota(idx.begin(), idx.end(), 0);
  std::partial_sort(idx.begin(), idx.begin() + k, idx.end(),
                    [v](int32_t a, int32_t b) { return GateBefore(v[a], a, v[b], b); });
  idx.resize(static_cast<size_t>(k));
}

// Route's buffers, reused token after token.
struct RouteScratch {
  std::vector<float> scores, choice, group_scores;
  std::vector<int32_t> idx;
  std::vector<char> keep;
};

// One token's experts and weights.
void Route(const MoeGateParams& p, const float* logits, int32_t* experts, float* weights, RouteScratch& rs) {
  const int64_t E = p.num_experts, K = p.top_k, G = p.n_group, per_group = E / G;
  std::vector<float>& scores = rs.scores;
  std::vector<float>& choice = rs.choice;
  std::vector<float>& group_scores = rs.group_scores;
  std::vector<int32_t>& idx = rs.idx;
  scores.assign(static_cast<size_t>(E), 0.f);
  group_scores.assign(static_cast<size_t>(G), 0.f);
  if (p.scoring == ScoringFunc::kSigmoid) {
    for (int64_t e = 0; e < E; ++e) scores[static_cast<size_t>(e)] = GateSigmoid(logits[e]);
  } else {
    const float mx = *std::max_element(logits, logits + E);
    float sum = 0.f;
    for (int64_t e = 0; e < E; ++e) sum += scores[static_cast<size_t>(e)] = GateExp(logits[e] - mx);
    for (float& s : scores) s /= sum;
  }
  choice = scores;
  if (p.bias != nullptr)
    for (int64_t e = 0; e < E; ++e) choice[static_cast<size_t>(e)] += p.bias[e];
  const bool grouped = p.method == TopkMethod::kNoauxTc || p.method == TopkMethod::kGroupLimitedGreedy;
  if (grouped && G > 1) {
    // V3 noaux_tc: the sum of the group's two best (biased) scores; V2
    // group_limited_greedy: its best score.
    for (int64_t g = 0; g < G; ++g)
      group_scores[static_cast<size_t>(g)] =
          GateGroupScore(choice.data() + g * per_group, per_group, p.method == TopkMethod::kNoauxTc);
    TopK(group_scores.data(), G, p.topk_group, idx);
    std::vector<char>& keep = rs.keep;
    keep.assign(static_cast<size_t>(G), 0);
    for (int32_t g : idx) keep[static_cast<size_t>(g)] = 1;
    // V3 masks dropped groups to -inf, V2 to 0 (scores are positive there).
    const float masked = p.method == TopkMethod::kNoauxTc ? -INFINITY : 0.f;
    for (int64_t e = 0; e < E; ++e)
      if (!keep[static_cast<size_t>(e / per_group)]) choice[static_cast<size_t>(e)] = masked;
  }
  TopK(choice.data(), E, K, idx);
  float sum = 0.f;
  for (int64_t k = 0; k < K; ++k) {
    experts[k] = idx[static_cast<size_t>(k)];
    weights[k] = scores[static_cast<size_t>(idx[static_cast<size_t>(k)])];  // unbiased score
    sum += weights[k];
  }
  if (p.norm_topk_prob && K > 1)
    for (int64_t k = 0; k < K; ++k) weights[k] /= sum + 1e-20f;
  for (int64_t k = 0; k < K; ++k) weights[k] *= static_cast<float>(p.routed_scaling_factor);
}

}  // namespace

Status MoeGate(const MoeGateParams& p) {
  thread_local RouteScratch rs;
  for (int64_t t = 0; t < p.tokens; ++t)
    Route(p, p.logits + t * p.num_experts, p.experts + t * p.top_k, p.weights + t * p.top_k, rs);
  return Status::Ok();
}

}  // namespace mlarun::cpu
