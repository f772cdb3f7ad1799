// Linear products over f8_e4m3 weights with 128 x 128 block scales: the CPU
// op (and both CpuGemm kernels it may take) against a float64 reference over
// the dequantized weights, on random codes with random block scales, blocks
// cut short at the edges, column ranges, ld > in, 1..300 rows, accumulation;
// then the CUDA op against the CPU op (skipped without a GPU).
//
// Padding that must never be read is poisoned: x's and the weight's columns
// past `in` (NaN, and the NaN code 0x7f), the scales of block columns past
// ceil(in / 128) (NaN), and y's columns past the range (NaN, must stay NaN).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "base/cuda_device.h"
#include "base/device_memory.h"
#include "base/float8.h"
#include "gemm/cpu/kernels.h"
#include "gemm/cpu_gemm.h"
#include "runtime/ops/linear.h"

namespace mlarun {
namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// The e4m3fn value of a code, from its definition (bias 7, subnormals).
double Decode(uint8_t code) {
  const int s = code >> 7, e = (code >> 3) & 15, m = code & 7;
  const double mag = e == 0 ? std::ldexp(m / 8.0, -6) : std::ldexp(1.0 + m / 8.0, e - 7);
  return s ? -mag : mag;
}

// A random [out, in] f8_e4m3 weight, row stride ld >= in: every finite code
// (NaN codes only in the padding), block scales 2^U(-10, -2) x U(1, 2).
Linear RandomFp8(std::mt19937& rng, int64_t out, int64_t in, int64_t ld) {
  Linear w = Linear::Owned(out, ld, DType::kF8E4M3);
  std::uniform_int_distribution<int> code(0, 253);  // 254 finite codes
  for (int64_t r = 0; r < out; ++r)
    for (int64_t c = 0; c < ld; ++c) {
      int v = code(rng);
      v = v >= 0x7f ? v + 1 : v;  // skip 0x7f (NaN); 0xff is past 253 + 1
      reinterpret_cast<uint8_t*>(w.mutable_data())[r * ld + c] = c < in ? static_cast<uint8_t>(v) : uint8_t{0x7f};
    }
  std::uniform_real_distribution<float> mant(1.f, 2.f);
  std::uniform_int_distribution<int> expo(-10, -2);
  const int64_t block_cols = Fp8Blocks(in);
  for (int64_t br = 0; br < Fp8Blocks(out); ++br)
    for (int64_t bc = 0; bc < w.scale_ld; ++bc)
      w.mutable_scale()[br * w.scale_ld + bc] = bc < block_cols ? std::ldexp(mant(rng), expo(rng)) : kNaN;
  w.in = in;  // columns [in, ld) stay behind the stride
  return w;
}

double Weight(const Linear& w, int64_t r, int64_t c) {
  return Decode(reinterpret_cast<const uint8_t*>(w.data)[r * w.ld + c]) *
         static_cast<double>(w.scale[Fp8ScaleIndex(r, c, w.scale_ld)]);
}

struct Case {
  int64_t out, in, ld;
  int64_t c0, c1;  // column range (weight rows)
};
std::string Name(const Case& c, int64_t rows, bool acc) {
  std::ostringstream os;  // (GCC 12 -O3 warns falsely of -Wrestrict on "literal" + std::string)
  os << "[" << c.out << ", " << c.in << "] ld " << c.ld << " cols [" << c.c0 << ", " << c.c1 << ") rows " << rows
     << (acc ? " +=" : "");
  return os.str();
}

// Partial blocks in both dimensions, ranges that start inside a block row,
// strides that are no multiple of a vector; and an input so long (5000) that
// one or two fp32 rows of it no longer stay in L1 beside a streamed weight,
// so the streaming kernel takes tiles of weight rows (kStreamMaxABytes).
const Case kCases[] = {
    {300, 200, 264, 0, 300}, {300, 200, 264, 5, 297},     {129, 130, 131, 100, 129},
    {64, 7, 16, 0, 64},      {257, 1000, 1024, 128, 257}, {40, 300, 333, 3, 37},
    {1, 128, 128, 0, 1},     {200, 520, 520, 60, 190},    {40, 5000, 5011, 3, 37},
};

struct Inputs {
  std::vector<float> x, y;
  int64_t ldx, ldy, n;
};
Inputs MakeInputs(std::mt19937& rng, const Case& c, int64_t rows, bool acc) {
  Inputs in;
  in.n = c.c1 - c.c0;
  in.ldx = c.in + 3;
  in.ldy = in.n + 2;
  std::uniform_real_distribution<float> u(0.1f, 1.f);
  std::bernoulli_distribution sign(0.5);
  auto next = [&] { return sign(rng) ? u(rng) : -u(rng); };
  in.x.assign(static_cast<size_t>(rows * in.ldx), kNaN);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < c.in; ++i) in.x[static_cast<size_t>(r * in.ldx + i)] = next();
  in.y.assign(static_cast<size_t>(rows * in.ldy), kNaN);
  if (acc)
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < in.n; ++j) in.y[static_cast<size_t>(r * in.ldy + j)] = next();
  return in;
}

