// LinearRun with int8 / int4 weights (group scales, with and without
// offsets) against a float64 reference computed from Linear::At, with A as
// it is (MLARUN_INT_DOT=off) and, where few rows take the integer dot
// products (on), with A rounded to int8 per block of 32 (int16 in the packed
// kernel of an int8 weight on AVX512-VNNI) as specified in
// gemm/cpu/int_dot.inc, rounded here by code of the test's own: every shape
// the CPU kernels treat apart (the streaming kernels of one and two rows, the
// tiles of more, the packed kernel past the small-rows limit), groups of
// 32, 64, 128, per channel and a short last group, column ranges, a weight
// that is a column slice of a wider one (ld > in) and accumulation. x's
// padding beyond `in` and y outside the written range hold NaN.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "base/cpu_isa.h"
#include "base/dtype.h"
#include "gemm/cpu/kernels.h"
#include "gemm/cpu_gemm.h"
#include "runtime/ops/linear.h"

namespace mlarun {
namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// A random fp32 weight [out, in].
Linear RandomF32(int64_t out, int64_t in, uint32_t seed) {
  Linear w = Linear::Owned(out, in, DType::kF32);
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.f, 0.05f);
  auto* p = reinterpret_cast<float*>(w.mutable_data());
  for (int64_t i = 0; i < out * in; ++i) p[i] = d(rng);
  return w;
}

// An int weight [out, in] with random integers, scales (either sign) and,
// with `offsets`, offsets, written directly.
Linear RandomInt(int64_t out, int64_t in, DType dtype, int64_t group, bool offsets, uint32_t seed) {
  Linear w = Linear::Owned(out, in, dtype, group, offsets);
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_real_distribution<float> s(0.001f, 0.02f), o(-0.1f, 0.1f);
  auto* d = reinterpret_cast<uint8_t*>(w.mutable_data());
  for (int64_t i = 0; i < out * DTypeBytes(dtype, w.ld); ++i) d[i] = static_cast<uint8_t>(byte(rng));
  for (int64_t i = 0; i < out * w.scale_ld; ++i) {
    w.mutable_scale()[i] = (i % 3 == 0 ? -1.f : 1.f) * s(rng);
    if (offsets) w.mutable_offset()[i] = o(rng);
  }
  return w;
}

// The first `in` columns of `w` as a weight of its own (ld stays w's).
Linear ColumnSlice(const Linear& w, int64_t in) {
  Linear v = w;
  v.in = in;
  return v;
}

struct Case {
  int64_t rows, col_begin, col_end;
  bool accumulate;
};

// The kernel LinearRun takes for `rows` rows of `w` (the product it
// prepares: cpu_gemm's choice, asked the same way).
std::string ImplFor(const Linear& w, int64_t rows, int64_t n) {
  const int64_t m = rows <= kGemmSmallRows ? rows : (rows + 7) / 8 * 8;  // LinearRun pads to 8
  auto g = CpuGemm::Get({.m = m,
                         .n = n,
                         .k = w.in,
                         .a_type = DType::kF32,
                         .b_type = w.dtype,
                         .c_type = DType::kF32,
                         .lda = w.in,
                         .b_stride_k = 1,
                         .b_stride_n = w.ld,
                         .ldc = n,
                         .b_group = w.group},
                        GemmImpl::kAuto);
  return g.ok() ? (*g)->impl_name() : g.status().ToString();
}
// Whether it rounds A to int8 (the few-row or the packed int-dot kernel).
bool TakesIntDot(const Linear& w, int64_t rows, int64_t n) {
  return ImplFor(w, rows, n).find("_int8a:") != std::string::npos;
}
// The largest code A is rounded to: 127 (int8), 32767 (int16: the packed
// kernel of an int8 B on AVX512-VNNI) or 0 (A as it is).
int RoundingOf(const Linear& w, int64_t rows, int64_t n) {
  const std::string impl = ImplFor(w, rows, n);
  return impl.find("_int8a:") != std::string::npos ? 127 : impl.find("_int16a:") != std::string::npos ? 32767 : 0;
}

// x rounded as the int-dot path specifies: per block of 32, d = max|x| /
// qmax and x^ = d * round(x * (qmax / max|x|)), in fp32 as the kernels
// compute it.
std::vector<double> RoundedA(const float* x, int64_t in, int qmax) {
  std::vector<double> r(static_cast<size_t>(in));
  for (int64_t b = 0; b < in; b += 32) {
    float amax = 0;
    for (int64_t t = b; t < b + 32; ++t) amax = std::max(amax, std::abs(x[t]));
    const float inv = amax > 0 ? static_cast<float>(qmax) / amax : 0.0f, d = amax / static_cast<float>(qmax);
    for (int64_t t = b; t < b + 32; ++t)
      r[static_cast<size_t>(t)] = static_cast<double>(d) * std::nearbyint(x[t] * inv);
  }
  return r;
}

