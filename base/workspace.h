// Scratch memory for kernels. Kernels never allocate: a plan states how many
// bytes it needs, the caller owns a Workspace big enough, and the kernel carves
// its buffers out of the view it is handed.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>

#include "base/device_memory.h"

namespace mlarun {

inline constexpr size_t kWorkspaceAlign = 64;

// Non-owning view of caller-provided scratch memory.
struct WorkspaceView {
  void* data = nullptr;
  size_t bytes = 0;
};

// Hands out consecutive 64-byte-aligned sub-buffers of a WorkspaceView.
// Constructed over an empty view it only measures: the pointers it returns
// must not be dereferenced, and used_bytes() is the size to reserve. Sizing
// and carving run the same code, so the two can never disagree.
class WorkspaceCarver {
 public:
  explicit WorkspaceCarver(WorkspaceView ws) : ws_(ws) {}

  template <typename T>
  T* Take(size_t count) {
    const size_t offset = used_;
    used_ = AlignUp(used_ + count * sizeof(T));
    return reinterpret_cast<T*>(static_cast<std::byte*>(ws_.data) + offset);
  }
  size_t used_bytes() const { return used_; }
  // True when the view is too small for what was taken.
  bool overflowed() const { return used_ > ws_.bytes; }

  static size_t AlignUp(size_t n) { return (n + kWorkspaceAlign - 1) / kWorkspaceAlign * kWorkspaceAlign; }

 private:
  WorkspaceView ws_;
  size_t used_ = 0;
};

// Owns a growable, 64-byte-aligned buffer in one device's memory (the
// host's by default). Not thread-safe.
class Workspace {
 public:
  Workspace() = default;
  explicit Workspace(DeviceMemory* memory) : memory_(memory) {}
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;
  Workspace(Workspace&&) = default;
  Workspace& operator=(Workspace&&) = default;

  // Returns a view of at least `bytes` bytes; reallocates (discarding the
  // contents) only when the current buffer is smaller. {} when it cannot.
  WorkspaceView Reserve(size_t bytes) {
    if (bytes > buf_.bytes()) {
      buf_.Reset();
      auto b = DeviceBuffer::Allocate(*memory_, WorkspaceCarver::AlignUp(bytes), "a workspace");
      if (!b.ok()) return {};
      buf_ = std::move(*b);
    }
    return {buf_.data(), bytes};
  }
  size_t capacity_bytes() const { return buf_.bytes(); }

 private:
  DeviceMemory* memory_ = &HostMemory();
  DeviceBuffer buf_;
};

}  // namespace mlarun
