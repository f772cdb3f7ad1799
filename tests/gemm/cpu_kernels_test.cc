// Every matrix-product implementation (our streaming and packed kernels, and
// oneDNN where the family allows it) under every kernel family this CPU can
// run, against a float64 loop on the values as stored. Inputs are random; the
// memory a product must not read (A's and B's padding between rows) is NaN,
// A and B end where an unreadable page begins (a read past them faults), and
// C's columns between n and ldc must come back untouched.
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "base/cpu_isa.h"
#include "gemm/convert.h"
#include "gemm/cpu/kernels.h"
#include "gemm/cpu_gemm.h"

namespace mlarun {

// Names instead of bytes in the parameterized tests' names.
void PrintTo(CpuIsa isa, std::ostream* os) { *os << CpuIsaName(isa); }

namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

struct Shape {
  int64_t m, n, k;
};

struct Case {
  CpuIsa isa;
  GemmImpl impl;
  DType dtype;
  DType c_type;
  bool b_col_major;
  bool accumulate;
};

std::string Name(const Case& c, const Shape& s) {
  return std::string(CpuIsaName(c.isa)) + "/" + std::string(GemmImplName(c.impl)) + "/" +
         std::string(DTypeName(c.dtype)) + "->" + std::string(DTypeName(c.c_type)) + (c.b_col_major ? "/Bt" : "/Bn") +
         (c.accumulate ? "/+=" : "") + " m=" + std::to_string(s.m) + " n=" + std::to_string(s.n) +
         " k=" + std::to_string(s.k);
}

// A copy of `src` that ends where a PROT_NONE page begins, so a kernel that
// reads past the matrix (a vector over the last row's end, rows or columns
// past m or n) faults instead of reading whatever follows.
class GuardedCopy {
 public:
  explicit GuardedCopy(const std::vector<std::byte>& src) {
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    const size_t body = (src.size() + page - 1) / page * page;
    bytes_ = body + page;
    void* m = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) return;
    base_ = static_cast<std::byte*>(m);
    mprotect(base_ + body, page, PROT_NONE);
    data_ = base_ + body - src.size();
    std::memcpy(data_, src.data(), src.size());
  }
  ~GuardedCopy() {
    if (base_) munmap(base_, bytes_);
  }
  GuardedCopy(const GuardedCopy&) = delete;
  GuardedCopy& operator=(const GuardedCopy&) = delete;
  const std::byte* data() const { return data_; }

 private:
  std::byte* base_ = nullptr;
  std::byte* data_ = nullptr;
  size_t bytes_ = 0;
};

