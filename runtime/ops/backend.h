// Internal: what every backend of the ops implements. Not part of the public
// API. Each entry point's params are checked by the op's Run before it is
// called.
#pragma once

#include <string_view>

#include "runtime/ops/elementwise.h"
#include "runtime/ops/embedding.h"
#include "runtime/ops/linear.h"
#include "runtime/ops/moe_experts.h"
#include "runtime/ops/moe_gate.h"
#include "runtime/ops/norm.h"
#include "runtime/ops/rope.h"
#include "runtime/ops/sampling.h"

namespace mlarun {

namespace cpu {
Status Embedding(const EmbeddingParams& p);
Status RmsNorm(const RmsNormParams& p);
Status ApplyLinear(const LinearParams& p);  // REQUIRES: p.col_end resolved (not -1)
// ApplyLinear's buffers are per thread and grow to the largest call the
// thread has made. A region whose threads take products dynamically grows
// every thread's to the largest of its products first (LinearBuffersFor each,
// the maximum reserved by every thread), so which thread ran which product
// does not decide whether a later step of the same shapes allocates.
struct LinearBufferSizes {
  size_t a_bytes = 0, c_elems = 0, scratch_bytes = 0;
  void Grow(const LinearBufferSizes& o);  // to the elementwise maximum
};
StatusOr<LinearBufferSizes> LinearBuffersFor(const LinearParams& p);  // REQUIRES: as ApplyLinear
void ReserveLinearBuffers(const LinearBufferSizes& s);                // the calling thread's
Status SiluMul(const SiluMulParams& p);
Status ApplyMlp(const MlpParams& p);
Status Add(const AddParams& p);
Status CopyRows(const CopyRowsParams& p);
Status ApplyRope(const RopeParams& p);
Status MoeGate(const MoeGateParams& p);
Status MoeExperts(const MoeExpertsParams& p, const MoePlan& plan, WorkspaceView ws);
Status Sample(const SampleParams& p);
Status Score(const ScoreParams& p);
}  // namespace cpu

// The CUDA implementations (runtime/ops/cuda/*.cu; runtime/ops/cuda_stub.cc in
// builds without nvcc answers UNIMPLEMENTED). Every pointer in the params is a
// device pointer of the current GPU except where an op's header says host
// (the MoE plan, the samplers). Kernels run on the legacy default stream, in
// the host's call order; an op returns once its work is queued, except where
// it must read a result back (the embedding's id check, sampling).
namespace cuda {
Status Embedding(const EmbeddingParams& p);
Status RmsNorm(const RmsNormParams& p);
Status ApplyLinear(const LinearParams& p);     // REQUIRES: p.col_end resolved; f32 and bf16 weights
Status ApplyLinearFp8(const LinearParams& p);  // REQUIRES: as ApplyLinear; w->dtype == kF8E4M3 (linear_fp8.cu)
Status SiluMul(const SiluMulParams& p);
Status ApplyMlp(const MlpParams& p);
Status Add(const AddParams& p);
Status CopyRows(const CopyRowsParams& p);
Status ApplyRope(const RopeParams& p);
Status MoeGate(const MoeGateParams& p);
Status MoeExperts(const MoeExpertsParams& p, const MoePlan& plan, WorkspaceView ws);
Status Sample(const SampleParams& p);
Status Score(const ScoreParams& p);  // reads each row back to the host
}  // namespace cuda

// What an op's Run answers for a backend that has no implementation of it:
// UNIMPLEMENTED naming the op and the backend (INVALID_ARGUMENT for a value
// that is no backend).
inline Status NoBackend(std::string_view op, Backend b) {
  if (b == Backend::kCuda)
    return UnimplementedError(op, ": the ", BackendName(b), " backend has no implementation of this op in this build");
  return InvalidArgumentError(op, ": unknown backend ", static_cast<int>(b));
}

}  // namespace mlarun
