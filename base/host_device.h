// MLARUN_HD marks inline functions that run on the host and, compiled by
// nvcc, on the device too: index math, merges and planning helpers live in
// plain headers so that host tests cover exactly what the kernels execute.
#pragma once

#if defined(__CUDACC__)
#define MLARUN_HD __host__ __device__
#else
#define MLARUN_HD
#endif
