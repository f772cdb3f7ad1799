#include "launcher/env.h"

#include <cstdlib>
#include <string>

#include "runtime/base/cpu_isa.h"

namespace mlarun {

Status ApplyEnvironmentOverrides() {
  if (const char* isa = std::getenv("MLARUN_CPU_ISA"); isa != nullptr && *isa != '\0') {
    auto parsed = ParseCpuIsa(isa);
    if (!parsed.ok()) return parsed.status().WithContext("MLARUN_CPU_ISA");
    MLARUN_RETURN_IF_ERROR(SetCpuIsaLimit(*parsed).WithContext(std::string("MLARUN_CPU_ISA=") + isa));
  }
  return Status::Ok();
}

}  // namespace mlarun