// Runs `w` over `c` and checks every written element against float64, and
// that nothing outside was written. With A rounded (the int-dot path), the
// result must also lie within the rounding's own bound of the exact one:
// sum(|x^ - x| |w|) <= sum(d / 2 |w|).
void Check(const Linear& w, const Case& c, uint32_t seed, const std::string& what) {
  const int64_t in = w.in, n = c.col_end - c.col_begin, ldx = in + 5, ldy = n + 3;
  const int a_qmax = RoundingOf(w, c.rows, n);
  const bool rounded = a_qmax > 0;
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  std::vector<float> x(static_cast<size_t>(c.rows * ldx), kNaN), y(static_cast<size_t>(c.rows * ldy), kNaN);
  for (int64_t r = 0; r < c.rows; ++r)
    for (int64_t k = 0; k < in; ++k) x[static_cast<size_t>(r * ldx + k)] = u(rng);
  std::vector<float> y0 = y;
  if (c.accumulate)
    for (int64_t r = 0; r < c.rows; ++r)
      for (int64_t j = 0; j < n; ++j)
        y0[static_cast<size_t>(r * ldy + j)] = y[static_cast<size_t>(r * ldy + j)] = u(rng);
  ASSERT_TRUE(LinearRun({.w = &w,
                         .col_begin = c.col_begin,
                         .col_end = c.col_end,
                         .x = x.data(),
                         .rows = c.rows,
                         .ldx = ldx,
                         .y = y.data(),
                         .ldy = ldy,
                         .accumulate = c.accumulate})
                  .ok())
      << what;
  // The weight as float64 once, and a bound on each row's terms: the
  // kernels sum x q per group and scale it, so their rounding follows
  // |x| (|q s| + |o|), not |x w|.
  const double qmax = w.dtype == DType::kInt4 ? 16 : 128;
  std::vector<double> wd(static_cast<size_t>(n * in)), mag(static_cast<size_t>(n * in));
  for (int64_t j = 0; j < n; ++j)
    for (int64_t k = 0; k < in; ++k) {
      const int64_t gi = (c.col_begin + j) * w.scale_ld + k / w.group;
      const double o = w.offset != nullptr ? std::abs(w.offset[gi]) : std::abs(w.zero * w.scale[gi]);
      wd[static_cast<size_t>(j * in + k)] = w.At(c.col_begin + j, k);
      mag[static_cast<size_t>(j * in + k)] = qmax * std::abs(w.scale[gi]) + o;
    }
  int bad = 0;
  for (int64_t r = 0; r < c.rows; ++r) {
    const float* xr = x.data() + r * ldx;
    const std::vector<double> xh = rounded ? RoundedA(xr, in, a_qmax) : std::vector<double>(xr, xr + in);
    for (int64_t j = 0; j < ldy; ++j) {
      const float got = y[static_cast<size_t>(r * ldy + j)];
      if (j >= n) {
        ASSERT_TRUE(std::isnan(got)) << what << ": wrote y[" << r << "][" << j << "] past the range";
        continue;
      }
      const double y0v = c.accumulate ? y0[static_cast<size_t>(r * ldy + j)] : 0;
      double want = y0v, exact = y0v, bound = 0, rounding = 0;
      for (int64_t k = 0; k < in; ++k) {
        const double wv = wd[static_cast<size_t>(j * in + k)];
        want += xh[static_cast<size_t>(k)] * wv;
        exact += xr[k] * wv;
        bound += std::abs(xh[static_cast<size_t>(k)]) * mag[static_cast<size_t>(j * in + k)];
        rounding += std::abs(xh[static_cast<size_t>(k)] - xr[k]) * std::abs(wv);
      }
      if (!(std::abs(got - want) <= 2e-6 * bound + 1e-6) && ++bad <= 5)
        ADD_FAILURE() << what << (rounded ? " (A rounded to " + std::to_string(a_qmax) + ")" : std::string()) << ": y["
                      << r << "][" << j << "] = " << got << ", want " << want << " (bound " << bound << ")";
      if (rounded && !(std::abs(got - exact) <= rounding + 2e-6 * bound + 1e-6) && ++bad <= 5)
        ADD_FAILURE() << what << ": y[" << r << "][" << j << "] = " << got << " is " << std::abs(got - exact)
                      << " from the exact product, more than A's rounding explains (" << rounding << ")";
    }
  }
  EXPECT_EQ(bad, 0) << what;
}

// Rows on both sides of the small-rows limit (32).
constexpr int64_t kRows[] = {1, 2, 3, 4, 5, 8, 16, 17, 32, 33, 64, 100};

