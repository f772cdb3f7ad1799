// What this x86-64 CPU can run, and which kernel family the process uses.
//
// Detection reads cpuid and the OS's enabled register state (XGETBV): an
// instruction set counts only when the CPU has it *and* the kernel saves its
// registers (AVX needs YMM state, AVX-512 opmask/ZMM state, AMX tile state
// plus the per-process permission Linux grants through arch_prctl).
//
// Kernel families, lowest first. Every CPU op has an implementation for each;
// the process uses the highest one the CPU supports, or a lower one when the
// launcher limits it (MLARUN_CPU_ISA, so a machine with AMX also runs and tests
// the AVX2 and scalar paths):
//   kScalar  any x86-64 (SSE2 baseline): plain C++ loops. Correct, slow.
//   kAvx2    AVX2 + FMA: our own bf16/f32 kernels; oneDNN for f32 products.
//   kAvx512  AVX-512 F/BW/VL/DQ: our own kernels at 512 bits; oneDNN for f32
//            products and for bf16 products where it can build one
//            (AVX512-BF16).
//   kAmx     AMX-BF16 tiles usable: as kAvx512, and oneDNN's AMX bf16 products.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"

namespace mlarun {

// Values are frozen: they appear in logs, JSON and on the wire as names.
enum class CpuIsa : uint8_t { kScalar = 0, kAvx2 = 1, kAvx512 = 2, kAmx = 3 };
// "scalar", "avx2", "avx512", "amx".
std::string_view CpuIsaName(CpuIsa isa);
// The names above; the error lists them.
StatusOr<CpuIsa> ParseCpuIsa(std::string_view name);

struct CpuFeatures {
  std::string vendor;      // cpuid vendor string, e.g. "GenuineIntel", "AuthenticAMD"
  std::string model_name;  // cpuid brand string, e.g. "AMD EPYC 9B14"
  // Instruction sets the CPU reports (cpuid).
  bool sse41 = false, avx = false, avx2 = false, fma = false, f16c = false;
  bool avx512f = false, avx512bw = false, avx512vl = false, avx512dq = false, avx512_bf16 = false;
  bool avx512_vnni = false;  // vpdpbusd: u8 x s8 products summed in fours into int32
  bool amx_tile = false, amx_bf16 = false;
  // Register state the OS saves (XCR0): YMM; opmask + ZMM; AMX tiles.
  bool os_ymm = false, os_zmm = false, os_amx = false;
  // Linux granted this process AMX tile data (arch_prctl ARCH_REQ_XCOMP_PERM).
  bool amx_permitted = false;

  // The highest kernel family this CPU and OS can run.
  CpuIsa best() const;
  // The kernel families it can run, lowest first (always starts with kScalar).
  std::vector<CpuIsa> supported() const;
  // "avx2 fma f16c avx512f avx512bw avx512vl avx512dq avx512_vnni avx512_bf16"
  // (what is usable).
  std::string FlagList() const;
};

// This machine's CPU, detected on first use (thread-safe; asks Linux for AMX
// permission once when the CPU has AMX).
const CpuFeatures& HostCpu();

// The kernel family CPU ops use now: min(HostCpu().best(), the limit).
CpuIsa ActiveCpuIsa();

// Limits the kernel family to `isa`. INVALID_ARGUMENT when this CPU cannot
// run `isa` (the message names what it lacks). Thread-safe, but meant for
// start-up (launcher/) and tests: products prepared before the call keep the
// implementation they were prepared with. The first call also limits
// oneDNN's own code generation (it can be limited only once per process).
Status SetCpuIsaLimit(CpuIsa isa);

// Removes the limit set by SetCpuIsaLimit (oneDNN's stays). For tests.
void ClearCpuIsaLimit();

// One line for logs and reports, e.g.
//   "AMD EPYC 9B14 (AuthenticAMD): avx2 fma ... avx512_bf16; kernels avx2 (limited from avx512)"
std::string CpuSummary();

// For tests that run one body under each family: sets the limit of our own
// dispatch for its scope (oneDNN's code generation is left as it is) and
// restores the previous one after. status() is INVALID_ARGUMENT, and nothing
// changes, when this CPU cannot run `isa`.
class ScopedCpuIsa {
 public:
  explicit ScopedCpuIsa(CpuIsa isa);
  ~ScopedCpuIsa();
  ScopedCpuIsa(const ScopedCpuIsa&) = delete;
  ScopedCpuIsa& operator=(const ScopedCpuIsa&) = delete;
  const Status& status() const { return status_; }

 private:
  int previous_;
  Status status_;
};

}  // namespace mlarun
