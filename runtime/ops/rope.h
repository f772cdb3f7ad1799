// RoPE on the rope slices of rows of heads, in place. The tables (inverse
// frequencies, the YaRN factor on cos/sin, the pairing) are a Rope's
// (attention/rope.h), made once per model; the params point at them.
#pragma once

#include <cstdint>

#include "attention/rope.h"
#include "base/backend.h"
#include "base/status.h"

namespace mlarun {

// Rotates the dim floats at x + t * stride_token + h * stride_head (elements)
// for t < n_tokens, h < n_heads by position positions[t].
struct RopeParams {
  float* x = nullptr;
  int64_t n_tokens = 0;
  int64_t n_heads = 0;
  int64_t stride_token = 0;
  int64_t stride_head = 0;             // may be 0 when n_heads == 1
  const int32_t* positions = nullptr;  // [n_tokens], >= 0
  // The tables: Rope::config().dim and .layout, Rope::inv_freq() [dim / 2],
  // Rope::attention_factor().
  int64_t dim = 0;
  RopeLayout layout = RopeLayout::kInterleavedToHalf;
  const float* inv_freq = nullptr;
  float attention_factor = 1.f;
  Backend backend = Backend::kCpu;
};
Status RopeRun(const RopeParams& p);

// The tables of `rope` in `p`: its frequencies in host memory, or
// `inv_freq`, their copy in the backend's memory.
inline RopeParams WithRopeTables(RopeParams p, const Rope& rope, const float* inv_freq = nullptr) {
  p.dim = rope.config().dim;
  p.layout = rope.config().layout;
  p.inv_freq = inv_freq != nullptr ? inv_freq : rope.inv_freq().data();
  p.attention_factor = rope.attention_factor();
  return p;
}

}  // namespace mlarun
