#include "base/device_memory.h"

#include <cstdlib>
#include <cstring>

#include "base/large_buffer.h"

namespace mlarun {
namespace {

class Host final : public DeviceMemory {
 public:
  Backend backend() const override { return Backend::kCpu; }
  bool host_accessible() const override { return true; }
  void* Allocate(size_t bytes) override { return AllocateLarge(bytes, /*zero=*/false); }
  void Free(void* p) override { std::free(p); }
  Status CopyIn(void* dst, const void* src, size_t bytes) override {
    if (bytes > 0) std::memcpy(dst, src, bytes);
    return Status::Ok();
  }
  Status CopyOut(void* dst, const void* src, size_t bytes) override { return CopyIn(dst, src, bytes); }
  Status Zero(void* dst, size_t bytes) override {
    if (bytes > 0) std::memset(dst, 0, bytes);
    return Status::Ok();
  }
};

}  // namespace

DeviceMemory& HostMemory() {
  static Host host;
  return host;
}

StatusOr<DeviceMemory*> MemoryFor(Backend backend) {
  switch (backend) {
    case Backend::kCpu:
      return &HostMemory();
    case Backend::kCuda:
      return CudaMemory();
  }
  return InvalidArgumentError("no memory for backend ", static_cast<int>(backend));
}

StatusOr<DeviceBuffer> DeviceBuffer::Allocate(DeviceMemory& memory, size_t bytes, std::string_view what) {
  DeviceBuffer b;
  b.memory_ = &memory;
  b.data_ = memory.Allocate(bytes);
  if (b.data_ == nullptr)
    return ResourceExhaustedError("cannot allocate ", bytes, " bytes of ", BackendName(memory.backend()),
                                  " memory for ", what);
  b.bytes_ = bytes;
  return b;
}

}  // namespace mlarun