// Runs one product and compares it with the float64 reference.
void CheckOne(const Case& cs, const Shape& sh, std::mt19937& rng) {
  const int64_t m = sh.m, n = sh.n, k = sh.k;
  const int64_t lda = k + 3, ldc = n + 5;
  const int64_t bsk = cs.b_col_major ? 1 : n + 2, bsn = cs.b_col_major ? k + 4 : 1;
  const GemmDesc desc{.m = m,
                      .n = n,
                      .k = k,
                      .a_type = cs.dtype,
                      .b_type = cs.dtype,
                      .c_type = cs.c_type,
                      .lda = lda,
                      .b_stride_k = bsk,
                      .b_stride_n = bsn,
                      .ldc = ldc,
                      .accumulate = cs.accumulate};
  ScopedCpuIsa scope(cs.isa);
  ASSERT_TRUE(scope.status().ok()) << scope.status();
  auto g = CpuGemm::Get(desc, cs.impl);
  if (cs.impl == GemmImpl::kOneDnn && !g.ok()) return;  // not offered under this family: covered by ours
  // The tile kernel: bf16 with a k-contiguous B under the amx family, refused otherwise.
  const bool tiles_fit = cs.isa == CpuIsa::kAmx && cs.dtype == DType::kBF16 && cs.b_col_major;
  if (cs.impl == GemmImpl::kTiles && !tiles_fit) {
    EXPECT_FALSE(g.ok()) << Name(cs, sh) << ": offered outside its family and types";
    return;
  }
  ASSERT_TRUE(g.ok()) << Name(cs, sh) << ": " << g.status();

  std::normal_distribution<float> d;
  const size_t es = DTypeSize(cs.dtype);
  // A and B with NaN in every element that is not part of the matrices.
  std::vector<float> a(static_cast<size_t>(m * lda), kNaN);
  std::vector<float> b(static_cast<size_t>(cs.b_col_major ? n * bsn : k * bsk), kNaN);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t p = 0; p < k; ++p) a[static_cast<size_t>(i * lda + p)] = d(rng);
  for (int64_t p = 0; p < k; ++p)
    for (int64_t j = 0; j < n; ++j) b[static_cast<size_t>(p * bsk + j * bsn)] = d(rng);
  std::vector<std::byte> ac(a.size() * es), bc(b.size() * es);
  StoreFromF32(a.data(), ac.data(), cs.dtype, static_cast<int64_t>(a.size()));
  StoreFromF32(b.data(), bc.data(), cs.dtype, static_cast<int64_t>(b.size()));
  LoadToF32(ac.data(), cs.dtype, a.data(), static_cast<int64_t>(a.size()));  // the values as stored
  LoadToF32(bc.data(), cs.dtype, b.data(), static_cast<int64_t>(b.size()));

  const size_t ces = DTypeSize(cs.c_type);
  std::vector<float> c0(static_cast<size_t>(m * ldc));
  for (float& v : c0) v = d(rng);
  std::vector<std::byte> c(c0.size() * ces);
  StoreFromF32(c0.data(), c.data(), cs.c_type, static_cast<int64_t>(c0.size()));
  const std::vector<std::byte> c_before = c;
  std::vector<std::byte> scratch((*g)->scratch_bytes() + 64);
  const GuardedCopy ag(ac), bg(bc);
  ASSERT_NE(ag.data(), nullptr);
  ASSERT_NE(bg.data(), nullptr);
  ASSERT_TRUE((*g)->Run(ag.data(), bg.data(), c.data(), scratch.data()).ok());

  std::vector<float> got(c0.size());
  LoadToF32(c.data(), cs.c_type, got.data(), static_cast<int64_t>(got.size()));
  double max_err = 0, max_ref = 0;
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double ref = cs.accumulate ? c0[static_cast<size_t>(i * ldc + j)] : 0.0;
      double mag = std::abs(ref);
      for (int64_t p = 0; p < k; ++p) {
        const double t = double{a[static_cast<size_t>(i * lda + p)]} * b[static_cast<size_t>(p * bsk + j * bsn)];
        ref += t;
        mag += std::abs(t);
      }
      const double err = std::abs(ref - got[static_cast<size_t>(i * ldc + j)]);
      ASSERT_TRUE(std::isfinite(got[static_cast<size_t>(i * ldc + j)])) << Name(cs, sh) << " at " << i << "," << j;
      // fp32 accumulation: a few ulps of the sum of magnitudes; a bf16 C adds
      // its own rounding (2^-8 relative).
      const double tol =
          1e-6 * mag * std::sqrt(static_cast<double>(k)) + (cs.c_type == DType::kBF16 ? std::abs(ref) / 256 : 0) + 1e-6;
      max_err = std::max(max_err, err / tol);
      max_ref = std::max(max_ref, std::abs(ref));
    }
  EXPECT_LE(max_err, 1.0) << Name(cs, sh) << " (" << (*g)->impl_name() << "): error / tolerance " << max_err;
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = n; j < ldc; ++j)
      for (size_t e = 0; e < ces; ++e)
        ASSERT_EQ(c[static_cast<size_t>(i * ldc + j) * ces + e], c_before[static_cast<size_t>(i * ldc + j) * ces + e])
            << Name(cs, sh) << ": wrote past n at " << i << "," << j;
}

class GemmEveryIsa : public ::testing::TestWithParam<CpuIsa> {};