std::string Name(const Linear& w, const char* kind) {
  return std::string(DTypeName(w.dtype)) + " " + kind + " [" + std::to_string(w.out) + ", " + std::to_string(w.in) +
         "] ld " + std::to_string(w.ld) + " group " + std::to_string(w.group) +
         (w.offset != nullptr ? " offsets" : " zero " + std::to_string(w.zero));
}

void CheckAllRows(const Linear& w, const std::string& what, uint32_t seed) {
  for (int64_t rows : kRows) {
    // A as it is and rounded, whatever the dtype's default.
    for (cpu::IntDotMode mode : {cpu::IntDotMode::kOff, cpu::IntDotMode::kOn}) {
      const cpu::IntDotMode was = cpu::SetIntDotMode(mode);
      const std::string a = mode == cpu::IntDotMode::kOn ? " int8 A" : "";
      Check(w, {rows, 0, w.out, false}, seed + static_cast<uint32_t>(rows), what + a + " rows " + std::to_string(rows));
      Check(w, {rows, 3, w.out - 2, true}, seed + 7 * static_cast<uint32_t>(rows),
            what + a + " rows " + std::to_string(rows) + " cols [3, out - 2) accumulate");
      cpu::SetIntDotMode(was);
    }
  }
}

TEST(IntLinear, QuantizedWeightsMatchReference) {
  const Linear f = RandomF32(45, 256, 1);
  uint32_t seed = 100;
  for (DType dt : {DType::kInt8, DType::kInt4})
    for (bool symmetric : {true, false})
      for (int64_t group : {32, 64, 128, 0}) {
        auto q = QuantizeLinear(f, {.dtype = dt, .group = group, .symmetric = symmetric});
        ASSERT_TRUE(q.ok()) << q.status();
        CheckAllRows(*q, Name(*q, "quantized"), seed += 1000);
      }
}

// Rows quantized on the OpenMP threads (the loader's lm_head) give the bytes,
// scales and offsets of one thread.
TEST(IntLinear, QuantizingOnThreadsGivesTheSameBytes) {
  const Linear f = RandomF32(257, 2000, 5);  // long rows: a shared scratch row would race
  for (DType dt : {DType::kInt8, DType::kInt4})
    for (bool symmetric : {true, false})
      for (int64_t group : {64, 0}) {
        auto one = QuantizeLinear(f, {.dtype = dt, .group = group, .symmetric = symmetric});
        auto many = QuantizeLinear(f, {.dtype = dt, .group = group, .symmetric = symmetric, .parallel = true});
        ASSERT_TRUE(one.ok() && many.ok());
        const std::string what = Name(*one, "threads");
        ASSERT_EQ(one->bytes(), many->bytes()) << what;
        EXPECT_EQ(std::memcmp(one->data, many->data, static_cast<size_t>(one->data_bytes())), 0) << what;
        const size_t scales = static_cast<size_t>(one->out * one->scale_ld) * sizeof(float);
        EXPECT_EQ(std::memcmp(one->scale, many->scale, scales), 0) << what;
        if (!symmetric) {
          EXPECT_EQ(std::memcmp(one->offset, many->offset, scales), 0) << what;
        }
      }
}

TEST(IntLinear, RandomScalesAndOffsetsMatchReference) {
  uint32_t seed = 7;
  for (DType dt : {DType::kInt8, DType::kInt4})
    for (bool offsets : {false, true})
      for (int64_t group : {32, 128, 0}) {
        Linear w = RandomInt(37, 384, dt, group, offsets, seed += 11);
        if (dt == DType::kInt8 && !offsets) w.zero = 3;  // any zero point, not only the formats' own
        CheckAllRows(w, Name(w, "random"), seed * 31);
      }
}

// A short last group (in % group != 0), group sizes that are no multiple of
// the kernels' vectors, and a column slice of a wider matrix (ld > in).
TEST(IntLinear, ShortGroupsAndColumnSlices) {
  uint32_t seed = 500;
  for (DType dt : {DType::kInt8, DType::kInt4})
    for (bool offsets : {false, true})
      for (auto [in, group] : {std::pair<int64_t, int64_t>{100, 32}, {150, 128}, {90, 6}, {70, 2}}) {
        const Linear wide = RandomInt(29, in + 38, dt, group, offsets, seed += 3);
        const Linear w = ColumnSlice(wide, in);
        CheckAllRows(w, Name(w, "slice"), seed * 17);
        const Linear own = RandomInt(29, in, dt, group, offsets, seed += 5);
        CheckAllRows(own, Name(own, "short group"), seed * 19);
      }
}

