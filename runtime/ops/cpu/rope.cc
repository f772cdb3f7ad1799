#include <algorithm>
#include <vector>

#include "runtime/ops/backend.h"

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
        const float c = cos[static_cast<size_t>(j)], s = sin[static_cast<size_t>(j)];
        switch (p.layout) {
          case RopeLayout::kInterleavedToHalf: {
            const float a = tmp[static_cast<size_t>(2 * j)], b = tmp[static_cast<size_t>(2 * j + 1)];
            v[j] = a * c - b * s;
            v[j + half] = b * c + a * s;
            break;
          }
          case RopeLayout::kInterleaved: {
            const float a = tmp[static_cast<size_t>(2 * j)], b = tmp[static_cast<size_t>(2 * j + 1)];
            v[2 * j] = a * c - b * s;
            v[2 * j + 1] = a * s + b * c;
            break;
          }
          case RopeLayout::kHalf: {
            const float a = tmp[static_cast<size_t>(j)], b = tmp[static_cast<size_t>(j + half)];
            v[j] = a * c - b * s;
            v[j + half] = b * c + a * s;
            break;
          }
        }
      }
    }
  }
  return Status::Ok();
}

}  // namespace mlarun::cpu
