#include "gemm/cpu/kernels.h"

#include <algorithm>
#include <atomic>

namespace mlarun::cpu {
namespace {
std::atomic<bool> g_bf16_dot_allowed{true};
std::atomic<bool> g_vnni_allowed{true};
std::atomic<IntDotMode> g_int_dot{IntDotMode::kAuto};
std::atomic<bool> g_stream_prefetch{HostCpu().vendor == "GenuineIntel"};

// Whether B's groups (or k, when one group spans it) are whole blocks of 32
// that divide k: what every int-dot kernel needs of its shape.
bool WholeBlocks(int64_t k, int64_t b_group) {
  if (b_group <= 0 || k <= 0) return false;
  const int64_t group = std::min(b_group, k);
  return group % 32 == 0 && k % group == 0;
}
}  // namespace

bool UseBf16Dot(const CpuKernels& k) {
  return k.gemm_small_bt_bf16_dot != nullptr && HostCpu().avx512_bf16 && HostCpu().os_zmm &&
         g_bf16_dot_allowed.load(std::memory_order_relaxed);
}

bool SetBf16DotAllowed(bool allowed) { return g_bf16_dot_allowed.exchange(allowed); }

bool UseVnni() { return HostCpu().avx512_vnni && HostCpu().os_zmm && g_vnni_allowed.load(std::memory_order_relaxed); }

bool SetVnniAllowed(bool allowed) { return g_vnni_allowed.exchange(allowed); }

bool UseIntDot(CpuIsa isa, DType b_type, int64_t k, int64_t b_group) {
  const IntDotMode mode = g_int_dot.load(std::memory_order_relaxed);
  const bool auto_on = b_type == DType::kInt4 && isa != CpuIsa::kScalar;
  const bool allowed = (b_type == DType::kInt4 || b_type == DType::kInt8) &&
                       (mode == IntDotMode::kOn || (mode == IntDotMode::kAuto && auto_on));
  return allowed && WholeBlocks(k, b_group);
}

bool UsePackedIntDot(const CpuKernels& k, DType b_type, int64_t k_dim, int64_t b_group) {
  if (k.gemm_packed_int_dot == nullptr) return false;
  if (b_type == DType::kInt4) return UseIntDot(k.isa, b_type, k_dim, b_group);
  return b_type == DType::kInt8 && g_int_dot.load(std::memory_order_relaxed) != IntDotMode::kOff &&
         WholeBlocks(k_dim, b_group);
}

IntDotMode SetIntDotMode(IntDotMode mode) { return g_int_dot.exchange(mode); }

IntDotMode GetIntDotMode() { return g_int_dot.load(std::memory_order_relaxed); }

bool StreamPrefetch() { return g_stream_prefetch.load(std::memory_order_relaxed); }

bool SetStreamPrefetch(bool prefetch) { return g_stream_prefetch.exchange(prefetch); }

const CpuKernels* KernelsFor(CpuIsa isa) {
  // Never touch a family's code on a CPU that cannot run it.
  if (static_cast<int>(isa) > static_cast<int>(HostCpu().best())) return nullptr;
  switch (isa) {
    case CpuIsa::kScalar:
      return &ScalarKernels();
    case CpuIsa::kAvx2:
      return &Avx2Kernels();
    case CpuIsa::kAvx512:
      return &Avx512Kernels();
    case CpuIsa::kAmx:
      return &AmxKernels();
  }
  return nullptr;
}

const CpuKernels& Kernels() {
  static const CpuKernels* const tables[4] = {KernelsFor(CpuIsa::kScalar), KernelsFor(CpuIsa::kAvx2),
                                              KernelsFor(CpuIsa::kAvx512), KernelsFor(CpuIsa::kAmx)};
  return *tables[static_cast<int>(ActiveCpuIsa())];
}

}  // namespace mlarun::cpu
