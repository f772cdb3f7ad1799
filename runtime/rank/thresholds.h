// The attention dispatch thresholds of one machine, as a file:
// `mlarun bench attention --write-thresholds FILE` measures and writes it,
// `mlarun worker|generate --attention-thresholds FILE` uses it instead of the
// kernel family's compiled-in defaults (attention/mla.h
// DefaultAbsorbThresholds). JSON:
//   {"absorb_below_query_len": 256, "absorb_below_query_len_no_prefix": 32,
//    "kernels": "avx2", "cpu": "AMD EPYC 7B13", "date": "2026-12-01"}
// The last three say where it was measured; a file measured under another
// kernel family is refused (its crossover is not this machine's).
#pragma once

#include <string>

#include "attention/mla.h"
#include "base/status.h"

namespace mlarun {

Status WriteAbsorbThresholds(const std::string& path, const AbsorbThresholds& t);

// Reads `path`; errors name the file and the field (missing, not a
// non-negative integer, measured with other kernels than the ones in force).
StatusOr<AbsorbThresholds> LoadAbsorbThresholds(const std::string& path);

// When `path` is set, the thresholds in it, into `c`.
Status ApplyAbsorbThresholdsFile(const std::string& path, MlaConfig* c);

}  // namespace mlarun
