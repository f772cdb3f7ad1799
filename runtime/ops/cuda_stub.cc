// Built when the CUDA backend is not: every CUDA op answers UNIMPLEMENTED.
#include "runtime/ops/backend.h"

namespace mlarun::cuda {
namespace {

Status NoCuda(std::string_view op) { return UnimplementedError(op, ": this build has no CUDA backend"); }

}  // namespace

Status Embedding(const EmbeddingParams&) { return NoCuda("embedding"); }
Status RmsNorm(const RmsNormParams&) { return NoCuda("rms_norm"); }
Status ApplyLinear(const LinearParams&) { return NoCuda("linear"); }
Status ApplyLinearFp8(const LinearParams&) { return NoCuda("linear (f8_e4m3)"); }
Status SiluMul(const SiluMulParams&) { return NoCuda("silu_mul"); }
Status ApplyMlp(const MlpParams&) { return NoCuda("mlp"); }
Status Add(const AddParams&) { return NoCuda("add"); }
Status CopyRows(const CopyRowsParams&) { return NoCuda("copy_rows"); }
Status ApplyRope(const RopeParams&) { return NoCuda("rope"); }
Status MoeGate(const MoeGateParams&) { return NoCuda("moe_gate"); }
Status MoeExperts(const MoeExpertsParams&, const MoePlan&, WorkspaceView) { return NoCuda("moe_experts"); }
Status Sample(const SampleParams&) { return NoCuda("sample"); }
Status Score(const ScoreParams&) { return NoCuda("score"); }

}  // namespace mlarun::cuda
