// Fuzz target: a .safetensors file's header and layout (SafetensorsFile::Open,
// then every tensor's bytes read through the TensorRefs it returns, so a
// header that passes validation but points outside the mapping is caught by
// ASan). The input is the whole file, written to an in-memory file.
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "runtime/model/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const int fd = memfd_create("fuzz.safetensors", MFD_CLOEXEC);
  if (fd < 0) return 0;
  size_t done = 0;
  while (done < size) {
    const ssize_t n = write(fd, data + done, size - done);
    if (n <= 0) break;
    done += static_cast<size_t>(n);
  }
  auto file = mlarun::SafetensorsFile::Open("/proc/self/fd/" + std::to_string(fd));
  if (file.ok()) {
    unsigned sum = 0;
    for (const mlarun::TensorRef& t : (*file)->tensors()) {
      if (static_cast<size_t>(t.numel()) * mlarun::SafetensorsDTypeSize(t.dtype) != t.bytes) __builtin_trap();
      for (size_t i = 0; i < t.bytes; ++i) sum += static_cast<unsigned>(t.data[i]);
      if ((*file)->Find(t.name) != &t) __builtin_trap();
    }
    asm volatile("" : : "r"(sum));
  }
  close(fd);
  return 0;
}
