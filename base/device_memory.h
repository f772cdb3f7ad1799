// Where a runner's memory lives: the weights it computes with, the latent
// cache pool, the step's buffers and the kernels' workspaces are allocated
// from the DeviceMemory of the runner's backend, and what the host prepares
// (the weights at load, the step's batch arrays) is copied there through it.
// The CPU's is the host's own memory (host_accessible: nothing is copied, a
// mapped checkpoint is used in place); CUDA's is the GPU's
// (base/cuda/device_memory.cu). Plain C++: no CUDA headers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string_view>
#include <utility>
#include <vector>

#include "base/backend.h"
#include "base/status.h"

namespace mlarun {

class DeviceMemory {
 public:
  virtual ~DeviceMemory() = default;
  virtual Backend backend() const = 0;
  // True when the host reads and writes this memory directly: then copies
  // to and from it are not needed (CopyIn/CopyOut still work, as memcpy).
  virtual bool host_accessible() const = 0;
  // `bytes` of memory aligned to at least 64 bytes, contents undefined;
  // nullptr when it cannot be had. Buffers of 2 MiB and more are backed by
  // huge pages on the host (large_buffer.h).
  virtual void* Allocate(size_t bytes) = 0;
  virtual void Free(void* p) = 0;
  // Host -> this memory, this memory -> host, and zero-filling; synchronous
  // (when they return, the bytes are there).
  virtual Status CopyIn(void* dst, const void* src, size_t bytes) = 0;
  virtual Status CopyOut(void* dst, const void* src, size_t bytes) = 0;
  virtual Status Zero(void* dst, size_t bytes) = 0;
  // Bytes allocated through this memory and not yet freed, -1 where it does
  // not count them (the host's: its resident set is the measure there).
  virtual int64_t live_bytes() const { return -1; }
};

// The host's memory (Backend::kCpu).
DeviceMemory& HostMemory();
// The memory of `backend`'s device: the host's for kCpu; for kCuda the
// current GPU's, UNIMPLEMENTED in a build without CUDA.
StatusOr<DeviceMemory*> MemoryFor(Backend backend);
// CUDA's (base/cuda/device_memory.cu; cuda_device_stub.cc answers
// UNIMPLEMENTED in builds without nvcc).
StatusOr<DeviceMemory*> CudaMemory();

// One allocation, freed with its memory's Free. Move-only.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  // RESOURCE_EXHAUSTED naming `what` and the bytes when it cannot be had.
  static StatusOr<DeviceBuffer> Allocate(DeviceMemory& memory, size_t bytes, std::string_view what);
  ~DeviceBuffer() { Reset(); }
  DeviceBuffer(DeviceBuffer&& o) noexcept
      : memory_(std::exchange(o.memory_, nullptr)),
        data_(std::exchange(o.data_, nullptr)),
        bytes_(std::exchange(o.bytes_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) {
      Reset();
      memory_ = std::exchange(o.memory_, nullptr);
      data_ = std::exchange(o.data_, nullptr);
      bytes_ = std::exchange(o.bytes_, 0);
    }
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  DeviceMemory* memory() const { return memory_; }
  void Reset() {
    if (data_ != nullptr) memory_->Free(data_);
    data_ = nullptr;
    bytes_ = 0;
  }

 private:
  DeviceMemory* memory_ = nullptr;
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

// A typed step buffer in one device's memory that only grows: Resize
// reallocates (dropping the contents) only when it needs more than it has,
// so steps after warm-up allocate nothing. Not thread-safe.
template <class T>
class DeviceArray {
 public:
  DeviceArray() = default;
  explicit DeviceArray(DeviceMemory* memory) : memory_(memory) {}
  void set_memory(DeviceMemory* memory) {
    if (memory != memory_) {
      buffer_.Reset();
      size_ = 0;
      memory_ = memory;
    }
  }
  // At least n elements, contents undefined. RESOURCE_EXHAUSTED naming `what`.
  Status Resize(size_t n, std::string_view what) {
    if (n * sizeof(T) > buffer_.bytes()) {
      buffer_.Reset();
      // 1/8 headroom, so slowly growing batches do not reallocate every step.
      MLARUN_ASSIGN_OR_RETURN(buffer_, DeviceBuffer::Allocate(*memory_, (n + n / 8) * sizeof(T), what));
    }
    size_ = n;
    return Status::Ok();
  }
  // n zero elements.
  Status Zeroed(size_t n, std::string_view what) {
    MLARUN_RETURN_IF_ERROR(Resize(n, what));
    return n == 0 ? Status::Ok() : memory_->Zero(buffer_.data(), n * sizeof(T));
  }
  T* data() const { return static_cast<T*>(buffer_.data()); }
  size_t size() const { return size_; }
  size_t capacity_bytes() const { return buffer_.bytes(); }

 private:
  DeviceMemory* memory_ = &HostMemory();
  DeviceBuffer buffer_;
  size_t size_ = 0;
};

// A batch array the host builds every step (positions, slots, token ids) and
// a device's ops read: `host` is filled on the host; Publish() makes the
// device's copy and returns what the ops get (the host's own array when the
// memory is host-accessible: no copy).
template <class T>
class StagedArray {
 public:
  std::vector<T> host;
  StatusOr<const T*> Publish(DeviceMemory& memory, std::string_view what) {
    if (memory.host_accessible()) return static_cast<const T*>(host.data());
    device_.set_memory(&memory);
    MLARUN_RETURN_IF_ERROR(device_.Resize(host.size(), what));
    if (!host.empty()) MLARUN_RETURN_IF_ERROR(memory.CopyIn(device_.data(), host.data(), host.size() * sizeof(T)));
    return static_cast<const T*>(device_.data());
  }

 private:
  DeviceArray<T> device_;
};

// A small weight array (norm scales, biases, the absorbed MLA matrices)
// loaded on the host. Place() moves it to a memory the host cannot address:
// the copy there is then the only one (the host's is released, so a device
// runner does not hold its weights twice). `data()` is what ops read.
template <class T>
class PlacedVector {
 public:
  std::vector<T> host;  // the loader fills it; empty once placed
  const T* data() const { return placed_ != nullptr ? static_cast<const T*>(placed_->data()) : host.data(); }
  size_t size() const { return placed_ != nullptr ? placed_size_ : host.size(); }
  bool empty() const { return size() == 0; }
  Status Place(DeviceMemory& memory, std::string_view what) {
    if (memory.host_accessible() || host.empty()) return Status::Ok();
    MLARUN_ASSIGN_OR_RETURN(DeviceBuffer b, DeviceBuffer::Allocate(memory, host.size() * sizeof(T), what));
    MLARUN_RETURN_IF_ERROR(memory.CopyIn(b.data(), host.data(), host.size() * sizeof(T)));
    placed_ = std::make_shared<DeviceBuffer>(std::move(b));
    placed_size_ = host.size();
    std::vector<T>().swap(host);
    return Status::Ok();
  }

 private:
  std::shared_ptr<DeviceBuffer> placed_;  // shared: copies of a model layer share it
  size_t placed_size_ = 0;
};

}  // namespace mlarun
