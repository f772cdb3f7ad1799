#include "launcher/env.h"

#include <cstdlib>
#include <string>

#include "runtime/base/cpu/kernels.h"
#include "runtime/base/cpu_gemm.h"
#include "runtime/base/cpu_isa.h"

namespace mlarun {

Status ApplyEnvironmentOverrides() {
  if (const char* isa = std::getenv("MLARUN_CPU_ISA"); isa != nullptr && *isa != '\0') {
    auto parsed = ParseCpuIsa(isa);
    if (!parsed.ok()) return parsed.status().WithContext("MLARUN_CPU_ISA");
    MLARUN_RETURN_IF_ERROR(SetCpuIsaLimit(*parsed).WithContext(std::string("MLARUN_CPU_ISA=") + isa));
  }
  if (const char* onednn = std::getenv("MLARUN_ONEDNN"); onednn != nullptr && *onednn != '\0') {
    const std::string v = onednn;
    if (v != "on" && v != "off") return InvalidArgumentError("MLARUN_ONEDNN=", v, ": expected on or off");
    SetOneDnnEnabled(v == "on");
  }
  if (const char* prefetch = std::getenv("MLARUN_STREAM_PREFETCH"); prefetch != nullptr && *prefetch != '\0') {
    const std::string v = prefetch;
    if (v != "on" && v != "off") return InvalidArgumentError("MLARUN_STREAM_PREFETCH=", v, ": expected on or off");
    cpu::SetStreamPrefetch(v == "on");
  }
  return Status::Ok();
}

}  // namespace mlarun
