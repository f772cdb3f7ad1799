// The CPU kernels of one instruction-set family, as a table of functions.
//
// Each family is the same source (simd_kernels.inc) compiled in its own
// translation unit with its own target flags (kernels_scalar.cc: baseline
// x86-64; kernels_avx2.cc: -mavx2 -mfma; kernels_avx512.cc: -mavx512f/bw/vl/dq),
// so one binary carries all of them and picks one at run time
// (base/cpu_isa.h). No function here is called on a CPU that lacks
// its family: KernelsFor() refuses, and Kernels() follows ActiveCpuIsa().
//
// bf16 operands are read as they are stored and widened to fp32 in registers
// (a bf16 is the upper half of an fp32: a 16-bit shift); f8_e4m3 weights too
// (moved into binary16 bit positions and converted with F16C / AVX-512, a
// 256-entry table in the scalar family), times their block scale; int8 and
// int4 weights too (sign-extended, or the nibbles masked and shifted, then
// converted), their group scale applied once per group; or, where
// UseIntDot, A is rounded to int8 per block of 32 and the weights meet it as
// bytes (int_dot.inc: integer sums per block, fp32 across blocks). Every
// other product accumulates in fp32. Nothing here allocates; callers pass
// scratch.
#pragma once

#include <cstddef>
#include <cstdint>

#include "base/cpu_isa.h"
#include "base/dtype.h"

namespace mlarun::cpu {

// One matrix product C[m, n] (=|+=) A[m, k] x B[k, n], the part of it in
// columns [n_begin, n_end). Strides are in elements.
struct GemmArgs {
  int64_t m = 0, n = 0, k = 0;
  // A[i, p] at a[i * lda + p]: fp32, or bf16 (the dot kernels; the packed
  // kernels' prepare_a). The packed and tile kernels read A from where their
  // prepare_a wrote it, in a layout of their own (a_type and lda unused),
  // except gemm_packed with a_rows (below).
  const void* a = nullptr;
  DType a_type = DType::kF32;
  int64_t lda = 0;
  const void* b = nullptr;  // B[p, j] at b[p * b_stride_k + j * b_stride_n], f32, bf16 or f8_e4m3
  DType b_type = DType::kF32;
  int64_t b_stride_k = 0, b_stride_n = 0;  // one of them is 1 (b_stride_k for f8_e4m3)
  // f8_e4m3 B only (with an fp32 A; gemm_small_bt, gemm_packed and
  // gemm_packed_bf16_dot):
  // B[p, j] = e4m3(b[j * b_stride_n + p]) * b_scale[((b_row0 + j) / 128) * b_scale_ld + p / 128].
  const float* b_scale = nullptr;
  int64_t b_scale_ld = 0, b_row0 = 0;
  // int8 / int4 B (b_stride_k == 1, b_stride_n even for int4; gemm_small_bt
  // and gemm_packed with an fp32 A): B[p, j] = q * s + o, q the stored
  // integer of b[j * b_stride_n + p] (int8 signed; int4 the unsigned nibble,
  // element 2i in the low nibble of byte i), s = b_scale[(b_row0 + j) *
  // b_scale_ld + p / b_group], o the same entry of b_offset, or -b_zero * s
  // where b_offset is null. small_bt_prepare_a then also writes each row's
  // sum of A per group after A (small_bt_prepared_a_floats).
  const float* b_offset = nullptr;
  int64_t b_group = 0;
  int32_t b_zero = 0;
  void* c = nullptr;  // C[i, j] at c[i * ldc + j], f32 or bf16 (rounded once)
  DType c_type = DType::kF32;
  int64_t ldc = 0;
  bool accumulate = false;  // C += A x B (f32 C only)
  // gemm_packed with an fp32 A: A read from its rows (a, lda) instead of
  // prepared strips.
  bool a_rows = false;
};

struct CpuKernels {
  CpuIsa isa = CpuIsa::kScalar;

