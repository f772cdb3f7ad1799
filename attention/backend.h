// Internal: what every attention backend implements. Not part of the public API.
#pragma once

#include <memory>

#include "attention/mla.h"

namespace mlarun {

// Backend-specific plan state behind MlaPlan::impl.
struct MlaPlanImpl {
  virtual ~MlaPlanImpl() = default;
};

namespace cpu {
// REQUIRES: MlaCheck(p) and MlaCheckConfig(c) are OK.
StatusOr<std::unique_ptr<MlaPlanImpl>> MakeMlaPlan(const MlaParams& p, const MlaConfig& c, MlaPlan* plan);
// Plans again into plan->impl (a CPU plan), reusing its memory.
Status RemakeMlaPlan(const MlaParams& p, const MlaConfig& c, MlaPlan* plan);
Status RunMla(const MlaParams& p, const MlaPlanImpl& plan, WorkspaceView ws);
}  // namespace cpu

// attention/cuda/ (attention/cuda_stub.cc in builds without nvcc). q, out, lse,
// w_uk_t, w_uv and cache.data are device pointers; the batch description is
// host memory, from which the plan is made on the host.
namespace cuda {
StatusOr<std::unique_ptr<MlaPlanImpl>> MakeMlaPlan(const MlaParams& p, const MlaConfig& c, MlaPlan* plan);
Status RemakeMlaPlan(const MlaParams& p, const MlaConfig& c, MlaPlan* plan);
Status RunMla(const MlaParams& p, const MlaPlanImpl& plan, WorkspaceView ws);
}  // namespace cuda

}  // namespace mlarun
