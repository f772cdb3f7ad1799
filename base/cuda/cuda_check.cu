#include <cstdlib>
#include <cstring>
#include <mutex>

#include "base/cuda/cuda_check.h"
#include "base/cuda_device.h"

namespace mlarun {
namespace {

std::mutex& LabelMutex() {
  static std::mutex m;
  return m;
}
std::string& Label() {
  static std::string label;
  return label;
}

}  // namespace

void SetCudaErrorLabel(std::string label) {
  std::lock_guard<std::mutex> lock(LabelMutex());
  Label() = std::move(label);
}

namespace cuda_check {

std::string Where() {
  int device = -1;
  if (cudaGetDevice(&device) != cudaSuccess) {
    cudaGetLastError();
    device = -1;
  }
  std::string label;
  {
    std::lock_guard<std::mutex> lock(LabelMutex());
    label = Label();
  }
  std::string out = " on device " + std::to_string(device);
  if (!label.empty()) out += " (" + label + ")";
  return out;
}

bool SyncAfterLaunch() {
  static const bool sync = [] {
    const char* v = std::getenv("MLARUN_CUDA_SYNC");
    return v != nullptr && std::strcmp(v, "0") != 0 && v[0] != '\0';
  }();
  return sync;
}

Status LaunchStatus(const char* what, const char* file, int line) {
  cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess && SyncAfterLaunch()) err = cudaDeviceSynchronize();
  if (err == cudaSuccess) return Status::Ok();
  return InternalError("kernel ", what, " failed at ", file, ":", line, Where(), ": ", cudaGetErrorName(err), " (",
                       cudaGetErrorString(err), ")");
}

}  // namespace cuda_check
}  // namespace mlarun