  // Few rows, B with k contiguous (b_stride_k == 1; a linear layer's weight
  // [out, in]): each thread streams its columns' B rows once from memory and
  // dots them with all m rows of A. The decode path: bound by reading B.
  // A must first be rewritten by small_bt_prepare_a into m x k fp32 (a
  // layout of the kernel's own; g.a then points at it, lda = k).
  void (*gemm_small_bt)(const GemmArgs& g, int64_t n_begin, int64_t n_end) = nullptr;
  void (*small_bt_prepare_a)(const GemmArgs& g, float* out) = nullptr;
  // (It writes SmallBtPreparedAFloats floats.)
  // The same for an int8 / int4 B with A quantized to int8 per block of 32
  // and integer dot products (int_dot.inc), where UseIntDot. Its prepare
  // writes int_dot_prepared_a_bytes(m, k, b_group) bytes.
  void (*gemm_small_bt_int_dot)(const GemmArgs& g, int64_t n_begin, int64_t n_end) = nullptr;
  void (*small_bt_int_dot_prepare_a)(const GemmArgs& g, float* out) = nullptr;
  size_t (*int_dot_prepared_a_bytes)(int64_t m, int64_t k, int64_t b_group) = nullptr;
  // Many rows with an int4 B, A rounded the same way (in k order): panels of
  // weight rows unpacked to bytes, 8-bit products summed per block
  // (int_dot.inc; with AVX512-VNNI where UseVnni); with an int8 B, A
  // rounded to int16 and B widened to int16 per panel (vpmaddwd, or
  // vpdpwssd where UseVnni). Its prepare writes rows [r_begin, r_end) of A's rounded
  // copy into `out` (packed_int_dot_prepared_a_bytes, shared by the
  // threads); each thread's scratch is packed_int_dot_scratch_bytes. The
  // SIMD families only (nullptr in scalar's table).
  void (*gemm_packed_int_dot)(const GemmArgs& g, int64_t n_begin, int64_t n_end, void* scratch) = nullptr;
  void (*packed_int_dot_prepare_a)(const GemmArgs& g, int64_t r_begin, int64_t r_end, void* out) = nullptr;
  size_t (*packed_int_dot_prepared_a_bytes)(int64_t m, int64_t k, int64_t b_group, DType b_type) = nullptr;
  size_t (*packed_int_dot_scratch_bytes)(int64_t k, int64_t b_group, DType b_type) = nullptr;
  // The same for a bf16 A and B with AVX512-BF16 dot products (A read as it
  // is, no prepare). Present in the avx512 table; callable only when
  // HostCpu().avx512_bf16 (see UseBf16Dot).
  void (*gemm_small_bt_bf16_dot)(const GemmArgs& g, int64_t n_begin, int64_t n_end) = nullptr;
  // Few rows, B with n contiguous (b_stride_n == 1): B rows are read once,
  // each scaled by A's column and summed into C, a few vectors of C at a time.
  void (*gemm_small_bn)(const GemmArgs& g, int64_t n_begin, int64_t n_end) = nullptr;
  // Any shape: panels of B (converted to fp32 once per panel) are packed
  // into `scratch` (packed_scratch_bytes()) and multiplied with A's strips by
  // a register-blocked micro-kernel. The prefill path. A must first be
  // rewritten by packed_prepare_a, strips of packed_mr rows [s_begin, s_end)
  // into `out` (packed_prepared_a_bytes(m, k) bytes, 64-byte aligned; g.a
  // then points at it), once per product: the threads share it.
  void (*gemm_packed)(const GemmArgs& g, int64_t n_begin, int64_t n_end, void* scratch) = nullptr;
  void (*packed_prepare_a)(const GemmArgs& g, int64_t s_begin, int64_t s_end, void* out) = nullptr;
  size_t (*packed_prepared_a_bytes)(int64_t m, int64_t k) = nullptr;
  int64_t packed_mr = 0;
  // The same for a bf16 A and B with AVX512-BF16 dot products (panels of
  // bf16 pairs, never widened; scratch per thread as gemm_packed's); or for
  // an fp32 A, rounded to bf16, and an f8_e4m3 B, whose codes bf16 holds
  // exactly (summed per block of 128 of k, then times the block's scale).
  // Present in the avx512 and amx tables; callable only when UseBf16Dot.
  void (*gemm_packed_bf16_dot)(const GemmArgs& g, int64_t n_begin, int64_t n_end, void* scratch) = nullptr;
  // Its A, prepared as gemm_packed's is (a layout of pairs of its own; an
  // fp32 A rounded to bf16, to nearest even).
  void (*packed_dot_prepare_a)(const GemmArgs& g, int64_t s_begin, int64_t s_end, void* out) = nullptr;
  size_t (*packed_dot_prepared_a_bytes)(int64_t m, int64_t k) = nullptr;
  int64_t packed_dot_mr = 0;
  // bf16 A x bf16 B with k contiguous on the AMX tile unit, any m (the amx
  // table only; nullptr elsewhere). A must first be rewritten by
  // tiles_prepare_a into tiles_prepared_a_bytes(m, k) bytes (64-byte
  // aligned; g.a then points at it); B is read as stored. See amx_tiles.inc.
  void (*gemm_tiles)(const GemmArgs& g, int64_t n_begin, int64_t n_end) = nullptr;
  void (*tiles_prepare_a)(const GemmArgs& g, void* out) = nullptr;
  size_t (*tiles_prepared_a_bytes)(int64_t m, int64_t k) = nullptr;
  // Scratch gemm_packed needs for an m x n x k product (n: the widest column
  // range one call covers), whose C is bf16 or not.
  size_t (*packed_scratch_bytes)(int64_t m, int64_t n, int64_t k, bool c_bf16) = nullptr;
  // gemm_packed writes a bf16 C only when k is at most this (it rounds the
  // whole sum once); callers route longer products through an fp32 C.
  int64_t packed_max_k_bf16_c = 0;
  // Column granularity the callers split n on across threads (keeps every
  // thread's share a whole number of micro-kernel strips).
  int64_t n_align = 1;

