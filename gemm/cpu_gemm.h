// Matrix products on the CPU, on any x86-64.
//
// One GemmDesc describes one product on row-major strided views. CpuGemm::Get
// returns a prepared product from a process-wide cache (preparing a oneDNN one
// costs ~50-100 us, running a small one a few us), so callers ask for every
// shape they will use while planning and only run products in their hot loops.
//
// The implementation is chosen per product by its shape and what the CPU has
// (ActiveCpuIsa()), fastest first:
//  * few rows (m <= GemmSmallRowsLimit): our own kernels, which stream B once and
//    widen bf16 to fp32 in registers (decode: bound by reading the weights);
//  * on AMX, bf16 products whose B is a weight as stored (k contiguous), up
//    to where oneDNN's AMX product is faster: our tile kernel, which reads
//    the weight in place and packs only A; oneDNN's matmul for the other
//    bf16 products of many rows there;
//  * our own packed kernels otherwise: bf16 pairs and AVX512-BF16 dot
//    products where the CPU has them, else fp32 panels (B converted a
//    cache-sized panel at a time; f32 products on every family).
// oneDNN runs only under AMX by default (its execute allocates on every
// call); any family can ask for it by name.
// Every product accumulates in fp32; f32 x f32 products are strict fp32.
//
// An f8_e4m3 B (a DeepSeek-V3 weight with 128 x 128 block scales, B's columns
// its rows: b_stride_k == 1) times an fp32 A always takes our own kernels: the
// streaming ones for few rows (B read as stored, decoded and scaled in
// registers: half the bytes of bf16), the packed one otherwise (a panel of B
// decoded once): on AVX512-BF16 the dot-product kernel, A rounded to bf16 as
// the products of bf16 weights round it (the e4m3 codes are exact in bf16),
// else fp32 panels. The scales come with each Run (GemmBScales).
//
// An int8 / int4 B (a weight with group scales, b_stride_k == 1) times an
// fp32 A too: few rows stream the packed integers once, unpacked in
// registers, a dot product per group scaled once per group (the offsets
// through each group's sum of A); more rows, integer panels of B unpacked
// once against A rounded per block of 32 (int8 B: int16 A; int4 B: int8 A;
// cpu::UsePackedIntDot), else the packed kernel with a panel of B decoded
// to fp32 once.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <ostream>
#include <string>
#include <string_view>

#include "base/dtype.h"
#include "base/status.h"

namespace mlarun {

// C = A x B, or C += A x B with `accumulate`. All strides are in elements.
struct GemmDesc {
  int64_t m = 0, n = 0, k = 0;
  DType a_type = DType::kF32;  // A and B share one type: f32 or bf16; or f32 A and f8_e4m3, int8 or int4 B
  DType b_type = DType::kF32;
  DType c_type = DType::kF32;  // f32, or bf16 (rounded once after fp32 accumulation)
  int64_t lda = 0;             // A[i, p] at a[i * lda + p]
  int64_t b_stride_k = 0;      // B[p, j] at b[p * b_stride_k + j * b_stride_n];
  int64_t b_stride_n = 0;      //   one of the two must be 1
  int64_t ldc = 0;             // C[i, j] at c[i * ldc + j]
  bool accumulate = false;
  int64_t b_group = 0;  // int8 / int4 B: elements of k per scale (even; >= k: one per column)