// The few-row int4 kernels take blocks in pairs where no pair straddles a
// group (an odd count of pairs per group, per channel, groups of 32 on an
// even count of blocks) and one at a time otherwise (groups of 96, an odd
// count of blocks of 32).
TEST(IntLinear, BlockPairsAndSingleBlocksMatchReference) {
  uint32_t seed = 200;
  for (bool offsets : {false, true})
    for (auto [in, group] :
         {std::pair<int64_t, int64_t>{320, 0}, {192, 192}, {448, 64}, {224, 32}, {288, 96}, {96, 32}}) {
      const Linear w = RandomInt(21, in, DType::kInt4, group, offsets, seed += 13);
      CheckAllRows(w, Name(w, "pairs"), seed * 7);
    }
}

// A long k: one row's A no longer stays in L1 beside the stream, so one and
// two rows take tiles of B rows too.
TEST(IntLinear, LongRowsMatchReference) {
  for (DType dt : {DType::kInt8, DType::kInt4}) {
    const Linear w = RandomInt(19, 4200, dt, 128, dt == DType::kInt4, 3);
    for (int64_t rows : {1, 2, 3, 33})
      Check(w, {rows, 1, 19, rows == 2}, 9, Name(w, "long") + " rows " + std::to_string(rows));
  }
}

// Which products take the integer dot products: few rows, groups (or k,
// one group spanning it) of whole blocks of 32 that divide k, and the mode
// allowing the dtype.
TEST(IntLinear, FewRowsWithWholeBlocksTakeTheIntegerDotProducts) {
  const cpu::IntDotMode was = cpu::SetIntDotMode(cpu::IntDotMode::kOn);
  for (DType dt : {DType::kInt8, DType::kInt4}) {
    EXPECT_TRUE(TakesIntDot(RandomInt(8, 256, dt, 32, false, 1), 1, 8));
    EXPECT_TRUE(TakesIntDot(RandomInt(8, 256, dt, 128, true, 1), 16, 8));
    EXPECT_TRUE(TakesIntDot(RandomInt(8, 384, dt, 0, false, 1), 3, 8)) << "per channel";
    EXPECT_TRUE(TakesIntDot(ColumnSlice(RandomInt(8, 512, dt, 0, false, 1), 256), 1, 8)) << "a slice of k, per channel";
    EXPECT_FALSE(TakesIntDot(RandomInt(8, 100, dt, 32, false, 1), 1, 8)) << "a short last group";
    EXPECT_FALSE(TakesIntDot(RandomInt(8, 96, dt, 6, false, 1), 1, 8)) << "groups of 6";
    // Many rows: the packed int-dot kernel for int4 on the SIMD families.
    const bool simd = ActiveCpuIsa() != CpuIsa::kScalar;
    EXPECT_EQ(TakesIntDot(RandomInt(8, 256, dt, 32, false, 1), 64, 8), simd && dt == DType::kInt4);
    cpu::SetIntDotMode(cpu::IntDotMode::kOff);
    EXPECT_FALSE(TakesIntDot(RandomInt(8, 256, dt, 32, false, 1), 1, 8)) << "turned off";
    cpu::SetIntDotMode(cpu::IntDotMode::kAuto);
    EXPECT_EQ(TakesIntDot(RandomInt(8, 256, dt, 32, false, 1), 1, 8), simd && dt == DType::kInt4)
        << "the default: int4 only, on the families with byte dot products";
    cpu::SetIntDotMode(cpu::IntDotMode::kOn);
  }
  cpu::SetIntDotMode(was);
}

// NaN in A (one block of one row) makes that row's outputs NaN, not a number
// made up from a rounded NaN; the other rows are untouched.
TEST(IntLinear, NanInAReachesTheOutput) {
  const Linear w = RandomInt(8, 128, DType::kInt4, 32, false, 2);
  std::vector<float> x(2 * 128, 0.5f), y(2 * 8);
  x[40] = kNaN;
  ASSERT_TRUE(LinearRun({.w = &w, .x = x.data(), .rows = 2, .ldx = 128, .y = y.data(), .ldy = 8}).ok());
  for (int j = 0; j < 8; ++j) {
    EXPECT_TRUE(std::isnan(y[static_cast<size_t>(j)])) << j;
    EXPECT_FALSE(std::isnan(y[static_cast<size_t>(8 + j)])) << j;
  }
}

TEST(IntLinear, BadScalesAreRefused) {
  Linear w = RandomInt(8, 64, DType::kInt4, 32, false, 1);
  std::vector<float> x(64, 1.f), y(8);
  auto run = [&] { return LinearRun({.w = &w, .x = x.data(), .rows = 1, .ldx = 64, .y = y.data(), .ldy = 8}); };
  EXPECT_TRUE(run().ok());
  w.scale_ld = 1;
  const Status st = run();
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.ToString().find("scale_ld"), std::string::npos) << st;
  w.scale_ld = 2;
  w.group = 3;
  EXPECT_FALSE(run().ok());
}

}  // namespace
}  // namespace mlarun