TEST_P(GemmEveryIsa, EveryImplementationMatchesFloat64) {
  const CpuIsa isa = GetParam();
  if (!cpu::KernelsFor(isa)) GTEST_SKIP() << "this CPU cannot run the " << CpuIsaName(isa) << " kernels";
  std::mt19937 rng(1234 + static_cast<int>(isa));
  // Odd and prime sizes, single rows, more rows than one tile, k past one
  // panel (256) and past the single-panel limit of a bf16 C (1024), n past
  // the width up to which the packed kernel reads an fp32 A's rows (384); and
  // one to three rows of a k so long (8300) that A's rows no longer stay in
  // L1 beside a streamed B, so the streaming kernels take tiles of B rows
  // instead (kStreamMaxABytes, for an fp32 and a bf16 A alike); one row of
  // a k between the bf16 dots' streaming limit with the prefetch (Intel) and
  // without it (5000: tiles with it, a stream without), and one whose stream
  // prefetches across rows and ends in a tail (2100).
  const std::vector<Shape> shapes = {{1, 1, 1},     {1, 37, 64},    {2, 53, 71},   {3, 64, 40},    {4, 97, 129},
                                     {5, 33, 17},   {7, 130, 300},  {16, 48, 576}, {17, 65, 33},   {37, 53, 71},
                                     {64, 64, 64},  {97, 161, 257}, {9, 40, 1100}, {33, 200, 100}, {16, 128, 64},
                                     {48, 96, 33},  {21, 419, 70},  {1, 29, 8300}, {2, 19, 8231},  {3, 11, 8250},
                                     {1, 23, 5000}, {1, 45, 2100}};
  // On a CPU with AVX512-BF16 the avx512 streaming kernels use its dot
  // products; run their FMA path too.
  const bool dot_variants = isa >= CpuIsa::kAvx512 && HostCpu().avx512_bf16;
  // On Intel CPUs one row's stream prefetches and two or three rows take
  // tiles of B rows; elsewhere they stream unprefetched (StreamPrefetch). The
  // other vendor's paths run too, on the shapes of up to three rows.
  const bool vendor_prefetch = cpu::StreamPrefetch();
  for (bool prefetch : {vendor_prefetch, !vendor_prefetch}) {
    const bool previous_prefetch = cpu::SetStreamPrefetch(prefetch);
    for (bool dot : dot_variants ? std::vector<bool>{true, false} : std::vector<bool>{true}) {
      const bool previous = cpu::SetBf16DotAllowed(dot);
      for (GemmImpl impl : {GemmImpl::kSmall, GemmImpl::kPacked, GemmImpl::kOneDnn, GemmImpl::kTiles, GemmImpl::kAuto})
        for (DType t : {DType::kF32, DType::kBF16})
          for (DType ct : {DType::kF32, DType::kBF16})
            for (bool col : {false, true})
              for (bool acc : {false, true}) {
                if (acc && ct == DType::kBF16) continue;
                for (const Shape& s : shapes) {
                  if (impl == GemmImpl::kSmall && s.m > 40) continue;  // the streaming kernels are for few rows
                  if (prefetch != vendor_prefetch && s.m > 3) continue;
                  CheckOne(Case{isa, impl, t, ct, col, acc}, s, rng);
                  if (HasFatalFailure()) {
                    cpu::SetBf16DotAllowed(previous);
                    cpu::SetStreamPrefetch(previous_prefetch);
                    return;
                  }
                }
              }
      cpu::SetBf16DotAllowed(previous);
    }
    cpu::SetStreamPrefetch(previous_prefetch);
  }
}

INSTANTIATE_TEST_SUITE_P(Isa, GemmEveryIsa,
                         ::testing::Values(CpuIsa::kScalar, CpuIsa::kAvx2, CpuIsa::kAvx512, CpuIsa::kAmx),
                         [](const auto& info) { return std::string(CpuIsaName(info.param)); });

// The automatic choice: few rows stream; bf16 products without bf16
// arithmetic and f32 products never reach oneDNN.
TEST(GemmDispatch, ChoosesByShapeAndFamily) {
  const GemmDesc small{.m = 1,
                       .n = 64,
                       .k = 40,
                       .a_type = DType::kBF16,
                       .b_type = DType::kBF16,
                       .lda = 40,
                       .b_stride_k = 1,
                       .b_stride_n = 40,
                       .ldc = 64};
  GemmDesc large = small;
  large.m = 128;
  large.lda = 40;
  for (CpuIsa isa : HostCpu().supported()) {
    ScopedCpuIsa scope(isa);
    ASSERT_TRUE(scope.status().ok());
    auto s = CpuGemm::Get(small);
    ASSERT_TRUE(s.ok()) << s.status();
    EXPECT_EQ((*s)->impl(), GemmImpl::kSmall) << CpuIsaName(isa);
    auto l = CpuGemm::Get(large);
    ASSERT_TRUE(l.ok()) << l.status();
    const bool bf16_units = isa == CpuIsa::kAmx || (isa == CpuIsa::kAvx512 && HostCpu().avx512_bf16);
    if (!bf16_units) {
      EXPECT_EQ((*l)->impl(), GemmImpl::kPacked) << CpuIsaName(isa) << " " << (*l)->impl_name();
    }
    if (isa == CpuIsa::kAvx2) {  // a batch of 32 under AVX2: packed over a weight [n, k], streamed over the folds
      GemmDesc rows32 = small;
      rows32.m = 32;
      auto w = CpuGemm::Get(rows32);
      ASSERT_TRUE(w.ok()) << w.status();
      EXPECT_EQ((*w)->impl(), GemmImpl::kPacked) << (*w)->impl_name();
      rows32.b_stride_k = rows32.n, rows32.b_stride_n = 1;
      auto fold = CpuGemm::Get(rows32);
      ASSERT_TRUE(fold.ok()) << fold.status();
      EXPECT_EQ((*fold)->impl(), GemmImpl::kSmall) << (*fold)->impl_name();
    }
    GemmDesc f32 = large;
    f32.a_type = f32.b_type = DType::kF32;
    auto f = CpuGemm::Get(f32);
    ASSERT_TRUE(f.ok()) << f.status();
    EXPECT_EQ((*f)->impl(), GemmImpl::kPacked) << CpuIsaName(isa) << " " << (*f)->impl_name();
    EXPECT_EQ((*f)->impl_name(), "packed:" + std::string(CpuIsaName(cpu::KernelsFor(isa)->isa)));
  }
}

