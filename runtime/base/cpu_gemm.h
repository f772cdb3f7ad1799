// Matrix products on the CPU through oneDNN.
//
// One GemmDesc describes one product on row-major strided views. CpuGemm::Get
// returns a prepared product from a process-wide cache (preparing one costs
// ~50-100 us, running a small one a few us), so callers ask for every shape they
// will use while planning and only run products in their hot loops.
//
// bf16 x bf16 products accumulate in fp32 and run on AMX / AVX512-BF16 where the
// CPU has them; f32 x f32 products run in strict fp32 (no implicit down-conversion).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <ostream>

#include "runtime/base/dtype.h"
#include "runtime/base/status.h"

namespace mlarun {

// C = A x B, or C += A x B with `accumulate`. All strides are in elements.
struct GemmDesc {
  int64_t m = 0, n = 0, k = 0;
  DType a_type = DType::kF32;  // A and B share one type: f32 or bf16
  DType b_type = DType::kF32;
  DType c_type = DType::kF32;  // f32, or bf16 (rounded once after fp32 accumulation)
  int64_t lda = 0;             // A[i, p] at a[i * lda + p]
  int64_t b_stride_k = 0;      // B[p, j] at b[p * b_stride_k + j * b_stride_n];
  int64_t b_stride_n = 0;      //   one of the two must be 1
  int64_t ldc = 0;             // C[i, j] at c[i * ldc + j]
  bool accumulate = false;

  friend bool operator==(const GemmDesc&, const GemmDesc&) = default;
};
std::ostream& operator<<(std::ostream& os, const GemmDesc& d);

// Checks a GemmDesc: positive sizes, supported types, consistent strides.
Status ValidateGemmDesc(const GemmDesc& d);

class CpuGemm {
 public:
  // Prepared product for `desc`, shared through a process-wide cache.
  // Thread-safe.
  static StatusOr<std::shared_ptr<const CpuGemm>> Get(const GemmDesc& desc);

  ~CpuGemm();
  CpuGemm(const CpuGemm&) = delete;
  CpuGemm& operator=(const CpuGemm&) = delete;

  const GemmDesc& desc() const { return desc_; }
  // Scratch the caller must pass to Run (0 when none is needed).
  size_t scratch_bytes() const { return scratch_bytes_; }
  // oneDNN's implementation name, e.g. "brg:avx512_core_amx_bf16".
  const char* impl_name() const;

  // Runs the product and blocks until it is done. Thread-safe: concurrent calls
  // must pass different `scratch` buffers of scratch_bytes() (64-byte aligned;
  // may be nullptr when scratch_bytes() is 0). Called inside an OpenMP parallel
  // region it runs on the calling thread only; outside, on all OpenMP threads.
  Status Run(const void* a, const void* b, void* c, void* scratch) const;

  // Number of products prepared so far (cache misses), for diagnostics.
  static int64_t PreparedCount();

 private:
  struct Impl;
  explicit CpuGemm(const GemmDesc& desc);
  GemmDesc desc_;
  size_t scratch_bytes_ = 0;
  std::unique_ptr<Impl> impl_;
};

}  // namespace mlarun
