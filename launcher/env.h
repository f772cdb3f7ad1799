// Environment overrides: every variable mlarun reads, registered here with its
// name and default, and read once at start-up by main() (and the test mains).
//
//   MLARUN_CPU_ISA  scalar | avx2 | avx512 | amx. Limits the CPU kernel family
//                   (runtime/base/cpu_isa.h) so a machine with a higher ISA can
//                   run, test and benchmark the lower paths. Default: unset,
//                   the best this CPU supports. A value above what the CPU
//                   supports is an error, never a crash later.
#pragma once

#include "runtime/base/status.h"

namespace mlarun {

// Reads and applies every override. Call once, first thing in main(), before
// any kernel or oneDNN product runs. Errors name the variable and the value.
Status ApplyEnvironmentOverrides();

}  // namespace mlarun