// The product of `rows` fp32 rows of k with columns of an f8_e4m3 weight of
// row stride ld, into a C of row stride ldc.
GemmDesc Fp8Desc(int64_t rows, int64_t n, int64_t k, int64_t ld, int64_t ldc) {
  return {.m = rows,
          .n = n,
          .k = k,
          .a_type = DType::kF32,
          .b_type = DType::kF8E4M3,
          .c_type = DType::kF32,
          .lda = k,
          .b_stride_k = 1,
          .b_stride_n = ld,
          .ldc = ldc};
}

// Whether `gemm` runs on the AVX512-BF16 dot kernel, which rounds x to bf16
// first (the e4m3 codes are exact in bf16).
bool RoundsXToBf16(const CpuGemm& gemm) { return gemm.impl_name().starts_with("packed_dpbf16"); }
// The same for the op's product of `rows` rows of c (its padding of rows
// past kGemmSmallRows changes no choice: those rows are packed anyway).
bool OpRoundsXToBf16(const Case& c, int64_t rows) {
  auto g = CpuGemm::Get(Fp8Desc(rows, c.c1 - c.c0, c.in, c.ld, c.c1 - c.c0));
  EXPECT_TRUE(g.ok()) << g.status();
  return g.ok() && RoundsXToBf16(**g);
}

// y against y0 (+=) plus the float64 product (of x rounded to bf16 with
// `x_bf16`); padding columns stay NaN.
void Check(const Linear& w, const Case& c, int64_t rows, bool acc, const Inputs& in, const std::vector<float>& y0,
           const std::vector<float>& y, bool x_bf16) {
  double worst = 0;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < in.n; ++j) {
      double s = 0, mag = 0;
      for (int64_t i = 0; i < c.in; ++i) {
        const float x = in.x[static_cast<size_t>(r * in.ldx + i)];
        const double t = static_cast<double>(x_bf16 ? Bf16ToFloat(FloatToBf16(x)) : x) * Weight(w, c.c0 + j, i);
        s += t, mag += std::abs(t);
      }
      const size_t k = static_cast<size_t>(r * in.ldy + j);
      const double want = (acc ? static_cast<double>(y0[k]) : 0.0) + s;
      // fp32 products and sums of terms of total magnitude `mag` (plus the
      // accumulated value's own rounding).
      const double tol = 1e-5 * (mag + std::abs(want)) + 1e-30;
      const double err = std::abs(static_cast<double>(y[k]) - want);
      worst = std::max(worst, err / tol);
      if (!(err <= tol)) {  // a NaN (an element never written: y starts NaN) fails too
        ADD_FAILURE() << "y[" << r << "][" << j << "] = " << y[k] << ", want " << want << " (tol " << tol << ")";
        return;
      }
    }
    for (int64_t j = in.n; j < in.ldy; ++j) ASSERT_TRUE(std::isnan(y[static_cast<size_t>(r * in.ldy + j)])) << j;
  }
  EXPECT_LE(worst, 1.0);
}

