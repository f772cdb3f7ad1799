#include "base/cpu_isa.h"

#include <cpuid.h>
#include <oneapi/dnnl/dnnl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <mutex>

namespace mlarun {
namespace {

struct Regs {
  unsigned a = 0, b = 0, c = 0, d = 0;
};
Regs Cpuid(unsigned leaf, unsigned sub = 0) {
  Regs r;
  if (!__get_cpuid_count(leaf, sub, &r.a, &r.b, &r.c, &r.d)) r = Regs{};
  return r;
}
bool Bit(unsigned v, int b) { return ((v >> b) & 1u) != 0; }

// XCR0, the register state the OS saves on context switches. Written as raw
// xgetbv so this file needs no -mxsave.
uint64_t Xcr0() {
  unsigned lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (static_cast<uint64_t>(hi) << 32) | lo;
}

// Linux keeps AMX tile data off until a process asks (5.16+).
bool RequestAmxPermission() {
  constexpr long kArchGetXcompPerm = 0x1022, kArchReqXcompPerm = 0x1023;
  constexpr long kXfeatureXtiledata = 18;
  if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) != 0) return false;
  unsigned long mask = 0;
  if (syscall(SYS_arch_prctl, kArchGetXcompPerm, &mask) != 0) return false;
  return (mask >> kXfeatureXtiledata) & 1u;
}

CpuFeatures Detect() {
  CpuFeatures f;
  const Regs v = Cpuid(0);
  char vendor[13] = {};
  std::memcpy(vendor, &v.b, 4);
  std::memcpy(vendor + 4, &v.d, 4);
  std::memcpy(vendor + 8, &v.c, 4);
  f.vendor = vendor;
  const unsigned max_leaf = v.a;
  if (Cpuid(0x80000000).a >= 0x80000004) {
    char brand[49] = {};
    for (unsigned i = 0; i < 3; ++i) {
      const Regs r = Cpuid(0x80000002 + i);
      std::memcpy(brand + 16 * i, &r, 16);
    }
    std::string s = brand;
    const size_t b = s.find_first_not_of(' '), e = s.find_last_not_of(' ');
    f.model_name = b == std::string::npos ? "" : s.substr(b, e - b + 1);
  }
  const Regs l1 = Cpuid(1);
  f.sse41 = Bit(l1.c, 19);
  const bool osxsave = Bit(l1.c, 27);
  const uint64_t xcr0 = osxsave ? Xcr0() : 0;
  f.os_ymm = (xcr0 & 0x6) == 0x6;
  f.os_zmm = f.os_ymm && (xcr0 & 0xe0) == 0xe0;
  f.os_amx = (xcr0 & 0x60000) == 0x60000;
  f.avx = Bit(l1.c, 28);
  f.fma = Bit(l1.c, 12);
  f.f16c = Bit(l1.c, 29);
  if (max_leaf >= 7) {
    const Regs l7 = Cpuid(7, 0);
    f.avx2 = Bit(l7.b, 5);
    f.avx512f = Bit(l7.b, 16);
    f.avx512dq = Bit(l7.b, 17);
    f.avx512bw = Bit(l7.b, 30);
    f.avx512vl = Bit(l7.b, 31);
    f.avx512_vnni = Bit(l7.c, 11);
    f.amx_bf16 = Bit(l7.d, 22);
    f.amx_tile = Bit(l7.d, 24);
    if (l7.a >= 1) f.avx512_bf16 = Bit(Cpuid(7, 1).a, 5);
  }
  if (f.amx_tile && f.amx_bf16 && f.os_amx) f.amx_permitted = RequestAmxPermission();
  return f;
}

constexpr int kNoLimit = -1;
std::atomic<int> g_limit{kNoLimit};
std::once_flag g_onednn_once;

}  // namespace

std::string_view CpuIsaName(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kScalar:
      return "scalar";
    case CpuIsa::kAvx2:
      return "avx2";
    case CpuIsa::kAvx512:
      return "avx512";
    case CpuIsa::kAmx:
      return "amx";
  }
  return "invalid";
}

StatusOr<CpuIsa> ParseCpuIsa(std::string_view name) {
  for (CpuIsa isa : {CpuIsa::kScalar, CpuIsa::kAvx2, CpuIsa::kAvx512, CpuIsa::kAmx})
    if (name == CpuIsaName(isa)) return isa;
  return InvalidArgumentError("unknown CPU kernel family '", std::string(name),
                              "' (expected scalar, avx2, avx512 or amx)");
}

