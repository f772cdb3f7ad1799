#include "launcher/env.h"

#include <cstdlib>
#include <string>

#include "base/cpu_isa.h"
#include "gemm/cpu/kernels.h"
#include "gemm/cpu_gemm.h"

namespace mlarun {
namespace {

// An on|off variable: applies it when set, refuses anything else by name.
Status ApplyOnOff(const char* name, void (*apply)(bool on)) {
  const char* value = std::getenv(name);
  if (value == nullptr || *value == '\0') return Status::Ok();
  const std::string v = value;
  if (v != "on" && v != "off") return InvalidArgumentError(name, "=", v, ": expected on or off");
  apply(v == "on");
  return Status::Ok();
}

}  // namespace

Status ApplyEnvironmentOverrides() {
  if (const char* isa = std::getenv("MLARUN_CPU_ISA"); isa != nullptr && *isa != '\0') {
    auto parsed = ParseCpuIsa(isa);
    if (!parsed.ok()) return parsed.status().WithContext("MLARUN_CPU_ISA");
    MLARUN_RETURN_IF_ERROR(SetCpuIsaLimit(*parsed).WithContext(std::string("MLARUN_CPU_ISA=") + isa));
  }
  MLARUN_RETURN_IF_ERROR(ApplyOnOff("MLARUN_ONEDNN", [](bool on) { SetOneDnnEnabled(on); }));
  if (const char* v = std::getenv("MLARUN_INT_DOT"); v != nullptr && *v != '\0') {
    const std::string mode = v;
    if (mode != "auto" && mode != "on" && mode != "off")
      return InvalidArgumentError("MLARUN_INT_DOT=", mode, ": expected auto, on or off");
    cpu::SetIntDotMode(mode == "on"    ? cpu::IntDotMode::kOn
                       : mode == "off" ? cpu::IntDotMode::kOff
                                       : cpu::IntDotMode::kAuto);
  }
  MLARUN_RETURN_IF_ERROR(ApplyOnOff("MLARUN_VNNI", [](bool on) { cpu::SetVnniAllowed(on); }));
  MLARUN_RETURN_IF_ERROR(ApplyOnOff("MLARUN_BF16_DOT", [](bool on) { cpu::SetBf16DotAllowed(on); }));
  return ApplyOnOff("MLARUN_STREAM_PREFETCH", [](bool on) { cpu::SetStreamPrefetch(on); });
}

}  // namespace mlarun
