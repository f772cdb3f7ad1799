// `mlarun bench memory`: the machine's streaming read bandwidth, measured
// the way `mlarun bench decode` measures it next to each timed step
// (BandwidthProbe: a plain read and a one-row bf16 product over a buffer much
// larger than the last-level cache, all threads), a few passes in a row.
//
// For comparing another runtime's decode with the bandwidth of the moment:
// a shared host's memory bandwidth can change by half from one minute to the
// next (docs/performance.md), so bench/llama_cpp_compare.sh runs this right before and after
// llama-bench and reports both runtimes' batch-1 decode against the bound.
#pragma once

#include <cstdint>
#include <iosfwd>

#include "base/status.h"

namespace mlarun {

struct MemoryBenchOptions {
  int passes = 5;     // timed passes, after one untimed
  int64_t bytes = 0;  // the buffer; 0: BandwidthProbe's default (4 x LLC, 1-2 GiB)
  bool json = false;  // one JSON document on `out` (the table then goes to `err`)
};

// Refuses passes < 1 and a negative or sub-MiB buffer (InvalidArgument).
Status RunMemoryBench(const MemoryBenchOptions& o, std::ostream& out, std::ostream& err);

}  // namespace mlarun