CpuIsa CpuFeatures::best() const {
  // The avx2 family's kernels use F16C too (fp8 and f16 conversions); every
  // AVX2 CPU made has it, but a hypervisor may hide it.
  const bool avx2_ok = avx && avx2 && fma && f16c && os_ymm;
  if (!avx2_ok) return CpuIsa::kScalar;
  const bool avx512_ok = avx512f && avx512bw && avx512vl && avx512dq && os_zmm;
  if (!avx512_ok) return CpuIsa::kAvx2;
  if (amx_tile && amx_bf16 && os_amx && amx_permitted) return CpuIsa::kAmx;
  return CpuIsa::kAvx512;
}

std::vector<CpuIsa> CpuFeatures::supported() const {
  std::vector<CpuIsa> out;
  for (int i = 0; i <= static_cast<int>(best()); ++i) out.push_back(static_cast<CpuIsa>(i));
  return out;
}

std::string CpuFeatures::FlagList() const {
  std::string s;
  auto add = [&s](bool on, const char* name) {
    if (!on) return;
    if (!s.empty()) s += ' ';
    s += name;
  };
  add(sse41, "sse4.1");
  add(avx && os_ymm, "avx");
  add(avx2 && os_ymm, "avx2");
  add(fma && os_ymm, "fma");
  add(f16c && os_ymm, "f16c");
  add(avx512f && os_zmm, "avx512f");
  add(avx512bw && os_zmm, "avx512bw");
  add(avx512vl && os_zmm, "avx512vl");
  add(avx512dq && os_zmm, "avx512dq");
  add(avx512_vnni && os_zmm, "avx512_vnni");
  add(avx512_bf16 && os_zmm, "avx512_bf16");
  add(amx_tile && os_amx && amx_permitted, "amx_tile");
  add(amx_bf16 && os_amx && amx_permitted, "amx_bf16");
  if (amx_tile && !(os_amx && amx_permitted)) add(true, "(amx present, not enabled by the OS)");
  return s.empty() ? "none beyond sse2" : s;
}

const CpuFeatures& HostCpu() {
  static const CpuFeatures features = Detect();
  return features;
}

CpuIsa ActiveCpuIsa() {
  const CpuIsa best = HostCpu().best();
  const int limit = g_limit.load(std::memory_order_relaxed);
  if (limit == kNoLimit || limit >= static_cast<int>(best)) return best;
  return static_cast<CpuIsa>(limit);
}

static Status CheckIsaRunnable(CpuIsa isa) {
  if (static_cast<int>(isa) > static_cast<int>(CpuIsa::kAmx))
    return InvalidArgumentError("unknown CPU kernel family value ", static_cast<int>(isa));
  const CpuFeatures& f = HostCpu();
  if (static_cast<int>(isa) > static_cast<int>(f.best()))
    return InvalidArgumentError("this CPU (", f.model_name, ") cannot run the ", CpuIsaName(isa),
                                " kernels: the best it supports is ", CpuIsaName(f.best()), " (usable: ", f.FlagList(),
                                ")");
  return Status::Ok();
}

Status SetCpuIsaLimit(CpuIsa isa) {
  MLARUN_RETURN_IF_ERROR(CheckIsaRunnable(isa));
  g_limit.store(static_cast<int>(isa), std::memory_order_relaxed);
  std::call_once(g_onednn_once, [isa] {
    dnnl_cpu_isa_t cap = dnnl_cpu_isa_all;
    switch (isa) {
      case CpuIsa::kScalar:
        cap = dnnl_cpu_isa_sse41;
        break;
      case CpuIsa::kAvx2:
        cap = dnnl_cpu_isa_avx2;
        break;
      case CpuIsa::kAvx512:
        cap = dnnl_cpu_isa_avx512_core_bf16;
        break;
      case CpuIsa::kAmx:
        cap = dnnl_cpu_isa_all;
        break;
    }
    // Fails only once oneDNN has generated code; the limit then holds for
    // our own dispatch, which is what decides whether oneDNN is called.
    (void)dnnl_set_max_cpu_isa(cap);
  });
  return Status::Ok();
}

void ClearCpuIsaLimit() { g_limit.store(kNoLimit, std::memory_order_relaxed); }

std::string CpuSummary() {
  const CpuFeatures& f = HostCpu();
  std::string s = (f.model_name.empty() ? "unknown CPU" : f.model_name) + " (" + f.vendor + "): " + f.FlagList() +
                  "; kernels " + std::string(CpuIsaName(ActiveCpuIsa()));
  if (ActiveCpuIsa() != f.best()) s += " (limited from " + std::string(CpuIsaName(f.best())) + ")";
  if (ActiveCpuIsa() == CpuIsa::kScalar) s += "; scalar kernels are correct but slow";
  return s;
}

ScopedCpuIsa::ScopedCpuIsa(CpuIsa isa) : previous_(g_limit.load()), status_(CheckIsaRunnable(isa)) {
  if (status_.ok()) g_limit.store(static_cast<int>(isa));
}
ScopedCpuIsa::~ScopedCpuIsa() { g_limit.store(previous_); }

}  // namespace mlarun