  friend bool operator==(const GemmDesc&, const GemmDesc&) = default;
};
std::ostream& operator<<(std::ostream& os, const GemmDesc& d);

// The block scales of an f8_e4m3 B: B[p, j] = e4m3(b[j * b_stride_n + p]) *
// scale[((row0 + j) / 128) * ld + p / 128]. `row0`: the weight row B's column
// 0 is (a product over a column range of a weight starts inside it). A view.
//
// The group scales of an int8 / int4 B (GemmDesc::b_group elements of k per
// group; runtime/ops/linear.h's contract): with q the stored integer (int8
// signed; int4 the unsigned nibble, element 2i in the low nibble of byte i),
// i = (row0 + j) * ld + p / b_group,
//   B[p, j] = q * scale[i] + offset[i]   (offset set),
//   B[p, j] = (q - zero) * scale[i]      (offset null).
struct GemmBScales {
  const float* scale = nullptr;
  int64_t ld = 0;
  int64_t row0 = 0;
  const float* offset = nullptr;  // int8 / int4 only; may be nullptr
  int32_t zero = 0;               // int8 / int4 with offset null
};

// Checks a GemmDesc: positive sizes, supported types, consistent strides.
Status ValidateGemmDesc(const GemmDesc& d);

// Products with at most this many rows take the streaming kernels (below it
// the weights' bytes set the pace; from it on the arithmetic does): where
// they stop being faster than oneDNN's and our packed kernels (figures:
// docs/cpu-kernels.md, 'Kernel choices'): bf16 where oneDNN has bf16
// arithmetic (AVX512-BF16, AMX), up to 16 rows with our AVX512-BF16 dot
// products (8 without them); bf16 elsewhere, up to 32; f32 up to 32 under
// AVX-512, 8 under AVX2, 16 on the baseline; f8_e4m3 up to 16 where the
// packed kernel has the bf16 dot products, else 32.
int64_t GemmSmallRowsLimit(const GemmDesc& d);
// The largest of those limits: callers that pad rows leave products this
// small exact.
inline constexpr int64_t kGemmSmallRows = 32;

enum class GemmImpl : uint8_t {
  kAuto = 0,    // the order above
  kOneDnn = 1,  // oneDNN's matmul (fails where oneDNN cannot build it)
  kSmall = 2,   // our streaming kernels, any m (slow for many rows)
  kPacked = 3,  // our packed kernel
  kTiles = 4,   // our AMX tile kernel (bf16 x bf16, B k-contiguous; amx family only)
};
std::string_view GemmImplName(GemmImpl impl);

// Whether products may go through oneDNN (the default). Off, every product
// runs on our kernels: slower on products of many rows (prefill) where oneDNN
// has the faster one, but a step after warm-up then allocates nothing at all
// (oneDNN's execute allocates on every call; see CpuGemm::InOneDnnExecute).
// Set once at start-up (MLARUN_ONEDNN, launcher/env.h); products prepared
// before keep what they were prepared with.
void SetOneDnnEnabled(bool enabled);
bool OneDnnEnabled();

class CpuGemm {
 public:
  // Prepared product for `desc`, shared through a process-wide cache.
  // Thread-safe. `impl` forces one implementation (tests, benchmarks).
  static StatusOr<std::shared_ptr<const CpuGemm>> Get(const GemmDesc& desc, GemmImpl impl = GemmImpl::kAuto);

  ~CpuGemm();
  CpuGemm(const CpuGemm&) = delete;
  CpuGemm& operator=(const CpuGemm&) = delete;

  const GemmDesc& desc() const { return desc_; }
  // Scratch the caller must pass to Run (0 when none is needed).
  size_t scratch_bytes() const { return scratch_bytes_; }
  // The implementation: oneDNN's name (e.g. "onednn:brg:avx512_core_amx_bf16"),
  // or ours with its kernel family ("small_bt:avx2", "packed:scalar").
  const std::string& impl_name() const { return impl_name_; }
  GemmImpl impl() const { return kind_; }

  // Runs the product and blocks until it is done. Thread-safe: concurrent calls
  // must pass different `scratch` buffers of scratch_bytes() (64-byte aligned;
  // may be nullptr when scratch_bytes() is 0). Called inside an OpenMP parallel
  // region it runs on the calling thread only; outside, on all OpenMP threads.
  // `b_scales`: required for an f8_e4m3, int8 or int4 B, ignored otherwise.
  Status Run(const void* a, const void* b, void* c, void* scratch, const GemmBScales* b_scales = nullptr) const;

  // Number of products prepared so far (cache misses), for diagnostics.
  static int64_t PreparedCount();

  // True while the calling thread is inside oneDNN's execution of a product
  // (Run of a kOneDnn product). oneDNN allocates there on every call (its
  // argument map, its execution context) and its API offers no way around
  // it; everything of ours around it reuses what earlier calls made. For
  // allocation accounting (tests/runtime/model/step_allocations_test.cc).
  static bool InOneDnnExecute();

 private:
  struct Impl;
  explicit CpuGemm(const GemmDesc& desc);
  Status RunOwn(const void* a, const void* b, void* c, void* scratch, const GemmBScales* b_scales) const;
  GemmDesc desc_;
  GemmImpl kind_ = GemmImpl::kAuto;
  std::string impl_name_;
  size_t scratch_bytes_ = 0;
  std::unique_ptr<Impl> impl_;
};

}  // namespace mlarun