// The op on columns [c.c0, c.c1) of `w` for in.x, into in.y.
Status RunOp(const Linear& w, const Case& c, int64_t rows, Inputs& in, bool acc) {
  return LinearRun({.w = &w,
                    .col_begin = c.c0,
                    .col_end = c.c1,
                    .x = in.x.data(),
                    .rows = rows,
                    .ldx = in.ldx,
                    .y = in.y.data(),
                    .ldy = in.ldy,
                    .accumulate = acc});
}

TEST(LinearFp8, MatchesFloat64Reference) {
  std::mt19937 rng(11);
  for (const Case& c : kCases) {
    const Linear w = RandomFp8(rng, c.out, c.in, c.ld);
    for (int64_t rows : {1, 2, 3, 4, 5, 8, 16, 31, 32, 33, 64, 300})
      for (bool acc : {false, true}) {
        SCOPED_TRACE(Name(c, rows, acc));
        Inputs in = MakeInputs(rng, c, rows, acc);
        const std::vector<float> y0 = in.y;
        const Status st = RunOp(w, c, rows, in, acc);
        ASSERT_TRUE(st.ok()) << st;
        Check(w, c, rows, acc, in, y0, in.y, OpRoundsXToBf16(c, rows));
      }
  }
}

// Both of our kernels on every row count (the op picks one by rows): the
// streaming one on many rows and the packed one on few; the packed one with
// the AVX512-BF16 dot products (x rounded to bf16) and without (fp32 panels).
TEST(LinearFp8, BothGemmKernels) {
  std::mt19937 rng(12);
  for (const Case& c : {kCases[1], kCases[4], kCases[5], kCases[8]}) {
    const Linear w = RandomFp8(rng, c.out, c.in, c.ld);
    for (int kernel = 0; kernel < 3; ++kernel)  // streaming; packed; packed without the bf16 dot products
      for (int64_t rows : {1, 2, 3, 7, 13, 40}) {
        const GemmImpl impl = kernel == 0 ? GemmImpl::kSmall : GemmImpl::kPacked;
        SCOPED_TRACE(Name(c, rows, false).append(" ").append(GemmImplName(impl)).append(kernel == 2 ? " fp32" : ""));
        const bool dot_before = cpu::SetBf16DotAllowed(kernel != 2);
        Inputs in = MakeInputs(rng, c, rows, false);
        // A contiguous copy of x (the GemmDesc's lda = in).
        std::vector<float> a(static_cast<size_t>(rows * c.in));
        for (int64_t r = 0; r < rows; ++r)
          std::memcpy(&a[static_cast<size_t>(r * c.in)], &in.x[static_cast<size_t>(r * in.ldx)], c.in * sizeof(float));
        auto g = CpuGemm::Get(Fp8Desc(rows, in.n, c.in, w.ld, in.ldy), impl);
        const bool dot = cpu::UseBf16Dot(cpu::Kernels());  // as this kernel's setting left it
        cpu::SetBf16DotAllowed(dot_before);
        ASSERT_TRUE(g.ok()) << g.status();
        EXPECT_EQ((*g)->impl(), impl);
        // The packed kernel takes the bf16 dot products wherever the CPU has them.
        EXPECT_EQ(RoundsXToBf16(**g), kernel == 1 && dot) << (*g)->impl_name();
        std::vector<std::byte> scratch((*g)->scratch_bytes() + 64);
        const GemmBScales scales{.scale = w.scale, .ld = w.scale_ld, .row0 = c.c0};
        const Status st = (*g)->Run(a.data(), w.row(c.c0), in.y.data(), scratch.data(), &scales);
        ASSERT_TRUE(st.ok()) << st;
        Check(w, c, rows, false, in, in.y, in.y, RoundsXToBf16(**g));
      }
  }
}