  // Element-wise.
  void (*f32_to_bf16)(const float* src, bf16_t* dst, int64_t n) = nullptr;  // round to nearest even, NaN stays NaN
  void (*bf16_to_f32)(const bf16_t* src, float* dst, int64_t n) = nullptr;
  float (*row_max)(const float* x, int64_t n) = nullptr;  // -inf for n == 0
  // x[j] <- exp((x[j] - mx) * scale) for j < n (mx >= every x[j]); returns the sum.
  float (*exp_shifted)(float* x, int64_t n, float mx, float scale) = nullptr;
  void (*scale)(float* x, int64_t n, float s) = nullptr;                                  // x *= s
  void (*axpby)(float* acc, const float* part, int64_t n, float wa, float wb) = nullptr;  // acc = acc wa + part wb

  // Reads `bytes` (a multiple of 64) at `p` with the widest loads of the family,
  // returns a value that depends on every byte (so the reads cannot be elided).
  uint64_t (*stream_read)(const void* p, size_t bytes) = nullptr;

  // `steps` x 12 (avx512, amx: 16) independent multiply-adds of the
  // family's widest product instruction on registers (vdpbf16ps where
  // `bf16_dot` and UseBf16Dot, else the fp32 FMA), nothing loaded: the
  // arithmetic peak a product is set against, whatever kernel computes it.
  // Returns the FLOP done.
  int64_t (*product_peak_loop)(int64_t steps, bool bf16_dot) = nullptr;
};

// The floats small_bt_prepare_a writes: m x k, plus m x ceil(k / b_group)
// sums of A per group for an int8 / int4 B. (For the callers: the kernels
// call no inline function of this header.)
inline int64_t SmallBtPreparedAFloats(int64_t m, int64_t k, DType b_type, int64_t b_group) {
  const bool int_b = (b_type == DType::kInt8 || b_type == DType::kInt4) && b_group > 0;
  return m * k + (int_b ? m * ((k + b_group - 1) / b_group) : 0);
}

// Whether products may use gemm_small_bt_bf16_dot: the table has it, the CPU
// has AVX512-BF16, and SetBf16DotAllowed did not turn it off.
bool UseBf16Dot(const CpuKernels& k);
// For tests, so the FMA path of the avx512 kernels runs on a CPU with
// AVX512-BF16 too. Returns the previous setting. Products prepared before
// keep what they were prepared with.
bool SetBf16DotAllowed(bool allowed);

// Whether the int-dot kernels of the avx512 and amx families may sum their
// byte products with AVX512-VNNI (vpdpbusd: four u8 x s8 products into an
// int32 lane in one instruction, over 512 bits) instead of the AVX2 pair
// vpmaddubsw + vpmaddwd: the CPU has it and SetVnniAllowed did not turn it
// off. The integer sums are the same either way (exact in both).
bool UseVnni();
// For tests and MLARUN_VNNI (launcher/env.h), so the AVX2 byte products run
// on a CPU with VNNI too. Returns the previous setting.
bool SetVnniAllowed(bool allowed);

// Whether few rows with int weights round A to int8 (gemm_small_bt_int_dot):
// kAuto for int4 weights only, where converting the weights to fp32, not
// memory, set the pace and A's rounding changes the error by less than the
// runs' noise; int8 keeps fp32 A, whose error stays below llama.cpp's Q8_0.
// kAuto also needs a family with byte dot products (avx2 and up): the
// scalar family's int-dot is plain loops, several times slower than its
// fp32 path (figures: docs/quantized-weights.md).
enum class IntDotMode : uint8_t { kAuto, kOn, kOff };
// Whether a small_bt product of family `isa` with B of `b_type` (k long,
// groups of b_group) takes gemm_small_bt_int_dot: the mode allows its dtype
// on that family, and its groups (or k, when one group spans it) are whole
// blocks of 32 that divide k.
bool UseIntDot(CpuIsa isa, DType b_type, int64_t k, int64_t b_group);
// Whether a product of many rows with B of `b_type` takes k's
// gemm_packed_int_dot: int4 where UseIntDot; int8 on the SIMD families
// where the mode is not kOff and its groups are whole blocks of 32 that
// divide k (its int16 A keeps the fp32 activations' accuracy, so kAuto
// allows it).
bool UsePackedIntDot(const CpuKernels& k, DType b_type, int64_t k_dim, int64_t b_group);
// For tests and MLARUN_INT_DOT (launcher/env.h). Returns the previous mode.
// Products prepared before keep what they were prepared with.
IntDotMode SetIntDotMode(IntDotMode mode);
IntDotMode GetIntDotMode();

// Whether one row's streaming products prefetch B in software, ahead of the
// hardware prefetchers, and two or three rows take tiles of B rows instead of
// streaming: on Intel CPUs (GenuineIntel), where the hardware prefetchers
// alone kept one row's stream short of the memory's rate (by where its loop
// fell in the code) and a prefetch 1 KiB ahead reached it, and tiles read two
// or three rows faster than streaming them, prefetched or not; not on AMD,
// where software prefetch measured slower than the plain stream and streaming
// was the faster up to three rows (figures: docs/cpu-kernels.md,
// 'Kernel choices').
bool StreamPrefetch();
// For tests and MLARUN_STREAM_PREFETCH (launcher/env.h), so either vendor's
// streaming path runs on any CPU. Returns the previous setting.
bool SetStreamPrefetch(bool prefetch);

// The table of `isa`; nullptr when this CPU cannot run it.
const CpuKernels* KernelsFor(CpuIsa isa);
// The table of ActiveCpuIsa(). Cheap (one atomic load and an index).
const CpuKernels& Kernels();

// The families' tables, one per translation unit. Call through KernelsFor.
const CpuKernels& ScalarKernels();
const CpuKernels& Avx2Kernels();
const CpuKernels& Avx512Kernels();
const CpuKernels& AmxKernels();

}  // namespace mlarun::cpu
