// `mlarun bench gemm`: our matrix-product kernels against each other and
// against oneDNN (the library product) on the same shapes, in one process:
// GFLOP/s and the bytes of B per second, per row count, for every
// implementation this CPU can run. The row limits in gemm/cpu_gemm.cc
// (where the streaming kernels hand over to the packed or tile kernels) were
// set from such runs; this measures them again on any machine, under any
// kernel family (MLARUN_CPU_ISA).
//
// B defaults to a weight larger than the last-level cache (4 x, 1-2 GiB), as
// a decode step reads it from memory; --n sets it smaller. Every product is
// checked against a float64 reference on a sample of its columns before it
// is timed.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <string>
#include <vector>

#include "base/status.h"

namespace mlarun {

struct GemmBenchOptions {
  std::vector<int64_t> rows = {1, 2, 4, 8, 12, 16, 20, 24, 32, 64};
  int64_t n = 0;  // B's columns (a weight's rows); 0: a weight of 4 x the LLC, 1-2 GiB
  int64_t k = 2048;
  std::string dtype = "bf16";     // A and B: bf16 or f32 (C is f32)
  std::string layout = "weight";  // weight: B as a weight [n, k] is stored (k contiguous); rows: B [k, n]
  std::vector<std::string> impls = {"small", "packed", "tiles", "onednn"};
  int repetitions = 5;
  bool json = false;  // one JSON document on `out` (the table then goes to `err`)
};

// Refuses bad options with InvalidArgument naming the option: no rows, a row
// count or k below 1 (or rows above 65536), a negative n, an unknown dtype,
// layout or implementation, repetitions below 1, or a C above 4 GiB. An
// implementation this CPU or kernel family cannot run is reported as such,
// not an error.
Status RunGemmBench(const GemmBenchOptions& o, std::ostream& out, std::ostream& err);

}  // namespace mlarun