// Inputs far from 1 in both directions: the few-row kernels carry the
// decoded weights at 2^-120 of their value, so products of tiny inputs must
// not fall into fp32's subnormal range (they lose digits there), and large
// inputs must not overflow.
TEST(LinearFp8, TinyAndLargeInputs) {
  std::mt19937 rng(13);
  for (const Case& c : {kCases[0], kCases[4], kCases[8]}) {
    const Linear w = RandomFp8(rng, c.out, c.in, c.ld);
    for (int expo : {-60, -24, 24, 60})
      for (int64_t rows : {1, 2, 3, 5}) {
        SCOPED_TRACE(Name(c, rows, false).append(" x 2^").append(std::to_string(expo)));
        Inputs in = MakeInputs(rng, c, rows, false);
        for (float& v : in.x) v = std::ldexp(v, expo);  // exact (NaN padding stays NaN)
        const Status st = RunOp(w, c, rows, in, false);
        ASSERT_TRUE(st.ok()) << st;
        Check(w, c, rows, false, in, in.y, in.y, OpRoundsXToBf16(c, rows));
      }
  }
}

TEST(LinearFp8, Errors) {
  std::mt19937 rng(13);
  Linear w = RandomFp8(rng, 8, 200, 200);
  std::vector<float> x(200, 1.f), y(8);
  Linear no_scale = w;
  no_scale.scale = nullptr;
  Status st = LinearRun({.w = &no_scale, .x = x.data(), .rows = 1, .ldx = 200, .y = y.data(), .ldy = 8});
  EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition) << st;
  EXPECT_NE(st.message().find("scales"), std::string::npos) << st;
  Linear short_ld = w;
  short_ld.scale_ld = 1;  // 200 columns need 2 block columns
  st = LinearRun({.w = &short_ld, .x = x.data(), .rows = 1, .ldx = 200, .y = y.data(), .ldy = 8});
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find("scale_ld"), std::string::npos) << st;
  // A GemmDesc with an f8_e4m3 B needs k contiguous, and its Run the scales.
  auto bad = CpuGemm::Get({.m = 1,
                           .n = 8,
                           .k = 200,
                           .a_type = DType::kF32,
                           .b_type = DType::kF8E4M3,
                           .c_type = DType::kF32,
                           .lda = 200,
                           .b_stride_k = 8,
                           .b_stride_n = 1,
                           .ldc = 8});
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  auto g = CpuGemm::Get({.m = 1,
                         .n = 8,
                         .k = 200,
                         .a_type = DType::kF32,
                         .b_type = DType::kF8E4M3,
                         .c_type = DType::kF32,
                         .lda = 200,
                         .b_stride_k = 1,
                         .b_stride_n = 200,
                         .ldc = 8});
  ASSERT_TRUE(g.ok()) << g.status();
  std::vector<std::byte> scratch((*g)->scratch_bytes() + 64);
  EXPECT_EQ((*g)->Run(x.data(), w.data, y.data(), scratch.data()).code(), StatusCode::kInvalidArgument);
  // Bytes: one per element plus one fp32 per (partial) 128 x 128 block.
  EXPECT_EQ(w.data_bytes(), 8 * 200);
  EXPECT_EQ(w.scale_bytes(), 1 * 2 * 4);
  EXPECT_EQ(w.bytes(), 8 * 200 + 8);
}

// ---- CUDA ------------------------------------------------------------------------

double Cosine(const std::vector<float>& a, const std::vector<float>& b) {
  double ab = 0, aa = 0, bb = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::isnan(a[i]) && std::isnan(b[i])) continue;  // padding
    ab += double(a[i]) * b[i], aa += double(a[i]) * a[i], bb += double(b[i]) * b[i];
  }
  return ab / std::sqrt(aa * bb);
}

