#include <algorithm>
#include <vector>

#include "runtime/ops/backend.h"
#include "runtime/ops/rope_math.h"

namespace mlarun::cpu {

Status ApplyRope(const RopeParams& p) {
  const int64_t dim = p.dim, half = dim / 2;
  // Per-thread scratch, grown once: a step applies RoPE per layer.
  thread_local std::vector<float> cos, sin, tmp;
  cos.resize(static_cast<size_t>(half));
  sin.resize(static_cast<size_t>(half));
  tmp.resize(static_cast<size_t>(dim));
  for (int64_t t = 0; t < p.n_tokens; ++t) {
    RopeCosSin(p.inv_freq, half, p.attention_factor, p.positions[t], cos.data(), sin.data());
    for (int64_t h = 0; h < p.n_heads; ++h) {
      float* v = p.x + t * p.stride_token + h * p.stride_head;
      std::copy(v, v + dim, tmp.begin());
      for (int64_t j = 0; j < half; ++j) {
        const RopePair q = RopePairOf(p.layout, j, half);
        RopeRotate(tmp[static_cast<size_t>(q.in_a)], tmp[static_cast<size_t>(q.in_b)], cos[static_cast<size_t>(j)],
                   sin[static_cast<size_t>(j)], v[q.out_a], v[q.out_b]);
      }
    }
  }
  return Status::Ok();
}

}  // namespace mlarun::cpu
