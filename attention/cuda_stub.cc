// The CUDA attention entry points in builds without nvcc: every call says so.
#include "attention/backend.h"

namespace mlarun::cuda {

StatusOr<std::unique_ptr<MlaPlanImpl>> MakeMlaPlan(const MlaParams&, const MlaConfig&, MlaPlan*) {
  return UnimplementedError(
      "mla: this build has no CUDA backend (configure with MLARUN_CUDA=ON and nvcc); use the cpu backend");
}

Status RemakeMlaPlan(const MlaParams&, const MlaConfig&, MlaPlan*) {
  return UnimplementedError(
      "mla: this build has no CUDA backend (configure with MLARUN_CUDA=ON and nvcc); use the cpu backend");
}

Status RunMla(const MlaParams&, const MlaPlanImpl&, WorkspaceView) {
  return UnimplementedError(
      "mla: this build has no CUDA backend (configure with MLARUN_CUDA=ON and nvcc); use the cpu backend");
}

}  // namespace mlarun::cuda