TEST(LinearFp8Cuda, MatchesCpu) {
  auto devices = CudaDevices();
  if (!devices.ok()) GTEST_SKIP() << devices.status();
  auto mem = MemoryFor(Backend::kCuda);
  ASSERT_TRUE(mem.ok()) << mem.status();
  DeviceMemory& dm = **mem;
  std::mt19937 rng(14);
  // The cases above plus ones whose rows and strides allow 16-byte loads
  // (the vector paths) and a decode-sized one.
  std::vector<Case> cases(std::begin(kCases), std::end(kCases));
  cases.push_back({512, 7168, 7168, 0, 512});
  cases.push_back({384, 1536, 1552, 128, 384});
  for (const Case& c : cases) {
    const Linear host_w = RandomFp8(rng, c.out, c.in, c.ld);
    Linear w = host_w;
    ASSERT_TRUE(w.Place(dm, "fp8 test weight").ok());
    ASSERT_NE(w.scale, host_w.scale);  // the scales moved too
    for (int64_t rows : {1, 2, 3, 4, 5, 8, 16, 17, 64, 300})
      for (bool acc : {false, true}) {
        SCOPED_TRACE(Name(c, rows, acc));
        Inputs in = MakeInputs(rng, c, rows, acc);
        std::vector<float> cpu = in.y;
        // The CPU's fp32 panels (x as it is, as on the GPU), not the bf16 dot
        // products, which round x to bf16.
        const bool dot_before = cpu::SetBf16DotAllowed(false);
        ASSERT_TRUE(LinearRun({.w = &host_w,
                               .col_begin = c.c0,
                               .col_end = c.c1,
                               .x = in.x.data(),
                               .rows = rows,
                               .ldx = in.ldx,
                               .y = cpu.data(),
                               .ldy = in.ldy,
                               .accumulate = acc})
                        .ok());
        cpu::SetBf16DotAllowed(dot_before);
        auto dx = DeviceBuffer::Allocate(dm, in.x.size() * sizeof(float), "x");
        auto dy = DeviceBuffer::Allocate(dm, in.y.size() * sizeof(float), "y");
        ASSERT_TRUE(dx.ok() && dy.ok());
        ASSERT_TRUE(dm.CopyIn(dx->data(), in.x.data(), in.x.size() * sizeof(float)).ok());
        ASSERT_TRUE(dm.CopyIn(dy->data(), in.y.data(), in.y.size() * sizeof(float)).ok());
        const Status st = LinearRun({.w = &w,
                                     .col_begin = c.c0,
                                     .col_end = c.c1,
                                     .x = static_cast<float*>(dx->data()),
                                     .rows = rows,
                                     .ldx = in.ldx,
                                     .y = static_cast<float*>(dy->data()),
                                     .ldy = in.ldy,
                                     .accumulate = acc,
                                     .backend = Backend::kCuda});
        ASSERT_TRUE(st.ok()) << st;
        std::vector<float> gpu(in.y.size());
        ASSERT_TRUE(dm.CopyOut(gpu.data(), dy->data(), gpu.size() * sizeof(float)).ok());
        double max_rel = 0;
        for (int64_t r = 0; r < rows; ++r) {
          for (int64_t j = 0; j < in.n; ++j) {
            const size_t k = static_cast<size_t>(r * in.ldy + j);
            const double d = std::abs(double(gpu[k]) - cpu[k]), scale = std::max(1e-6, std::abs(double(cpu[k])));
            max_rel = std::max(max_rel, d / scale);
          }
          for (int64_t j = in.n; j < in.ldy; ++j) ASSERT_TRUE(std::isnan(gpu[static_cast<size_t>(r * in.ldy + j)]));
        }
        const double cos = Cosine(gpu, cpu);
        RecordProperty("cosine", std::to_string(cos));
        EXPECT_GT(cos, 1 - 1e-9) << "f8_e4m3 cosine " << cos << ", max rel err " << max_rel;
        // Both accumulate exactly dequantized weights in fp32, in different
        // orders: relative differences stay where cancellation leaves them.
        Check(host_w, c, rows, acc, in, in.y, gpu, false);
      }
  }
}

}  // namespace
}  // namespace mlarun
