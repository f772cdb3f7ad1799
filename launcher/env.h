// Environment overrides: every variable mlarun reads, registered here with its
// name and default, and read once at start-up by main() (and the test mains).
//
//   MLARUN_CPU_ISA  scalar | avx2 | avx512 | amx. Limits the CPU kernel family
//                   (base/cpu_isa.h) so a machine with a higher ISA can
//                   run, test and benchmark the lower paths. Default: unset,
//                   the best this CPU supports. A value above what the CPU
//                   supports is an error, never a crash later.
//   MLARUN_ONEDNN   on | off. Off, no matrix product goes through oneDNN: all
//                   run on mlarun's own kernels (gemm/cpu_gemm.h).
//                   Products of many rows (prefill) are slower where oneDNN
//                   has the faster one (bf16 on AVX512-BF16 / AMX, f32), and
//                   a step after warm-up allocates nothing at all (oneDNN
//                   allocates inside every product it runs). Default: on.
//   MLARUN_STREAM_PREFETCH  on | off. The streaming products' vendor rule
//                   (cpu::StreamPrefetch, gemm/cpu/kernels.h): on,
//                   one row of A streams a weight with a software prefetch
//                   ahead and two or three rows take tiles of weight rows
//                   (what Intel CPUs measured faster); off, one to three rows
//                   stream it with the hardware prefetchers alone (AMD's).
//                   For measuring one vendor's rule on the other's CPU.
//                   Default: on for GenuineIntel, off otherwise.
//   MLARUN_INT_DOT  auto | on | off. Products of few rows (decode) with int
//                   weights: A rounded to int8 per block of 32 and multiplied
//                   with integer dot products (cpu::UseIntDot), or A kept
//                   fp32 and each weight converted to fp32 (the dequantized
//                   model's exact arithmetic). Default auto: int4 weights
//                   round A (avx2 and up; the scalar family keeps it fp32),
//                   int8 weights keep it fp32; on: both round it.
//   MLARUN_VNNI     on | off. Off, the int-dot kernels of the avx512 and
//                   amx families sum int4 byte products with AVX2's
//                   instructions even where the CPU has AVX512-VNNI
//                   (cpu::UseVnni; the same integer sums), few rows in
//                   pairs of blocks instead of quads, and int8 products of
//                   many rows take AVX2's vpmaddwd panels (the same C).
//                   For measuring and testing both paths on one CPU.
//                   Default: on.
//   MLARUN_BF16_DOT on | off. Off, no product uses AVX512-BF16's dot
//                   products (cpu::UseBf16Dot) even where the CPU has them:
//                   bf16 products widen to fp32 in registers (few rows) or
//                   go to oneDNN (many rows), and fp8 products of many rows
//                   keep fp32 activations on fp32 panels instead of rounding
//                   them to bf16. For measuring and testing both paths on
//                   one CPU. Default: on.
#pragma once

#include "base/status.h"

namespace mlarun {

// Reads and applies every override. Call once, first thing in main(), before
// any kernel or oneDNN product runs. Errors name the variable and the value.
Status ApplyEnvironmentOverrides();

}  // namespace mlarun
