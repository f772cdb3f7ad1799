#include "runtime/ops/rope.h"

#include "runtime/ops/backend.h"

namespace mlarun {

Status RopeRun(const RopeParams& p) {
  if (p.dim <= 0 || p.dim % 2 != 0) return InvalidArgumentError("rope: dim must be positive and even, got ", p.dim);
  if (p.layout != RopeLayout::kInterleavedToHalf && p.layout != RopeLayout::kInterleaved &&
      p.layout != RopeLayout::kHalf)
    return InvalidArgumentError("rope: unknown layout ", static_cast<int>(p.layout));
  if (p.n_tokens < 0 || p.n_heads < 0)
    return InvalidArgumentError("rope: n_tokens (", p.n_tokens, ") and n_heads (", p.n_heads, ") must be >= 0");
  if (p.n_tokens == 0 || p.n_heads == 0) return Status::Ok();
  if (p.x == nullptr || p.positions == nullptr || p.inv_freq == nullptr)
    return InvalidArgumentError("rope: x, positions and inv_freq must be set");
  if (p.n_heads > 1 && p.stride_head < p.dim)
    return InvalidArgumentError("rope: stride_head (", p.stride_head, ") < dim (", p.dim, ") with ", p.n_heads,
                                " heads");
  if (p.n_tokens > 1 && p.stride_token < (p.n_heads - 1) * p.stride_head + p.dim)
    return InvalidArgumentError("rope: stride_token (", p.stride_token, ") is too small for ", p.n_heads,
                                " heads of stride_head ", p.stride_head, " and dim ", p.dim);
  switch (p.backend) {
    case Backend::kCpu:
      return cpu::ApplyRope(p);
    case Backend::kCuda:
      return cuda::ApplyRope(p);
  }
  return NoBackend("rope", p.backend);
}

}  // namespace mlarun