// Element-wise kernels of every family against scalar definitions.
TEST(CpuKernels, ElementwiseMatchScalarDefinitions) {
  std::mt19937 rng(5);
  std::normal_distribution<float> d(0.f, 3.f);
  for (CpuIsa isa : HostCpu().supported()) {
    const cpu::CpuKernels* k = cpu::KernelsFor(isa);
    ASSERT_NE(k, nullptr);
    for (int64_t n : {0, 1, 3, 15, 16, 17, 33, 100}) {
      std::vector<float> x(static_cast<size_t>(n));
      for (float& v : x) v = d(rng);
      if (n > 2) x[1] = kNaN;
      std::vector<bf16_t> h(static_cast<size_t>(n));
      k->f32_to_bf16(x.data(), h.data(), n);
      for (int64_t i = 0; i < n; ++i) {
        if (std::isnan(x[static_cast<size_t>(i)])) {
          EXPECT_TRUE(std::isnan(Bf16ToFloat(h[static_cast<size_t>(i)])));
        } else {
          EXPECT_EQ(h[static_cast<size_t>(i)], FloatToBf16(x[static_cast<size_t>(i)])) << CpuIsaName(isa) << " " << i;
        }
      }
      std::vector<float> back(static_cast<size_t>(n));
      k->bf16_to_f32(h.data(), back.data(), n);
      for (int64_t i = 0; i < n; ++i) {
        if (!std::isnan(x[static_cast<size_t>(i)])) {
          EXPECT_EQ(back[static_cast<size_t>(i)], Bf16ToFloat(h[static_cast<size_t>(i)]));
        }
      }
      if (n > 2) x[1] = d(rng);
      float mx = -std::numeric_limits<float>::infinity();
      for (float v : x) mx = std::max(mx, v);
      EXPECT_EQ(k->row_max(x.data(), n), mx) << CpuIsaName(isa);
      std::vector<float> e = x;
      const float scale = 0.7f;
      const float sum = k->exp_shifted(e.data(), n, mx, scale);
      double ref_sum = 0;
      for (int64_t i = 0; i < n; ++i) {
        const double ref = std::exp((double{x[static_cast<size_t>(i)]} - mx) * scale);
        ref_sum += ref;
        EXPECT_NEAR(e[static_cast<size_t>(i)], ref, 2e-7 + 2e-6 * ref) << CpuIsaName(isa) << " " << i;
      }
      EXPECT_NEAR(sum, ref_sum, 1e-5 * (ref_sum + 1)) << CpuIsaName(isa);
      std::vector<float> acc = x, part(static_cast<size_t>(n));
      for (float& v : part) v = d(rng);
      k->axpby(acc.data(), part.data(), n, 0.25f, -1.5f);
      for (int64_t i = 0; i < n; ++i)
        EXPECT_NEAR(acc[static_cast<size_t>(i)],
                    x[static_cast<size_t>(i)] * 0.25f - 1.5f * part[static_cast<size_t>(i)], 1e-5);
      k->scale(acc.data(), n, 2.f);
    }
    // stream_read depends on every word.
    std::vector<uint64_t> buf(1024, 1);
    const uint64_t a = k->stream_read(buf.data(), buf.size() * 8);
    buf[777] = 2;
    EXPECT_NE(k->stream_read(buf.data(), buf.size() * 8), a) << CpuIsaName(isa);
  }
}

TEST(CpuIsa, ParseAndLimits) {
  EXPECT_EQ(*ParseCpuIsa("avx2"), CpuIsa::kAvx2);
  EXPECT_EQ(ParseCpuIsa("sse9").status().code(), StatusCode::kInvalidArgument);
  const CpuIsa best = HostCpu().best(), before = ActiveCpuIsa();
  EXPECT_EQ(HostCpu().supported().back(), best);
  EXPECT_EQ(HostCpu().supported().front(), CpuIsa::kScalar);
  if (best != CpuIsa::kAmx) {
    ScopedCpuIsa above(static_cast<CpuIsa>(static_cast<int>(best) + 1));
    EXPECT_EQ(above.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(above.status().message().find("cannot run"), std::string::npos);
    EXPECT_EQ(ActiveCpuIsa(), before);  // refused: nothing changed
  }
  {
    ScopedCpuIsa scalar(CpuIsa::kScalar);
    EXPECT_EQ(ActiveCpuIsa(), CpuIsa::kScalar);
    EXPECT_EQ(cpu::Kernels().isa, CpuIsa::kScalar);
    EXPECT_NE(CpuSummary().find("slow"), std::string::npos);
  }
  EXPECT_FALSE(CpuSummary().empty());
}

}  // namespace
}  // namespace mlarun
